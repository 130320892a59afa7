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

import torch

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.descriptor import ContentSemantics
from vllm_kvplugin.layout.groups import GroupSpec

#: recurrent (Mamba/GatedDeltaNet) state pages
SUPPORTS_RECURRENT = True
ERA = "0.29"


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


def state_views(tensor: Any, spec: GroupSpec) -> tuple[torch.Tensor, ...]:
    """A recurrent layer's ``[num_blocks, 1, 1, page_bytes]`` int8 page view as per-state views
    ``[num_blocks, *shape]``: each block's states are packed from the page's first byte on, in
    the spec's order (vLLM's ``MambaBase.bind_kv_cache``; the certification compares with the
    views the layer bound)."""
    need = sum(t.nbytes for t in spec.state)
    if not (isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and tensor.dtype == torch.int8
            and tuple(tensor.shape[1:3]) == (1, 1) and tensor.shape[3] >= need):
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise LayoutError(f"recurrent KV cache group {spec.index}: expected int8 pages "
                          f"[blocks, 1, 1, >= {need}], vLLM registered {shape}")
    pages = tensor.view(tensor.shape[0], tensor.shape[3])
    views, off = [], 0
    for t in spec.state:
        views.append(pages[:, off:off + t.nbytes].view(t.dtype).view(-1, *t.shape))
        off += t.nbytes
    return tuple(views)


def describe_state(vllm_config: Any, kv_cache_config: Any, spec: GroupSpec, kv_caches: dict, vllm_version: str):
    return _common.describe_state_group(vllm_config, kv_cache_config, spec, kv_caches, vllm_version, state_views)


def describe_groups(vllm_config: Any, kv_cache_config: Any, kv_caches: dict, vllm_version: str):
    return _common.describe_groups(
        vllm_config, kv_cache_config, kv_caches, vllm_version=vllm_version,
        layout_name=layout_name(vllm_config, kv_cache_config), physical_order=physical_order,
        mla_has_head_dim=True, split_semantics=split_semantics)
