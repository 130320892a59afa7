"""Version-stable chunk keys and the model fingerprint.

``k_0 = H(fingerprint | lora | cache_salt)`` and
``k_i = H(k_{i-1} | mm items overlapping chunk i | tokens of chunk i)``
with ``H`` = xxh3-128 and tokens as little-endian int32.  A key therefore names
the whole prefix up to its chunk's end.  It does not use vLLM's block hash
(whose seed and encoding change between versions), so engines of different
vLLM versions share one cache.  Only full chunks get keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

KEY_SIZE = 16


@dataclass(frozen=True)
class MMItem:
    """A multimodal item: its content hash and the token range it occupies."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class KeyExtras:
    """What besides the token ids changes the KV of a prefix."""

    lora: str | None = None
    cache_salt: str | None = None
    mm: tuple[MMItem, ...] = field(default_factory=tuple)


def model_fingerprint(identity: dict[str, Any]) -> bytes:
    """16-byte fingerprint of everything that determines the KV bytes of a model."""
    blob = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":")).encode()
    return xxhash.xxh3_128_digest(blob)


def _root(fingerprint: bytes, extras: KeyExtras) -> bytes:
    h = xxhash.xxh3_128()
    h.update(b"kvplugin-root\x00")
    h.update(fingerprint)
    h.update(b"\x00lora\x00" + (extras.lora or "").encode())
    h.update(b"\x00salt\x00" + (extras.cache_salt or "").encode())
    return h.digest()


def chunk_keys(fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int,
               extras: KeyExtras = KeyExtras(), start_key: bytes | None = None,
               start_chunk: int = 0) -> list[bytes]:
    """Keys of the full chunks of ``token_ids``, from ``start_chunk`` on.

    ``start_key`` is the key of chunk ``start_chunk - 1`` when extending an
    earlier call (incremental hashing of a growing sequence).
    """
    tokens = np.asarray(token_ids, dtype=np.int32)
    n_full = len(tokens) // chunk_size
    prev = start_key if start_chunk > 0 else _root(fingerprint, extras)
    if start_chunk > 0 and start_key is None:
        raise ValueError("start_key is required when start_chunk > 0")
    raw = tokens[: n_full * chunk_size].astype("<i4", copy=False).tobytes()
    step = chunk_size * 4
    keys = []
    for i in range(start_chunk, n_full):
        h = xxhash.xxh3_128()
        h.update(prev)
        lo, hi = i * chunk_size, (i + 1) * chunk_size
        for item in extras.mm:
            if item.offset < hi and item.offset + item.length > lo:
                h.update(f"\x00mm\x00{item.identifier}\x00{item.offset - lo}\x00".encode())
        h.update(raw[i * step:(i + 1) * step])
        prev = h.digest()
        keys.append(prev)
    return keys
