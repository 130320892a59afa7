"""Adapter for vLLM 0.29 - 0.33: one int8 KV buffer, ``KVCacheLayout`` views.

* The layout is resolved once in the engine core and published in
  ``KVCacheConfig.kv_cache_layout`` / ``CacheConfig.get_resolved_kv_cache_layout()``
  as a ``KVCacheLayout`` over logical ``[L, B, H, N, C]``.
* ``register_kv_caches`` gets per-layer ``(B*r, H, N, C)`` strided views into
  that one buffer (``create_kv_cache_views``); the layout's
  ``layer_view_order`` gives their physical order.
* MLA views are ``(B*r, 1, N, D_latent)``.
* 0.30+ completion goes through ``get_transfer_results`` (wrapping ``get_finished``).
* Recurrent (Mamba/GDN) layers are int8 pages ``[B, 1, 1, C]`` of the same buffer,
  each block's states packed from its first byte (:func:`state_views`).
"""

from __future__ import annotations

from typing import Any

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.layout.descriptor import ContentSemantics
from vllm_kvplugin.layout.groups import GroupSpec


def layout_name(vllm_config: Any, kv_cache_config: Any) -> str:
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = vllm_config.cache_config.get_resolved_kv_cache_layout()
    name = getattr(name, "name", name)
    from vllm.config.cache import _LAYOUT_COMPAT_ALIASES

    return str(_LAYOUT_COMPAT_ALIASES.get(name, name))


def physical_order(name: str, backend: Any = None) -> tuple[int, ...] | None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        return tuple(KVCacheLayout[name].layer_view_order)
    except KeyError:
        return None


def split_semantics(backend: str) -> ContentSemantics | None:
    return None


#: a recurrent layer's int8 page view as per-state views (shared with 0.28, which registers the same)
state_views = _common.page_state_views


def describe_state(vllm_config: Any, kv_cache_config: Any, spec: GroupSpec, kv_caches: dict, vllm_version: str):
    return _common.describe_state_group(vllm_config, kv_cache_config, spec, kv_caches, vllm_version, state_views)


def describe_groups(vllm_config: Any, kv_cache_config: Any, kv_caches: dict, vllm_version: str):
    return _common.describe_groups(
        vllm_config, kv_cache_config, kv_caches, vllm_version=vllm_version,
        layout_name=layout_name(vllm_config, kv_cache_config), physical_order=physical_order,
        mla_has_head_dim=True, split_semantics=split_semantics)
