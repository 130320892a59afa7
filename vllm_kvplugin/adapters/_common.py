"""What every era's adapter reads from vLLM the same way.

Every vLLM attribute read here is listed in ``compat/api_surface.toml``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vllm_kvplugin.layout.build import GroupSource, LayoutError
from vllm_kvplugin.layout.descriptor import ContentSemantics, GroupKind
from vllm_kvplugin.layout.groups import GroupSpec, StateTensor
from vllm_kvplugin.layout.state import StateSource

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
    "quantization_config", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "layers_block_type", "mamba_num_heads",
    "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
)


#: vLLM's KV cache spec classes the plugin stores, by class name (subclasses are named
#: too: a spec this table does not name is refused, never taken for its base class)
_SPEC_KINDS = {
    "FullAttentionSpec": GroupKind.ATTENTION,
    "MLAAttentionSpec": GroupKind.MLA,
    "SlidingWindowSpec": GroupKind.WINDOW,
    "MambaSpec": GroupKind.RECURRENT,
}


def drops_eagle_block(vllm_config: Any) -> bool:
    """Whether vLLM drops the last cached block of a hit for a drafter (EAGLE, EAGLE-3, MTP, ...):
    the drafter's KV of a block's last token was computed with the next token."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    drop = getattr(spec, "use_eagle_block_drop", None)  # 0.32+; before, every EAGLE-style method
    return bool(drop() if drop is not None else spec.use_eagle())


def group_specs(kv_cache_config: Any, vllm_config: Any = None) -> list[GroupSpec]:
    """One :class:`GroupSpec` per ``kv_cache_config.kv_cache_groups`` entry; an unknown
    spec class raises :class:`LayoutError` naming it.  With a drafter whose block vLLM drops
    and no group marked as the drafter's, every group is treated as a drafter's (as vLLM's
    KV cache coordinator does: EAGLE's layers share the target's group)."""
    groups = kv_cache_config.kv_cache_groups
    every_drafter = (vllm_config is not None and drops_eagle_block(vllm_config)
                     and not any(getattr(g, "is_eagle_group", False) for g in groups))
    out = []
    for gi, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = _SPEC_KINDS.get(name)
        if kind is None:
            raise LayoutError(
                f"vllm-kvplugin: KV cache group {gi} has spec {name}, which the plugin does not "
                f"store (supported: {', '.join(_SPEC_KINDS)})")
        window = state = None
        if kind is GroupKind.WINDOW:
            window = int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if kind is GroupKind.RECURRENT:
            state = tuple(StateTensor(dt, tuple(int(d) for d in shape))
                          for shape, dt in zip(spec.shapes, spec.dtypes))
        out.append(GroupSpec(
            index=gi,
            kind=kind,
            spec_name=name,
            block_size=int(spec.block_size),
            layer_names=tuple(group.layer_names),
            num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
            head_size=int(getattr(spec, "head_size", 0) or 0),
            dtype=getattr(spec, "dtype", torch.uint8) if state is None else torch.uint8,
            window=window or 0,
            state=state or (),
            state_mode=str(getattr(spec, "mamba_cache_mode", "")) if state else "",
            speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
            drafter=every_drafter or bool(getattr(group, "is_eagle_group", False)),
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
) -> list[tuple[GroupSource, list[torch.Tensor]] | None]:
    """(source, layer tensors) for every attention-like KV cache group (None for recurrent
    groups: :func:`describe_state_group`); raises :class:`LayoutError`."""
    out = []
    grouped: set[str] = set()
    for group, info in zip(kv_cache_config.kv_cache_groups, group_specs(kv_cache_config)):
        spec = group.kv_cache_spec
        if info.kind is GroupKind.RECURRENT:
            grouped.update(info.layer_names)
            out.append(None)  # described by describe_state_group
            continue
        names = tuple(n for n in info.layer_names if n in kv_caches)
        missing = [n for n in info.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"KV cache group {info.index}: layers {missing[:3]} were not registered")
        tensors = [kv_caches[n] for n in names]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(
                    f"KV cache group {info.index} ({info.spec_name}), layer {name}: "
                    f"vLLM {vllm_version} registered a {type(t).__name__}, not a tensor "
                    "(recurrent state pages are not supported)")
        classes = {attn_backend(vllm_config, n) for n in names}
        if len(classes) != 1:
            raise LayoutError(f"KV cache group {info.index} mixes attention backends "
                              f"{sorted(backend_name(c) for c in classes)}")
        backend_cls = classes.pop()
        backend = backend_name(backend_cls)
        src = GroupSource(
            group_index=info.index,
            spec_kind="mla" if info.kind is GroupKind.MLA else "attention",
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
    ptrs = {t.data_ptr() for entry in out if entry is not None for t in entry[1]}
    for name, t in kv_caches.items():
        if name not in grouped and isinstance(t, torch.Tensor) and t.data_ptr() not in ptrs:
            raise LayoutError(f"layer {name} is registered but belongs to no KV cache group")
    return out


def page_state_views(tensor: Any, spec: GroupSpec) -> tuple[torch.Tensor, ...]:
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


def describe_state_group(vllm_config: Any, kv_cache_config: Any, spec: GroupSpec,
                         kv_caches: Mapping[str, Any], vllm_version: str,
                         views_of: Callable[[Any, GroupSpec], tuple[torch.Tensor, ...]]) -> StateSource:
    """A recurrent group's per-layer state views (``views_of`` turns what vLLM registered for
    one layer into ``[num_blocks, *shape]`` views), and the views vLLM's layers bound."""
    ctx = vllm_config.compilation_config.static_forward_context
    missing = [n for n in spec.layer_names if n not in kv_caches]
    if missing:
        raise LayoutError(f"KV cache group {spec.index}: layers {missing[:3]} were not registered")
    views = tuple(views_of(kv_caches[n], spec) for n in spec.layer_names)
    bound = [getattr(ctx.get(n), "kv_cache", None) for n in spec.layer_names]
    reference = None
    if all(isinstance(b, (tuple, list)) and len(b) == len(spec.state) for b in bound):
        reference = tuple(tuple(b) for b in bound)
    return StateSource(spec.index, spec.layer_names, views, reference, int(kv_cache_config.num_blocks),
                       f"vLLM {vllm_version} {spec.spec_name} {spec.spec}")


def model_identity(vllm_config: Any, model_id: str | None) -> dict[str, Any]:
    """What determines a model's KV bytes: the basis of the chunk fingerprint.

    The config fields that decide KV, the dtypes, the quantization, and the weights
    themselves (:func:`vllm_kvplugin.identity.weights_digest`: a local directory whose
    weights changed never hits chunks of the old ones).  Raises :class:`LayoutError`
    for KV scales computed at run time (the KV would depend on the first batch)."""
    from vllm_kvplugin.identity import weights_digest

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if getattr(cc, "calculate_kv_scales", False):
        raise LayoutError("vllm-kvplugin: calculate_kv_scales=True makes the KV cache depend on "
                          "the first batch's activations; chunks could not be reused safely")
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else {}
    hf = {k: hf[k] for k in _IDENTITY_FIELDS if hf.get(k) is not None}
    return {
        "model": model_id or str(mc.model),
        "revision": None if model_id else getattr(mc, "revision", None),
        "weights": weights_digest(str(mc.model)),
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "kv_cache_dtype": str(cc.cache_dtype),
        "kv_cache_dtype_skip_layers": sorted(getattr(cc, "kv_cache_dtype_skip_layers", None) or []),
        "hf_config": hf,
    }


def model_parallel_world(vllm_config: Any) -> int:
    """Workers of one engine that each hold a slice of the KV cache (tensor x pipeline parallel)."""
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def max_batched_tokens(vllm_config: Any) -> int:
    """The most tokens one engine step computes (vLLM's ``max_num_batched_tokens``)."""
    return int(vllm_config.scheduler_config.max_num_batched_tokens)


def async_scheduling(vllm_config: Any) -> bool:
    """Whether vLLM schedules a step before the last one's output is in (its
    ``async_scheduling``, resolved by the time a connector is made)."""
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))


def v2_model_runner(vllm_config: Any) -> bool:
    """Whether vLLM's workers run its V2 model runner (``VllmConfig.use_v2_model_runner``: on GPUs
    the default for most models; the CPU platform, without Triton, runs V1).  False where the
    version has no such choice."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def check_pipeline_split(vllm_config: Any) -> None:
    """Pipeline parallelism only with every stage holding the same number of layers (the only
    split tested); anything else is a start-up error naming the split."""
    import os

    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp <= 1:
        return
    layers = int(getattr(vllm_config.model_config.hf_config, "num_hidden_layers", 0) or 0)
    partition = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if partition or not layers or layers % pp:
        raise LayoutError(
            f"vllm-kvplugin: pipeline parallel size {pp} with {layers or 'an unknown number of'} layers"
            f"{f' split as VLLM_PP_LAYER_PARTITION={partition}' if partition else ''} is not supported: "
            "only an even split of the layers over the stages is")


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


def engine_id(vllm_config: Any) -> str:
    """The engine's id (vLLM gives each engine's KV transfer config one), the same for its
    scheduler and worker halves."""
    return str(vllm_config.kv_transfer_config.engine_id)


def request_extras(request: Any):
    """Key extras of a vLLM ``Request``: LoRA name and path, cache salt, multimodal items."""
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
        lora_name=None if lora is None else str(lora.lora_name),
        lora_path=None if lora is None else str(lora.lora_path),
        cache_salt=getattr(request, "cache_salt", None),
        mm=tuple(items),
    )


def skips_prefix_cache(request: Any) -> bool:
    """The request must not read any cached prefix (prompt logprobs, some pooling tasks).
    vLLM 0.32 zeroes the connector's hit itself; 0.26 does not."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def request_prompt_ids(request: Any) -> Sequence[int] | None:
    """Prompt token ids of a ``Request`` (None for prompt-embeds requests)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    return request.prompt_token_ids
