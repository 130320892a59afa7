"""gather/scatter on every KV layout, against the independent reference.

Tensors are built the way each vLLM era builds them (``vllm_like``); the
expected values come from :mod:`vllm_kvplugin.layout.reference` (vLLM's
reading rules, plain indexing), never from a round trip through the ops.
"""

from __future__ import annotations

import pytest
import torch
from vllm_like import LAYOUTS_029, Case, build

from vllm_kvplugin import ops
from vllm_kvplugin.layout import LayoutError, build_layout, certify
from vllm_kvplugin.layout.build import derive_strides
from vllm_kvplugin.layout.reference import reference_gather, reference_scatter

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def _cases() -> list[Case]:
    base = [
        Case("fa-nhd", "0.26", "FLASH_ATTN", "NHD"),
        Case("fa-hnd", "0.26", "FLASH_ATTN", "HND"),
        Case("cpu-026", "0.26", "CPU_ATTN", "HND"),
        Case("split-kv-first", "0.26", "ROCM_ATTN", "split"),
        Case("split-block-first", "0.26", "SPLIT_BF", "split"),
        Case("mla-026", "0.26", "MLA", "mla", head_dim=576),
        Case("fa-nhd-padded", "0.26", "FLASH_ATTN", "NHD", padded=True),
        Case("cpu-029", "0.29", "CPU_ATTN", "LBHNC"),
        Case("mla-029", "0.29", "MLA", "LBNHC", head_dim=576),
    ] + [Case(f"fa-{n.lower()}", "0.29", "FLASH_ATTN", n) for n in LAYOUTS_029]
    out = []
    for c in base:
        out.append(c)
        # kernel-block splitting: manager block 64 = 4 kernel blocks of 16
        if not c.padded and c.layout not in ("BLNHC", "BLHNC", "BHLNC"):
            out.append(c.with_(name=c.name + "-kb", block_size=64, kernel_block_size=16, num_blocks=6))
    out.append(Case("fa-lbnhc-padded", "0.29", "FLASH_ATTN", "LBNHC", padded=True))
    out.append(Case("fa-blnhc-padded", "0.29", "FLASH_ATTN", "BLNHC", padded=True))
    return out


CASES = _cases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _rand(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def _fill(layout, layers, gen):
    """Random content in every block, written through the reference."""
    bs = layout.block_size
    slots = torch.arange(layout.num_blocks * bs).view(1, -1)
    reference_scatter(layout, layers, slots, _rand((1, *layout.chunk_shape(slots.shape[1])), layout.dtype, gen))


def _slots_for(blocks: list[int], block_size: int, chunk: int) -> torch.Tensor:
    t = torch.tensor([b * block_size + i for b in blocks for i in range(block_size)])
    return t.view(-1, chunk)


def _make(case: Case, heads: int | None = None, head_dim: int | None = None, dtype=None):
    kw = {}
    if heads is not None and not case.mla:
        kw["heads"] = heads
    if head_dim is not None and not case.mla:
        kw["head_dim"] = head_dim
    if dtype is not None:
        kw["dtype"] = dtype
    c = case.with_(**kw)
    src, tensors = build(c)
    layout, layers = build_layout(src, tensors)
    return c, layout, layers


# heads x head dim (MLA cases have one latent head of 576 whatever is asked)
_PARAMS = [(c, hd) for c in CASES for hd in ((2, 64), (8, 128)) if not (c.mla and hd != (2, 64))]


@pytest.mark.parametrize(("case", "hd"), _PARAMS,
                         ids=[c.name if c.mla else f"{c.name}-H{h}D{d}" for c, (h, d) in _PARAMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_blocks", [1, 2], ids=lambda n: f"chunk{n}blk")
def test_gather_scatter_match_reference(case, hd, dtype, chunk_blocks):
    gen = torch.Generator().manual_seed(hash((case.name, str(dtype), chunk_blocks, hd)) % 2**31)
    c, layout, layers = _make(case, *hd, dtype=dtype)
    _fill(layout, layers, gen)
    chunk = chunk_blocks * c.block_size
    blocks = [c.num_blocks - 1, 3, 1, 4][: 2 * chunk_blocks]  # two chunks, out of order
    slots = _slots_for(blocks, c.block_size, chunk)
    slots[0, : c.block_size // 4] = -1  # partial first block
    slots[-1, -(c.block_size // 3):] = -1  # partial last block
    shape = (slots.shape[0], *layout.chunk_shape(chunk))

    # gather: the kernel vs the reference, output poisoned first
    want = _rand(shape, dtype, gen)
    got = want.clone()
    reference_gather(layout, layers, slots, want)
    ops.gather(layers, slots, layout.strides, c.block_size, layout.kernel_block_size, c.num_blocks, got)
    assert torch.equal(_bits(got), _bits(want)), f"gather differs for {layout.describe()}"

    # scatter: write through the kernel, read back through the reference
    everything = torch.arange(c.num_blocks * c.block_size).view(1, -1)
    before = torch.zeros((1, *layout.chunk_shape(everything.shape[1])), dtype=dtype)
    reference_gather(layout, layers, everything, before)
    src = _rand(shape, dtype, gen)
    ops.scatter(layers, slots, layout.strides, c.block_size, layout.kernel_block_size, c.num_blocks, src)
    after = torch.zeros_like(before)
    reference_gather(layout, layers, everything, after)
    expect = before.clone()
    flat = slots.reshape(-1)
    chunk_of = torch.arange(flat.numel()) // chunk
    tok_of = torch.arange(flat.numel()) % chunk
    ok = flat >= 0
    expect[0, :, :, flat[ok]] = src[chunk_of[ok], :, :, tok_of[ok]].permute(1, 2, 0, 3, 4)
    assert torch.equal(_bits(after), _bits(expect)), (
        f"scatter wrong or touched other tokens for {layout.describe()}")


@pytest.mark.parametrize("case", [c for c in CASES if not c.name.endswith("-kb")], ids=lambda c: c.name)
def test_certification_passes(case):
    _, layout, layers = _make(case)
    certify(layout, layers)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], next(c for c in CASES if c.name == "fa-blhnc")],
                         ids=lambda c: c.name)
def test_certification_catches_a_wrong_stride(case):
    """A descriptor with swapped head/token strides must not pass certification."""
    _, layout, layers = _make(case)
    s = list(layout.strides)
    s[2], s[3] = s[3], s[2]
    bad = type(layout)(**{**layout.__dict__, "strides": tuple(s)})
    with pytest.raises(Exception, match="certification|differs"):
        certify(bad, layers)


def test_certification_catches_v_read_from_k():
    """The first seed's failure mode: V never round-trips (K and V read from the same half)."""
    _, layout, layers = _make(CASES[0])
    s = layout.strides
    bad = type(layout)(**{**layout.__dict__, "strides": (*s[:4], 0, s[5])})
    with pytest.raises(Exception, match="certification|differs"):
        certify(bad, layers)


def test_seed_model_shape_fused_nhd():
    """The seeds' model: 36 layers, 8 KV heads, head dim 128, bf16, block 16, chunk 256, fused NHD."""
    c = Case("seed", "0.26", "FLASH_ATTN", "NHD", num_layers=36, num_blocks=40, block_size=16,
             heads=8, head_dim=128)
    src, tensors = build(c)
    layout, layers = build_layout(src, tensors)
    assert layout.chunk_nbytes(256) == 36 * 2 * 256 * 8 * 128 * 2
    gen = torch.Generator().manual_seed(7)
    _fill(layout, layers, gen)
    slots = _slots_for(list(range(39, 7, -1)), 16, 256)  # 2 chunks of 16 blocks, descending
    want = torch.zeros((2, *layout.chunk_shape(256)), dtype=torch.bfloat16)
    got = _rand(want.shape, torch.bfloat16, gen)
    reference_gather(layout, layers, slots, want)
    ops.gather(layers, slots, layout.strides, 16, 16, 40, got)
    assert torch.equal(_bits(got), _bits(want))
    # V of token 5, head 3, layer 7 of chunk 0 really is the second half of its fused row
    b, n = divmod(int(slots[0, 5]), 16)
    assert torch.equal(_bits(got[0, 7, 1, 5, 3]), _bits(tensors[7][b, 3, n, 128:]))
    assert torch.equal(_bits(got[0, 7, 0, 5, 3]), _bits(tensors[7][b, 3, n, :128]))


def test_cpu_attn_semantics_are_k_rows_then_v_rows():
    """CPU_ATTN's (B, H, N, 2D) view holds N K rows then N V rows per (block, head)."""
    c = Case("cpu", "0.26", "CPU_ATTN", "HND", num_blocks=4, block_size=32)
    src, tensors = build(c)
    layout, layers = build_layout(src, tensors)
    t = tensors[0]
    t.view(torch.int16).copy_(torch.arange(t.numel(), dtype=torch.int32).to(torch.int16).view(t.shape))
    out = torch.zeros((1, *layout.chunk_shape(32)), dtype=c.dtype)
    ops.gather(layers, torch.arange(64, 96).view(1, 32), layout.strides, 32, 32, 4, out)
    rows = t[2].reshape(c.heads, 2 * 32, c.head_dim)  # vLLM: view(B, H, 2N, D)
    assert torch.equal(_bits(out[0, 0, 0, 5, 1]), _bits(rows[1, 5]))  # K of token 5, head 1
    assert torch.equal(_bits(out[0, 0, 1, 5, 1]), _bits(rows[1, 32 + 5]))  # its V


@pytest.mark.parametrize("pair", [("fa-nhd", "cpu-029"), ("cpu-026", "fa-blnhc"), ("split-kv-first", "fa-lbnhc"),
                                  ("fa-hnd-kb", "split-block-first"), ("mla-026", "mla-029")],
                         ids=lambda p: f"{p[0]}->{p[1]}")
def test_chunk_from_one_layout_restores_into_another(pair):
    """Store from layout A, restore into layout B: B's tokens read (by the reference) as A's did."""
    a_case = next(c for c in CASES if c.name == pair[0])
    b_case = next(c for c in CASES if c.name == pair[1]).with_(block_size=a_case.block_size,
                                                               kernel_block_size=None, num_blocks=10)
    if b_case.name.endswith("-kb") or a_case.kbs != a_case.block_size:
        b_case = b_case.with_(kernel_block_size=16 if b_case.block_size == 64 else None)
    _, la, layers_a = _make(a_case)
    _, lb, layers_b = _make(b_case)
    assert la.chunk_shape(8) == lb.chunk_shape(8)
    gen = torch.Generator().manual_seed(3)
    _fill(la, layers_a, gen)
    bs = a_case.block_size
    sa = _slots_for([2, 5], bs, 2 * bs)
    sb = _slots_for([7, 1], bs, 2 * bs)
    chunk = torch.zeros((1, *la.chunk_shape(2 * bs)), dtype=la.dtype)
    ops.gather(layers_a, sa, la.strides, bs, la.kernel_block_size, la.num_blocks, chunk)
    ops.scatter(layers_b, sb, lb.strides, bs, lb.kernel_block_size, lb.num_blocks, chunk)
    from_a = torch.zeros_like(chunk)
    from_b = torch.ones_like(chunk)
    reference_gather(la, layers_a, sa, from_a)
    reference_gather(lb, layers_b, sb, from_b)
    assert torch.equal(_bits(from_a), _bits(from_b))


def test_out_of_range_slot_raises_and_writes_nothing():
    _, layout, layers = _make(CASES[0])
    before = [t.clone() for t in layers]
    slots = _slots_for([1], layout.block_size, layout.block_size)
    slots[0, -1] = layout.num_blocks * layout.block_size  # one past the end
    src = torch.ones((1, *layout.chunk_shape(layout.block_size)), dtype=layout.dtype)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.scatter(layers, slots, layout.strides, layout.block_size, layout.kernel_block_size,
                    layout.num_blocks, src)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, layers))


def test_torch_path_matches_kernel():
    """The pure-torch fallback computes the same function as the compiled kernel."""
    gather_t, scatter_t = ops.torch_reference_impl()
    gen = torch.Generator().manual_seed(11)
    for case in (CASES[0], CASES[2], next(c for c in CASES if c.name == "fa-bhlnc")):
        _, layout, layers = _make(case)
        _fill(layout, layers, gen)
        slots = _slots_for([3, 0, 5, 2], layout.block_size, 2 * layout.block_size)
        slots[1, 3] = -1
        a = _rand((2, *layout.chunk_shape(2 * layout.block_size)), layout.dtype, gen)
        b = a.clone()
        ops.gather(layers, slots, layout.strides, layout.block_size, layout.kernel_block_size, layout.num_blocks, a)
        gather_t(layers, slots, layout.strides, layout.block_size, layout.kernel_block_size, layout.num_blocks, b)
        assert torch.equal(_bits(a), _bits(b))


def test_opcheck():
    _, layout, layers = _make(CASES[0])
    slots = _slots_for([1, 2], layout.block_size, layout.block_size)
    out = torch.zeros((2, *layout.chunk_shape(layout.block_size)), dtype=layout.dtype)
    args = (layers, slots, list(layout.strides), layout.block_size, layout.kernel_block_size, layout.num_blocks)
    torch.library.opcheck(torch.ops.kvplugin.gather.default, (*args, out))
    torch.library.opcheck(torch.ops.kvplugin.scatter.default, (*args, out))


@pytest.mark.parametrize("what", ["shape", "backend", "dtype", "physical-order", "cpu-not-hnd"])
def test_unsupported_layout_is_a_startup_error_naming_it(what):
    case = CASES[0]
    src, tensors = build(case)
    if what == "shape":
        src = type(src)(**{**src.__dict__, "num_kv_heads": 4})
        match = "shape"
    elif what == "backend":
        src = type(src)(**{**src.__dict__, "backend": "NEW_FANCY_ATTN"})
        match = "NEW_FANCY_ATTN"
    elif what == "dtype":
        src = type(src)(**{**src.__dict__, "dtype": torch.float16})
        match = "dtype"
    elif what == "physical-order":
        src = type(src)(**{**src.__dict__, "layout_name": "HND", "physical_order": (0, 1, 2, 3)})
        match = "HND"
    else:
        src, tensors = build(Case("cpu-nhd", "0.29", "CPU_ATTN", "LBNHC"))
        match = "CPU_ATTN"
    with pytest.raises(LayoutError, match=match):
        build_layout(src, tensors)


def test_aliased_layers_are_copied_once():
    src, tensors = build(CASES[0])
    src = type(src)(**{**src.__dict__, "layer_names": (*src.layer_names, "shared.attn")})
    layout, layers = build_layout(src, [*tensors, tensors[0]])
    assert layout.num_layers == len(tensors) and layout.layer_names == src.layer_names[:-1]


def test_derive_strides_examples():
    """Hand-computed strides for vllm_layouts.md's LBNHC/LBHNC example (H=8, N=16, D=128)."""
    assert derive_strides(*_gpu_fused(), (32768, 256, 2048, 1), 1, 16, 128) == (32768, 32768, 2048, 256, 128, 1)
    assert derive_strides(*_gpu_fused(), (32768, 4096, 256, 1), 1, 16, 128) == (32768, 32768, 256, 4096, 128, 1)


def _gpu_fused():
    from vllm_kvplugin.layout.descriptor import ContentSemantics

    return (ContentSemantics.GPU_FUSED,)


def test_all_cases_distinct():
    assert len({c.name for c in CASES}) == len(CASES)
    assert {c.layout for c in CASES if c.era == "0.29" and c.backend == "FLASH_ATTN"} == set(LAYOUTS_029)
