"""A held-back hit's verdict, straight from the worker half to the scheduler half of one engine.

Why: with async scheduling (vLLM's default on GPUs) the engine schedules step N+1 before it hands
step N's output to the connector, so a verdict carried by the worker's metadata of step N reaches
the scheduler one step after the worker gave it: an idle engine runs an empty step (0.6-0.8 ms on
the H200, ``benchmarks/NOTES.md``), a busy one holds the hit a whole step longer.

When the engine has one rank and both halves live in one process (vLLM's single-GPU executor),
the worker posts its verdict into this engine's :class:`VerdictBox` instead, and the scheduler
takes what is there before it matches a request.  A verdict carries the local tier's slots whose
objects failed, so the scheduler drops them before it claims the hit: the request then stores
those chunks again (had the drop come a step after the claim, the index would still have held
the key when the request's stores were decided, and the chunk would never be stored again).

The store finisher posts what finished there too (slots stored or failed, keys acknowledged): a
store that ends while the engine is idle is otherwise heard of only with the next step's output,
so a prompt repeated then was held back a step or two while the scheduler still counted its
chunks as being stored.

Otherwise (several ranks, or the worker in a process of its own) all of it goes with the step's
metadata, where the scheduler counts the ranks.

The worker half of such an engine also attaches its ``fetch_now`` and ``load_now`` to the box:
with no request running, the scheduler half has the worker fetch and verify a hit during the
lookup itself and claims it in the same step (``SchedulerSide._fetch_here``); a claimed hit of
groups that restore a prefix is loaded as soon as vLLM has allocated its blocks
(``SchedulerSide._load_here``).

Who calls: the scheduler half opens its engine's box when it is made (:func:`open_box`); the
worker half looks for it when it gives a verdict (:func:`find_box`: the scheduler may be made
after the worker).  Boxes are found by vLLM's ``engine_id``; a verdict names its fetch's
``serial``, so one never applies to another fetch of the same request.  Thread-safe.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

Slot = tuple[int, int]  # (group, slot) of the local tier


@dataclass(frozen=True)
class Posted:
    """What :meth:`VerdictBox.take` hands the scheduler: verdicts as (request, fetch serial,
    good), local slots that failed verification (-> reason), and finished stores: slots stored
    and slots whose store failed (-> acknowledgements), keys acknowledged (-> count)."""

    verdicts: list[tuple[str, int, int]] = field(default_factory=list)
    bad: dict[Slot, str] = field(default_factory=dict)
    stored: dict[Slot, int] = field(default_factory=dict)
    store_failed: dict[Slot, int] = field(default_factory=dict)
    store_done: dict[bytes, int] = field(default_factory=dict)


_NOTHING = Posted()  # (never changed)


def _add(into: dict, counts: dict) -> None:
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n


class VerdictBox:
    """What the worker half posted and the scheduler half has not taken yet (see :class:`Posted`):
    the latest verdict per request; bad slots and store results accumulate until taken.  Also
    the worker half's entries for fetching a hit at once and loading a claimed one
    (:meth:`attach_worker`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted = Posted()
        self._fetcher: weakref.WeakMethod | None = None
        self._loader: weakref.WeakMethod | None = None

    def attach_worker(self, fetch_now: Callable[..., bool | None], load_now: Callable[..., None]) -> None:
        """The worker half's ``fetch_now`` and ``load_now`` (bound methods, held weakly): the
        scheduler half may call them on vLLM's thread, where both halves run, to fetch a hit in
        its own step and to load a claimed hit as soon as vLLM has allocated its blocks."""
        self._fetcher, self._loader = weakref.WeakMethod(fetch_now), weakref.WeakMethod(load_now)

    def fetcher(self) -> Callable[..., bool | None] | None:
        """The worker half's ``fetch_now``, if one attached and still lives."""
        return self._fetcher() if self._fetcher is not None else None

    def loader(self) -> Callable[..., None] | None:
        """The worker half's ``load_now``, if one attached and still lives."""
        return self._loader() if self._loader is not None else None

    def post(self, req_id: str, serial: int, good: int, bad: dict[Slot, str] | None = None) -> None:
        """A fetch's verdict; ``bad``: local slots whose objects failed verification -> the reason."""
        with self._lock:
            self._posted.verdicts.append((req_id, serial, good))
            for slot, why in (bad or {}).items():
                self._posted.bad.setdefault(slot, why)

    def post_stores(self, stored: dict[Slot, int], failed: dict[Slot, int], done: dict[bytes, int]) -> None:
        """Stores that finished (the finisher's results, each posted once)."""
        with self._lock:
            _add(self._posted.stored, stored)
            _add(self._posted.store_failed, failed)
            _add(self._posted.store_done, done)

    def pending(self) -> bool:
        """Something posted and not taken yet (read without the lock: a post racing this is seen
        by the next call)."""
        p = self._posted
        return bool(p.verdicts or p.bad or p.stored or p.store_failed or p.store_done)

    def take(self) -> Posted:
        """Everything posted since the last call; a request's later verdict replaces its earlier."""
        if not self.pending():
            return _NOTHING
        with self._lock:
            posted, self._posted = self._posted, Posted()
        latest = {rid: (rid, serial, good) for rid, serial, good in posted.verdicts}
        return Posted(list(latest.values()), posted.bad, posted.stored, posted.store_failed, posted.store_done)


_lock = threading.Lock()
_boxes: weakref.WeakValueDictionary[str, VerdictBox] = weakref.WeakValueDictionary()


def open_box(engine_id: str) -> VerdictBox:
    """The scheduler half's box for ``engine_id`` (it keeps the box alive)."""
    with _lock:
        box = VerdictBox()
        _boxes[engine_id] = box
        return box


def find_box(engine_id: str) -> VerdictBox | None:
    """The box of ``engine_id``'s scheduler half when it lives in this process."""
    with _lock:
        return _boxes.get(engine_id)
