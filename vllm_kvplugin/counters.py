"""Counters: readable in-process (:func:`vllm_kvplugin.stats`) and exported to vLLM.

Two counter sets, one per connector role, so that an engine running scheduler
and worker in one process never reports a counter twice:

* scheduler: ``lookup_requests``, ``lookup_tokens``, ``hit_tokens``
  (of which ``server_hit_tokens`` come from the cache server),
  ``planned_load_tokens``, ``planned_load_bytes``, ``evicted_bytes``,
  ``store_skipped_chunks``, ``server_lookup_errors``, ``fetch_timeouts`` (hits
  given up because the workers' verdict never came), ``dropped_objects`` (local
  tier objects that failed verification, dropped at once), ``lone_fetches`` and
  ``lone_fetch_wait_s`` (hits fetched and verified during their lookup, the engine
  running nothing else, and the seconds the lookups waited for them), ``split_fetches`` (of
  those, hits whose first chunks were read and sent before the rest were keyed),
  ``lone_server_lookups`` (lookups of such requests answered by the cache server on vLLM's
  thread instead of the index's), ``server_wakes`` (such lookups announced to the server
  before their keys were computed), ``tainted_requests`` (requests a step computed over a
  failed load's blocks under vLLM's ``recompute`` policy: truncated by vLLM, their chunks of
  that step not stored), and for the cache server
  the hit accounting against the transfer accounting: ``server_planned_bytes``
  (objects the plans read) vs ``server_served_bytes`` (what the server says
  the workers resolved), with ``server_bytes_mismatches`` counting leases
  where they differ;
* worker: ``loaded_tokens``, ``loaded_bytes``, ``stored_tokens``,
  ``stored_bytes``, ``load_seconds``, ``store_seconds``,
  ``server_store_errors``, ``server_store_skipped`` (server objects of a step that
  found no room in the worker's staging memory), ``server_store_direct`` (server objects the
  GPU copied straight into the server's pool, digested on the device), ``stores_cancelled``
  (objects not stored because a load of their step failed), ``early_claims`` (lone hits claimed
  before the device's verdict, ``scheduler_lone.CLAIM_BEFORE_VERDICT``) and ``load_failures`` (a dict: reason -> count; a hit whose
  verification failed before its claim counts here too).

Each connector hands vLLM the *delta* of its own set every step
(:meth:`Counters.take_delta`), which vLLM aggregates over ranks and feeds to
the log line and to Prometheus (:mod:`vllm_kvplugin.connector.metrics`).
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from typing import Any

SCHEDULER_FIELDS = (
    "lookup_requests", "lookup_tokens", "hit_tokens", "server_hit_tokens", "planned_load_tokens",
    "planned_load_bytes", "evicted_bytes", "store_skipped_chunks", "server_lookup_errors", "fetch_timeouts",
    "dropped_objects", "lone_fetches", "lone_fetch_wait_s", "split_fetches", "lone_server_lookups",
    "server_wakes", "tainted_requests", "server_planned_bytes", "server_served_bytes", "server_bytes_mismatches",
)
WORKER_FIELDS = (
    "loaded_tokens", "loaded_bytes", "stored_tokens", "stored_bytes",
    "load_seconds", "store_seconds", "server_store_errors", "server_store_skipped", "server_store_direct",
    "stores_cancelled", "early_claims",
)
FAILURES = "load_failures"


class Counters:
    """Thread-safe counters with a delta cursor."""

    def __init__(self, fields: tuple[str, ...], with_failures: bool):
        self._fields = fields
        self._with_failures = with_failures
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(fields, 0)
        self._failures: dict[str, int] = defaultdict(int)
        self._reported: dict[str, Any] = self._blank()
        self._touched: set[str] = set()  # fields added to since the last delta (taken every step)

    def _blank(self) -> dict[str, Any]:
        d: dict[str, Any] = dict.fromkeys(self._fields, 0)
        if self._with_failures:
            d[FAILURES] = {}
        return d

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v
            self._touched.update(deltas)

    def failure(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._failures[reason] += n
            self._touched.add(FAILURES)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = dict(self._values)
            if self._with_failures:
                d[FAILURES] = dict(self._failures)
            return d

    def take_delta(self) -> dict[str, Any]:
        """Counts since the previous call (what vLLM's stats pipeline sums up)."""
        with self._lock:
            touched, self._touched = self._touched, set()
            delta: dict[str, Any] = {}
            for k in touched - {FAILURES}:
                delta[k] = self._values[k] - self._reported[k]
                self._reported[k] = self._values[k]
            if FAILURES in touched and self._with_failures:
                f = dict(self._failures)
                prev = self._reported[FAILURES]
                delta[FAILURES] = {k: v - prev.get(k, 0) for k, v in f.items() if v != prev.get(k, 0)}
                self._reported[FAILURES] = f
            return {k: v for k, v in delta.items() if v}

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(self._fields, 0)
            self._failures = defaultdict(int)
            self._reported = self._blank()
            self._touched = set()


SCHEDULER = Counters(SCHEDULER_FIELDS, with_failures=False)
WORKER = Counters(WORKER_FIELDS, with_failures=True)


class _Merged:
    def snapshot(self) -> dict[str, Any]:
        out = SCHEDULER.snapshot()
        out.update(WORKER.snapshot())
        return out

    def reset(self) -> None:
        SCHEDULER.reset()
        WORKER.reset()


STATS = _Merged()


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum two delta dicts (used when vLLM aggregates over ranks and steps)."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict):
            sub = out.setdefault(k, {})
            for r, n in v.items():
                sub[r] = sub.get(r, 0) + n
        else:
            out[k] = out.get(k, 0) + v
    return out
