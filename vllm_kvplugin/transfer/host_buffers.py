"""Private host buffers: where a server store's objects are gathered and hashed.

The cache server's pool is mapped writable by every engine on the node.  A header's checksum
must vouch for the bytes this engine computed, not for whatever that shared memory holds when
it is hashed: a writer that stalled past its reservation may still be copying into room the
server has since given to another writer.  So a worker gathers its server objects into a
buffer only its own process maps, hashes them there, and only then copies them into the pool
(:func:`vllm_kvplugin.chunk.checksums.hash_then_copy`); a byte changed in the pool after that
fails the checksum at the load and is recomputed.  (On a GPU that digests a store's bytes before
their DMA, the checksum already vouches for the computed bytes: those objects are copied straight
into the pool and never pass through here.)

The buffers are ranges of one slab allocated at start-up (page-locked on a GPU machine): page-
locking gigabytes takes about a second per gigabyte, which must never fall inside an engine
step.  A store whose objects do not all fit in the free room sends only the leading ones that do.

Who calls: the worker takes a buffer when it issues a store (vLLM's thread) and gives it back
when the store finished (the finisher thread); after a store that failed while being issued,
once the device has finished the copies issued before the failure.  Thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

import torch

#: slices handed out start at multiples of this (a dtype view of any slice is aligned)
ALIGN = 256
#: the default capacity's bounds: where every server object passes through (no device digests) ...
MIN_BYTES, MAX_BYTES = 1 << 30, 16 << 30
#: ... and where only the calls too small to be digested and recurrent states do
MIN_BYTES_DIGESTED = 64 << 20
#: steps' worth of objects in flight (the finisher may lag a few short steps behind)
STEPS_IN_FLIGHT = 4


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def default_capacity(step_bytes: Sequence[tuple[int, bool]], undigested_max: int | None) -> int:
    """The slab's size when ``server_staging_bytes`` is unset.  ``step_bytes``: per KV cache group,
    the bytes of the objects one full step stores and whether they are states (read on the host);
    ``undigested_max``: the largest store call the device does not digest (None: it digests none).
    A digested call goes straight into the server's pool, so per step at most ``undigested_max``
    of a token group passes through here, and every state."""
    digested = undigested_max is not None
    step = sum(min(n, undigested_max) if digested and not state else n for n, state in step_bytes)
    return min(MAX_BYTES, max(MIN_BYTES_DIGESTED if digested else MIN_BYTES, STEPS_IN_FLIGHT * step))


class HostBuffers:
    """Contiguous ranges of one flat ``uint8`` host slab of ``capacity`` bytes (page-locked when
    ``pin``: the GPU copies into them), first fit, freed ranges merged with their neighbours."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity = aligned(max(0, capacity))
        self.slab = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (offset, size)
        self._lock = threading.Lock()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def take_slices(self, sizes: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Slices of ``sizes`` bytes (each aligned) in one range, for the longest leading run of
        ``sizes`` that fits the largest free range (maybe none: ``([], None)``); give back the
        range (the second value)."""
        with self._lock:
            largest = max((n for _, n in self._free), default=0)
            k, need = 0, 0
            while k < len(sizes) and need + aligned(sizes[k]) <= largest:
                need += aligned(sizes[k])
                k += 1
            if k == 0:
                return [], None
            i = next(i for i, (_, n) in enumerate(self._free) if n >= need)
            off, n = self._free[i]
            if n == need:
                del self._free[i]
            else:
                self._free[i] = (off + need, n - need)
        buf = self.slab[off:off + need]
        slices, at = [], 0
        for n in sizes[:k]:
            slices.append(buf[at:at + n])
            at += aligned(n)
        return slices, buf

    def give(self, buf: torch.Tensor) -> None:
        """A range back (no copy into or out of it may still be in flight)."""
        off = buf.data_ptr() - self.slab.data_ptr()
        n = buf.numel()
        if not (0 <= off and off + n <= self.capacity and off % ALIGN == 0):
            raise ValueError(f"host buffer at offset {off} of {n} bytes is not a range of this slab "
                             f"({self.capacity} bytes)")
        with self._lock:
            i = bisect.bisect(self._free, (off, n))
            if (i > 0 and sum(self._free[i - 1]) > off) or (i < len(self._free) and off + n > self._free[i][0]):
                raise ValueError(f"host buffer at offset {off} of {n} bytes given back twice")
            if i < len(self._free) and off + n == self._free[i][0]:  # merge with the next
                n += self._free.pop(i)[1]
            if i > 0 and sum(self._free[i - 1]) == off:  # and with the previous
                off, n = self._free[i - 1][0], self._free[i - 1][1] + n
                i -= 1
                del self._free[i]
            self._free.insert(i, (off, n))
