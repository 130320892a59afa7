"""Payload digests on the device: kvplugin::segment_digests's CUDA kernel against the xxhash
library (every short size, the long path's block and stripe edges, segments of many rows, rows
at every 16-byte misalignment), and the transfer engine's two uses of it -- a prefetch's rows
digested where they landed, a staged store's rows digested before their DMA -- against
:func:`payload_checksum` of the host bytes."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash
from test_cuda_transfer import _host_bufs, _layout

from vllm_kvplugin import ops
from vllm_kvplugin.chunk.format import SEGMENT_BYTES, payload_checksum
from vllm_kvplugin.tiers.local_cpu import bytes_of
from vllm_kvplugin.transfer.cuda import CudaTransfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
U64 = (1 << 64) - 1


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    info = ops.load()
    if info.cuda != "CUDA kernel" or not hasattr(torch.ops.kvplugin, "segment_digests"):
        pytest.skip(f"CUDA digest kernel not built ({info.describe()})")


def _on_device(data: bytes, rows: int, misalign: int = 0) -> torch.Tensor:
    """``data`` as uint8 [rows, N] on the device, its first byte ``misalign`` bytes past a
    256-byte boundary."""
    flat = torch.empty(len(data) + 256, dtype=torch.uint8, device="cuda")
    if data:
        flat[misalign:misalign + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    return flat[misalign:misalign + len(data)].view(rows, -1)


def _want(data: bytes, rows: int, seg: int) -> list[list[int]]:
    n = len(data) // rows
    out = []
    for r in range(rows):
        row = data[r * n:(r + 1) * n]
        out.append([xxhash.xxh3_64_intdigest(row[i:i + seg]) for i in range(0, n, seg)]
                   or [xxhash.xxh3_64_intdigest(b"")])
    return out


def _got(t: torch.Tensor, seg: int) -> list[list[int]]:
    out = torch.ops.kvplugin.segment_digests(t, seg)
    assert out.device == t.device and out.dtype == torch.int64
    return [[v & U64 for v in row] for row in out.cpu().tolist()]


def test_every_size_up_to_1100_bytes_matches_xxhash():
    data = os.urandom(1100)
    for n in range(1101):
        assert _got(_on_device(data[:n], 1), 4096) == _want(data[:n], 1, 4096), n


@pytest.mark.parametrize("misalign", [0, 1, 8, 15])
@pytest.mark.parametrize("rows,n,seg", [(3, 5 * 1024 + 17, 1024), (5, 3 * SEGMENT_BYTES + 4100, SEGMENT_BYTES),
                                        (2, 2 * SEGMENT_BYTES, SEGMENT_BYTES), (7, 100, 64), (33, 70_001, 4096)])
def test_segments_of_rows_match_xxhash(rows, n, seg, misalign):
    data = os.urandom(rows * n)
    assert _got(_on_device(data, rows, misalign), seg) == _want(data, rows, seg)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.kvplugin.segment_digests(torch.zeros(2, 8, dtype=torch.uint8, device="cuda"), 100)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.kvplugin.segment_digests(torch.zeros(2, 8, dtype=torch.int32, device="cuda"), 64)


def _engine(**kw) -> CudaTransfer:
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), **kw)
    assert eng.digests
    return eng


def test_a_prefetch_is_digested_where_it_landed():
    """Chunks of one segment (256 KiB) and of eight, copied in pieces: each row's digest is the payload
    checksum of its host buffer as it was when copied, whatever the host holds afterwards."""
    eng = _engine()
    gen = torch.Generator().manual_seed(41)
    case, layout, layers = _layout("v026-nhd", gen)
    _, bufs = _host_bufs(layout, 10, 64, gen)
    want = [payload_checksum(bytes_of(b)) for b in bufs]
    pre = eng.prefetch(layout, bufs)
    assert pre is not None and pre.rows == 10 and len(pre.pieces) > 2
    digests = eng.digest(pre)
    assert [(a, b) for a, b, _ in digests.marks] == [(a, b) for a, b, _ in pre.pieces]
    while not digests.done():  # as a lone fetch polls: the landed pieces' rows combined early
        digests.advance()
    pre.event.synchronize()
    for b in bufs:  # the host's bytes change after the copy: the digests are of what landed
        bytes_of(b)[0] ^= 0xFF
    assert digests.result() == want
    assert digests.done()
    eng.release(pre)
    _, big = _host_bufs(layout, 2, 512, gen)
    assert big[0].nbytes == 8 * SEGMENT_BYTES
    pre = eng.prefetch(layout, big)
    assert eng.digest(pre).result() == [payload_checksum(bytes_of(b)) for b in big]
    eng.release(pre)


def test_when_done_calls_back_after_the_digests():
    eng = _engine()
    gen = torch.Generator().manual_seed(43)
    case, layout, layers = _layout("v026-nhd", gen)
    _, bufs = _host_bufs(layout, 4, 64, gen)
    pre = eng.prefetch(layout, bufs)
    digests = eng.digest(pre)
    import threading

    called = threading.Event()
    digests.when_done(called.set)
    assert called.wait(30) and digests.done()
    eng.release(pre)


@pytest.mark.parametrize("T", [64, 512])
def test_a_staged_store_gives_the_digests_of_its_full_chunks(T):
    """Chunks with skipped tokens go through the zero-copy kernel (the host keeps the skipped
    tokens' bytes): the host hashes those; every full chunk's digest comes from the device and
    equals the payload checksum of the bytes that reached its host buffer."""
    eng = _engine(store_zero_copy_max_bytes=-1, load_zero_copy_max_bytes=-1)
    gen = torch.Generator().manual_seed(44 + T)
    case, layout, layers = _layout("v026-nhd", gen)
    C = 1024 // T  # every block of the cache
    blocks = torch.randperm(layout.num_blocks, generator=gen)
    slots = (blocks.repeat_interleave(16) * 16 + torch.arange(1024) % 16).view(C, T).clone()
    slots[-1, -3:] = -1  # the last chunk has skipped tokens
    if C > 2:
        slots[0, :2] = -1  # and the first
    _, bufs = _host_bufs(layout, C, T, gen)
    ticket = eng.store(layout, layers, slots, bufs)
    eng.wait(ticket)
    got = eng.checksums(ticket)
    full = [b for b, row in zip(bufs, slots) if bool((row >= 0).all())]
    assert len(full) == (C - 2 if C > 2 else 1)
    assert got == {b.data_ptr(): payload_checksum(bytes_of(b)) for b in full}
