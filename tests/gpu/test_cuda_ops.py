"""The CUDA kernels of kvplugin::gather / kvplugin::scatter against the independent reference.

Every layout is built the way vLLM builds it (``_kvcases``), described by
``build_layout`` from a ``GroupSource``, and checked against
``vllm_kvplugin.layout.reference`` (plain tensor indexing from vLLM's reading
rules), never against a round trip alone.  Fresh random bytes for every case;
outputs poisoned before each run; the whole backing buffer compared after a
scatter (blocks outside the batch and page padding byte-identical).
"""

from __future__ import annotations

import zlib

import _kvcases as K
import pytest
import torch

from vllm_kvplugin import ops
from vllm_kvplugin.layout.build import build_layout
from vllm_kvplugin.layout.reference import reference_gather, reference_scatter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
CASES = sorted(K.catalogue(torch.bfloat16, "cpu").keys())


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    info = ops.load()
    if info.cuda != "CUDA kernel":
        pytest.skip(f"CUDA kernel not built ({info.describe()})")


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _ref_views(layers, dtype):
    # index ops are not implemented for every float8 type: the reference moves the same bits as uint8
    return [t.view(torch.uint8) for t in layers] if dtype.itemsize == 1 else list(layers)


def _ref_chunk(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def make_slots(layout, C: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[C, T] slots over distinct random blocks, with skipped tokens (partial first/last
    blocks, a hole in the middle), some blocks left out of the batch."""
    bs = layout.block_size
    nblk = -(-C * T // bs)
    assert nblk < layout.num_blocks, "leave blocks outside the batch"
    blocks = torch.randperm(layout.num_blocks, generator=gen)[:nblk]
    tok = torch.arange(nblk * bs)
    flat = (blocks.repeat_interleave(bs) * bs + tok % bs)[: C * T].clone()
    flat[:3] = -1  # partial first block
    flat[-5:] = -1  # partial last block
    holes = torch.rand(C * T, generator=gen) < 0.1
    flat[holes] = -1
    return flat.view(C, T).to(torch.int64)


def _setup(case_name: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    case = K.catalogue(dtype, "cuda")[case_name]()
    for r in case.raws:
        K.random_bytes_(r, gen)
    layout, layers = build_layout(case.src, case.views)
    return gen, case, layout, layers


def _args(layout):
    return (list(layout.strides), layout.block_size, layout.kernel_block_size, layout.num_blocks)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_name", CASES)
def test_gather_matches_reference(case_name, dtype):
    gen, case, layout, layers = _setup(case_name, dtype, seed=_seed(case_name, dtype))
    C, T = 3, 2 * layout.block_size
    slots = make_slots(layout, C, T, gen)
    out = torch.empty((C, *layout.chunk_shape(T)), dtype=dtype, device="cuda")
    for _ in range(2):  # two runs, each with fresh poison
        K.random_bytes_(out, gen)
        ref = out.clone()
        ops.gather(layers, slots.cuda(), *_args(layout), out)
        reference_gather(layout, _ref_views(layers, dtype), slots, _ref_chunk(ref))
        torch.cuda.synchronize()
        assert torch.equal(_bits(out), _bits(ref)), f"{case.name} {dtype}: gather differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_name", CASES)
def test_scatter_matches_reference(case_name, dtype):
    gen, case, layout, layers = _setup(case_name, dtype, seed=1 + _seed(case_name, dtype))
    C, T = 3, 2 * layout.block_size
    slots = make_slots(layout, C, T, gen)
    src = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=dtype, device="cuda"), gen)
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, _ref_views(expect_layers, dtype), slots, _ref_chunk(src))
    ops.scatter(layers, slots.cuda(), *_args(layout), src)
    torch.cuda.synchronize()
    for got, want in zip(case.raws, expect_raws):
        # the whole backing buffer: targets written, everything else byte-identical
        assert torch.equal(got, want), f"{case.name} {dtype}: scatter differs from the reference"


@pytest.mark.parametrize("bad", ["past-end", "below-minus-one"])
@pytest.mark.parametrize("case_name", ["v026-nhd", "v032-BLHNC", "v032-mla"])
def test_out_of_range_slot_raises_and_writes_nothing(case_name, bad):
    gen, case, layout, layers = _setup(case_name, torch.bfloat16, seed=7)
    C, T = 2, 2 * layout.block_size
    slots = make_slots(layout, C, T, gen)
    slots[1, 5] = layout.num_blocks * layout.block_size if bad == "past-end" else -2
    out = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=torch.bfloat16,
                                      device="cuda"), gen)
    before = out.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.gather(layers, slots.cuda(), *_args(layout), out)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(before))
    raws_before = [r.clone() for r in case.raws]
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.scatter(layers, slots.cuda(), *_args(layout), out)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.raws, raws_before))
    # the transfer-engine ops validate on the host, with the same rule
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvplugin.gather_multi(layers, slots, *_args(layout), [out], 0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvplugin.scatter_multi(layers, slots, *_args(layout), [out], 0)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(before))
    assert all(torch.equal(a, b) for a, b in zip(case.raws, raws_before))


@pytest.mark.parametrize("case_name", ["v026-nhd", "v032-LBHNC-kernel-split", "split-kv-first",
                                       "v032-mla", "v026-nhd-head-dim-3", "dim-strided"])
@pytest.mark.parametrize("where", ["pinned-host", "device-pieces"])
def test_multi_ops_match_reference(case_name, where):
    """gather_multi/scatter_multi: zero-copy into pinned host buffers (not contiguous with
    each other), or into device pieces of one staging tensor."""
    dtype = torch.bfloat16
    gen, case, layout, layers = _setup(case_name, dtype, seed=11)
    C, T = 4, 2 * layout.block_size
    slots = make_slots(layout, C, T, gen)
    shape = layout.chunk_shape(T)
    ref = K.random_bytes_(torch.empty((C, *shape), dtype=dtype, device="cuda"), gen)
    if where == "pinned-host":
        pool = torch.empty((2 * C + 1, *shape), dtype=dtype, pin_memory=True)
        K.random_bytes_(pool, gen)
        order = [5, 0, 1, 7]  # two adjacent, two scattered
        outs = [pool[i:i + 1] for i in order]
        for c, o in enumerate(outs):
            ref[c].copy_(o[0])
    else:
        stage = ref.clone()
        outs = [stage[0:1], stage[1:4]]
    reference_gather(layout, layers, slots, ref)
    torch.ops.kvplugin.gather_multi(layers, slots, *_args(layout), outs, 16)
    torch.cuda.synchronize()
    got = torch.cat([o.cuda() for o in outs])
    assert torch.equal(_bits(got), _bits(ref)), f"{case.name}: gather_multi ({where}) differs"

    src = K.random_bytes_(torch.empty((C, *shape), dtype=dtype, device="cuda"), gen)
    if where == "pinned-host":
        for c, o in enumerate(outs):
            o.copy_(src[c:c + 1])
    else:
        stage.copy_(src)
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, expect_layers, slots, src)
    torch.ops.kvplugin.scatter_multi(layers, slots, *_args(layout), outs, 0)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.raws, expect_raws)), \
        f"{case.name}: scatter_multi ({where}) differs"


def _blocks_case(layout, C: int, per: int, gen: torch.Generator):
    """``C`` objects of ``per`` distinct random blocks each (some blocks left out of the batch),
    and a span per object: whole, cut at both ends across a block boundary, and empty."""
    assert C * per < layout.num_blocks, "leave blocks outside the batch"
    blocks = torch.randperm(layout.num_blocks, generator=gen)[:C * per].view(C, per).to(torch.int64)
    T = per * layout.block_size
    spans = [(0, T), (3, T - layout.block_size - 1), (T // 2, T // 2)][:C]
    spans += [(0, T)] * (C - len(spans))
    return blocks, torch.tensor(spans, dtype=torch.int64)


def _slots_from_blocks(blocks, spans, block_size: int) -> torch.Tensor:
    """The contract, token by token: object c's token t at block blocks[c][t // B], offset t % B,
    when spans[c][0] <= t < spans[c][1]; -1 otherwise."""
    T = blocks.shape[1] * block_size
    return torch.tensor([[int(row[t // block_size]) * block_size + t % block_size if lo <= t < hi else -1
                          for t in range(T)] for row, (lo, hi) in zip(blocks.tolist(), spans.tolist())],
                        dtype=torch.int64)


#: the catalogue's layouts whose every block is one dense run of 16-byte vectors on the paged
#: side (a token's head rows one after another, K and V apart or interleaved per head, a block's
#: tokens one after another across its kernel blocks): HND, the CPU backend's, strided or
#: 6-byte head dims and K/V inside a kernel block are not
BLOCK_RUN_LAYOUTS = {
    "v026-nhd", "v026-nhd-kernel-split", "v026-nhd-padded", "v026-mla", "v026-mla-kernel-split",
    "v032-BLNHC", "v032-BLNHC-padded", "v032-LBNHC", "v032-LBNHC-kernel-split", "v032-LBNHC-padded",
    "v032-mla", "v032-mla-kernel-split", "split-block-first", "split-kv-first", "split-kv-first-kernel-split",
}


@pytest.mark.parametrize(("block_runs", "max_ctas"), [(False, 0), (True, 0), (True, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("case_name", CASES)
def test_scatter_blocks_matches_reference(case_name, dtype, block_runs, max_ctas):
    """scatter_blocks (a load's objects given as block ids and spans) writes what the reference
    scatter writes with the contract's per-token slots, from pieces of a staging tensor; the
    rest of every backing buffer (blocks outside the batch, skipped tokens) is untouched.  With
    ``block_runs``, blocks that are one dense run (the NHD layouts, K and V interleaved or apart,
    MLA: :data:`BLOCK_RUN_LAYOUTS`) take the op's block-run kernel, which it reports, the other
    layouts its per-token one (as without); a capped grid (``max_ctas``) walks the block-run
    kernel's loops."""
    gen, case, layout, layers = _setup(case_name, dtype, seed=_seed("blocks", case_name, dtype))
    C, per = 3, 2
    blocks, spans = _blocks_case(layout, C, per, gen)
    shape = layout.chunk_shape(per * layout.block_size)
    stage = K.random_bytes_(torch.empty((C, *shape), dtype=dtype, device="cuda"), gen)
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, _ref_views(expect_layers, dtype), _slots_from_blocks(blocks, spans, layout.block_size),
                      _ref_chunk(stage))
    ran = torch.ops.kvplugin.scatter_blocks(layers, blocks, spans, *_args(layout), [stage[0:1], stage[1:3]],
                                            max_ctas, block_runs)
    torch.cuda.synchronize()
    for got, want in zip(case.raws, expect_raws):
        assert torch.equal(got, want), f"{case.name} {dtype}: scatter_blocks differs from the reference"
    assert ran == (block_runs and case_name in BLOCK_RUN_LAYOUTS), f"{case.name}: block-run kernel ran: {ran}"


@pytest.mark.parametrize("bad", ["block-past-end", "block-negative", "span-past-end", "span-backwards",
                                 "blocks-shape"])
def test_scatter_blocks_refuses_bad_places_and_writes_nothing(bad):
    gen, case, layout, layers = _setup("v026-nhd", torch.bfloat16, seed=13)
    C, per = 3, 2
    blocks, spans = _blocks_case(layout, C, per, gen)
    T = per * layout.block_size
    if bad == "block-past-end":  # (object 0 is moved whole)
        blocks[0, 1] = layout.num_blocks
    elif bad == "block-negative":
        blocks[0, 0] = -1
    elif bad == "span-past-end":
        spans[0, 1] = T + 1
    elif bad == "span-backwards":
        spans[1] = torch.tensor([5, 4])
    else:
        blocks = blocks[:, :1].contiguous()
    src = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=torch.bfloat16, device="cuda"), gen)
    before = [r.clone() for r in case.raws]
    match = {"blocks-shape": "blocks must be", "span-past-end": "span", "span-backwards": "span"}.get(bad, "outside the cache")
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kvplugin.scatter_blocks(layers, blocks, spans, *_args(layout), [src], 0)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.raws, before))


def test_scatter_blocks_ignores_the_block_ids_of_skipped_tokens():
    """A block that holds no moved token (outside its object's span, e.g. vLLM's null block or
    a block of a shorter hit) is neither checked nor written."""
    gen, case, layout, layers = _setup("v026-nhd", torch.bfloat16, seed=17)
    blocks, spans = _blocks_case(layout, 1, 2, gen)
    spans[0] = torch.tensor([0, layout.block_size])  # the second block is skipped
    kept = blocks.clone()
    blocks[0, 1] = layout.num_blocks + 7
    src = K.random_bytes_(torch.empty((1, *layout.chunk_shape(2 * layout.block_size)), dtype=torch.bfloat16,
                                      device="cuda"), gen)
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, expect_layers, _slots_from_blocks(kept, spans, layout.block_size), src)
    torch.ops.kvplugin.scatter_blocks(layers, blocks, spans, *_args(layout), [src], 0)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.raws, expect_raws))


def test_multi_ops_refuse_pageable_host_memory():
    gen, case, layout, layers = _setup("v026-nhd", torch.bfloat16, seed=3)
    T = layout.block_size
    slots = make_slots(layout, 1, T, gen)
    out = torch.empty((1, *layout.chunk_shape(T)), dtype=torch.bfloat16)  # not pinned
    with pytest.raises(RuntimeError, match="page-locked"):
        torch.ops.kvplugin.gather_multi(layers, slots, *_args(layout), [out], 0)


@pytest.mark.parametrize("layout_name", ["v026", "v032"])
def test_seeds_shape(layout_name):
    """36 layers, 8 KV heads, head dim 128, bf16, block 16, chunk 256 (fused NHD / LBNHC)."""
    gen = torch.Generator().manual_seed(5)
    nb = 80
    if layout_name == "v026":
        case = K.seeds_nhd("cuda", num_blocks=nb)
    else:
        case = K.v032(layout="LBNHC", L=36, num_blocks=nb, block_size=16, H=8, D=128,
                      dtype=torch.bfloat16, device="cuda")
    for r in case.raws:
        K.random_bytes_(r, gen)
    layout, layers = build_layout(case.src, case.views)
    C, T = 2, 256
    slots = make_slots(layout, C, T, gen)
    out = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=torch.bfloat16,
                                      device="cuda"), gen)
    ref = out.clone()
    ops.gather(layers, slots.cuda(), *_args(layout), out)
    reference_gather(layout, layers, slots, ref)
    assert torch.equal(_bits(out), _bits(ref))
    src = K.random_bytes_(torch.empty_like(out), gen)
    expect_raws = [r.clone() for r in case.raws]
    _, expect_layers = build_layout(case.src, case.make_views(expect_raws))
    reference_scatter(layout, expect_layers, slots, src)
    ops.scatter(layers, slots.cuda(), *_args(layout), src)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(case.raws, expect_raws))


def test_empty_batch_is_a_no_op():
    gen, case, layout, layers = _setup("v026-nhd", torch.bfloat16, seed=9)
    out = torch.empty((0, *layout.chunk_shape(16)), dtype=torch.bfloat16, device="cuda")
    ops.gather(layers, torch.empty((0, 16), dtype=torch.int64, device="cuda"), *_args(layout), out)
    all_skipped = torch.full((1, 16), -1, dtype=torch.int64, device="cuda")
    out1 = K.random_bytes_(torch.empty((1, *layout.chunk_shape(16)), dtype=torch.bfloat16,
                                       device="cuda"), gen)
    before = out1.clone()
    ops.gather(layers, all_skipped, *_args(layout), out1)
    torch.cuda.synchronize()
    assert torch.equal(_bits(out1), _bits(before))


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_opcheck(op):
    gen, case, layout, layers = _setup("v026-nhd", torch.bfloat16, seed=13)
    C, T = 2, 2 * layout.block_size
    slots = make_slots(layout, C, T, gen).cuda()
    chunk = K.random_bytes_(torch.empty((C, *layout.chunk_shape(T)), dtype=torch.bfloat16,
                                        device="cuda"), gen)
    target = getattr(torch.ops.kvplugin, op).default
    torch.library.opcheck(target, (layers, slots, *_args(layout), chunk))


def test_dma_ops_merge_adjacent_host_buffers():
    """dma_to_host / dma_from_host: host tensors taken in order, adjacent ones in one copy."""
    gen = torch.Generator().manual_seed(17)
    C, n = 5, 4096 + 16
    dev = K.random_bytes_(torch.empty((C, n), dtype=torch.uint8, device="cuda"), gen)
    pool = K.random_bytes_(torch.empty((2 * C + 2, n), dtype=torch.uint8, pin_memory=True), gen)
    hosts = [pool[i:i + 1] for i in (7, 0, 1, 2, 9)]
    torch.ops.kvplugin.dma_to_host(dev, hosts)
    torch.cuda.synchronize()
    for c, h in enumerate(hosts):
        assert torch.equal(h[0], dev[c].cpu())
    back = torch.empty_like(dev)
    torch.ops.kvplugin.dma_from_host(hosts, back)
    torch.cuda.synchronize()
    assert torch.equal(back, dev)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.kvplugin.dma_to_host(dev, hosts[:2])
