"""Version-stable, collision-resistant chunk keys and the model fingerprint.

Encoding (version 3, every field length-prefixed, ``None`` distinct from ``""``)::

    k_root = SHA-256("kvplugin/chunk-key/v3" | u32 chunk_size | fingerprint | namespace |
                     lora name | lora path | cache salt)
    k_i    = SHA-256(k_{i-1} | u32 #items | (identifier | i64 offset - chunk start | u64 length)*
                     | tokens of chunk i as little-endian int32)

where each variable field is ``u8 present | u64 length | bytes``.  Version 3 is version 2's
encoding for chunk format 3 (:mod:`vllm_kvplugin.chunk.format`): a key names an object of one
format, so engines of two formats sharing a store never find each other's objects (each would
refuse the other's and drop it as corrupt).  A key names the
whole prefix up to its chunk's end and everything that decides its KV (the model
fingerprint covers weights, dtypes and quantization, see
:mod:`vllm_kvplugin.identity`).  SHA-256 (not a fast non-cryptographic hash): the
cache is shared by tenants and persists, so nobody may craft two prompts with one
key.  It does not use vLLM's block hash, whose seed and encoding change between
versions, so engines of different vLLM versions share one cache.  Only full
chunks get keys.  ``namespace`` is empty unless the engine reset its connector
cache (``reset_prefix_cache(reset_connector=True)``): then everything it stored
before is unreachable to it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KEY_SIZE = 32
KEY_VERSION = b"kvplugin/chunk-key/v3"  # with the chunk format's version
_U32 = struct.Struct("<I")
_ITEM_POS = struct.Struct("<qQ")


@dataclass(frozen=True)
class MMItem:
    """A multimodal item: its content hash and the token range it occupies."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class KeyExtras:
    """What besides the token ids changes the KV of a prefix."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm: tuple[MMItem, ...] = field(default_factory=tuple)


def _field(value: str | bytes | None) -> bytes:
    """``u8 present | u64 length | bytes``: no two values share an encoding, ``None != ""``."""
    if value is None:
        return b"\x00"
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def model_fingerprint(identity: dict[str, Any]) -> bytes:
    """32-byte fingerprint of everything that determines the KV bytes of a model."""
    blob = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvplugin/model-fingerprint/v2\x00" + blob).digest()


def root_key(fingerprint: bytes, chunk_size: int, extras: KeyExtras = KeyExtras(),
             namespace: bytes = b"") -> bytes:
    """The key "before" chunk 0: what every key of a prompt depends on besides its tokens."""
    h = hashlib.sha256(KEY_VERSION)
    h.update(_U32.pack(chunk_size))
    for value in (fingerprint, namespace, extras.lora_name, extras.lora_path, extras.cache_salt):
        h.update(_field(value))
    return h.digest()


def _int32_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The ids as non-negative little-endian int32 (a list through ``struct``: vLLM's prompts
    are lists, and on the lookup's critical path ``struct.pack`` converts one in half the time
    of ``array`` and of ``np.asarray``)."""
    if isinstance(token_ids, np.ndarray):
        tokens = token_ids
        if tokens.size and tokens.max() > 0x7FFFFFFF:
            raise ValueError("token ids must fit in int32")
    else:
        try:
            tokens = np.frombuffer(struct.pack(f"<{len(token_ids)}i", *token_ids), dtype="<i4")
        except (struct.error, OverflowError, TypeError) as e:
            raise ValueError(f"token ids must fit in int32 ({e})") from None
    if tokens.size and tokens.min() < 0:
        raise ValueError("token ids must fit in int32")
    return tokens


def chunk_keys(fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int,
               extras: KeyExtras = KeyExtras(), namespace: bytes = b"",
               start_key: bytes | None = None, start_chunk: int = 0) -> list[bytes]:
    """Keys of the full chunks of ``token_ids``, from ``start_chunk`` on.

    ``start_key`` is the key of chunk ``start_chunk - 1`` when extending an
    earlier call (incremental hashing of a growing sequence); only the ids from
    chunk ``start_chunk`` on are read then (the earlier call read the others).
    """
    if start_chunk > 0 and start_key is None:
        raise ValueError("start_key is required when start_chunk > 0")
    base = start_chunk * chunk_size
    tokens = _int32_tokens(token_ids[base:] if base else token_ids)
    n_full = (base + len(tokens)) // chunk_size
    raw = tokens[: max(0, n_full * chunk_size - base)].astype("<i4", copy=False).tobytes()
    step = chunk_size * 4
    prev = start_key if start_chunk > 0 else root_key(fingerprint, chunk_size, extras, namespace)
    keys = []
    for i in range(start_chunk, n_full):
        lo, hi = i * chunk_size, (i + 1) * chunk_size
        items = [m for m in extras.mm if m.offset < hi and m.offset + m.length > lo]
        h = hashlib.sha256(prev)
        h.update(_U32.pack(len(items)))
        for m in items:
            h.update(_field(m.identifier))
            h.update(_ITEM_POS.pack(m.offset - lo, m.length))
        h.update(raw[(i - start_chunk) * step:(i - start_chunk + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
