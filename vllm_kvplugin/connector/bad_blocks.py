"""vLLM blocks that do not hold what vLLM's prefix cache says they hold: those of a claimed load
that failed (its copy never wrote them), and every block a step computed over such a block.

Under vLLM's ``recompute`` policy a failed load's blocks stay in vLLM's prefix cache while the
request recomputes them; vLLM truncates only the requests whose computed tokens cover a block in
the step output that reports it.  A request that found those blocks in the prefix cache a step
later was served them (``test_a_failed_claimed_load_is_served_to_no_other_request``).  So the
connector reports every bad block as invalid in *every* step's output (the worker's
``get_block_ids_with_load_errors``) until a step has computed it again over clean blocks: any
request that reads one is then truncated to it and recomputes it, and its output of that step is
dropped.  A block is good again once a step writes it from its first token by a request none of
whose earlier blocks is bad, or loads it (a verified load of the plugin's).  A request whose
earlier blocks hold a bad one is *tainted* in that step: what it writes is bad too, and none of
its chunks is stored.

:class:`BadBlocks` is the scheduler half's record (one KV cache group: vLLM 0.26-0.29 cannot
take invalid blocks of several groups).  Who calls: ``SchedulerSide`` on vLLM's scheduler thread
-- :meth:`failed` when a worker reports a failed load, :meth:`step` from every
``build_connector_meta``.  Pure bookkeeping: no vLLM names, nothing waits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kvplugin.config import ConfigError

logger = logging.getLogger(__name__)


def tracked(policy: str, groups: Sequence[Any]) -> bool:
    """Whether bad blocks are kept and reported for a model of ``groups`` under vLLM's ``policy``
    (the scheduler half's :class:`BadBlocks`, a worker's own failed blocks until it does)."""
    return policy == "recompute" and len(groups) == 1


@dataclass(frozen=True)
class StepReport:
    """What one step's metadata carries: ``invalid`` goes into the step's output as vLLM's
    invalid blocks; ``tainted`` are the requests whose chunks this step must not store."""

    invalid: frozenset[int] = frozenset()
    tainted: frozenset[str] = frozenset()


class BadBlocks:
    """The bad blocks of one KV cache group of ``block_size`` tokens (see the module's docstring)."""

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.blocks: set[int] = set()

    @classmethod
    def for_policy(cls, policy: str, groups: Sequence[Any], async_scheduling: bool,
                   v2_model_runner: bool = False) -> BadBlocks | None:
        """The scheduler half's record under vLLM's ``policy`` for a model of ``groups`` (KV cache
        group specs), or None where there is nothing to report: ``fail`` (vLLM drops the blocks),
        or several groups (vLLM 0.26-0.29 take no block ids of several; a warning says that
        ``recompute`` then leaves them readable).  ``recompute`` is a start-up error where vLLM's
        own recompute is wrong: under its asynchronous scheduling it keeps a recomputed request's
        output placeholders (vLLM issue #45138; read in 0.26 and 0.32), and the request may never
        finish; its V2 model runner (``v2_model_runner``) lowers only the host's copy of a
        recomputed request's computed tokens, so the recompute reads its tokens and positions
        from the wrong offset (vLLM issue #49250; wrong outputs measured on an H100 with 0.26,
        the same code read in 0.32)."""
        if policy != "recompute":
            return None
        if async_scheduling:
            raise ConfigError(
                "vllm-kvplugin: load_failure_policy 'recompute' needs vLLM's synchronous scheduling "
                "(async_scheduling=False, --no-async-scheduling): under asynchronous scheduling vLLM "
                "keeps a recomputed request's output placeholders (vLLM issue #45138), and the "
                "request may never finish. Use 'fail' (the default) or turn asynchronous scheduling off.")
        if v2_model_runner:
            raise ConfigError(
                "vllm-kvplugin: load_failure_policy 'recompute' needs vLLM's V1 model runner "
                "(VLLM_USE_V2_MODEL_RUNNER=0): the V2 model runner recomputes a request whose load "
                "failed from stale token positions and gives wrong output (vLLM issue #49250). "
                "Use 'fail' (the default) or the V1 model runner.")
        if not tracked(policy, groups):
            logger.warning("vllm-kvplugin: load_failure_policy 'recompute' with %d KV cache groups: should a "
                           "copy fail after its hit was claimed, vLLM keeps the blocks it never wrote in its "
                           "prefix cache until the request has recomputed them, and a request sharing the "
                           "prefix can read them", len(groups))
            return None
        return cls(groups[0].block_size)

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def failed(self, blocks: Iterable[int], holders: Iterable[Sequence[int]]) -> None:
        """A claimed load failed over ``blocks`` (learned a step or two after the steps that may
        have read them).  ``holders``: the block ids of every request the scheduler tracks; one
        that holds a failed block also computed its later blocks over it, so they are bad too
        (vLLM truncates it to the first failed block and it recomputes them)."""
        failed = {b for b in blocks if b > 0}  # (0: vLLM's null block, never read)
        if not failed:
            return
        self.blocks |= failed
        for ids in holders:
            first = next((i for i, b in enumerate(ids) if b in failed), None)
            if first is not None:
                self.blocks.update(b for b in ids[first:] if b > 0)

    def step(self, scheduled: Mapping[str, tuple[Sequence[int], int, int]], loaded: Iterable[int] = ()) -> StepReport:
        """One step: ``scheduled`` maps each request of the step to (its block ids, tokens
        computed before the step, tokens the step computes); ``loaded``: blocks the step's
        verified loads write before its forward.  Returns what this step reports, then updates
        the record: blocks written by tainted requests become bad, blocks written from their
        first token by clean ones (and loaded ones) good."""
        if not self.blocks:
            return StepReport()
        self.blocks.difference_update(loaded)
        B = self.block_size
        tainted: set[str] = set()
        bad_written: set[int] = set()
        good_written: set[int] = set()
        for rid, (ids, start, n) in scheduled.items():
            if n <= 0:
                continue
            first, end = start // B, -(-(start + n) // B)
            if any(b in self.blocks for b in ids[:-(-start // B)]):
                tainted.add(rid)
                bad_written.update(b for b in ids[first:end] if b > 0)
            else:
                good_written.update(ids[k] for k in range(first, min(end, len(ids))) if k * B >= start)
        invalid = frozenset(self.blocks | bad_written)
        self.blocks = (self.blocks - good_written) | bad_written
        return StepReport(invalid, frozenset(tainted))
