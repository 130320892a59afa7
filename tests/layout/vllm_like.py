"""KV cache tensors built the way vLLM builds them, re-derived from its sources.

These helpers do not import vLLM (``test_vllm_layouts.py`` uses vLLM's own code
where it is installed).  Each returns the per-layer tensors that vLLM hands to
``register_kv_caches`` and the :class:`GroupSource` an adapter would describe.

* 0.26-0.28 (``_reshape_kv_cache_tensors``): one raw int8 allocation per layer,
  ``raw.view(dtype).view(physical_shape).permute(inverse(stride_order))`` where
  the logical shape comes from ``get_kv_cache_shape`` and the stride order from
  ``get_kv_cache_stride_order`` (fused NHD: (0, 2, 1, 3); HND / CPU_ATTN:
  identity); padded pages get an ``as_strided`` block stride.
* 0.29+ (``create_kv_cache_views``): ONE int8 buffer, a 5-D ``[L, B, H, N, C]``
  ``as_strided`` view whose strides follow the ``KVCacheLayout`` permutation,
  filled innermost-first, with ``fixed_strides=(layer_stride, block_stride)``;
  per layer ``view[l].view(dtype)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm_kvplugin.layout.build import GroupSource
from vllm_kvplugin.layout.descriptor import ContentSemantics

# KVCacheLayout values (stride permutation over logical [L, B, H, N, C]), vLLM 0.29+
LAYOUTS_029 = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class Case:
    """One KV cache group as some vLLM version lays it out."""

    name: str
    era: str  # "0.26" or "0.29"
    backend: str  # FLASH_ATTN | CPU_ATTN | ROCM_ATTN | SPLIT_BF | MLA
    layout: str  # NHD/HND (0.26), a LAYOUTS_029 key, or a split name
    num_layers: int = 2
    num_blocks: int = 12
    block_size: int = 16
    kernel_block_size: int | None = None
    heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    padded: bool = False  # page padding (0.26 as_strided block stride; 0.29+ page_size_padded)

    @property
    def kbs(self) -> int:
        return self.kernel_block_size or self.block_size

    @property
    def mla(self) -> bool:
        return self.backend == "MLA"

    def with_(self, **kw) -> Case:
        return replace(self, **kw)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def build(case: Case) -> tuple[GroupSource, list[torch.Tensor]]:
    tensors = _build_026(case) if case.era == "0.26" else _build_029(case)
    src = GroupSource(
        group_index=0,
        spec_kind="mla" if case.mla else "attention",
        block_size=case.block_size,
        num_blocks=case.num_blocks,
        num_kv_heads=1 if case.mla else case.heads,
        head_size=case.head_dim,
        head_size_v=case.head_dim,
        dtype=case.dtype,
        backend={"SPLIT_BF": "ROCM_ATTN", "MLA": "FLASHMLA"}.get(case.backend, case.backend),
        layout_name=case.layout,
        layer_names=tuple(f"model.layers.{i}.attn" for i in range(case.num_layers)),
        vllm_version="test-" + case.era,
        mla_has_head_dim=case.era != "0.26",
        split_semantics=(ContentSemantics.SPLIT_BLOCK_FIRST if case.backend == "SPLIT_BF"
                         else ContentSemantics.SPLIT_KV_FIRST if case.backend == "ROCM_ATTN" else None),
        physical_order=_order_026(case) if case.era == "0.26" else _layer_view_order(case.layout),
    )
    return src, tensors


def _order_026(case: Case):
    if case.backend in ("FLASH_ATTN", "CPU_ATTN"):
        return {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}[case.layout]
    return None


def _layer_view_order(name: str):
    order = LAYOUTS_029.get(name)
    return None if order is None else tuple(i - 1 for i in order if i != 0)


def _build_026(c: Case) -> list[torch.Tensor]:
    nbk = c.num_blocks * (c.block_size // c.kbs)
    if c.backend in ("FLASH_ATTN", "CPU_ATTN"):
        logical = (nbk, c.heads, c.kbs, 2 * c.head_dim)
        order = (0, 2, 1, 3) if (c.backend == "FLASH_ATTN" and c.layout == "NHD") else (0, 1, 2, 3)
    elif c.backend == "ROCM_ATTN":
        logical = (2, nbk, c.kbs, c.heads, c.head_dim)
        order = tuple(range(5))
    elif c.backend == "SPLIT_BF":
        logical = (nbk, 2, c.kbs, c.heads, c.head_dim)
        order = tuple(range(5))
    else:  # MLA (B, N, D)
        logical = (nbk, c.kbs, c.head_dim)
        order = (0, 1, 2)
    physical = tuple(logical[i] for i in order)
    inv = tuple(order.index(i) for i in range(len(order)))
    numel = 1
    for n in physical:
        numel *= n
    out = []
    for _ in range(c.num_layers):
        if c.padded and c.backend != "ROCM_ATTN":
            page = numel // physical[0]
            pad_page = page + 24  # elements of padding after each page
            raw = torch.zeros(pad_page * physical[0] * _esize(c.dtype), dtype=torch.int8)
            stride = [1] * len(physical)
            for i in range(len(physical) - 2, -1, -1):
                stride[i] = stride[i + 1] * physical[i + 1]
            stride[0] = pad_page
            t = torch.as_strided(raw.view(c.dtype), physical, tuple(stride))
        else:
            raw = torch.zeros(numel * _esize(c.dtype), dtype=torch.int8)
            t = raw.view(c.dtype).view(physical)
        out.append(t.permute(*inv))
    return out


def _layout_strides(shape, order, fixed, padded_page):
    """vLLM 0.29+ ``compute_layout_strides``: byte strides over logical [L, B, H, N, C]."""
    page_grid_end = max(order.index(0), order.index(1)) + 1
    strides = [0] * 5
    cur = 1
    for phys_idx, dim in reversed(tuple(enumerate(order))):
        if padded_page is not None and phys_idx == page_grid_end - 1:
            cur = max(cur, padded_page)
        strides[dim] = fixed[dim] or cur
        cur = strides[dim] * shape[dim]
    return tuple(strides)


def _build_029(c: Case) -> list[torch.Tensor]:
    es = _esize(c.dtype)
    r = c.block_size // c.kbs
    H = 1 if c.mla else c.heads
    C = c.head_dim * es if c.mla else 2 * c.head_dim * es  # content bytes
    page = H * c.block_size * C  # one manager block of one layer, bytes
    order = LAYOUTS_029[c.layout]
    L, B = c.num_layers, c.num_blocks
    padded_page = page + 64 if c.padded else None
    block_outer = order[0] == 1
    # kv_cache_utils.get_kv_cache_config_from_groups: placement of the layers
    fixed_block = (padded_page or page) * L if block_outer else padded_page
    layer_stride, block_stride, *_ = _layout_strides(
        (L, B, H, c.block_size, C), order, (None, fixed_block, None, None, None), padded_page)
    # kv_cache_interface.create_kv_cache_views: per-layer views at kernel-block granularity
    if r > 1:
        block_stride //= r
    shape = (L, B * r, H, c.kbs, C)
    strides = _layout_strides(shape, order, (layer_stride, block_stride, None, None, None),
                              None if r > 1 else padded_page)
    size = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    raw = torch.zeros(size, dtype=torch.int8)
    v5 = torch.as_strided(raw, shape, strides, 0)
    return [v5[layer].view(c.dtype) for layer in range(L)]
