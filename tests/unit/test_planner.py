"""The load planner: whole chunks, never the whole prompt, recurrent checkpoints."""

from __future__ import annotations

import pytest

from vllm_kvplugin.layout.descriptor import GroupKind
from vllm_kvplugin.planner import GroupCost, max_loadable_tokens, plan_load

ATT = [GroupCost(GroupKind.ATTENTION, bytes_per_token=100)]
HYBRID = [GroupCost(GroupKind.ATTENTION, bytes_per_token=100), GroupCost(GroupKind.RECURRENT, state_bytes=5000)]


@pytest.mark.parametrize("prompt_len,expected", [
    (1, 0), (255, 0), (256, 0), (257, 256), (511, 256), (512, 256), (513, 512),
    (128 * 256, 127 * 256), (128 * 256 + 1, 128 * 256), (128 * 256 - 1, 127 * 256),
])
def test_last_token_reserved_before_aligning(prompt_len, expected):
    """A prompt of exactly k chunks loads k-1: the second seed's 128-chunk case."""
    assert max_loadable_tokens(prompt_len, 256) == expected
    plan = plan_load(prompt_len, 0, hit_chunks=10_000, chunk_size=256, groups=HYBRID)
    if expected == 0:
        assert plan is None
    else:
        assert plan.end == expected and plan.end < prompt_len
        assert plan.expected_bytes == (expected * 100, 5000)


def test_hits_limit_the_plan_and_local_hits_are_skipped():
    plan = plan_load(10_000, 0, hit_chunks=3, chunk_size=256, groups=ATT)
    assert (plan.start, plan.end, plan.first_chunk, plan.end_chunk) == (0, 768, 0, 3)
    plan = plan_load(10_000, 512, hit_chunks=3, chunk_size=256, groups=ATT)
    assert (plan.start, plan.end, plan.num_tokens) == (512, 768, 256)
    assert plan.expected_bytes == (256 * 100,)
    # a local hit that ends mid-chunk: that chunk is loaded from there on
    plan = plan_load(10_000, 300, hit_chunks=3, chunk_size=256, groups=ATT)
    assert plan.first_chunk == 1 and plan.skip_tokens(1) == 44 and plan.skip_tokens(2) == 0
    assert plan_load(10_000, 768, hit_chunks=3, chunk_size=256, groups=ATT) is None
    assert plan_load(10_000, 0, hit_chunks=0, chunk_size=256, groups=ATT) is None


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        plan_load(10, 0, 1, 0, ATT)
