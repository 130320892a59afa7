"""The exact KV tensors the installed vLLM builds, through the plugin's adapters.

* vLLM 0.26-0.28: each backend's ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``
  and vLLM's own ``_reshape_attention_kv_cache`` (padding and packed blocks included).
* vLLM 0.29+: vLLM's own ``compute_layout_strides`` (KVCacheTensor placement, as
  ``get_kv_cache_config_from_groups`` does) and ``create_kv_cache_views`` for every
  ``KVCacheLayout``, with kernel-block splitting and padded pages.

Each layout then goes through the plugin's adapter functions (layout name,
physical order), :func:`build_layout`, start-up certification, and a gather
compared with the independent reference.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvplugin import ops
from vllm_kvplugin.adapters import parse_version
from vllm_kvplugin.layout import build_layout, certify
from vllm_kvplugin.layout.build import GroupSource
from vllm_kvplugin.layout.reference import reference_gather, reference_scatter

vllm = pytest.importorskip("vllm")
VERSION = parse_version(vllm.__version__)
ERA_026 = VERSION < (0, 29, 0)


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _check(src: GroupSource, tensors: list[torch.Tensor]) -> None:
    layout, layers = build_layout(src, tensors)
    certify(layout, layers)
    gen = torch.Generator().manual_seed(5)
    bs = layout.block_size
    every = torch.arange(layout.num_blocks * bs).view(1, -1)
    content = torch.randn((1, *layout.chunk_shape(every.shape[1])), generator=gen).to(layout.dtype)
    reference_scatter(layout, layers, every, content)
    slots = torch.tensor([b * bs + i for b in (layout.num_blocks - 1, 2) for i in range(bs)]).view(1, -1)
    want = torch.zeros((1, *layout.chunk_shape(2 * bs)), dtype=layout.dtype)
    got = torch.randn(want.shape, generator=gen).to(layout.dtype)
    reference_gather(layout, layers, slots, want)
    ops.gather(layers, slots, layout.strides, bs, layout.kernel_block_size, layout.num_blocks, got)
    assert torch.equal(_bits(got), _bits(want)), layout.describe()


# ----------------------------------------------------------------- 0.26 - 0.28
def _backend(name: str):
    import importlib

    mod, cls = {
        "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
        "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
        "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
        "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    }[name]
    try:
        return getattr(importlib.import_module(mod), cls)
    except Exception as exc:  # backend not importable on this build
        pytest.skip(f"{name} not importable here: {exc}")


@pytest.fixture
def kv_cache_layout_026():
    from vllm.v1.attention.backends import utils

    def set_layout(name):
        utils.set_kv_cache_layout(name)
        utils.get_kv_cache_layout.cache_clear()

    yield set_layout
    utils.set_kv_cache_layout(None)
    utils.get_kv_cache_layout.cache_clear()


def _params_026():
    if not ERA_026:
        return []
    return [(b, n, v) for b in ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN")
            for n in ("NHD", "HND") for v in ("plain", "kernel-blocks", "padded", "packed")
            if not (b == "CPU_ATTN" and n == "NHD")]  # CPU_ATTN forces HND


@pytest.mark.parametrize(("backend", "layout_name", "variant"), _params_026(),
                         ids=["-".join(p) for p in _params_026()])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_vllm_026_layouts(backend, layout_name, variant, dtype, kv_cache_layout_026):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    from vllm_kvplugin.adapters import v0_26

    kv_cache_layout_026(layout_name)
    cls = _backend(backend)
    H, D, nb, L = 4, 64, 10, 3
    kbs = 32 if backend == "CPU_ATTN" else 16  # CPU_ATTN: MultipleOf(32); GPU: MultipleOf(16)
    bs = 64 if variant == "kernel-blocks" else kbs
    esize = torch.empty((), dtype=dtype).element_size()
    page = bs * H * 2 * D * esize
    kw = {"page_size_padded": page + 256} if variant == "padded" else {}
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=dtype, **kw)
    knb = nb * (bs // kbs)
    shape = cls.get_kv_cache_shape(knb, kbs, H, D)
    try:  # as _reshape_kv_cache_tensors: no stride order -> logical order
        order = cls.get_kv_cache_stride_order()
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    tensors = []
    packed_raw = None
    if variant == "packed":  # one allocation, each block holds every layer's page
        assert tuple(order)[0] == 0, "vLLM packs only blocks-outermost orders"
        packed_raw = torch.zeros(nb * L * page, dtype=torch.int8)
    for layer in range(L):
        if packed_raw is not None:
            t = _reshape_attention_kv_cache(packed_raw, spec, shape, order, knb, (layer * page, L * page))
        else:
            pg = spec.page_size_bytes
            t = _reshape_attention_kv_cache(torch.zeros(nb * pg, dtype=torch.int8), spec, shape, order, knb, None)
        tensors.append(t)
    name = v0_26.layout_name(None, None)
    src = GroupSource(0, "attention", bs, nb, H, D, D, dtype, cls.get_name(), name,
                      tuple(f"l{i}" for i in range(L)), vllm.__version__, mla_has_head_dim=False,
                      physical_order=v0_26.physical_order(name, cls))
    _check(src, tensors)


# ------------------------------------------------------------------------ 0.29+
def _params_029():
    """(layout, variant) pairs vLLM itself can produce."""
    if ERA_026:
        return []
    from vllm.v1.kv_cache_layout import KVCacheLayout

    out = []
    for lay in KVCacheLayout:
        for v in ("plain", "kernel-blocks", "padded", "mla", "cpu-semantics"):
            if v == "cpu-semantics" and lay.name != "LBHNC":
                continue  # CPU_ATTN supports only LBHNC
            if v == "kernel-blocks" and not (lay.is_block_compact and lay.is_layer_compact):
                continue  # blocks are split only when a block is one dense page
            if v == "padded" and not lay.is_block_compact:
                continue  # "cannot pad pages"
            out.append((lay.name, v))
    return out


@pytest.mark.parametrize(("layout_name", "variant"), _params_029(), ids=[f"{a}-{b}" for a, b in _params_029()])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_vllm_029_layouts(layout_name, variant, dtype):
    from vllm.v1 import kv_cache_interface as kci
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_kvplugin.adapters import v0_29

    layout = KVCacheLayout[layout_name]
    H, D, bs, nb, L = 2, 64, 32, 9, 3
    kbs = 16 if variant == "kernel-blocks" else None
    esize = torch.empty((), dtype=dtype).element_size()
    if variant == "mla":
        spec = kci.MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=dtype)
        D, H = 576, 1
    else:
        kw = {"page_size_padded": bs * H * 2 * D * esize + 512} if variant == "padded" else {}
        spec = kci.FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=D, dtype=dtype, **kw)
    # placement as kv_cache_utils.get_kv_cache_config_from_groups computes it
    padded = getattr(spec, "page_size_padded", None) or spec.page_size_bytes
    block_stride = L * padded if layout.is_block_outermost else (
        padded if padded != spec.page_size_bytes else None)
    layer_stride, block_stride, *_ = kci.compute_layout_strides(
        spec, nb, L, layout, fixed_strides=(None, block_stride, None, None, None))
    size = nb * L * padded + 4096
    kvt = kci.KVCacheTensor(size=size, layers=[f"l{i}" for i in range(L)], layer_stride=layer_stride,
                            block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = kci.create_kv_cache_views(raw, spec, nb, layout, kvt, kbs)
    backend = "FLASHMLA" if variant == "mla" else ("CPU_ATTN" if variant == "cpu-semantics" else "FLASH_ATTN")
    src = GroupSource(0, "mla" if variant == "mla" else "attention", bs, nb, H, D, D, dtype, backend,
                      layout_name, tuple(kvt.layers), vllm.__version__, mla_has_head_dim=True,
                      physical_order=v0_29.physical_order(layout_name))
    _check(src, views)
