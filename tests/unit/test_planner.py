"""The load planner: chunk-aligned hits, never the whole prompt, per-group needs."""

from __future__ import annotations

import pytest
import torch

from vllm_kvplugin.chunk.rules import GroupNeed, Need, best_hit
from vllm_kvplugin.layout.descriptor import GroupKind
from vllm_kvplugin.layout.groups import GroupSpec, StateTensor
from vllm_kvplugin.planner import max_loadable_tokens, plan_load

C = 256


def group(index: int, kind: GroupKind, block: int = 128, **kw) -> GroupSpec:
    layers = kw.pop("layers", 2)
    return GroupSpec(index, kind, kind.name, block, tuple(f"l{index}.{i}" for i in range(layers)),
                     num_kv_heads=2, head_size=8, dtype=torch.bfloat16, **kw)


ATT = [group(0, GroupKind.ATTENTION)]  # 2 layers x 2 (K, V) x 2 heads x 8 x 2 bytes = 128 B/token
STATE = (StateTensor(torch.bfloat16, (3, 16)), StateTensor(torch.float32, (2, 4, 4)))  # 96 + 128 bytes
HYBRID = [group(0, GroupKind.ATTENTION), group(1, GroupKind.RECURRENT, state=STATE)]


def everywhere(pos: int, g: int) -> bool:
    return True


@pytest.mark.parametrize("prompt_len,expected", [
    (1, 0), (255, 0), (256, 0), (257, 256), (511, 256), (512, 256), (513, 512),
    (128 * 256, 127 * 256), (128 * 256 + 1, 128 * 256), (128 * 256 - 1, 127 * 256),
])
def test_last_token_reserved_before_aligning(prompt_len, expected):
    """A prompt of exactly k chunks loads k-1: the second seed's 128-chunk case."""
    assert max_loadable_tokens(prompt_len, C) == expected
    plan = plan_load(prompt_len, 0, C, HYBRID, everywhere)
    if expected == 0:
        assert plan is None
    else:
        assert plan.end == expected and plan.end < prompt_len
        assert plan.expected_bytes == (expected * 128, 2 * (96 + 128))
        state = [o for o in plan.objects if o.group == 1]
        assert [(o.position, o.lo, o.hi) for o in state] == [(expected // C - 1, expected, expected)]


def test_present_chunks_limit_the_plan_and_local_hits_are_skipped():
    first3 = lambda pos, g: pos < 3  # noqa: E731
    plan = plan_load(10_000, 0, C, ATT, first3)
    assert (plan.start, plan.end) == (0, 768)
    assert [(o.position, o.lo, o.hi) for o in plan.objects] == [(0, 0, 256), (1, 256, 512), (2, 512, 768)]
    plan = plan_load(10_000, 512, C, ATT, first3)
    assert (plan.start, plan.end, plan.num_tokens, plan.expected_bytes) == (512, 768, 256, (256 * 128,))
    # a local hit that ends mid-chunk: that chunk is loaded from there on
    plan = plan_load(10_000, 300, C, ATT, first3)
    assert [(o.position, o.lo, o.hi) for o in plan.objects] == [(1, 300, 512), (2, 512, 768)]
    assert plan_load(10_000, 768, C, ATT, first3) is None
    assert plan_load(10_000, 0, C, ATT, lambda pos, g: False) is None
    assert plan_load(10_000, 0, C, ATT, everywhere, limit=2).end == 512


def test_a_gap_ends_a_prefix_hit():
    assert plan_load(10_000, 0, C, ATT, lambda pos, g: pos != 2).end == 512


def test_recurrent_hit_needs_the_checkpoint_at_the_hit():
    """Attention holds 6 chunks but the state was checkpointed only after chunks 1 and 3:
    the hit is 4 chunks (the largest with a checkpoint), loading attention chunks 0-3."""
    present = lambda pos, g: pos < 6 if g == 0 else pos in (1, 3)  # noqa: E731
    plan = plan_load(10_000, 0, C, HYBRID, present)
    assert plan.end == 4 * C
    assert [(o.position, o.group) for o in plan.objects] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1)]
    # vLLM already holds 2 chunks (its own prefix cache): still the checkpoint at 4, attention 2-3
    plan = plan_load(10_000, 2 * C, C, HYBRID, present)
    assert [(o.position, o.group) for o in plan.objects] == [(2, 0), (3, 0), (3, 1)]
    # ... and with 4 chunks held locally, nothing can be added
    assert plan_load(10_000, 4 * C, C, HYBRID, present) is None


def test_window_loads_only_the_tokens_in_the_window_before_the_hit():
    """Sliding window 300 (299 tokens before a token), blocks of 128: a tail of 384 tokens,
    two chunks' objects of which the older contributes its last 128 tokens."""
    win = group(0, GroupKind.WINDOW, window=299)
    assert win.window_tail == 384 and win.stored_tokens(C) == 256 and win.need(C) == GroupNeed(Need.WINDOW, 2)
    present = lambda pos, g: pos in (3, 4)  # noqa: E731  chunks 0-2 were never stored (or evicted)
    plan = plan_load(10_000, 0, C, [win], present)
    assert plan.end == 5 * C
    assert [(o.position, o.lo, o.hi) for o in plan.objects] == [(3, 5 * C - 384, 4 * C), (4, 4 * C, 5 * C)]
    assert plan.expected_bytes == (384 * 128,)
    small = group(0, GroupKind.WINDOW, window=63)  # a tail of one block: objects hold 128 tokens
    assert small.stored_tokens(C) == 128 and small.object_bytes(C) == 128 * 128
    plan = plan_load(10_000, 0, C, [small], lambda pos, g: pos == 7)
    assert [(o.position, o.lo, o.hi) for o in plan.objects] == [(7, 8 * C - 128, 8 * C)]


def test_best_hit_is_the_largest_every_group_restores():
    needs = [GroupNeed(Need.PREFIX), GroupNeed(Need.WINDOW, 2), GroupNeed(Need.POINT)]
    have = {0: set(range(10)), 1: {3, 4, 6, 7, 8}, 2: {4, 7, 9}}
    def hit(max_hit: int = 10, first: int = 0) -> int:
        return best_hit(max_hit, first, needs, lambda p, g: p in have[g])

    assert hit() == 8  # 10: window chunk 9 missing; 9: no checkpoint at chunk 8
    assert hit(first=8) == 0  # vLLM already holds 8 chunks
    have[1].discard(6)  # the window before 8 is broken: the next hit with both is 5
    assert hit() == 5 and hit(max_hit=4) == 0
    have[0].discard(2)  # a gap in the prefix caps everything at 2
    assert hit() == 0


def test_best_hit_equals_the_rule_checked_position_by_position_and_stays_linear():
    """Against every group's positions checked for every candidate hit (the rule as written),
    on random presence; and ``present`` asked at most once per position of a prefix or window
    group and once per candidate of a point group, however long the window (a whole window
    checked per candidate let one lookup hold the cache server for minutes)."""
    import random

    rnd = random.Random(5)
    for _ in range(400):
        n, first = rnd.randrange(1, 40), rnd.randrange(0, 6)
        needs = [rnd.choice([GroupNeed(Need.PREFIX), GroupNeed(Need.POINT),
                             GroupNeed(Need.WINDOW, rnd.choice([1, 2, 3, 7, 65535]))])
                 for _ in range(rnd.randrange(1, 4))]
        have = {(p, g) for p in range(n) for g in range(len(needs)) if rnd.random() < 0.85}
        want = next((h for h in range(n, first, -1)
                     if all((p, g) in have for g, need in enumerate(needs) for p in need.positions(h, first))), 0)
        asked = []
        got = best_hit(n, first, needs, lambda p, g, asked=asked, have=have: asked.append((p, g)) or (p, g) in have)
        assert got == want, (n, first, needs, sorted(have))
        assert len(asked) <= len(needs) * max(0, n - first), (len(asked), n, first, needs)

    window, n = [GroupNeed(Need.WINDOW, 65535), GroupNeed(Need.POINT)], 20_000
    asked = []
    assert best_hit(n, 0, window, lambda p, g: asked.append(p) or g == 0) == 0  # no checkpoint anywhere
    assert len(asked) == 2 * n


def test_bad_chunk_size():
    with pytest.raises(ValueError):
        plan_load(10, 0, 0, ATT, everywhere)


@pytest.mark.parametrize("groups", [ATT, HYBRID, [group(0, GroupKind.WINDOW, window=299)],
                                    [group(0, GroupKind.ATTENTION), group(1, GroupKind.WINDOW, window=299)]],
                         ids=["attention", "hybrid", "window", "attention+window"])
def test_a_plan_planned_again_from_its_own_objects_is_the_same(groups):
    """The scheduler claims a fetch whose every object was verified with the plan it fetched,
    without planning again (when vLLM's own hit is unchanged): planning from exactly the plan's
    objects must give that plan back, whatever was present around them."""
    import random

    rnd = random.Random(3)
    plans = 0
    for _ in range(300):
        prompt = rnd.randrange(1, 40 * C)
        computed = rnd.choice([0, 0, rnd.randrange(0, prompt)])
        have = {(p, g) for p in range(40) for g in range(len(groups)) if rnd.random() < 0.85}
        limit = rnd.choice([None, rnd.randrange(0, 40)])
        plan = plan_load(prompt, computed, C, groups, lambda pos, g, have=have: (pos, g) in have, limit)
        if plan is None:
            continue
        plans += 1
        own = {(o.position, o.group) for o in plan.objects}
        assert plan_load(prompt, computed, C, groups, lambda pos, g, own=own: (pos, g) in own, limit) == plan
    assert plans > 50
