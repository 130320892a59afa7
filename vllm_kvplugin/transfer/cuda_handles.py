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
    ``[rows, segments]`` int64 tensor that holds the segments' xxh3 once ``event`` completed."""

    __slots__ = ("segments", "event", "device")

    def __init__(self, segments: torch.Tensor, event: torch.cuda.Event, device: torch.device):
        self.segments = segments
        self.event = event
        self.device = device

    def done(self) -> bool:
        return self.event.query()

    def when_done(self, callback: Callable[[], None]) -> None:
        if self.done():
            callback()
            return

        def wait() -> None:
            with torch.cuda.device(self.device):
                self.event.synchronize()  # releases the GIL
            callback()
        _wait_thread().submit(wait)

    def result(self) -> list[int]:
        self.event.synchronize()
        rows = self.segments.numpy().view("<u8")  # the segments' xxh3 as little-endian u64
        return [xxhash.xxh3_64_intdigest(row) for row in rows]  # = combine_segments(row)


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
