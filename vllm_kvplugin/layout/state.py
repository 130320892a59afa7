"""Recurrent (Mamba / GatedDeltaNet) state pages: descriptor, copies, certification.

vLLM keeps one state per block of a recurrent group: in ``mamba_cache_mode="align"``
block column ``i`` of a request holds the state after exactly ``(i + 1) * B``
tokens.  Each layer's state is a few tensors (e.g. conv and SSM state) that an
adapter hands over as per-layer views ``[num_blocks, *shape]`` of their dtype
(:class:`StateSource`).  A chunk object is one block's state of every layer of the
group, raw bytes back to back: ``[L, S]`` uint8 with ``S`` the layer's state bytes,
shapes and dtypes named in the chunk header (``GroupSpec.spec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.groups import GroupSpec


@dataclass(frozen=True)
class StateSource:
    """What an adapter read from vLLM about one recurrent group: per layer, the views of its
    state tensors (``[num_blocks, *shape]``, in the spec's order), and the views vLLM's own
    layers bound for their forward (the certification's independent reference)."""

    group_index: int
    layer_names: tuple[str, ...]
    views: tuple[tuple[torch.Tensor, ...], ...]
    reference: tuple[tuple[torch.Tensor, ...], ...] | None
    num_blocks: int
    source: str  # what vLLM said, for messages


def check_state(spec: GroupSpec, src: StateSource) -> None:
    """Every layer's views are the spec's tensors (dtype, shape), one per block; raises LayoutError."""
    where = f"recurrent KV cache group {spec.index} ({src.source})"
    if len(src.views) != spec.num_layers:
        raise LayoutError(f"{where}: {len(src.views)} layers registered, the spec has {spec.num_layers}")
    for name, views in zip(src.layer_names, src.views):
        got = [(v.dtype, tuple(v.shape[1:])) for v in views]
        want = [(t.dtype, t.shape) for t in spec.state]
        if got != want or any(v.shape[0] != src.num_blocks for v in views):
            raise LayoutError(f"{where}, layer {name}: state views {[(str(d), s) for d, s in got]} of "
                              f"{[v.shape[0] for v in views]} blocks; the spec says "
                              f"{[(str(d), s) for d, s in want]} of {src.num_blocks} blocks")


def gather_state(views: Sequence[Sequence[torch.Tensor]], block: int, out: torch.Tensor) -> None:
    """Block ``block``'s state of every layer into ``out`` (``[L, S]`` uint8, host)."""
    for layer, tensors in enumerate(views):
        off = 0
        for t in tensors:
            raw = t[block].contiguous().view(torch.uint8).reshape(-1)
            out[layer, off:off + raw.numel()].copy_(raw)
            off += raw.numel()


def scatter_state(views: Sequence[Sequence[torch.Tensor]], block: int, src: torch.Tensor) -> None:
    """``src`` (``[L, S]`` uint8) into block ``block`` of every layer."""
    for layer, tensors in enumerate(views):
        off = 0
        for t in tensors:
            n = t[block].numel() * t.element_size()
            t[block].copy_(src[layer, off:off + n].to(t.device).view(t.dtype).view(t[block].shape))
            off += n


def certify_state(spec: GroupSpec, src: StateSource) -> None:
    """Our views must be exactly the tensors vLLM's layers compute with (address, shape,
    strides, dtype), and a scratch block round-trips through them to the reference's bytes."""
    where = f"recurrent KV cache group {spec.index} ({src.source})"
    if src.reference is None:
        return
    for name, mine, theirs in zip(src.layer_names, src.views, src.reference):
        for a, b in zip(mine, theirs):
            if (a.data_ptr(), a.shape, a.stride(), a.dtype) != (b.data_ptr(), b.shape, b.stride(), b.dtype):
                raise LayoutError(f"{where}, layer {name}: the plugin's state view "
                                  f"{tuple(a.shape)}/{a.stride()}/{a.dtype} at {a.data_ptr():#x} is not the "
                                  f"layer's own {tuple(b.shape)}/{b.stride()}/{b.dtype} at {b.data_ptr():#x}")
    block = src.num_blocks - 1
    saved = torch.empty((spec.num_layers, sum(t.nbytes for t in spec.state)), dtype=torch.uint8)
    gather_state(src.views, block, saved)
    gen = torch.Generator().manual_seed(spec.index)
    noise = torch.randint(0, 256, saved.shape, dtype=torch.uint8, generator=gen)
    try:
        scatter_state(src.views, block, noise)
        for layer, tensors in enumerate(src.reference):
            got = torch.cat([t[block].contiguous().view(torch.uint8).reshape(-1).cpu() for t in tensors])
            if not torch.equal(got, noise[layer]):
                raise LayoutError(f"{where}: a state written through the plugin reads back differently "
                                  f"through vLLM's own views (layer {src.layer_names[layer]})")
    finally:
        scatter_state(src.views, block, saved)
