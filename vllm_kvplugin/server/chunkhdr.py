"""The chunk header as the server reads it: :mod:`vllm_kvplugin.chunk.format` (torch-free),
plus the object id a header names and a header builder for tests and benchmarks."""

from __future__ import annotations

from vllm_kvplugin.chunk.format import HEADER_SIZE, ChunkError, ChunkHeader, payload_checksum

HeaderError = ChunkError

__all__ = ["HEADER_SIZE", "ChunkHeader", "HeaderError", "header_object_id", "pack_header",
           "parse_header", "payload_checksum"]


def parse_header(data) -> ChunkHeader:
    """Parse and self-check a header (magic, version, header checksum); raises :class:`HeaderError`."""
    return ChunkHeader.unpack(data)


def header_object_id(h: ChunkHeader) -> bytes:
    """The object id a header names (key, group, rank, world)."""
    from vllm_kvplugin.server.protocol import object_id

    return object_id(h.key, h.group_index, h.tp_rank, h.tp_size)


def pack_header(*, key: bytes, group: int, rank: int, world: int, payload_nbytes: int,
                checksum: int, fingerprint: bytes = b"\0" * 32, kind: int = 0, dtype: str = "uint8",
                shape: tuple[int, int, int, int, int] | None = None,
                token_start: int = 0, token_end: int = 0) -> bytes:
    """A header for tests and benchmarks (dtype uint8, shape ``[1, 1, n, 1, 1]`` by default)."""
    return ChunkHeader(fingerprint, key, kind, dtype, shape or (1, 1, payload_nbytes, 1, 1),
                       token_start, token_end, world, rank, group, payload_nbytes, checksum).pack()
