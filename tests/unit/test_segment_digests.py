"""kvplugin::segment_digests on the CPU: the XXH3 written for the GPU (csrc/xxh3.h, compiled for
the host here) against the xxhash library, at every short-input size and across the long
path's block and stripe boundaries, and the payload digest built from it."""

from __future__ import annotations

import os
import random

import pytest
import torch
import xxhash

from vllm_kvplugin import ops
from vllm_kvplugin.chunk.format import SEGMENT_BYTES, combine_segments, payload_checksum

pytestmark = pytest.mark.skipif(not ops.load().cpu.startswith("C++"),
                                reason="the compiled CPU op is not built (pip install --no-build-isolation)")


def _digests(data: bytes, rows: int, segment: int) -> list[list[int]]:
    t = (torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, -1) if data
         else torch.empty((rows, 0), dtype=torch.uint8))
    out = torch.ops.kvplugin.segment_digests(t, segment)
    assert out.dtype == torch.int64 and out.shape == (rows, max(1, -(-t.shape[1] // segment)))
    return [[v & ((1 << 64) - 1) for v in row] for row in out.tolist()]


def test_every_size_up_to_2100_bytes_matches_xxhash():
    """0-16, 17-128, 129-240 bytes each have their own mixing; 241+ the long path, whose blocks
    are 1024 bytes and stripes 64."""
    data = os.urandom(2100)
    for n in range(2101):
        (row,) = _digests(data[:n], 1, 4096)
        assert row == [xxhash.xxh3_64_intdigest(data[:n])], n


def test_segments_of_rows_match_xxhash():
    rnd = random.Random(5)
    for rows, n, seg in [(3, 5 * 1024 + 17, 1024), (2, 3 * 4096, 4096), (4, 100, 64), (1, 0, 64),
                         (2, rnd.randrange(70_000, 200_000), 16384)]:
        data = os.urandom(rows * n)
        got = _digests(data, rows, seg)
        for r in range(rows):
            row = data[r * n:(r + 1) * n]
            want = [xxhash.xxh3_64_intdigest(row[i:i + seg]) for i in range(0, n, seg)] or [xxhash.xxh3_64_intdigest(b"")]
            assert got[r] == want, (rows, n, seg, r)


def test_the_payload_digest_of_segments_is_payload_checksum():
    data = os.urandom(2 * (2 * SEGMENT_BYTES + 300))
    for r, row in enumerate(_digests(data, 2, SEGMENT_BYTES)):
        assert combine_segments(row) == payload_checksum(data[r * len(data) // 2:(r + 1) * len(data) // 2])


@pytest.mark.parametrize("bad", [
    (torch.zeros(4, 4, dtype=torch.int32), 64, "uint8"),
    (torch.zeros(16, dtype=torch.uint8), 64, r"\[R, N\]"),
    (torch.zeros(8, 8, dtype=torch.uint8).t(), 64, "contiguous"),
    (torch.zeros(2, 8, dtype=torch.uint8), 100, "multiple of 64"),
])
def test_bad_arguments_are_refused_by_name(bad):
    data, seg, match = bad
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kvplugin.segment_digests(data, seg)
