"""The chunk header: packing, every mismatch reason, checksum, truncation."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from vllm_kvplugin.chunk.format import (
    HEADER_SIZE,
    SEGMENT_BYTES,
    ChunkError,
    ChunkExpect,
    ChunkHeader,
    check_chunk,
    layers_digest,
    payload_checksum,
    state_spec,
)

EXPECT = ChunkExpect(fingerprint=b"F" * 32, key=b"K" * 32, kind=1, dtype="bfloat16",
                     shape=(4, 2, 32, 2, 64), token_start=64, token_end=96, tp_size=2, tp_rank=1,
                     group_index=0, layers=layers_digest(["model.layers.0.attn", "model.layers.1.attn"]))


def _payload(seed=0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(EXPECT.shape, generator=g).to(torch.bfloat16)
    return t.view(torch.uint8).numpy().tobytes()


def test_round_trip():
    payload = _payload()
    assert len(payload) == EXPECT.payload_nbytes
    header = ChunkHeader.for_payload(EXPECT, payload)
    raw = header.pack()
    assert len(raw) == HEADER_SIZE
    assert ChunkHeader.unpack(raw) == header
    assert check_chunk(raw, payload, EXPECT) == header


@pytest.mark.parametrize("field,value", [
    ("fingerprint", b"G" * 32), ("key", b"J" * 32), ("kind", 2), ("dtype", "float16"),
    ("shape", (4, 2, 32, 2, 128)), ("token_start", 0), ("tp_rank", 0), ("tp_size", 4), ("group_index", 1),
    # two groups of one shape (e.g. three one-layer GatedDeltaNet groups) differ in their layers
    ("layers", layers_digest(["model.layers.1.attn", "model.layers.0.attn"])),
    ("spec", state_spec([(torch.float32, (2, 128, 128))])),
])
def test_every_field_mismatch_is_a_header_mismatch(field, value):
    payload = _payload()
    raw = ChunkHeader.for_payload(EXPECT, payload).pack()
    other = dataclasses.replace(EXPECT, **{field: value})
    with pytest.raises(ChunkError) as e:
        check_chunk(raw, payload, other)
    assert e.value.reason in ("header_mismatch", "short_read")


def test_state_spec_names_dtypes_and_shapes():
    assert state_spec([(torch.bfloat16, (3, 512)), (torch.float32, (2, 128, 128))]) == \
        "bfloat16[3,512];float32[2,128,128]"
    long = state_spec([(torch.float32, (i, 4096, 4096)) for i in range(1, 9)])
    assert long.startswith("sha256:") and len(long) == 64


def test_flipped_payload_byte_is_a_checksum_error():
    payload = bytearray(_payload())
    raw = ChunkHeader.for_payload(EXPECT, bytes(payload)).pack()
    payload[12345] ^= 0x10
    with pytest.raises(ChunkError) as e:
        check_chunk(raw, bytes(payload), EXPECT)
    assert e.value.reason == "checksum"
    # verification can be turned off (then the header still must match)
    check_chunk(raw, bytes(payload), EXPECT, verify_checksum=False)


def test_truncated_payload_and_header_are_short_reads():
    payload = _payload()
    raw = ChunkHeader.for_payload(EXPECT, payload).pack()
    with pytest.raises(ChunkError) as e:
        check_chunk(raw, payload[:-1], EXPECT)
    assert e.value.reason == "short_read"
    with pytest.raises(ChunkError) as e:
        ChunkHeader.unpack(raw[:-3])
    assert e.value.reason == "short_read"


@pytest.mark.parametrize("offset,reason", [(0, "bad_magic"), (4, "version"), (40, "header_checksum")])
def test_corrupt_header_bytes(offset, reason):
    raw = bytearray(ChunkHeader.for_payload(EXPECT, _payload()).pack())
    raw[offset] ^= 0xFF
    with pytest.raises(ChunkError) as e:
        ChunkHeader.unpack(bytes(raw))
    assert e.value.reason == reason


def _segmented_xxh3(data: bytes, segment: int) -> int:
    """The format's payload digest, written out: xxh3-64 of each segment, then of those."""
    import xxhash

    parts = [data[i:i + segment] for i in range(0, len(data), segment)] or [b""]
    return xxhash.xxh3_64_intdigest(b"".join(xxhash.xxh3_64_intdigest(p).to_bytes(8, "little") for p in parts))


@pytest.mark.parametrize("nbytes", [0, 1, 240, 241, SEGMENT_BYTES - 1, SEGMENT_BYTES, SEGMENT_BYTES + 1,
                                    3 * SEGMENT_BYTES + 100])
def test_checksum_is_xxh3_of_the_xxh3s_of_256kib_segments(nbytes):
    import numpy as np

    assert SEGMENT_BYTES == 256 << 10
    p = os.urandom(nbytes)
    assert payload_checksum(p) == _segmented_xxh3(p, 256 << 10)
    assert payload_checksum(memoryview(p)) == payload_checksum(p)
    if nbytes % 2 == 0:  # a view of another format: its bytes
        assert payload_checksum(memoryview(np.frombuffer(p, dtype=np.uint16))) == payload_checksum(p)


def test_a_changed_byte_in_any_segment_changes_the_checksum():
    p = bytearray(os.urandom(2 * SEGMENT_BYTES + 5))
    before = payload_checksum(bytes(p))
    for at in (0, SEGMENT_BYTES - 1, SEGMENT_BYTES, 2 * SEGMENT_BYTES + 4):
        q = bytearray(p)
        q[at] ^= 1
        assert payload_checksum(bytes(q)) != before


def test_a_format_2_chunk_is_refused_by_its_version():
    import struct

    raw = bytearray(ChunkHeader.for_payload(EXPECT, _payload()).pack())
    assert struct.unpack_from("<H", raw, 4)[0] == 3
    struct.pack_into("<H", raw, 4, 2)
    with pytest.raises(ChunkError) as e:
        ChunkHeader.unpack(bytes(raw))
    assert e.value.reason == "version"


def test_dtype_names():
    from vllm_kvplugin.chunk.format import dtype_name

    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name("float8_e4m3fn") == "float8_e4m3fn"
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)


def test_format_module_does_not_need_torch():
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; import vllm_kvplugin.chunk.format, vllm_kvplugin.chunk.keys"
    assert subprocess.run([sys.executable, "-c", code], cwd="/").returncode == 0


def test_chunk_keys_follow_the_format_version():
    """Objects of two formats never share a key: a store shared by engines of both holds each
    format's objects apart (neither finds, refuses and drops the other's)."""
    from vllm_kvplugin.chunk.format import FORMAT_VERSION
    from vllm_kvplugin.chunk.keys import KEY_VERSION

    assert KEY_VERSION == b"kvplugin/chunk-key/v%d" % FORMAT_VERSION
