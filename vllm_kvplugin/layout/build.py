"""Build a :class:`KVLayout` from what the running vLLM says about one group.

An adapter fills a :class:`GroupSource` (spec, backend name, layout name) and
hands over the layer tensors; :func:`build_layout` decides the content
semantics from the backend and spec (never from the shape alone), checks that
the tensors have exactly the logical shape vLLM documents for it, and derives
the six strides.  Anything else is a :class:`LayoutError` naming what was seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvplugin.layout.descriptor import ContentSemantics, GroupKind, KVLayout

#: attention backends whose logical (B, H, N, 2D) rows are [K | V] per token-head
GPU_FUSED_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION",
    "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN",
})
#: backends whose (B, H, N, 2D) view holds K rows then V rows per (block, head)
CPU_FUSED_BACKENDS = frozenset({"CPU_ATTN"})
#: backends that keep K and V in separate planes, K/V outermost: (2, B, N, H, D)
SPLIT_KV_FIRST_BACKENDS = frozenset({"ROCM_ATTN"})
#: dtypes whose bytes the plugin copies verbatim
SUPPORTED_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
})


class LayoutError(RuntimeError):
    """A KV cache layout the plugin does not support; raised at start-up."""


@dataclass(frozen=True)
class GroupSource:
    """What an adapter read from vLLM about one KV cache group."""

    group_index: int
    spec_kind: str  # "attention" | "mla" | anything else (class name) -> unsupported
    block_size: int  # manager block size in tokens
    num_blocks: int  # manager blocks
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    backend: str  # attention backend name, e.g. "CPU_ATTN"
    layout_name: str  # "NHD"/"HND" (vLLM <= 0.28) or a KVCacheLayout name (0.29+)
    layer_names: tuple[str, ...]
    vllm_version: str
    #: (B, N, D) MLA views (vLLM <= 0.28) vs (B, 1, N, D) (0.29+)
    mla_has_head_dim: bool = True
    #: for split backends, which split form the version uses
    split_semantics: ContentSemantics | None = None
    #: physical order (outermost first) of the logical (B, H, N, C) dims, as the
    #: layout name says; checked against the tensor strides for fused views
    physical_order: tuple[int, ...] | None = None

    def describe(self) -> str:
        return (f"vLLM {self.vllm_version} {self.backend} {self.layout_name} "
                f"{self.spec_kind} {self.dtype}")


def semantics_for(src: GroupSource) -> ContentSemantics:
    """Content semantics from the spec kind and the attention backend."""
    if src.spec_kind == "mla":
        return ContentSemantics.MLA_LATENT
    if src.spec_kind != "attention":
        raise LayoutError(
            f"KV cache group {src.group_index} ({src.describe()}): spec kind {src.spec_kind!r} "
            "is not supported (supported: full attention, MLA)")
    if src.head_size_v != src.head_size:
        raise LayoutError(
            f"KV cache group {src.group_index} ({src.describe()}): head_size {src.head_size} != "
            f"head_size_v {src.head_size_v} is not supported")
    if src.backend in GPU_FUSED_BACKENDS:
        return ContentSemantics.GPU_FUSED
    if src.backend in CPU_FUSED_BACKENDS:
        return ContentSemantics.CPU_FUSED
    if src.backend in SPLIT_KV_FIRST_BACKENDS or src.split_semantics is not None:
        return src.split_semantics or ContentSemantics.SPLIT_KV_FIRST
    raise LayoutError(
        f"KV cache group {src.group_index} ({src.describe()}): attention backend "
        f"{src.backend!r} is not supported (supported: {sorted(GPU_FUSED_BACKENDS | CPU_FUSED_BACKENDS | SPLIT_KV_FIRST_BACKENDS)})")


def _expected_shape(sem: ContentSemantics, src: GroupSource, nbk: int, kbs: int) -> tuple[int, ...]:
    H, D = src.num_kv_heads, src.head_size
    if sem in (ContentSemantics.GPU_FUSED, ContentSemantics.CPU_FUSED):
        return (nbk, H, kbs, 2 * D)
    if sem is ContentSemantics.SPLIT_KV_FIRST:
        return (2, nbk, kbs, H, D)
    if sem is ContentSemantics.SPLIT_BLOCK_FIRST:
        return (nbk, 2, kbs, H, D)
    if src.mla_has_head_dim:
        return (nbk, 1, kbs, D)
    return (nbk, kbs, D)


def _kernel_block_size(sem: ContentSemantics, src: GroupSource, shape: Sequence[int]) -> int:
    if sem in (ContentSemantics.GPU_FUSED, ContentSemantics.CPU_FUSED):
        return shape[2] if len(shape) == 4 else -1
    if sem in (ContentSemantics.SPLIT_KV_FIRST, ContentSemantics.SPLIT_BLOCK_FIRST):
        return shape[2] if len(shape) == 5 else -1
    if src.mla_has_head_dim:
        return shape[2] if len(shape) == 4 else -1
    return shape[1] if len(shape) == 3 else -1


def derive_strides(sem: ContentSemantics, stride: Sequence[int], r: int, kbs: int,
                   head_dim: int) -> tuple[int, int, int, int, int, int]:
    """Six element strides [block, sub, tok, head, kv, dim] of one layer view.

    ``stride`` is the layer tensor's ``.stride()`` in the logical order vLLM
    documents for ``sem``.  Pure arithmetic; the independent reference in
    :mod:`.reference` checks it.
    """
    s = tuple(stride)
    if sem is ContentSemantics.GPU_FUSED:
        # (NBk, H, N, 2D): K at [.., :D], V at [.., D:]
        return (r * s[0], s[0], s[2], s[1], head_dim * s[3], s[3])
    if sem is ContentSemantics.CPU_FUSED:
        # (NBk, H, N, 2D) read as (NBk, H, 2N, D): token n of K at row n, of V at row N + n
        return (r * s[0], s[0], head_dim, s[1], kbs * head_dim, 1)
    if sem is ContentSemantics.SPLIT_KV_FIRST:
        return (r * s[1], s[1], s[2], s[3], s[0], s[4])
    if sem is ContentSemantics.SPLIT_BLOCK_FIRST:
        return (r * s[0], s[0], s[2], s[3], s[1], s[4])
    if len(s) == 4:  # MLA (NBk, 1, N, D)
        return (r * s[0], s[0], s[2], 0, 0, s[3])
    return (r * s[0], s[0], s[1], 0, 0, s[2])  # MLA (NBk, N, D)


def dedup_layers(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """Drop layers that alias an earlier one (KV sharing): same address, shape and strides."""
    seen: dict[tuple, str] = {}
    out_names, out_tensors = [], []
    for name, t in zip(names, tensors):
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in seen:
            continue
        seen[ident] = name
        out_names.append(name)
        out_tensors.append(t)
    return out_names, out_tensors


def _max_offset(strides: Sequence[int], sizes: Sequence[int]) -> int:
    return sum((n - 1) * s for n, s in zip(sizes, strides) if n > 0)


def _check_physical_order(where: str, src: GroupSource, shape: tuple[int, ...],
                          stride: tuple[int, ...]) -> None:
    """The strides must nest in the order the layout name states (outer dims span inner ones)."""
    dims = [d for d in src.physical_order if shape[d] > 1]
    for outer, inner in zip(dims, dims[1:]):
        if stride[outer] < stride[inner] * shape[inner]:
            raise LayoutError(
                f"{where}: vLLM says the layout is {src.layout_name} (physical order "
                f"{src.physical_order} of (B, H, N, C)) but the view has shape {shape} and "
                f"strides {stride}")


def build_layout(src: GroupSource, tensors: Sequence[torch.Tensor],
                 kind: GroupKind | None = None) -> tuple[KVLayout, list[torch.Tensor]]:
    """Descriptor and de-duplicated layer tensors for one group; raises :class:`LayoutError`.

    ``kind``: the group's kind when it is not plain attention or MLA (a sliding-window
    group's pages are attention pages)."""
    if len(tensors) != len(src.layer_names):
        raise LayoutError(f"group {src.group_index}: {len(tensors)} tensors for {len(src.layer_names)} layers")
    if not tensors:
        raise LayoutError(f"group {src.group_index} ({src.describe()}) has no layers")
    sem = semantics_for(src)
    names, layers = dedup_layers(src.layer_names, tensors)
    first = layers[0]
    where = f"KV cache group {src.group_index} ({src.describe()}), layer {names[0]}"
    if not isinstance(first, torch.Tensor):
        raise LayoutError(f"{where}: expected a tensor, got {type(first).__name__}")
    if first.dtype not in SUPPORTED_DTYPES or first.dtype != src.dtype:
        raise LayoutError(f"{where}: dtype {first.dtype} (spec says {src.dtype}) is not supported")
    for name, t in zip(names, layers):
        if (tuple(t.shape), tuple(t.stride()), t.dtype, t.device) != (
                tuple(first.shape), tuple(first.stride()), first.dtype, first.device):
            raise LayoutError(
                f"{where}: layer {name} has shape {tuple(t.shape)} stride {tuple(t.stride())} "
                f"{t.dtype} on {t.device}, unlike the group's first layer "
                f"{tuple(first.shape)} {tuple(first.stride())} {first.dtype} on {first.device}")
    shape = tuple(first.shape)
    kbs = _kernel_block_size(sem, src, shape)
    if kbs <= 0 or src.block_size % kbs:
        raise LayoutError(
            f"{where}: shape {shape} does not match {sem.value} with block size {src.block_size}")
    r = src.block_size // kbs
    expected = _expected_shape(sem, src, src.num_blocks * r, kbs)
    if shape != expected:
        raise LayoutError(
            f"{where}: shape {shape} stride {tuple(first.stride())} is not the {sem.value} "
            f"shape {expected} vLLM documents for {src.num_blocks} blocks of {src.block_size} "
            f"tokens (kernel blocks of {kbs}), {src.num_kv_heads} KV heads, head size {src.head_size}")
    if sem is ContentSemantics.CPU_FUSED and (first.stride(3) != 1 or first.stride(2) != 2 * src.head_size):
        raise LayoutError(
            f"{where}: CPU_ATTN reads each (block, head) as dense (2N, D) rows, but the view has "
            f"strides {tuple(first.stride())}")
    if src.physical_order is not None and sem in (ContentSemantics.GPU_FUSED, ContentSemantics.CPU_FUSED):
        _check_physical_order(where, src, shape, tuple(first.stride()))
    strides = derive_strides(sem, first.stride(), r, kbs, src.head_size)
    mla = sem is ContentSemantics.MLA_LATENT
    H, KV = (1, 1) if mla else (src.num_kv_heads, 2)
    sizes = (src.num_blocks, r, kbs, H, KV, src.head_size)
    limit = first.untyped_storage().nbytes() // first.element_size() - first.storage_offset()
    if _max_offset(strides, sizes) >= limit or min(strides) < 0:
        raise LayoutError(f"{where}: strides {strides} reach outside the layer's storage")
    layout = KVLayout(
        group_index=src.group_index,
        kind=kind or (GroupKind.MLA if mla else GroupKind.ATTENTION),
        semantics=sem,
        source=src.describe(),
        layer_names=tuple(names),
        num_blocks=src.num_blocks,
        block_size=src.block_size,
        kernel_block_size=kbs,
        num_heads=H,
        head_dim=src.head_size,
        num_kv=KV,
        dtype=src.dtype,
        strides=strides,
    )
    return layout, list(layers)
