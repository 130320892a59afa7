"""A torch-free reader of the canonical chunk header (:mod:`vllm_kvplugin.chunk.format`).

The server must run without torch, and ``chunk/format.py`` imports torch for its
dtype table, so the server reads the header through this mirror of the same
struct.  ``tests/server/test_units.py`` checks byte for byte that both agree
(any change of the format must change both).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVPC"
FORMAT_VERSION = 1
_BODY = struct.Struct("<4sHHBBBBIIIIQQHHHH16s16sQQ")
HEADER_SIZE = _BODY.size + 8


class HeaderError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class RawHeader:
    kind: int
    dtype_code: int
    shape: tuple[int, int, int, int, int]  # L, KV, T, H, D
    token_start: int
    token_end: int
    tp_size: int
    tp_rank: int
    group_index: int
    fingerprint: bytes
    key: bytes
    payload_nbytes: int
    checksum: int

    @property
    def object_size(self) -> int:
        return HEADER_SIZE + self.payload_nbytes


def parse_header(data) -> RawHeader:
    """Parse and self-check a header (magic, version, header checksum); raises :class:`HeaderError`."""
    data = bytes(data[:HEADER_SIZE])
    if len(data) < HEADER_SIZE:
        raise HeaderError("short_read", f"header has {len(data)} of {HEADER_SIZE} bytes")
    body = data[:_BODY.size]
    (hsum,) = struct.unpack_from("<Q", data, _BODY.size)
    f = _BODY.unpack(body)
    if f[0] != MAGIC:
        raise HeaderError("bad_magic", f"magic {f[0]!r}")
    if f[1] != FORMAT_VERSION or f[2] != HEADER_SIZE:
        raise HeaderError("version", f"format version {f[1]} header size {f[2]}")
    if xxhash.xxh3_64_intdigest(body) != hsum:
        raise HeaderError("header_checksum", "header bytes do not match their checksum")
    (_, _, _, kind, dcode, kv, _, L, T, H, D, start, end, tps, tpr, gi, _, fp, key, n, csum) = f
    return RawHeader(kind, dcode, (L, kv, T, H, D), start, end, tps, tpr, gi, fp, key, n, csum)


def pack_header(*, key: bytes, group: int, rank: int, world: int, payload_nbytes: int,
                checksum: int, fingerprint: bytes = b"\0" * 16, kind: int = 0, dtype_code: int = 6,
                shape: tuple[int, int, int, int, int] | None = None,
                token_start: int = 0, token_end: int = 0) -> bytes:
    """A header for tests and benchmarks (dtype uint8, shape ``[1, 1, n, 1, 1]`` by default)."""
    L, KV, T, H, D = shape or (1, 1, payload_nbytes, 1, 1)
    body = _BODY.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, kind, dtype_code, KV, 0, L, T, H, D,
                      token_start, token_end, world, rank, group, 0, fingerprint, key,
                      payload_nbytes, checksum)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def header_object_id(h: RawHeader) -> bytes:
    """The object id a header names (key, group, rank, world)."""
    from vllm_kvplugin.server.protocol import object_id

    return object_id(h.key, h.group_index, h.tp_rank, h.tp_size)
