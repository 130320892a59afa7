"""Completing stores away from the step that issued them.

A store's copies are issued right after its step's forward (``wait_for_save``); on a
GPU they cross the link for tens of milliseconds more.  Waiting for them and then
checksumming the bytes at the end of the step would hold the step's first token
(measured on the H200: +25% cold time to first token at 16k tokens), so a
:class:`StoreFinisher` does it on a daemon thread of the worker: it waits for the
copies, checksums the payloads, writes the local tier's headers, commits the server's
objects, and records what finished; the worker hands that to the scheduler with the
next step's metadata (:meth:`StoreFinisher.take`).

Until the scheduler has heard of every rank's stores of a key it treats the key as
"being stored": a repeated prompt waits a moment for them instead of missing
(``SchedulerSide.get_num_new_matched_tokens``), which also keeps an otherwise idle
engine stepping, so the acknowledgements arrive.

When the KV cache lives in host memory the copies are done when issued and the work
is cheap relative to a CPU forward: the finisher then runs inside ``submit``.

The thread holds the worker (its ``finish``): :meth:`StoreFinisher.close`, called when vLLM shuts
the connector down, ends it, so that an engine shut down frees its KV cache, tiers and staging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_kvplugin import counters

logger = logging.getLogger(__name__)

#: finish on the worker's own thread when the cache is in host memory (tests may flip it)
ASYNC_ON_HOST = False
#: how long :meth:`StoreFinisher.close` waits for the stores still in flight
CLOSE_WAIT_S = 10.0


@dataclass
class PendingStore:
    """The stores of one step: their copy tickets, local tier jobs, reserved server objects
    (gathered into ``sources``, slices of the worker's ``private`` buffer), and the key of every
    job (each acknowledged once, however it ends)."""

    tickets: list[Any]
    local: list[Any]
    remote: list[Any]
    keys: list[bytes]
    t0: float = field(default_factory=time.perf_counter)
    sources: list[Any] = field(default_factory=list)
    private: Any = None


class StoreFinisher:
    """Finishes :class:`PendingStore` entries in order; see the module docstring.

    ``finish(entry) -> (stored slots, failed slots)`` is the worker's own completion (checksums,
    headers, commit); it runs on the finisher thread, which owns the entries from ``submit`` on.
    """

    def __init__(self, engine: Any, finish, asynchronous: bool, on_done=None):
        self._engine = engine
        self._finish = finish
        self._on_done = on_done  # called after each store finished (on the finisher thread)
        self._async = asynchronous
        self._lock = threading.Lock()
        self._stored: dict[tuple[int, int], int] = {}
        self._failed: dict[tuple[int, int], int] = {}
        self._done: dict[bytes, int] = {}
        self._queue: queue.Queue[PendingStore | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, entry: PendingStore) -> None:
        if not self._async or self._closed:
            self._complete(entry)
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, daemon=True, name="kvplugin-store-finisher")
            self._thread.start()
        self._idle.clear()
        self._queue.put(entry)

    def acknowledge(self, keys: list[bytes]) -> None:
        """Jobs that ended without a store to finish (cancelled, failed when issued)."""
        with self._lock:
            for k in keys:
                self._done[k] = self._done.get(k, 0) + 1

    def take(self, meta: Any) -> None:
        """Move what finished into ``meta`` (the step's worker metadata); never waits."""
        with self._lock:
            stored, failed, done = self._stored, self._failed, self._done
            self._stored, self._failed, self._done = {}, {}, {}
        for slots, into in ((stored, meta.stored), (failed, meta.store_failed)):
            for s, n in slots.items():
                into[s] = into.get(s, 0) + n
        for k, n in done.items():
            meta.store_done[k] = meta.store_done.get(k, 0) + n

    def busy(self) -> bool:
        """Stores submitted and not finished yet."""
        return not self._idle.is_set()

    def has_results(self) -> bool:
        """Finished stores (or acknowledgements) that :meth:`take` has not moved yet."""
        with self._lock:
            return bool(self._stored or self._failed or self._done)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted store finished (tests, shutdown)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """End the thread once the stores submitted so far are finished (at most ``timeout``
        seconds each for the drain and the join; a store still in flight then finishes on the
        daemon thread or never); later stores finish inside :meth:`submit`.  Whether the
        thread ended.  Who calls: the worker's ``close``, at vLLM's connector shutdown."""
        self._closed = True
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        self.drain(timeout)
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                self._complete(entry)
            finally:
                if self._queue.empty():
                    self._idle.set()

    def _complete(self, entry: PendingStore) -> None:
        try:
            for t in entry.tickets:
                self._engine.wait(t)
            stored, failed = self._finish(entry)
        except Exception:
            logger.exception("vllm-kvplugin: finishing a store of %d objects failed", len(entry.keys))
            counters.WORKER.add(server_store_errors=int(bool(entry.remote)))
            stored, failed = [], [(j.group, j.slot) for j in entry.local]
        with self._lock:
            for s in stored:
                self._stored[s] = self._stored.get(s, 0) + 1
            for s in failed:
                self._failed[s] = self._failed.get(s, 0) + 1
            for k in entry.keys:
                self._done[k] = self._done.get(k, 0) + 1
        if self._on_done is not None:
            self._on_done()
