"""Adapter for vLLM 0.26 - 0.28: per-layer KV allocations, NHD/HND layouts.

* ``register_kv_caches`` gets one tensor per layer, each its own allocation,
  logical ``(B*r, H, N, 2D)`` (fused backends) permuted by the backend's
  ``get_kv_cache_stride_order()``, which follows ``get_kv_cache_layout()``
  ("NHD" or "HND"; CPU_ATTN forces "HND") except where a backend fixes its own
  order (FlexAttention: always NHD).
* MLA views are ``(B*r, N, D_latent)``; ROCM_ATTN keeps ``(2, B, N, H, D)``.
* Recurrent (Mamba/GDN) layers: 0.26 registers a list of per-state views
  ``[num_blocks, *shape]`` (conv, then ssm) striding over one page per block; 0.28
  registers the int8 pages ``[B, 1, 1, C]`` as 0.29+ do.  Either way each block's
  states are packed from the page's first byte (:func:`state_views`).
* Completion goes through ``get_finished`` (0.26 calls it directly).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.descriptor import ContentSemantics
from vllm_kvplugin.layout.groups import GroupSpec


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return str(get_kv_cache_layout() or "NHD")


def physical_order(name: str, backend: Any) -> tuple[int, ...] | None:
    """The backend's own stride order (logical -> physical) for 4-D fused views.

    As ``_reshape_kv_cache_tensors`` does: a backend without one (CPU_ATTN)
    keeps the logical order.
    """
    try:
        order = tuple(backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = (0, 1, 2, 3)
    return order if len(order) == 4 else None


def split_semantics(backend: str) -> ContentSemantics | None:
    return ContentSemantics.SPLIT_KV_FIRST if backend == "ROCM_ATTN" else None


def state_views(registered: Any, spec: GroupSpec) -> tuple[torch.Tensor, ...]:
    """A recurrent layer as vLLM 0.26-0.28 register it: one ``[num_blocks, *shape]`` view per
    state, in the spec's order (0.26's ``GPUModelRunner._reshape_kv_cache_tensors``), or the
    int8 pages of 0.28 (:func:`~vllm_kvplugin.adapters._common.page_state_views`); anything
    else is a start-up error naming what was registered."""
    if isinstance(registered, torch.Tensor) and registered.dim() == 4 and registered.dtype == torch.int8:
        return _common.page_state_views(registered, spec)
    views = tuple(registered) if isinstance(registered, (list, tuple)) else ()
    ok = len(views) == len(spec.state) and all(
        isinstance(v, torch.Tensor) and v.dtype == t.dtype and tuple(v.shape[1:]) == tuple(t.shape)
        and v.shape[0] == views[0].shape[0] for v, t in zip(views, spec.state))
    if not ok:
        got = [(str(v.dtype), tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
               for v in (views or (registered,))]
        want = [(str(t.dtype), ("blocks", *t.shape)) for t in spec.state]
        raise LayoutError(f"recurrent KV cache group {spec.index}: expected per-state views {want}, "
                          f"vLLM registered {got}")
    return views


def describe_state(vllm_config: Any, kv_cache_config: Any, spec: GroupSpec, kv_caches: dict, vllm_version: str):
    return _common.describe_state_group(vllm_config, kv_cache_config, spec, kv_caches, vllm_version, state_views)


def describe_groups(vllm_config: Any, kv_cache_config: Any, kv_caches: dict, vllm_version: str):
    return _common.describe_groups(
        vllm_config, kv_cache_config, kv_caches, vllm_version=vllm_version,
        layout_name=layout_name(vllm_config, kv_cache_config), physical_order=physical_order,
        mla_has_head_dim=False, split_semantics=split_semantics)
