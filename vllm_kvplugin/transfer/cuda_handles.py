"""What a :class:`~vllm_kvplugin.transfer.cuda.CudaTransfer` hands out and keeps per call:
staging buffers, prefetches on their way to the device, payload digests computed there, and store
tickets.  Each completes on CUDA events; who waits for them and on which thread is said per class.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from vllm_kvplugin.transfer.paced import DmaJob


@dataclass
class Staging:
    tensor: torch.Tensor  # uint8, flat
    busy: torch.cuda.Event | None = None  # completes when its last user is done
    last_use: int = 0
    held: bool = False  # by a prefetch, until its load or release
    pacing: DmaJob | None = None  # a store whose DMAs from it are not all issued yet


class Prefetch:
    """Host chunks already on their way to (or in) a device staging buffer: a later ``load``
    scatters rows of it without touching the link.  Holds the staging buffer until released.
    The copy goes in pieces (``pieces``: (first row, end row, event when they are in)), so a
    scatter of early rows need not wait for the last ones."""

    __slots__ = ("staging", "stage", "event", "nbytes", "rows", "pieces")

    def __init__(self, staging: Staging, stage: torch.Tensor, pieces: list[tuple[int, int, torch.cuda.Event]],
                 nbytes: int):
        self.staging = staging
        self.stage = stage
        self.pieces = pieces
        self.event = pieces[-1][2]  # all of it
        self.nbytes = nbytes
        self.rows = stage.shape[0]  # the leading objects it holds


_waiter_lock = threading.Lock()
_waiter: ThreadPoolExecutor | None = None
_waiter_pid = -1


def _wait_thread() -> ThreadPoolExecutor:
    """The thread that waits for device digests on behalf of ``when_done`` callers (one per
    process: a forked child makes its own)."""
    global _waiter, _waiter_pid
    with _waiter_lock:
        if _waiter is None or _waiter_pid != os.getpid():
            _waiter = ThreadPoolExecutor(1, thread_name_prefix="kvplugin-digest-wait")
            _waiter_pid = os.getpid()
        return _waiter


class DeviceDigests:
    """Payload digests of rows of device bytes, computed there (a
    :class:`~vllm_kvplugin.chunk.checksums.PendingChecksums`): ``segments`` is a page-locked
    ``[rows, segments]`` int64 tensor whose rows ``[a, b)`` hold their segments' xxh3 once
    ``event`` of ``(a, b, event)`` in ``marks`` completed (in row order; the last one's is
    :attr:`event`, all of them).  A row's digest is the xxh3 of its segments' values, combined
    on the host once, by :meth:`advance` as soon as its mark is in (a fetch's thread calls it
    while it polls for the copy's end, so the rows of earlier pieces are combined while the
    last ones land) or else by :meth:`result`."""

    __slots__ = ("segments", "marks", "event", "device", "_values")

    def __init__(self, segments: torch.Tensor, marks: list[tuple[int, int, torch.cuda.Event]], device: torch.device):
        if not marks or marks[0][0] != 0 or marks[-1][1] != segments.shape[0] or any(
                b != a2 for (_, b, _), (a2, _, _) in zip(marks, marks[1:])):
            raise ValueError(f"marks {[(a, b) for a, b, _ in marks]} do not cover rows [0, {segments.shape[0]}) in order")
        self.segments = segments
        self.marks = marks
        self.event = marks[-1][2]
        self.device = device
        self._values: list[int] = []  # the leading rows' digests combined so far

    def done(self) -> bool:
        """Whether :meth:`result` would not wait; also True when the device cannot be asked
        (its error is then :meth:`result`'s, raised where the verdict handles it: nothing from
        these digests is verified)."""
        try:
            return self.event.query()
        except Exception:
            return True

    def when_done(self, callback: Callable[[], None]) -> None:
        if self.done():
            callback()
            return

        def wait() -> None:
            try:
                with torch.cuda.device(self.device):
                    self.event.synchronize()  # releases the GIL
            except Exception:  # (result() raises it)
                pass
            callback()
        _wait_thread().submit(wait)

    def advance(self) -> None:
        """Combine the digests of the rows whose marks are in.  Never waits, never raises (a
        device error is :meth:`result`'s)."""
        try:
            for _, b, ev in self.marks:
                if b <= len(self._values):
                    continue
                if not ev.query():
                    return
                self._combine(b)
        except Exception:
            return

    def _combine(self, end: int) -> None:
        rows = self.segments[len(self._values):end].numpy().view("<u8")  # the segments' xxh3, little-endian u64
        self._values += [xxhash.xxh3_64_intdigest(row) for row in rows]  # = combine_segments(row)

    def result(self) -> list[int]:
        if len(self._values) < self.segments.shape[0]:
            self.event.synchronize()  # (each mark's event is before the last on one stream)
            self._combine(self.segments.shape[0])
        return list(self._values)


class StoreTicket:
    """Completes when the chunk bytes are in the host buffers: after ``events`` and, for a
    staged store, after its paced DMAs (``job``).  ``digests``: the staged rows' payload digests
    (their host buffers ``digested``), computed on the device."""

    __slots__ = ("events", "job", "nbytes", "path", "digests", "digested")

    def __init__(self, events: list[torch.cuda.Event], nbytes: int, path: str, job: DmaJob | None = None,
                 digests: DeviceDigests | None = None, digested: Sequence[torch.Tensor] = ()):
        self.events = events
        self.job = job
        self.nbytes = nbytes
        self.path = path
        self.digests = digests
        self.digested = list(digested)
