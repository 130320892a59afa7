"""Adapter for vLLM 0.26 - 0.28: per-layer KV allocations, NHD/HND layouts.

* ``register_kv_caches`` gets one tensor per layer, each its own allocation,
  logical ``(B*r, H, N, 2D)`` (fused backends) permuted by the backend's
  stride order; the order is ``get_kv_cache_layout()`` ("NHD" or "HND";
  CPU_ATTN forces "HND").
* MLA views are ``(B*r, N, D_latent)``; ROCM_ATTN keeps ``(2, B, N, H, D)``.
* Completion goes through ``get_finished`` (0.26 calls it directly).
"""

from __future__ import annotations

from typing import Any

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.layout.descriptor import ContentSemantics

ERA = "0.26"
_ORDER = {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    return str(get_kv_cache_layout() or "NHD")


def physical_order(name: str) -> tuple[int, ...] | None:
    return _ORDER.get(name)


def split_semantics(backend: str) -> ContentSemantics | None:
    return ContentSemantics.SPLIT_KV_FIRST if backend == "ROCM_ATTN" else None


def describe_groups(vllm_config: Any, kv_cache_config: Any, kv_caches: dict, vllm_version: str):
    return _common.describe_groups(
        vllm_config, kv_cache_config, kv_caches, vllm_version=vllm_version,
        layout_name=layout_name(vllm_config, kv_cache_config), physical_order=physical_order,
        mla_has_head_dim=False, split_semantics=split_semantics)
