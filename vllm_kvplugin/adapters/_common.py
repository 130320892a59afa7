"""What every era's adapter reads from vLLM the same way.

Every vLLM attribute read here is listed in ``compat/api_surface.toml``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvplugin.layout.build import GroupSource, LayoutError
from vllm_kvplugin.layout.descriptor import ContentSemantics

#: HF config fields that decide a model's KV bytes for given weights and token ids.  A
#: curated list, not the whole config: vLLM versions (and their transformers) add, drop
#: and rename incidental fields, and engines of different versions must share one cache.
_IDENTITY_FIELDS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "hidden_act",
    "rms_norm_eps", "layer_norm_eps", "attention_bias", "tie_word_embeddings", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "sliding_window",
    "use_sliding_window", "layer_types", "max_window_layers", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok",
)


@dataclass(frozen=True)
class GroupInfo:
    """Scheduler-side facts about one KV cache group (no tensors)."""

    group_index: int
    spec_kind: str
    block_size: int
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def num_kv(self) -> int:
        return 1 if self.spec_kind == "mla" else 2

    @property
    def num_heads(self) -> int:
        return 1 if self.spec_kind == "mla" else self.num_kv_heads

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        n = len(self.layer_names) if num_layers is None else num_layers
        esize = torch.empty((), dtype=self.dtype).element_size()
        return n * self.num_kv * self.num_heads * self.head_size * esize


def spec_kind(spec: Any) -> str:
    name = type(spec).__name__
    if name == "FullAttentionSpec":
        return "attention"
    if name == "MLAAttentionSpec":
        return "mla"
    return name


def group_infos(kv_cache_config: Any) -> list[GroupInfo]:
    """One :class:`GroupInfo` per ``kv_cache_config.kv_cache_groups`` entry."""
    out = []
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        out.append(GroupInfo(
            group_index=gi,
            spec_kind=spec_kind(spec),
            block_size=int(spec.block_size),
            layer_names=tuple(group.layer_names),
            num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
            head_size=int(getattr(spec, "head_size", 0) or 0),
            dtype=getattr(spec, "dtype", torch.uint8),
        ))
    return out


def attn_backend(vllm_config: Any, layer_name: str) -> Any:
    """The attention backend class of a layer (None for layers without one)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    return getattr(layer, "attn_backend", None)


def backend_name(backend: Any) -> str:
    return "<no attention backend>" if backend is None else str(backend.get_name())


def describe_groups(
    vllm_config: Any,
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    *,
    vllm_version: str,
    layout_name: str,
    physical_order: Callable[[str, Any], tuple[int, ...] | None],
    mla_has_head_dim: bool,
    split_semantics: Callable[[str], ContentSemantics | None],
) -> list[tuple[GroupSource, list[torch.Tensor]]]:
    """(source, layer tensors) for every KV cache group; raises :class:`LayoutError`."""
    out = []
    grouped: set[str] = set()
    for group, info in zip(kv_cache_config.kv_cache_groups, group_infos(kv_cache_config)):
        spec = group.kv_cache_spec
        names = tuple(n for n in info.layer_names if n in kv_caches)
        missing = [n for n in info.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"KV cache group {info.group_index}: layers {missing[:3]} were not registered")
        tensors = [kv_caches[n] for n in names]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(
                    f"KV cache group {info.group_index} ({info.spec_kind}), layer {name}: "
                    f"vLLM {vllm_version} registered a {type(t).__name__}, not a tensor "
                    "(recurrent state pages are not supported)")
        classes = {attn_backend(vllm_config, n) for n in names}
        if len(classes) != 1:
            raise LayoutError(f"KV cache group {info.group_index} mixes attention backends "
                              f"{sorted(backend_name(c) for c in classes)}")
        backend_cls = classes.pop()
        backend = backend_name(backend_cls)
        src = GroupSource(
            group_index=info.group_index,
            spec_kind=info.spec_kind,
            block_size=info.block_size,
            num_blocks=int(kv_cache_config.num_blocks),
            num_kv_heads=info.num_kv_heads,
            head_size=info.head_size,
            head_size_v=int(getattr(spec, "head_size_v", None) or info.head_size),
            dtype=info.dtype,
            backend=backend,
            layout_name=layout_name,
            layer_names=names,
            vllm_version=vllm_version,
            mla_has_head_dim=mla_has_head_dim,
            split_semantics=split_semantics(backend),
            physical_order=physical_order(layout_name, backend_cls),
        )
        out.append((src, tensors))
        grouped.update(names)
    # layers outside every group must alias a grouped layer (KV sharing)
    ptrs = {t.data_ptr() for _, ts in out for t in ts}
    for name, t in kv_caches.items():
        if name not in grouped and isinstance(t, torch.Tensor) and t.data_ptr() not in ptrs:
            raise LayoutError(f"layer {name} is registered but belongs to no KV cache group")
    return out


def model_identity(vllm_config: Any, model_id: str | None) -> dict[str, Any]:
    """What determines a model's KV bytes: the basis of the chunk fingerprint."""
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    hf = {k: hf[k] for k in _IDENTITY_FIELDS if hf.get(k) is not None}
    return {
        "model": model_id or str(mc.model),
        "revision": None if model_id else getattr(mc, "revision", None),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "hf_config": hf,
    }


def model_parallel_world(vllm_config: Any) -> int:
    """Workers of one engine that each hold a slice of the KV cache (tensor x pipeline parallel)."""
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def model_parallel_rank(vllm_config: Any) -> tuple[int, int]:
    """(rank, world) of this worker in the engine's tensor x pipeline parallel group.

    Each rank holds a different slice of the KV cache (heads or layers), so a
    chunk object belongs to one rank of one world size.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    return int(get_pp_group().rank_in_group) * tp + int(get_tensor_model_parallel_rank()), tp * pp


def is_cuda_alike() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def kv_transfer_extra_config(vllm_config: Any) -> Mapping[str, Any]:
    return vllm_config.kv_transfer_config.kv_connector_extra_config or {}


def request_extras(request: Any):
    """Key extras of a vLLM ``Request``: LoRA name, cache salt, multimodal items."""
    from vllm_kvplugin.chunk.keys import KeyExtras, MMItem

    lora = getattr(request, "lora_request", None)
    items = []
    for f in getattr(request, "mm_features", None) or []:
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is None or ident is None:
            continue
        items.append(MMItem(str(ident), int(pos.offset), int(pos.length)))
    return KeyExtras(
        lora=None if lora is None else str(getattr(lora, "lora_name", lora)),
        cache_salt=getattr(request, "cache_salt", None),
        mm=tuple(items),
    )


def request_prompt_ids(request: Any) -> Sequence[int] | None:
    """Prompt token ids of a ``Request`` (None for prompt-embeds requests)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    return request.prompt_token_ids
