"""The load planner: one pure function decides what a cache hit loads.

Scheduler (how many tokens to claim, which objects to fetch and verify), worker
(what to copy where) and metrics (expected bytes) all use its :class:`LoadPlan`;
a transfer that would move anything other than the planned bytes is refused.

Rules (DESIGN.md, correctness rules 5 and 6):

* a hit ends on a chunk boundary and never covers the whole prompt: vLLM must
  compute at least one token, so the last prompt token is reserved *before*
  aligning to chunks (a prompt of exactly ``k`` chunks hits at most ``k - 1``).
  For a recurrent group this puts the restored state checkpoint strictly before
  the last prompt token, so no token is ever applied to the state twice;
* what each group restores for a hit is its need (:mod:`vllm_kvplugin.chunk.rules`):
  every chunk from vLLM's own hit on (attention, MLA), the chunks inside the
  window before the hit (sliding window), the one checkpoint at the hit (recurrent);
  the hit is the largest that every group can restore from what is present;
* tokens vLLM already has (``num_computed_tokens``, its own prefix cache) are
  not loaded again; a chunk that straddles them is loaded from there on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from vllm_kvplugin.chunk.rules import best_hit
from vllm_kvplugin.layout.descriptor import GroupKind
from vllm_kvplugin.layout.groups import GroupSpec


class ObjectLoad(NamedTuple):
    """One object a plan loads: group ``group``'s object of chunk ``position``, whose tokens
    ``[lo, hi)`` are written (recurrent: ``lo == hi ==`` the hit; the state is written).
    (A named tuple: a 64k-token hit plans 256 of them on the lookup's path, at half a frozen
    dataclass's cost each.)"""

    position: int
    group: int
    lo: int
    hi: int


@dataclass(frozen=True)
class LoadPlan:
    """Tokens ``[start, end)`` come from a tier; ``objects`` say from which objects."""

    start: int
    end: int
    chunk_size: int
    objects: tuple[ObjectLoad, ...]  # ordered by (position, group)
    expected_bytes: tuple[int, ...]  # per group, for this rank

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def max_loadable_tokens(prompt_len: int, chunk_size: int) -> int:
    """Largest chunk-aligned prefix that still leaves the last prompt token to compute."""
    if prompt_len <= 0:
        return 0
    return ((prompt_len - 1) // chunk_size) * chunk_size


def plan_load(prompt_len: int, num_computed_tokens: int, chunk_size: int, groups: Sequence[GroupSpec],
              present: Callable[[int, int], bool], limit: int | None = None) -> LoadPlan | None:
    """The load for a request, or None when the tier adds nothing.

    ``present(position, group)``: the tier holds group ``group``'s object of chunk
    ``position``.  ``limit``: a hit may not end past this chunk (default: the prompt's).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    start = max(0, num_computed_tokens)
    max_hit = max_loadable_tokens(prompt_len, chunk_size) // chunk_size
    if limit is not None:
        max_hit = min(max_hit, limit)
    first = start // chunk_size
    hit = best_hit(max_hit, first, [g.need(chunk_size) for g in groups], present)
    if hit == 0:
        return None
    end = hit * chunk_size
    objects = []
    expected = [0] * len(groups)
    for g, spec in enumerate(groups):
        if spec.kind is GroupKind.RECURRENT:
            objects.append(ObjectLoad(hit - 1, g, end, end))
            expected[g] = spec.state_bytes
            continue
        lo_all = start if spec.kind is not GroupKind.WINDOW else max(start, end - spec.window_tail)
        tokens = 0
        for pos in spec.need(chunk_size).positions(hit, first):
            lo, hi = max(lo_all, pos * chunk_size), (pos + 1) * chunk_size
            if lo < hi:
                objects.append(ObjectLoad(pos, g, lo, hi))
                tokens += hi - lo
        expected[g] = tokens * spec.bytes_per_token
    if len(groups) > 1:  # one group's are in position order already
        objects.sort(key=lambda o: (o.position, o.group))
    return LoadPlan(start, end, chunk_size, tuple(objects), tuple(expected))
