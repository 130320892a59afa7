"""The canonical chunk format and its keys."""

from vllm_kvplugin.chunk.format import (
    HEADER_SIZE,
    ChunkError,
    ChunkExpect,
    ChunkHeader,
    check_chunk,
    payload_checksum,
)
from vllm_kvplugin.chunk.keys import KeyExtras, MMItem, chunk_keys, model_fingerprint

__all__ = [
    "HEADER_SIZE", "ChunkError", "ChunkExpect", "ChunkHeader", "KeyExtras", "MMItem",
    "check_chunk", "chunk_keys", "model_fingerprint", "payload_checksum",
]
