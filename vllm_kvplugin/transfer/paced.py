"""Store DMAs issued a few at a time, so that vLLM's own small copies never wait behind a store.

Why (measured on the H200, ``benchmarks/NOTES.md``, "Stores paced on the copy engine"): the copy
engine keeps serving a stream as long as that stream has work queued.  A store of 2.4 GB queued
at once held vLLM's copy of a step's sampled token (a few bytes, on a stream of its own) until
its last DMA was done, ~40 ms; with one piece queued at a time the copy waited one piece.

Who calls what:

* the transfer engine's ``store`` (vLLM's worker thread, in ``wait_for_save``) builds a
  :class:`DmaJob` of :class:`Piece` s and :meth:`PacedCopies.submit` s it;
* :meth:`PacedCopies.pump` (any thread, returns at once) issues pieces while fewer than
  ``window`` are on the copy engine: vLLM's thread calls it at every hook it passes (each
  attention layer while :meth:`PacedCopies.idle` is False, a step's start and end), the store
  finisher through :meth:`drain`;
* :meth:`PacedCopies.drain` (the finisher waiting for a ticket; the engine before it reuses a
  staging buffer) sleeps on the oldest piece's event and pumps until a job is fully issued;
  :meth:`PacedCopies.drain_all` does so for every job queued (a store that failed while issued).

Jobs are issued in submission order, on one stream, under one lock.  A piece that fails to issue
fails its job (``error``), and the queue goes on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Piece:
    """DMAs of chunk rows ``stage`` -> ``bufs``, issued after ``gathered`` and ``reads`` (pending
    loads' reads of those host buffers)."""

    gathered: torch.cuda.Event
    reads: list[torch.cuda.Event]
    stage: torch.Tensor
    bufs: list[torch.Tensor]


@dataclass(eq=False)
class DmaJob:
    """One staged store's pieces still to issue; ``event`` is recorded after its last one.
    ``staging``: the engine's buffer the pieces read (handed to ``on_issued``)."""

    staging: Any
    pieces: deque[Piece] = field(default_factory=deque)
    event: torch.cuda.Event | None = None
    error: BaseException | None = None


class PacedCopies:
    """The D2H stream's queue of store pieces (see the module doc).

    ``to_host(stage, bufs)`` issues one piece's DMAs on the current stream;
    ``on_issued(job)`` runs (under the lock) once a job's last piece is issued.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, window: int,
                 to_host: Callable[[torch.Tensor, list[torch.Tensor]], None],
                 on_issued: Callable[[DmaJob], None]):
        self.device = device
        self.stream = stream
        self.window = max(1, window)
        self._to_host = to_host
        self._on_issued = on_issued
        self._lock = threading.Lock()
        self._jobs: deque[DmaJob] = deque()
        self._out: deque[torch.cuda.Event] = deque()  # pieces on the copy engine, oldest first

    def submit(self, job: DmaJob) -> None:
        with self._lock:
            self._jobs.append(job)
        self.pump()

    def pump(self) -> None:
        """Issue queued pieces while fewer than ``window`` are on the copy engine; never waits
        for the device."""
        if not self._jobs:
            return
        with self._lock, torch.cuda.device(self.device):
            while self._out and self._out[0].query():
                self._out.popleft()
            while self._jobs and len(self._out) < self.window:
                job = self._jobs[0]
                piece = job.pieces.popleft()
                try:
                    self.stream.wait_event(piece.gathered)
                    for ev in piece.reads:
                        self.stream.wait_event(ev)
                    with torch.cuda.stream(self.stream):
                        self._to_host(piece.stage, piece.bufs)
                except Exception as e:  # the job fails (its ticket raises), the queue goes on
                    job.error = e
                    job.pieces.clear()
                ev = torch.cuda.Event(blocking=True)  # drain() sleeps on it rather than spin
                ev.record(self.stream)
                self._out.append(ev)
                if not job.pieces:
                    job.event = ev
                    self._jobs.popleft()
                    self._on_issued(job)

    def drain(self, job: DmaJob) -> None:
        """Until every piece of ``job`` is issued (sleeping on the oldest piece on the engine)."""
        while job.event is None:
            with self._lock:
                head = self._out[0] if self._out else None
            if head is not None:
                head.synchronize()
            self.pump()

    def drain_all(self) -> None:
        """Until every job submitted so far is fully issued (they go in order)."""
        with self._lock:
            last = self._jobs[-1] if self._jobs else None
        if last is not None:
            self.drain(last)

    def queued(self) -> int:
        """Pieces on the copy engine now (tests)."""
        return len(self._out)

    def idle(self) -> bool:
        """No job waits to be issued: :meth:`pump` would do nothing.  Read without the lock (any
        thread; jobs are submitted by vLLM's thread, the one that asks before each layer)."""
        return not self._jobs
