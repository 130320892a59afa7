"""KV cache layouts built the way vLLM builds them, for the GPU tests and benchmarks.

Each builder allocates raw int8 buffers and returns a :class:`Case`: the
:class:`GroupSource` an adapter would fill, the raw buffers, and a function
that turns (copies of) the raw buffers into the per-layer tensors vLLM hands
``register_kv_caches``.  Nothing here uses the plugin's stride arithmetic.

* vLLM 0.26 (``gpu/attn_utils.py::_reshape_attention_kv_cache``): one raw
  buffer per layer, ``raw.view(dtype).view(permuted_shape).permute(inv_order)``
  with the backend's stride order ((0, 2, 1, 3) for NHD, identity for HND);
  padded pages through ``as_strided`` with the page stride.
* vLLM 0.29+ (0.32 ``kv_cache_utils.get_kv_cache_config_from_groups``,
  ``kv_cache_interface.compute_layout_strides`` / ``create_kv_cache_views``):
  ONE int8 buffer; per layer an ``as_strided`` ``(B*r, H, N, C)`` view of a 5-D
  ``[L, B, H, N, C_bytes]`` view whose strides follow the ``KVCacheLayout``
  permutation, re-derived below (vLLM is not needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch

from vllm_kvplugin.layout.build import GroupSource
from vllm_kvplugin.layout.descriptor import ContentSemantics

#: vLLM 0.32 ``KVCacheLayout``: stride permutation over logical [L, B, H, N, C]
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
V026_ORDER = {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}
_DIM_L, _DIM_B = 0, 1


@dataclass
class Case:
    name: str
    src: GroupSource
    raws: list[torch.Tensor]  # int8 backing buffers
    make_views: Callable[[list[torch.Tensor]], list[torch.Tensor]]

    @property
    def views(self) -> list[torch.Tensor]:
        return self.make_views(self.raws)


def esize_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def random_bytes_(t: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``t`` (any dtype, contiguous) with random bytes."""
    flat = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen,
                             device="cpu").to(flat.device))
    return t


def _names(L: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(L))


def _source(**kw) -> GroupSource:
    base = dict(group_index=0, spec_kind="attention", head_size_v=kw["head_size"])
    base.update(kw)
    return GroupSource(**base)


# --------------------------------------------------------------- vLLM 0.26

def v026_attention(*, layout: str = "NHD", backend: str = "FLASH_ATTN", L: int, num_blocks: int,
                   block_size: int, kernel_block_size: int | None = None, H: int, D: int,
                   dtype: torch.dtype, device, pad_bytes: int = 0) -> Case:
    """Fused (B, H, N, 2D) per layer, permuted by the backend's stride order."""
    kbs = kernel_block_size or block_size
    r = block_size // kbs
    nbk = num_blocks * r
    es = esize_of(dtype)
    shape = (nbk, H, kbs, 2 * D)
    order = V026_ORDER[layout]
    permuted = tuple(shape[i] for i in order)
    inv = [order.index(i) for i in range(4)]
    page = H * kbs * 2 * D  # elements
    assert pad_bytes % es == 0 and (pad_bytes == 0 or r == 1)
    page_stride = page + pad_bytes // es
    raws = [torch.empty(nbk * page_stride * es, dtype=torch.int8, device=device) for _ in range(L)]

    def make(raws):
        out = []
        for raw in raws:
            if pad_bytes:
                strides = list(torch.empty(permuted, device="meta").stride())
                strides[inv[0]] = page_stride
                v = torch.as_strided(raw.view(dtype), permuted, tuple(strides))
            else:
                v = raw.view(dtype).view(permuted)
            out.append(v.permute(*inv))
        return out

    src = _source(spec_kind="attention", block_size=block_size, num_blocks=num_blocks,
                  num_kv_heads=H, head_size=D, dtype=dtype, backend=backend, layout_name=layout,
                  layer_names=_names(L), vllm_version="0.26.0", mla_has_head_dim=False,
                  physical_order=order)
    return Case(f"v026-{backend}-{layout}", src, raws, make)


def v026_mla(*, L: int, num_blocks: int, block_size: int, kernel_block_size: int | None = None,
             D: int = 576, dtype, device) -> Case:
    kbs = kernel_block_size or block_size
    nbk = num_blocks * (block_size // kbs)
    raws = [torch.empty(nbk * kbs * D * esize_of(dtype), dtype=torch.int8,
                        device=device) for _ in range(L)]

    def make(raws):
        return [raw.view(dtype).view(nbk, kbs, D) for raw in raws]

    src = _source(spec_kind="mla", block_size=block_size, num_blocks=num_blocks, num_kv_heads=1,
                  head_size=D, dtype=dtype, backend="FLASHMLA", layout_name="NHD",
                  layer_names=_names(L), vllm_version="0.26.0", mla_has_head_dim=False,
                  physical_order=V026_ORDER["NHD"])
    return Case("v026-mla", src, raws, make)


def split(*, kv_first: bool, L: int, num_blocks: int, block_size: int,
          kernel_block_size: int | None = None, H: int, D: int, dtype, device) -> Case:
    """(2, B, N, H, D) (ROCM_ATTN, vLLM <= 0.22) or (B, 2, N, H, D) (vLLM 0.23 - 0.25)."""
    kbs = kernel_block_size or block_size
    nbk = num_blocks * (block_size // kbs)
    shape = (2, nbk, kbs, H, D) if kv_first else (nbk, 2, kbs, H, D)
    raws = [torch.empty(prod(shape) * esize_of(dtype), dtype=torch.int8, device=device)
            for _ in range(L)]

    def make(raws):
        return [raw.view(dtype).view(shape) for raw in raws]

    sem = ContentSemantics.SPLIT_KV_FIRST if kv_first else ContentSemantics.SPLIT_BLOCK_FIRST
    src = _source(spec_kind="attention", block_size=block_size, num_blocks=num_blocks,
                  num_kv_heads=H, head_size=D, dtype=dtype,
                  backend="ROCM_ATTN" if kv_first else "TORCH_SDPA", layout_name="NHD",
                  layer_names=_names(L), vllm_version="0.22.0" if kv_first else "0.25.1",
                  split_semantics=sem)
    return Case("split-kv-first" if kv_first else "split-block-first", src, raws, make)


def dim_strided(*, L: int, num_blocks: int, block_size: int, H: int, D: int, dtype, device) -> Case:
    """Synthetic fused layout whose head dim is strided (physical (B, 2D, N, H)):
    not a vLLM layout, it drives the kernel's element-by-element path."""
    phys = (num_blocks, 2 * D, block_size, H)
    raws = [torch.empty(prod(phys) * esize_of(dtype), dtype=torch.int8, device=device)
            for _ in range(L)]

    def make(raws):
        return [raw.view(dtype).view(phys).permute(0, 3, 2, 1) for raw in raws]

    src = _source(spec_kind="attention", block_size=block_size, num_blocks=num_blocks,
                  num_kv_heads=H, head_size=D, dtype=dtype, backend="FLASH_ATTN",
                  layout_name="synthetic", layer_names=_names(L), vllm_version="0.26.0",
                  mla_has_head_dim=False, physical_order=None)
    return Case("dim-strided", src, raws, make)


# ---------------------------------------------------------- vLLM 0.29 - 0.33

def compute_layout_strides(shape: tuple[int, ...], order: tuple[int, ...],
                           padded_page_size: int | None,
                           fixed: tuple[int | None, ...] = (None,) * 5) -> tuple[int, ...]:
    """Byte strides over logical [L, B, H, N, C] (vLLM 0.32 ``compute_layout_strides``)."""
    page_grid_end = None
    if padded_page_size is not None:
        page_grid_end = max(order.index(_DIM_L), order.index(_DIM_B)) + 1
    strides = [0] * 5
    current = 1
    for physical_idx, dim in reversed(tuple(enumerate(order))):
        if padded_page_size is not None and physical_idx == page_grid_end - 1:
            current = max(current, padded_page_size)
            assert current % padded_page_size == 0
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def v032(*, layout: str, L: int, num_blocks: int, block_size: int,
         kernel_block_size: int | None = None, H: int, D: int, dtype, device,
         spec_kind: str = "attention", backend: str = "FLASH_ATTN",
         page_size_padded: int | None = None, force_split: bool = False) -> Case:
    """``force_split`` builds a kernel-split view vLLM itself refuses (blocks that are not
    one dense page, e.g. LHBNC): the kernel must still follow the strides."""
    """One int8 buffer; per-layer (B*r, H, N, C) views (vLLM 0.32 allocation and views)."""
    order = KV_CACHE_LAYOUTS[layout]
    es = esize_of(dtype)
    mla = spec_kind == "mla"
    heads = 1 if mla else H
    content = D if mla else 2 * D  # elements
    c_bytes = content * es
    page = heads * block_size * c_bytes  # unpadded manager page, bytes
    page_size = page_size_padded or page
    block_outer = order[0] == _DIM_B
    # planning (get_kv_cache_config_from_groups, one group, one spec)
    bytes_per_block = L * page_size
    size = bytes_per_block * num_blocks
    plan_shape = (L, num_blocks, heads, block_size, c_bytes)
    layer_stride, block_stride = compute_layout_strides(
        plan_shape, order, page_size_padded,
        (None, bytes_per_block if block_outer else None, None, None, None))[:2]
    # create_kv_cache_views
    kbs = kernel_block_size or block_size
    ratio = block_size // kbs
    if ratio > 1:
        if block_stride != page and not force_split:
            raise ValueError(f"{layout} cannot split blocks (vLLM refuses it too)")
        assert page_size_padded is None
        block_stride //= ratio
    shape = (L, num_blocks * ratio, heads, kbs, c_bytes)
    strides = compute_layout_strides(shape, order, page_size_padded,
                                     (layer_stride, block_stride, None, None, None))
    raw = torch.empty(size, dtype=torch.int8, device=device)

    def make(raws):
        (buf,) = raws
        view5 = torch.as_strided(buf, shape, strides, buf.storage_offset())
        return [view5[i].view(dtype) for i in range(L)]

    src = _source(spec_kind=spec_kind, block_size=block_size, num_blocks=num_blocks,
                  num_kv_heads=heads, head_size=D, dtype=dtype, backend=backend,
                  layout_name=layout, layer_names=_names(L), vllm_version="0.32.0",
                  mla_has_head_dim=True,
                  physical_order=tuple(i - 1 for i in order if i != _DIM_L))
    return Case(f"v032-{backend}-{layout}" + ("-mla" if mla else ""), src, [raw], make)


# ------------------------------------------------------------------ catalogue

def catalogue(dtype: torch.dtype, device) -> dict[str, Callable[[], Case]]:
    """Every layout the tests cover, at a small size."""
    es = esize_of(dtype)
    kw = dict(dtype=dtype, device=device)
    small = dict(L=3, num_blocks=24, H=2, D=32)
    out: dict[str, Callable[[], Case]] = {
        "v026-nhd": lambda: v026_attention(layout="NHD", block_size=16, **small, **kw),
        "v026-hnd": lambda: v026_attention(layout="HND", block_size=16, **small, **kw),
        "v026-nhd-kernel-split": lambda: v026_attention(
            layout="NHD", block_size=64, kernel_block_size=16, **small, **kw),
        "v026-hnd-kernel-split": lambda: v026_attention(
            layout="HND", block_size=64, kernel_block_size=16, **small, **kw),
        "v026-nhd-padded": lambda: v026_attention(layout="NHD", block_size=16, pad_bytes=64,
                                                  **small, **kw),
        # a pad that is not a multiple of 16 bytes forces narrower vectors
        "v026-hnd-padded-odd": lambda: v026_attention(layout="HND", block_size=16,
                                                      pad_bytes=4 * es, **small, **kw),
        # head dim 3: 2-byte (bf16/fp16), 1-byte (fp8) and 4-byte (fp32) vectors
        "v026-nhd-head-dim-3": lambda: v026_attention(layout="NHD", block_size=16, L=2,
                                                      num_blocks=24, H=3, D=3, **kw),
        "v026-cpu-attn": lambda: v026_attention(layout="HND", backend="CPU_ATTN", block_size=32,
                                                **small, **kw),
        "v026-mla": lambda: v026_mla(L=2, num_blocks=24, block_size=16, **kw),
        "split-kv-first": lambda: split(kv_first=True, block_size=16, **small, **kw),
        "split-block-first": lambda: split(kv_first=False, block_size=16, **small, **kw),
        "dim-strided": lambda: dim_strided(block_size=16, **small, **kw),
        "v032-cpu-attn": lambda: v032(layout="LBHNC", backend="CPU_ATTN", block_size=32,
                                      **small, **kw),
        "v032-mla": lambda: v032(layout="LBNHC", spec_kind="mla", backend="FLASHMLA", L=2,
                                 num_blocks=24, block_size=16, H=1, D=576, **kw),
        "v032-LBNHC-kernel-split": lambda: v032(layout="LBNHC", block_size=64,
                                                kernel_block_size=16, **small, **kw),
        "v032-LBHNC-kernel-split": lambda: v032(layout="LBHNC", block_size=64,
                                                kernel_block_size=16, **small, **kw),
        "v032-LBNHC-padded": lambda: v032(layout="LBNHC", block_size=16,
                                          page_size_padded=2 * 16 * 64 * es + 256, **small, **kw),
        "v032-BLHNC-padded": lambda: v032(layout="BLHNC", block_size=16,
                                          page_size_padded=2 * 16 * 64 * es + 256, **small, **kw),
    }
    split_kw = dict(block_size=64, kernel_block_size=16)
    out.update({
        "v026-cpu-attn-kernel-split": lambda: v026_attention(
            layout="HND", backend="CPU_ATTN", block_size=64, kernel_block_size=32, **small, **kw),
        "v026-mla-kernel-split": lambda: v026_mla(L=2, num_blocks=24, **split_kw, **kw),
        "split-kv-first-kernel-split": lambda: split(kv_first=True, **split_kw, **small, **kw),
        "split-block-first-kernel-split": lambda: split(kv_first=False, **split_kw, **small, **kw),
        "v032-cpu-attn-kernel-split": lambda: v032(
            layout="LBHNC", backend="CPU_ATTN", block_size=64, kernel_block_size=32, **small, **kw),
        "v032-mla-kernel-split": lambda: v032(layout="LBNHC", spec_kind="mla", backend="FLASHMLA",
                                              L=2, num_blocks=24, H=1, D=576, **split_kw, **kw),
        "v032-LHBNC-kernel-split": lambda: v032(layout="LHBNC", force_split=True, **split_kw,
                                                **small, **kw),
        "v032-BLNHC-padded": lambda: v032(layout="BLNHC", block_size=16,
                                          page_size_padded=2 * 16 * 64 * es + 64, **small, **kw),
    })
    for name in KV_CACHE_LAYOUTS:
        out[f"v032-{name}"] = (lambda name=name: v032(layout=name, block_size=16, **small, **kw))
    return out


def seeds_nhd(device, *, num_blocks: int, dtype=torch.bfloat16, L: int = 36) -> Case:
    """The seeds' model: 36 layers, 8 KV heads, head dim 128, bf16, block 16, fused NHD."""
    return v026_attention(layout="NHD", L=L, num_blocks=num_blocks, block_size=16, H=8, D=128,
                          dtype=dtype, device=device)
