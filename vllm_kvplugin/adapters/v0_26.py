"""Adapter for vLLM 0.26 - 0.28: per-layer KV allocations, NHD/HND layouts.

* ``register_kv_caches`` gets one tensor per layer, each its own allocation,
  logical ``(B*r, H, N, 2D)`` (fused backends) permuted by the backend's
  ``get_kv_cache_stride_order()``, which follows ``get_kv_cache_layout()``
  ("NHD" or "HND"; CPU_ATTN forces "HND") except where a backend fixes its own
  order (FlexAttention: always NHD).
* MLA views are ``(B*r, N, D_latent)``; ROCM_ATTN keeps ``(2, B, N, H, D)``.
* Completion goes through ``get_finished`` (0.26 calls it directly).
"""

from __future__ import annotations

from typing import Any

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.descriptor import ContentSemantics
from vllm_kvplugin.layout.groups import GroupSpec

#: recurrent (Mamba/GatedDeltaNet) state pages
SUPPORTS_RECURRENT = False
ERA = "0.26"


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


def describe_state(vllm_config: Any, kv_cache_config: Any, spec: GroupSpec, kv_caches: dict, vllm_version: str):
    raise LayoutError(
        f"vllm-kvplugin: {spec.describe()} on vLLM {vllm_version}: recurrent (Mamba/GatedDeltaNet) "
        "groups are supported from vLLM 0.29 on (0.26-0.28 register their state as [conv, ssm] "
        "lists and hand a connector a local hit the recurrent state may not have)")


def describe_groups(vllm_config: Any, kv_cache_config: Any, kv_caches: dict, vllm_version: str):
    return _common.describe_groups(
        vllm_config, kv_cache_config, kv_caches, vllm_version=vllm_version,
        layout_name=layout_name(vllm_config, kv_cache_config), physical_order=physical_order,
        mla_has_head_dim=False, split_semantics=split_semantics)
