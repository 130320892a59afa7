"""KV cache groups as the plugin sees them: kinds, what one object holds, refusals at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.rules import GroupNeed, Need
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.descriptor import GroupKind


# stand-ins named like vLLM's spec classes (the adapter matches the class name)
@dataclass
class FullAttentionSpec:
    block_size: int = 128
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 64
    extra_retained_tokens: int = 0


@dataclass
class MambaSpec:
    block_size: int = 384
    shapes: tuple = ((3, 512), (2, 128, 128))
    dtypes: tuple = (torch.bfloat16, torch.float32)
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0


@dataclass
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 1024


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: list = field(default_factory=lambda: ["model.layers.0.attn"])
    is_eagle_group: bool = False


def specs(*groups):
    return _common.group_specs(SimpleNamespace(kv_cache_groups=list(groups)))


def test_kinds_and_objects():
    full, win, rec = specs(Group(FullAttentionSpec()), Group(SlidingWindowSpec()),
                           Group(MambaSpec(), ["model.layers.1.linear_attn", "model.layers.2.linear_attn"]))
    assert (full.kind, win.kind, rec.kind) == (GroupKind.ATTENTION, GroupKind.WINDOW, GroupKind.RECURRENT)
    assert full.bytes_per_token == 2 * 2 * 64 * 2 and full.stored_tokens(256) == 256
    assert win.window == 63 and win.window_tail == 128 and win.stored_tokens(256) == 128
    assert win.need(256) == GroupNeed(Need.WINDOW, 1) and full.need(256) == GroupNeed(Need.PREFIX)
    assert rec.need(384) == GroupNeed(Need.POINT)
    assert rec.state_bytes == 2 * (3 * 512 * 2 + 2 * 128 * 128 * 4) == rec.object_bytes(384)
    assert rec.spec == "bfloat16[3,512];float32[2,128,128]"
    assert rec.unsupported() is None and full.unsupported() is None
    # extra retained tokens widen the window (vLLM 0.32+)
    wide, = specs(Group(SlidingWindowSpec(extra_retained_tokens=100)))
    assert wide.window == 163 and wide.window_tail == 256


def test_what_one_object_covers_and_where_it_is_copied():
    """Each kind's tokens and blocks, written out by hand for a request's block table (block 128,
    chunk 256: two blocks a chunk; the window's tail is one block)."""
    full, win, rec = specs(Group(FullAttentionSpec()), Group(SlidingWindowSpec()), Group(MambaSpec(block_size=128)))
    table = [10, 11, 12, 13, 14, 15]  # blocks of tokens 0-127, 128-255, ...
    assert (full.is_state, win.is_state, rec.is_state) == (False, False, True)
    assert (full.restores_prefix, win.restores_prefix, rec.restores_prefix) == (True, False, False)
    assert full.object_tokens(1, 256) == (256, 512) and full.object_blocks(table, 1, 256) == (12, 13)
    assert win.object_tokens(1, 256) == (384, 512) and win.object_blocks(table, 1, 256) == (13,)
    # a state covers the prefix up to its chunk's end; it is copied into the block at the hit
    assert rec.object_tokens(1, 256) == (0, 512)
    assert rec.object_blocks(table, 1, 256, hit_end=512) == (13,)
    assert rec.object_blocks(table, 0, 256, hit_end=256) == (11,)
    # many objects at once, as a load places them: the same, written out by hand
    assert full.objects_blocks(table, [0, 2, 1], 256) == [(10, 11), (14, 15), (12, 13)]
    assert win.objects_blocks(table, [0, 1, 2], 256) == [(11,), (13,), (15,)]
    assert rec.objects_blocks(table, [1], 256, hit_end=512) == [(13,)]
    assert full.object_starts(np.array([0, 2]), 256).tolist() == [0, 512]
    assert win.object_starts(np.array([0, 2]), 256).tolist() == [128, 640]
    with pytest.raises(ValueError, match="holds states, not tokens"):
        rec.object_starts(np.array([1]), 256)


def test_unknown_spec_is_refused_naming_it():
    with pytest.raises(LayoutError, match="ChunkedLocalAttentionSpec.*supported: FullAttentionSpec"):
        specs(Group(ChunkedLocalAttentionSpec()))


@pytest.mark.parametrize("spec,why", [
    (MambaSpec(mamba_cache_mode="none"), "only 'align' keeps a state per block"),
    (MambaSpec(mamba_cache_mode="all"), "only 'align'"),
    (MambaSpec(num_speculative_blocks=2), "speculative decoding"),
])
def test_recurrent_groups_vllm_cannot_checkpoint_are_refused(spec, why):
    g, = specs(Group(spec))
    assert why in g.unsupported()


def test_v026_state_views_are_the_lists_vllm_registers():
    """vLLM 0.26 registers a recurrent layer as [conv, ssm] views striding over one page per
    block (written out here as GPUModelRunner._reshape_kv_cache_tensors builds them): the adapter
    takes them as they are, and over the same page memory they are the views vLLM 0.29+ binds.
    vLLM 0.28 registers the int8 pages themselves: the same views again."""
    from vllm_kvplugin.adapters import v0_26, v0_29

    g, = specs(Group(MambaSpec(shapes=((3, 8), (2, 4, 4)))))
    page, blocks = 3 * 8 * 2 + 2 * 4 * 4 * 4 + 64, 5  # bf16 conv, fp32 ssm, padded page
    raw = torch.randint(-128, 127, (blocks * page,), dtype=torch.int8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, 3, 8), (page // 2, 8, 1), 0)
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 2, 4, 4), (page // 4, 16, 4, 1), 48 // 4)
    got = v0_26.state_views([conv, ssm], g)
    assert got[0] is conv and got[1] is ssm
    bound = v0_29.state_views(raw.view(blocks, 1, 1, page), g)
    for a, b in zip(got, bound):
        assert a.shape == b.shape and all(torch.equal(a[i].view(torch.uint8), b[i].view(torch.uint8))
                                          for i in range(blocks))
    paged = v0_26.state_views(raw.view(blocks, 1, 1, page), g)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(paged, bound))
    for bad in ([conv], [ssm, conv], [conv.float(), ssm], raw.view(blocks, page)):
        with pytest.raises(LayoutError, match="expected per-state views"):
            v0_26.state_views(bad, g)


def test_v029_state_views_are_the_pages_as_vllm_binds_them():
    """Independent reference: the slicing vLLM's MambaBase.bind_kv_cache does, written out."""
    from vllm_kvplugin.adapters.v0_29 import state_views

    g, = specs(Group(MambaSpec(shapes=((3, 8), (2, 4, 4)))))
    page = 3 * 8 * 2 + 2 * 4 * 4 * 4 + 64  # padded
    pages = torch.randint(-128, 127, (5, 1, 1, page), dtype=torch.int8)
    conv, ssm = state_views(pages, g)
    assert conv.shape == (5, 3, 8) and ssm.shape == (5, 2, 4, 4)
    raw = pages.view(5, page)
    assert torch.equal(conv[2].reshape(-1).view(torch.int8), raw[2, :48].view(torch.bfloat16).view(torch.int8))
    assert torch.equal(ssm[4].view(torch.uint8).reshape(-1), raw[4, 48:48 + 128].view(torch.uint8))
    with pytest.raises(LayoutError, match="expected int8 pages"):
        state_views(torch.zeros(5, 1, 1, 10, dtype=torch.int8), g)
