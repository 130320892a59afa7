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
the key when the request's stores were decided, and the chunk would never be stored again).  Otherwise (several ranks, or the worker in a
process of its own) verdicts go with the step's metadata, where the scheduler counts the ranks.

Who calls: the scheduler half opens its engine's box when it is made (:func:`open_box`); the
worker half looks for it when it gives a verdict (:func:`find_box`: the scheduler may be made
after the worker).  Boxes are found by vLLM's ``engine_id``; a verdict names its fetch's
``serial``, so one never applies to another fetch of the same request.  Thread-safe.
"""

from __future__ import annotations

import threading
import weakref

Slot = tuple[int, int]  # (group, slot) of the local tier


class VerdictBox:
    """Verdicts posted by the worker half and not taken yet: request -> (fetch serial, leading
    objects verified), and the local slots found bad (each taken once, whatever replaced its
    verdict)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, tuple[int, int]] = {}
        self._bad: dict[Slot, str] = {}

    def post(self, req_id: str, serial: int, good: int, bad: dict[Slot, str] | None = None) -> None:
        """``bad``: local slots whose objects failed verification -> the reason."""
        with self._lock:
            self._items[req_id] = (serial, good)
            for slot, why in (bad or {}).items():
                self._bad.setdefault(slot, why)

    def take(self) -> tuple[list[tuple[str, int, int]], dict[Slot, str]]:
        """Every verdict posted since the last call, as (request, fetch serial, good), and the
        bad slots posted with them."""
        if not self._items:  # a dict's truth is read atomically; a post racing this is taken next time
            return [], {}
        with self._lock:
            items, self._items = self._items, {}
            bad, self._bad = self._bad, {}
        return [(rid, serial, good) for rid, (serial, good) in items.items()], bad


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
