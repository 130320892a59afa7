"""The CUDA transfer engine: round trips checked against the reference, and device ordering.

Both paths (staged copy-engine DMAs and zero-copy kernels) are forced in turn
through the engine's thresholds, and the default (size-based) choice is run
too.  Host buffers are page-locked slots of a pool, not contiguous with each
other (with one adjacent pair, which the engine may copy in one DMA).
"""

from __future__ import annotations

from collections import deque

import _kvcases as K
import pytest
import torch

from vllm_kvplugin.layout.build import build_layout
from vllm_kvplugin.layout.reference import _index, reference_gather, reference_scatter, token_view
from vllm_kvplugin.transfer import engine_for
from vllm_kvplugin.transfer.cuda import CudaTransfer
from vllm_kvplugin.transfer.staging_choice import held_limit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODES = {
    "staged": dict(store_zero_copy_max_bytes=-1, load_zero_copy_max_bytes=-1),
    "zero-copy": dict(store_zero_copy_max_bytes=1 << 62, load_zero_copy_max_bytes=1 << 62),
    "default": {},
    # staged, each chunk its own DMA piece, one piece on the copy engine at a time
    "paced": dict(store_zero_copy_max_bytes=-1, load_zero_copy_max_bytes=-1, dma_piece_bytes=1, dma_window=1),
}
# about 20 ms of GPU time on an H200 (1.98 GHz): long enough for a missing wait to show
SLEEP_CYCLES = 40_000_000


def _bits(t):
    return t.view(torch.uint8)


def _engine(mode: str) -> CudaTransfer:
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), **MODES[mode])
    if mode != "default" and not eng.kernel:
        if mode == "zero-copy":
            pytest.skip("zero-copy needs the CUDA kernel")
    return eng


def _layout(name: str, gen, **kw):
    builders = {
        "v026-nhd": lambda: K.v026_attention(layout="NHD", L=4, num_blocks=64, block_size=16,
                                             H=4, D=64, dtype=torch.bfloat16, device="cuda"),
        "v032-LBHNC-kernel-split": lambda: K.v032(layout="LBHNC", L=4, num_blocks=32,
                                                  block_size=64, kernel_block_size=16, H=4, D=64,
                                                  dtype=torch.bfloat16, device="cuda"),
        "split-kv-first": lambda: K.split(kv_first=True, L=4, num_blocks=64, block_size=16, H=4,
                                          D=64, dtype=torch.float16, device="cuda"),
        "v032-mla": lambda: K.v032(layout="LBNHC", spec_kind="mla", backend="FLASHMLA", L=3,
                                   num_blocks=64, block_size=16, H=1, D=576,
                                   dtype=torch.bfloat16, device="cuda"),
        "v032-BLNHC-fp8": lambda: K.v032(layout="BLNHC", L=4, num_blocks=64, block_size=16, H=4,
                                         D=64, dtype=torch.float8_e4m3fn, device="cuda"),
    }
    case = builders[name]()
    for r in case.raws:
        K.random_bytes_(r, gen)
    layout, layers = build_layout(case.src, case.views)
    return case, layout, layers


def _slots(layout, C, T, gen, blocks=None):
    bs = layout.block_size
    nblk = -(-C * T // bs)
    if blocks is None:
        blocks = torch.randperm(layout.num_blocks, generator=gen)[:nblk]
    flat = (blocks.repeat_interleave(bs) * bs + torch.arange(nblk * bs) % bs)[: C * T].clone()
    flat[:2] = -1
    flat[-3:] = -1
    return flat.view(C, T).to(torch.int64)


def _host_bufs(layout, C, T, gen, order=None):
    shape = layout.chunk_shape(T)
    pool = torch.empty((2 * C + 2, *shape), dtype=layout.dtype, pin_memory=True)
    K.random_bytes_(pool, gen)
    order = order or ([2 * C + 1, 0, 1] + [3 + 2 * i for i in range(C)])[:C]
    return pool, [pool[i:i + 1] for i in order]


def _ref_views(layers, dtype):
    return [t.view(torch.uint8) for t in layers] if dtype.itemsize == 1 else list(layers)


def _ref_chunk(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _dev_index(layout, slots):
    """The reference's indices, on the device, so "compute" below never syncs the host."""
    return tuple(x.cuda() for x in _index(slots, layout.block_size, layout.kernel_block_size))


def _dev_scatter(layout, layers, idx, src):
    """reference_scatter with precomputed device indices: enqueued, no host sync."""
    c, t, kb, n = idx
    for li, layer in enumerate(layers):
        view = token_view(layout.semantics, layer, layout.head_dim, layout.kernel_block_size)
        view[kb, n] = src[c, li, :, t]


def _dev_gather(layout, layers, idx, out):
    c, t, kb, n = idx
    for li, layer in enumerate(layers):
        view = token_view(layout.semantics, layer, layout.head_dim, layout.kernel_block_size)
        out[c, li, :, t] = view[kb, n]


def _reference_chunks(layout, layers, slots, bufs):
    """What the host buffers must hold after a store: the reference gather over their old bytes."""
    ref = torch.cat([b for b in bufs]).cuda()
    reference_gather(layout, _ref_views(layers, layout.dtype), slots, _ref_chunk(ref))
    return ref.cpu()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["v026-nhd", "v032-LBHNC-kernel-split", "split-kv-first",
                                  "v032-mla", "v032-BLNHC-fp8"])
def test_store_then_load_matches_reference(name, mode):
    gen = torch.Generator().manual_seed(len(name) * 31 + len(mode))
    eng = _engine(mode)
    case, layout, layers = _layout(name, gen)
    C, T = 5, 64
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    want = _reference_chunks(layout, layers, slots, bufs)
    ticket = eng.store(layout, layers, slots, bufs)
    eng.fence()
    eng.wait(ticket)
    assert eng.done(ticket)
    got = torch.cat(bufs)
    assert torch.equal(_bits(got), _bits(want)), f"{name} {mode}: stored bytes differ from the reference"

    # load into a poisoned cache: every target written, everything else untouched
    for r in case.raws:
        K.random_bytes_(r, gen)
    new = torch.empty((C, *layout.chunk_shape(T)), dtype=layout.dtype)
    K.random_bytes_(new, gen)
    for c, b in enumerate(bufs):
        b.copy_(new[c:c + 1])
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, _ref_views(expect_layers, layout.dtype), slots, _ref_chunk(new.cuda()))
    eng.load(layout, layers, slots, bufs)
    torch.cuda.current_stream().synchronize()  # the load is ordered on the compute stream
    assert all(torch.equal(a, b) for a, b in zip(case.raws, expect_raws)), \
        f"{name} {mode}: loaded cache differs from the reference"

    # and back out again: where slots >= 0 the stored bytes are the loaded ones, elsewhere
    # the host buffers keep their bytes
    _, bufs2 = _host_bufs(layout, C, T, gen)
    poison2 = torch.cat(bufs2).clone()
    t2 = eng.store(layout, layers, slots, bufs2)
    eng.wait(t2)
    keep = (slots >= 0).view(C, 1, 1, T, 1, 1)
    assert torch.equal(_bits(torch.cat(bufs2)), torch.where(keep, _bits(new), _bits(poison2)))


@pytest.mark.parametrize("mode", ["staged", "zero-copy", "paced"])
def test_store_reads_blocks_after_the_forward_and_before_the_overwrite(mode):
    """A kernel on the compute stream writes the blocks (after a long sleep), the store is
    issued right after, the next step (after fence) overwrites the blocks: the stored bytes
    are the pre-overwrite ones."""
    gen = torch.Generator().manual_seed(21)
    eng = _engine(mode)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 4, 64
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    truth = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=layout.dtype,
                                        device="cuda"), gen)
    other = K.random_bytes_(torch.empty_like(truth), gen)
    poison = torch.cat(bufs).cuda()
    idx = _dev_index(layout, slots)
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward" is still running when the store is issued
    _dev_scatter(layout, layers, idx, truth)  # ... and writes the blocks at its end
    ticket = eng.store(layout, layers, slots, bufs)
    eng.fence()
    _dev_scatter(layout, layers, idx, other)  # next step reuses the blocks
    eng.wait(ticket)
    compute.synchronize()
    want = torch.where((slots >= 0).cuda().view(C, 1, 1, T, 1, 1), truth, poison)
    assert torch.equal(_bits(torch.cat(bufs).cuda()), _bits(want))


@pytest.mark.parametrize("mode", ["staged", "zero-copy"])
def test_load_is_ordered_before_attention(mode):
    """Attention issued on the compute stream right after load() reads the loaded bytes,
    and the load's writes come after earlier compute work on those blocks."""
    gen = torch.Generator().manual_seed(22)
    eng = _engine(mode)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 6, 64
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    before = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=layout.dtype,
                                         device="cuda"), gen)
    idx = _dev_index(layout, slots)
    seen = before.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    _dev_scatter(layout, layers, idx, before)  # earlier compute writing those blocks
    eng.load(layout, layers, slots, bufs)
    _dev_gather(layout, layers, idx, seen)  # "attention" reading the blocks
    torch.cuda.synchronize()
    want = torch.where((slots >= 0).cuda().view(C, 1, 1, T, 1, 1), torch.cat(bufs).cuda(), before)
    assert torch.equal(_bits(seen), _bits(want))


@pytest.mark.parametrize("mode", ["staged", "zero-copy"])
def test_load_into_blocks_a_pending_store_still_reads(mode):
    """store(X) then load(X <- other bytes) with no fence between: the store gets the old bytes."""
    gen = torch.Generator().manual_seed(23)
    eng = _engine(mode)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 3, 64
    slots = _slots(layout, C, T, gen)
    _, out_bufs = _host_bufs(layout, C, T, gen)
    _, in_bufs = _host_bufs(layout, C, T, gen)
    truth = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=layout.dtype,
                                        device="cuda"), gen)
    poison = torch.cat(out_bufs).cuda()
    incoming = torch.cat(in_bufs).cuda()
    idx = _dev_index(layout, slots)
    seen = incoming.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    _dev_scatter(layout, layers, idx, truth)
    ticket = eng.store(layout, layers, slots, out_bufs)
    eng.load(layout, layers, slots, in_bufs)
    _dev_gather(layout, layers, idx, seen)
    eng.wait(ticket)
    torch.cuda.synchronize()
    keep = (slots >= 0).cuda().view(C, 1, 1, T, 1, 1)
    assert torch.equal(_bits(torch.cat(out_bufs).cuda()), _bits(torch.where(keep, truth, poison)))
    assert torch.equal(_bits(seen), _bits(incoming))


@pytest.mark.parametrize("mode", ["staged", "zero-copy"])
def test_store_into_host_buffers_a_pending_load_still_reads(mode):
    gen = torch.Generator().manual_seed(24)
    eng = _engine(mode)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 3, 64
    slots_in = _slots(layout, C, T, gen, blocks=torch.arange(0, 12))
    slots_out = _slots(layout, C, T, gen, blocks=torch.arange(20, 32))
    _, bufs = _host_bufs(layout, C, T, gen)
    incoming = torch.cat(bufs).cuda()
    want_out = _reference_chunks(layout, layers, slots_out, bufs)
    idx_in = _dev_index(layout, slots_in)
    seen = incoming.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # delays the load (it waits for the compute stream)
    eng.load(layout, layers, slots_in, bufs)
    ticket = eng.store(layout, layers, slots_out, bufs)  # same host buffers, right away
    _dev_gather(layout, layers, idx_in, seen)
    eng.wait(ticket)
    torch.cuda.synchronize()
    assert torch.equal(_bits(seen), _bits(incoming)), "the load read host bytes a later store wrote"
    # want_out was computed before the load: blocks 20.. are untouched by it
    assert torch.equal(_bits(torch.cat(bufs)), _bits(want_out))


@pytest.mark.parametrize("mode", ["staged", "default", "paced"])
def test_back_to_back_stores_reuse_staging_safely(mode):
    gen = torch.Generator().manual_seed(25)
    eng = _engine(mode)
    eng.max_staging_buffers = 2  # force reuse of busy staging buffers
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 4, 64
    jobs = []
    for _ in range(6):
        slots = _slots(layout, C, T, gen)
        _, bufs = _host_bufs(layout, C, T, gen)
        want = _reference_chunks(layout, layers, slots, bufs)
        jobs.append((eng.store(layout, layers, slots, bufs), bufs, want))
    eng.fence()
    for ticket, bufs, want in jobs:
        eng.wait(ticket)
        assert torch.equal(_bits(torch.cat(bufs)), _bits(want))
    assert len(eng._pool) <= 2


def test_store_pieces_are_paced():
    """A store queues its DMAs in pieces; no more than the window is ever on the copy engine
    (vLLM's own small copies must not wait behind a whole store), the rest are issued as
    pieces complete, by ``pump`` from any thread, and the bytes are the reference's."""
    import threading

    gen = torch.Generator().manual_seed(27)
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), store_zero_copy_max_bytes=-1,
                       dma_piece_bytes=1, dma_window=2)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 6, 64
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    want = _reference_chunks(layout, layers, slots, bufs)
    torch.cuda.synchronize()
    torch.cuda._sleep(5 * SLEEP_CYCLES)  # the "forward": no gather, so no piece, can finish meanwhile
    assert not eng.pumping()  # (vLLM then skips the per-layer hooks: connector.has_connector_metadata)
    ticket = eng.store(layout, layers, slots, bufs)
    eng.fence()
    for _ in range(3):
        eng.pump()
    full = C - 2 if eng.kernel else C  # with the kernel the partial first and last chunk go zero-copy
    assert eng._paced.queued() == 2 and len(ticket.job.pieces) == full - 2 and ticket.job.event is None
    assert not eng.done(ticket) and eng.pumping()
    waiter = threading.Thread(target=eng.wait, args=(ticket,))  # as the store finisher does
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and eng.done(ticket)
    assert eng._paced.idle() and not eng.pumping() and ticket.job.pieces == deque()
    assert torch.equal(_bits(torch.cat(bufs)), _bits(want))


def test_settle_waits_for_every_queued_store_piece():
    """``settle`` (after a store failed while it was issued, before its memory is reused):
    two stores' pieces still queued behind a slow "forward" are all issued and done when it
    returns, and the bytes are the reference's."""
    gen = torch.Generator().manual_seed(28)
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), store_zero_copy_max_bytes=-1,
                       dma_piece_bytes=1, dma_window=1)
    case, layout, layers = _layout("v026-nhd", gen)
    cases = []
    for _ in range(2):
        slots = _slots(layout, 4, 64, gen)
        _, bufs = _host_bufs(layout, 4, 64, gen)
        cases.append((slots, bufs, _reference_chunks(layout, layers, slots, bufs)))
    torch.cuda.synchronize()
    torch.cuda._sleep(5 * SLEEP_CYCLES)  # the "forward": no gather, so no piece, can finish meanwhile
    jobs = [(eng.store(layout, layers, slots, bufs), bufs, want) for slots, bufs, want in cases]
    assert not eng._paced.idle()
    eng.settle()
    assert eng._paced.idle()
    for ticket, bufs, want in jobs:
        assert ticket.job.event.query() and all(e.query() for e in ticket.events)
        assert torch.equal(_bits(torch.cat(bufs)), _bits(want))


def test_out_of_range_slot_raises_before_anything_moves():
    gen = torch.Generator().manual_seed(26)
    eng = _engine("staged")
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 2, 64
    slots = _slots(layout, C, T, gen)
    slots[1, 7] = layout.num_blocks * layout.block_size
    _, bufs = _host_bufs(layout, C, T, gen)
    before = torch.cat(bufs).clone()
    raws = [r.clone() for r in case.raws]
    with pytest.raises(RuntimeError, match="outside the cache"):
        eng.store(layout, layers, slots, bufs)
    with pytest.raises(RuntimeError, match="outside the cache"):
        eng.load(layout, layers, slots, bufs)
    torch.cuda.synchronize()
    assert torch.equal(_bits(torch.cat(bufs)), _bits(before))
    assert all(torch.equal(a, b) for a, b in zip(case.raws, raws))


def test_refuses_pageable_host_buffers():
    gen = torch.Generator().manual_seed(27)
    eng = _engine("default")
    case, layout, layers = _layout("v026-nhd", gen)
    slots = _slots(layout, 1, 64, gen)
    with pytest.raises(ValueError, match="page-locked"):
        eng.store(layout, layers, slots, [torch.empty((1, *layout.chunk_shape(64)), dtype=layout.dtype)])


def test_engine_for_cuda_device():
    eng = engine_for(torch.device("cuda", 0))
    assert isinstance(eng, CudaTransfer)
    assert eng.name in ("cuda", "cuda-torch")
    assert eng.done(None)


def _prefetch_case(eng, C=4, T=64, seed=28):
    gen = torch.Generator().manual_seed(seed)
    case, layout, layers = _layout("v026-nhd", gen)
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    return case, layout, layers, slots, bufs


def _load_prefetched(eng, layout, layers, slots, bufs):
    """Prefetch, then load every chunk (the prefetched rows from the device, the rest over the
    link); the cache must then hold what the reference scatter writes."""
    want = [r.clone() for r in layers]
    reference_scatter(layout, _ref_views(want, layout.dtype), slots.cuda(),
                      _ref_chunk(torch.cat(bufs).cuda()))
    pre = eng.prefetch(layout, bufs)
    rows = 0 if pre is None else pre.rows
    if rows:
        eng.load(layout, layers, slots[:rows], bufs[:rows], staged=[(pre, list(range(rows)))])
    eng.load(layout, layers, slots[rows:], bufs[rows:])
    eng.release(pre)
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))
    return rows


def test_prefetch_takes_what_the_staging_cap_allows():
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    case, layout, layers, slots, bufs = _prefetch_case(eng)
    eng._fixed_cap = 2 * bufs[0].nbytes
    assert _load_prefetched(eng, layout, layers, slots, bufs) == 2


def test_a_prefetch_does_not_hold_a_large_idle_buffer():
    """The pool's one buffer is a large idle one (a large store's): a prefetch replaces it by one
    of its own size rather than holding it, and its load is still the reference's."""
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    eng.max_staging_buffers = 1
    case, layout, layers, slots, bufs = _prefetch_case(eng, seed=31)
    eng._acquire(256 << 20)  # a store's, handed back at once (no copy used it)
    nbytes = sum(b.nbytes for b in bufs)
    assert _load_prefetched(eng, layout, layers, slots, bufs) == len(bufs)
    assert len(eng._pool) == 1 and nbytes <= eng._pool[0].tensor.numel() <= held_limit(nbytes)


def test_warm_up_keeps_an_idle_buffer_that_a_first_hit_holds(monkeypatch):
    """After a warm-up with ``keep_bytes``, a prefetch of up to that size allocates no device
    memory and its load is the reference's; under a cap without room, nothing is kept."""
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    case, layout, layers, slots, bufs = _prefetch_case(eng, C=16, seed=33)  # the whole cache
    nbytes = sum(b.nbytes for b in bufs)  # 4 MiB: beyond the warm-up's own 2 MiB buffer
    eng.warm_up(layout, layers, 64)
    assert all(e.tensor.numel() < nbytes for e in eng._pool)  # without the kept buffer
    eng.warm_up(layout, layers, 64, keep_bytes=nbytes)
    assert any(e.tensor.numel() >= nbytes and not e.held for e in eng._pool)
    allocs, real = [], eng._alloc
    monkeypatch.setattr(eng, "_alloc", lambda n: allocs.append(n) or real(n))
    assert _load_prefetched(eng, layout, layers, slots, bufs) == len(bufs)
    assert allocs == []
    tight = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), staging_cap_bytes=nbytes // 2)
    tight.warm_up(layout, layers, 64, keep_bytes=nbytes)
    assert tight._pool and all(e.tensor.numel() < nbytes for e in tight._pool)


def test_automatic_staging_cap_follows_free_device_memory(monkeypatch):
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    free, total = torch.cuda.mem_get_info()
    assert eng.staging_cap_bytes == min(total // 4, free - (2 << 30))  # no staging held yet
    assert eng.staging_cap_bytes > 4 << 30  # an H200 with room: a 64k-token hit of an 8B model fits
    case, layout, layers, slots, bufs = _prefetch_case(eng)
    assert _load_prefetched(eng, layout, layers, slots, bufs) == len(bufs)
    held = sum(e.tensor.numel() for e in eng._pool)
    # a device with 3 chunks' room beyond the reserve: the staging held plus that room
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: ((2 << 30) + 3 * bufs[0].nbytes, total))
    assert eng.staging_cap_bytes == held + 3 * bufs[0].nbytes


def test_a_prefetch_without_device_memory_leaves_the_load_to_copy(monkeypatch):
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    case, layout, layers, slots, bufs = _prefetch_case(eng, seed=29)
    eng._pool.clear()

    def oom(nbytes):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(eng, "_alloc", oom)
    assert eng.prefetch(layout, bufs) is None
    monkeypatch.undo()
    assert _load_prefetched(eng, layout, layers, slots, bufs) == len(bufs)


def _fill_device_memory() -> list[torch.Tensor]:
    """Tensors that take the device's free memory, down to less than one 2 MiB granule (a
    real out-of-memory for any new staging buffer; the allocator's cached small blocks stay)."""
    hog: list[torch.Tensor] = []
    for size in (1 << 30, 1 << 26, 2 << 20):
        while True:
            try:
                hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return hog


def test_a_load_without_device_memory_for_staging_is_scattered_from_the_host():
    """A claimed load whose staging buffer cannot be allocated (the device really full) still
    lands, read by the kernel from the page-locked host buffers: the cache holds the
    reference's bytes and the next load, with memory back, stages as usual."""
    eng = _engine("staged")
    if not eng.kernel:
        pytest.skip("the fallback reads the host through the CUDA kernel")
    gen = torch.Generator().manual_seed(31)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 4, 64
    slots = _slots(layout, C, T, gen)
    _, bufs = _host_bufs(layout, C, T, gen)
    for r in layers:  # poisoned: the loads must write every slot they plan
        r.view(torch.uint8).fill_(0xA5)
    want = [r.clone() for r in layers]
    reference_scatter(layout, _ref_views(want, layout.dtype), slots.cuda(), _ref_chunk(torch.cat(bufs).cuda()))
    with torch.cuda.stream(eng._kern):  # a small block in use where the kernel's table is allocated: it fits beside it
        keep = torch.empty(1024, device="cuda")  # noqa: F841
    eng._pool.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    hog = _fill_device_memory()
    # and the free room of the allocator's cached segments on the engine's own stream (left by
    # the tests before this one): staging-sized buffers there until none fits either
    while True:
        try:
            hog.append(eng._alloc(C * layout.chunk_nbytes(T)))
        except torch.OutOfMemoryError:
            break
    try:
        with pytest.raises(torch.OutOfMemoryError):
            eng._acquire(C * layout.chunk_nbytes(T))
        eng.load(layout, layers, slots, bufs)
        torch.cuda.synchronize()
        assert not eng._pool  # no staging buffer was made
    finally:
        del hog
        torch.cuda.empty_cache()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))
    for r in layers:  # poisoned again, then loaded again: staged this time
        r.view(torch.uint8).fill_(0xA5)
    eng.load(layout, layers, slots, bufs)
    torch.cuda.synchronize()
    assert eng._pool
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))


def test_staged_load_of_rows_out_of_order_across_pieces():
    """Rows of a prefetch copied in pieces, scattered in another order and with a gap: each
    run waits for its own piece; the cache holds the reference's bytes."""
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    case, layout, layers, slots, bufs = _prefetch_case(eng, C=10, seed=30)
    pre = eng.prefetch(layout, bufs)
    assert pre is not None and pre.rows == 10 and len(pre.pieces) > 2
    rows = [6, 7, 8, 9, 0, 1, 3]  # row 2 (and its slots) left out
    want = [r.clone() for r in layers]
    reference_scatter(layout, _ref_views(want, layout.dtype), slots[rows].cuda(),
                      _ref_chunk(torch.cat([bufs[r] for r in rows]).cuda()))
    eng.load(layout, layers, slots[rows], [bufs[r] for r in rows], staged=[(pre, rows)])
    eng.release(pre)
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))


@pytest.mark.parametrize("landed", [True, False])
def test_two_prefetches_are_scattered_by_one_load(landed):
    """A split hit's two prefetches (rows of each out of order, one row left out) loaded by one
    call: once both copies have landed, one launch scatters them all; before, each run goes
    after its own piece.  Either way the poisoned cache then holds the reference's bytes."""
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    if not eng.kernel:
        pytest.skip("staged loads need the CUDA kernel")
    case, layout, layers, slots, bufs = _prefetch_case(eng, C=10, seed=32)
    for r in layers:
        r.view(torch.uint8).fill_(0xA5)
    first, second = eng.prefetch(layout, bufs[:4]), eng.prefetch(layout, bufs[4:])
    assert first is not None and second is not None and (first.rows, second.rows) == (4, 6)
    if landed:
        torch.cuda.synchronize()
    parts = [(first, [1, 0, 3]), (second, [5, 0, 1, 2])]  # bufs 1, 0, 3, then 9, 4, 5, 6 (2, 7, 8 left out)
    order = [1, 0, 3, 9, 4, 5, 6]
    want = [r.clone() for r in layers]
    reference_scatter(layout, _ref_views(want, layout.dtype), slots[order].cuda(),
                      _ref_chunk(torch.cat([bufs[i] for i in order]).cuda()))
    calls, scatter = [], eng._scatter
    eng._scatter = lambda *a: calls.append(len(a[3])) or scatter(*a)
    eng.load(layout, layers, slots[order], [bufs[i] for i in order], staged=parts)
    eng.release(first)
    eng.release(second)
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))
    if landed:
        assert calls == [5]  # one launch: the runs [1], [0], [3] and [5], [0, 1, 2]
    with pytest.raises(ValueError, match="do not cover"):
        eng.load(layout, layers, slots[order], [bufs[i] for i in order], staged=parts[:1])


@pytest.mark.parametrize(("by_blocks", "block_runs"), [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("landed", [True, False])
def test_staged_load_given_block_ids(monkeypatch, landed, by_blocks, block_runs):
    """A staged load whose objects are given as block ids (the worker's ``PlacedObjects``): the
    scatter op takes them as they are (``SCATTER_BY_BLOCKS``; with ``BLOCK_RUNS`` its block-run
    kernel) or the engine makes per-token slots first (the A/B's other side); landed or still
    in pieces (each run a slice of the placement), the poisoned cache then holds what the
    reference scatter writes, partial first and last objects included."""
    from vllm_kvplugin.transfer import cuda as cuda_mod
    from vllm_kvplugin.transfer.placement import PlacedObjects

    monkeypatch.setattr(cuda_mod, "SCATTER_BY_BLOCKS", by_blocks)
    monkeypatch.setattr(cuda_mod, "BLOCK_RUNS", block_runs)
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    if not eng.kernel:
        pytest.skip("staged loads need the CUDA kernel")
    gen = torch.Generator().manual_seed(34)
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 10, 64
    _, bufs = _host_bufs(layout, C, T, gen)
    per = T // layout.block_size
    ids = torch.randperm(layout.num_blocks, generator=gen)[:C * per].view(C, per).tolist()
    placed = PlacedObjects.of(ids, layout.block_size, T, [5] + [0] * (C - 1), [T] * (C - 1) + [T - 20])
    for r in layers:
        r.view(torch.uint8).fill_(0xA5)
    want = [r.clone() for r in layers]
    reference_scatter(layout, _ref_views(want, layout.dtype), placed.slots().cuda(),
                      _ref_chunk(torch.cat(bufs).cuda()))
    pre = eng.prefetch(layout, bufs)
    assert pre is not None and pre.rows == C and len(pre.pieces) > 2
    if landed:
        torch.cuda.synchronize()
    calls, scatter = [], eng._scatter
    eng._scatter = lambda *a: calls.append(type(a[2]).__name__) or scatter(*a)
    eng.load(layout, layers, placed, bufs, staged=[(pre, list(range(C)))])
    eng.release(pre)
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(layers, want))
    assert set(calls) == {"PlacedObjects" if by_blocks else "Tensor"}
    if landed:
        assert len(calls) == 1
    with pytest.raises(ValueError, match="placed objects for" if by_blocks else "slots must be"):
        eng.load(layout, layers, placed[1:], bufs, staged=[(pre, list(range(C)))])


@pytest.mark.parametrize("by_blocks", [True, False])
def test_staged_load_is_ordered_after_compute_and_a_pending_store(by_blocks):
    """A staged load (its copy landed) issued behind compute work that writes its blocks and a
    store still to gather them (no fence between): the store gets the compute's bytes, and
    "attention" issued on the compute stream right after the load reads the loaded ones."""
    from vllm_kvplugin.transfer.placement import PlacedObjects

    gen = torch.Generator().manual_seed(36)
    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()), store_zero_copy_max_bytes=-1)
    if not eng.kernel:
        pytest.skip("staged loads need the CUDA kernel")
    case, layout, layers = _layout("v026-nhd", gen)
    C, T = 3, 64
    per = T // layout.block_size
    ids = torch.randperm(layout.num_blocks, generator=gen)[:C * per].view(C, per).tolist()
    placed = PlacedObjects.of(ids, layout.block_size, T, [2, 0, 0], [T, T, T - 3])
    slots = placed.slots()
    _, out_bufs = _host_bufs(layout, C, T, gen)
    _, in_bufs = _host_bufs(layout, C, T, gen)
    truth = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=layout.dtype, device="cuda"), gen)
    poison = torch.cat(out_bufs).cuda()
    incoming = torch.cat(in_bufs).cuda()
    idx = _dev_index(layout, slots)
    unseen = K.random_bytes_(torch.empty_like(incoming), gen)
    seen = unseen.clone()
    pre = eng.prefetch(layout, in_bufs)
    assert pre is not None and pre.rows == C
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    _dev_scatter(layout, layers, idx, truth)  # earlier compute writing those blocks
    ticket = eng.store(layout, layers, slots, out_bufs)
    eng.load(layout, layers, placed if by_blocks else slots, in_bufs, staged=[(pre, list(range(C)))])
    _dev_gather(layout, layers, idx, seen)  # "attention" reading the blocks
    eng.wait(ticket)
    eng.release(pre)
    torch.cuda.synchronize()
    keep = (slots >= 0).cuda().view(C, 1, 1, T, 1, 1)
    assert torch.equal(_bits(torch.cat(out_bufs).cuda()), _bits(torch.where(keep, truth, poison)))
    assert torch.equal(_bits(seen), _bits(torch.where(keep, incoming, unseen)))


def test_a_rehearsal_moves_nothing():
    """``rehearse`` (a lone hit's load path run over no object while its copy ends) writes no
    byte of the cache and holds no device memory, whatever placement it is given."""
    from vllm_kvplugin.transfer.placement import PlacedObjects

    eng = CudaTransfer(torch.device("cuda", torch.cuda.current_device()))
    if not eng.kernel:
        pytest.skip("staged loads need the CUDA kernel")
    gen = torch.Generator().manual_seed(38)
    case, layout, layers = _layout("v026-nhd", gen)
    per = 64 // layout.block_size
    before = [r.clone() for r in case.raws]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for placed in (PlacedObjects.of([[0] * per], layout.block_size, 64, [0], [0]),
                   PlacedObjects.of([list(range(1, per + 1))], layout.block_size, 64, [0], [64])):
        eng.rehearse(layout, layers, placed)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == held
    assert all(torch.equal(a, b) for a, b in zip(case.raws, before))
