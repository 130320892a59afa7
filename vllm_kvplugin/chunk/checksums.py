"""Payload checksums of many chunks at once, on several host threads.

The chunks of one load or store are hashed in parallel: on the H200's host one
thread hashed a 16k-token load (2.4 GB) slower than the PCIe link moved it.
Same values as :func:`~vllm_kvplugin.chunk.format.payload_checksum`, in the
input order.

A payload of :data:`OP_MIN_BYTES` or more is hashed by the compiled CPU op
(``kvplugin::segment_digests``), one call that releases Python's GIL for the
whole payload.  The xxhash library's call per 256 KiB segment releases it too,
but takes it back between segments, so vLLM's thread waits for it each time it
lets go (``benchmarks/host_hash.py``: 16x slower small torch calls beside four
such threads on a 2-core machine).  On the H200's host, while fourteen of them
hashed a burst of hits, each of vLLM's fetch calls took ~8 ms for 1.3 ms of CPU.

Checksums still being computed -- here, or on a GPU (``transfer/cuda.py``'s
``DeviceDigests``) -- are :class:`PendingChecksums`; :func:`join_checksums` makes
one of several.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from vllm_kvplugin.chunk.format import SEGMENT_BYTES, combine_segments, payload_checksum

#: below this many bytes in all, one thread (a thread hop costs more than it saves)
PARALLEL_MIN_BYTES = 8 << 20
MAX_THREADS = 16  # a GPU host's cores hash while the link moves the same bytes
#: a payload of at least this many bytes is hashed by the compiled op, where it is built
OP_MIN_BYTES = 1 << 20

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1


def _executor() -> ThreadPoolExecutor:
    """One pool per process (a forked child makes its own)."""
    global _pool, _pool_pid
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            n = max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else (os.cpu_count() or 1)))
            _pool = ThreadPoolExecutor(n, thread_name_prefix="kvplugin-xxh3")
            _pool_pid = os.getpid()
        return _pool


_op: Callable | None = None
_op_known = False


def _segment_op() -> Callable | None:
    """``kvplugin::segment_digests`` when the compiled CPU kernel is loaded (looked up once)."""
    global _op, _op_known
    if not _op_known:
        with _lock:
            if not _op_known:
                try:
                    import torch

                    from vllm_kvplugin import ops
                    _op = torch.ops.kvplugin.segment_digests if ops.load().cpu == "C++ kernel" else None
                except Exception:  # no torch, or ops that do not load: the library hashes
                    _op = None
                _op_known = True
    return _op


def checksum(payload: memoryview) -> int:
    """``payload_checksum`` of one payload: by the compiled op (the GIL released throughout)
    for a large, writable, contiguous one, where the op is built; else by the xxhash library."""
    big = (isinstance(payload, memoryview) and payload.nbytes >= OP_MIN_BYTES and not payload.readonly
           and payload.c_contiguous)
    op = _segment_op() if big else None
    if op is None:
        return payload_checksum(payload)
    import torch
    rows = torch.frombuffer(payload.cast("B") if payload.ndim != 1 or payload.format != "B" else payload,
                            dtype=torch.uint8).view(1, -1)
    return combine_segments(op(rows, SEGMENT_BYTES)[0].tolist())


def payload_checksums(payloads: Sequence[memoryview]) -> list[int]:
    """``payload_checksum`` of each payload; several threads when they are large and many."""
    return start_payload_checksums(payloads).result()


class PendingChecksums(Protocol):
    """Checksums of payloads, in their order, still being computed."""

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting."""

    def when_done(self, callback: Callable[[], None]) -> None:
        """``callback()`` once :meth:`done` (now if it is; else on some other thread)."""

    def result(self) -> list[int]:
        """The checksums (waits for them)."""

    def advance(self) -> None:
        """Whatever of :meth:`result`'s own work can be done now, without waiting (called while
        the caller polls; :meth:`result` then has less left to do)."""


def _after_all(n: int, callback: Callable[[], None]) -> Callable[..., None]:
    """A function that calls ``callback()`` on its ``n``-th call (whatever it is given)."""
    left, lock = [n], threading.Lock()

    def one_done(*_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()
    return one_done


class JoinedChecksums:
    """Several pending checksums as one, in their order."""

    def __init__(self, parts: Sequence[PendingChecksums]):
        self._parts = list(parts)

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def when_done(self, callback: Callable[[], None]) -> None:
        if not self._parts:
            callback()
            return
        one_done = _after_all(len(self._parts), callback)
        for p in self._parts:
            p.when_done(one_done)

    def result(self) -> list[int]:
        return [c for p in self._parts for c in p.result()]

    def advance(self) -> None:
        for p in self._parts:
            p.advance()


def join_checksums(parts: Sequence[PendingChecksums]) -> PendingChecksums:
    """One pending result of several, in their order."""
    return parts[0] if len(parts) == 1 else JoinedChecksums(parts)


class StartedChecksums:
    """The checksums of payloads, started by :func:`start_payload_checksums` (a
    :class:`PendingChecksums`).  ``futures``: one per payload, None for one hashed by
    :meth:`result` on the asking thread (inputs too small for the threads); None instead of a
    list: every one so."""

    def __init__(self, payloads: Sequence[memoryview], futures: Sequence[Future | None] | None):
        self._payloads = list(payloads)
        self._futures = list(futures) if futures is not None else [None] * len(self._payloads)
        if len(self._futures) != len(self._payloads):
            raise ValueError(f"{len(self._futures)} futures for {len(self._payloads)} payloads")

    def _threaded(self) -> list[Future]:
        return [f for f in self._futures if f is not None]

    def done(self) -> bool:
        """Whether :meth:`result` would return without waiting for the hashing threads (inputs
        too small for them are hashed by ``result`` itself, on the calling thread)."""
        return all(f.done() for f in self._threaded())

    def when_done(self, callback: Callable[[], None]) -> None:
        """``callback()`` once every hash is in: now if they are, else on the hashing thread that
        finishes the last one."""
        threaded = self._threaded()
        if not threaded:
            callback()
            return
        one_done = _after_all(len(threaded), callback)
        for f in threaded:
            f.add_done_callback(one_done)

    def result(self) -> list[int]:
        """The checksums, in the payloads' order (waits for the hashing threads)."""
        return [f.result() if f is not None else checksum(p) for p, f in zip(self._payloads, self._futures)]

    def advance(self) -> None:
        """Nothing: the hashing threads do the work."""


def start_payload_checksums(payloads: Sequence[memoryview]) -> StartedChecksums:
    """:func:`payload_checksums`, started on the hashing threads now.  The caller works
    meanwhile and must not change the payloads before the result is in.  Small inputs are
    hashed when the result is asked for, on the asking thread."""
    if len(payloads) < 2 or sum(p.nbytes for p in payloads) < PARALLEL_MIN_BYTES:
        return StartedChecksums(payloads, None)
    return StartedChecksums(payloads, [_executor().submit(checksum, p) for p in payloads])


def _hash_then_copy(item: tuple[memoryview, memoryview, int | None]) -> int:
    src, dst, known = item
    if known is None:
        known = checksum(src)
    np.copyto(np.asarray(dst), np.asarray(src))  # numpy copies without the GIL
    return known


def hash_then_copy(srcs: Sequence[memoryview], dsts: Sequence[memoryview],
                   known: Sequence[int | None] | None = None) -> list[int]:
    """``payload_checksum`` of each source, each then copied into its destination (same size):
    the checksums vouch for the sources, whatever happens to the destinations meanwhile.
    ``known``: a source's checksum computed already (of the same bytes, on the device that made
    them), taken as it is (None: hashed here)."""
    if len(srcs) != len(dsts) or any(s.nbytes != d.nbytes for s, d in zip(srcs, dsts)):
        raise ValueError(f"hash_then_copy: source sizes {[s.nbytes for s in srcs]} "
                         f"!= destination sizes {[d.nbytes for d in dsts]}")
    known = list(known) if known is not None else [None] * len(srcs)
    if len(known) != len(srcs):
        raise ValueError(f"hash_then_copy: {len(known)} known checksums for {len(srcs)} sources")
    items = list(zip(srcs, dsts, known))
    if len(items) < 2 or sum(s.nbytes for s in srcs) < PARALLEL_MIN_BYTES:
        return [_hash_then_copy(i) for i in items]
    return list(_executor().map(_hash_then_copy, items))
