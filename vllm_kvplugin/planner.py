"""The load planner: one pure function decides what a cache hit loads.

Scheduler (how many tokens to claim), worker (what to copy) and metrics
(expected bytes) all use its :class:`LoadPlan`; a transfer that moves anything
other than the planned bytes fails the load.

Rules (DESIGN.md, correctness rules 5 and 6):

* only whole chunks, and only a prefix of them (chunk ``i`` needs chunks ``< i``);
* never the whole prompt: vLLM must compute at least one token, so the last
  prompt token is reserved *before* aligning to chunks.  For a recurrent group
  this also puts the restored state checkpoint strictly before the last prompt
  token (a prompt of exactly ``k`` chunks loads ``k - 1``);
* tokens vLLM already has (``num_computed_tokens``, its own prefix cache) are
  not loaded again; a chunk that straddles them is loaded from there on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvplugin.layout.descriptor import GroupKind


@dataclass(frozen=True)
class GroupCost:
    """What loading costs for one KV cache group."""

    kind: GroupKind
    bytes_per_token: int = 0  # attention / MLA: every loaded token
    state_bytes: int = 0  # recurrent: one state checkpoint at the end of the load


@dataclass(frozen=True)
class LoadPlan:
    """Tokens ``[start, end)`` come from the tier, as chunks ``[first_chunk, end_chunk)``."""

    start: int
    end: int
    chunk_size: int
    expected_bytes: tuple[int, ...]  # per group, for this rank

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def first_chunk(self) -> int:
        return self.start // self.chunk_size

    @property
    def end_chunk(self) -> int:
        return self.end // self.chunk_size

    def skip_tokens(self, chunk_index: int) -> int:
        """Tokens at the start of ``chunk_index`` that must not be written (already computed)."""
        return max(0, self.start - chunk_index * self.chunk_size)


def max_loadable_tokens(prompt_len: int, chunk_size: int) -> int:
    """Largest chunk-aligned prefix that still leaves the last prompt token to compute."""
    if prompt_len <= 0:
        return 0
    return ((prompt_len - 1) // chunk_size) * chunk_size


def plan_load(prompt_len: int, num_computed_tokens: int, hit_chunks: int, chunk_size: int,
              groups: Sequence[GroupCost]) -> LoadPlan | None:
    """The load for a request, or None when the tier adds nothing.

    ``hit_chunks``: how many leading full chunks (0, 1, ...) the tier holds for
    every group.  ``num_computed_tokens``: tokens vLLM already has.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    end = min(hit_chunks * chunk_size, max_loadable_tokens(prompt_len, chunk_size))
    start = max(0, num_computed_tokens)
    if end <= start:
        return None
    expected = []
    for g in groups:
        if g.kind is GroupKind.RECURRENT:
            expected.append(g.state_bytes)
        else:
            expected.append((end - start) * g.bytes_per_token)
    return LoadPlan(start=start, end=end, chunk_size=chunk_size, expected_bytes=tuple(expected))
