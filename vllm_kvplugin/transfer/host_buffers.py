"""Private host buffers: where a server store's objects are gathered and hashed.

The cache server's pool is mapped writable by every engine on the node.  A header's checksum
must vouch for the bytes this engine computed, not for whatever that shared memory holds when
it is hashed: a writer that stalled past its reservation may still be copying into room the
server has since given to another writer.  So a worker gathers its server objects into a
buffer only its own process maps, hashes them there, and only then copies them into the pool
(:func:`vllm_kvplugin.chunk.checksums.hash_then_copy`); a byte changed in the pool after that
fails the checksum at the load and is recomputed.

Who calls: the worker takes a buffer when it issues a store (vLLM's thread) and gives it back
when the store finished (the finisher thread); after a store that failed while being issued it
is not given back (copies issued before the failure may still write it).  Thread-safe.
"""

from __future__ import annotations

import threading

import torch

#: slices handed out start at multiples of this (a dtype view of any slice is aligned)
ALIGN = 256
#: released buffers kept for reuse, at most this many bytes in all
KEEP_BYTES = 1 << 30


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostBuffers:
    """Reusable flat ``uint8`` host tensors (page-locked when ``pin``: the GPU copies into them).

    Sizes are rounded up to a power of two so that buffers of a similar store are reused; a
    released buffer is kept while the kept ones stay within ``keep_bytes``."""

    def __init__(self, pin: bool, keep_bytes: int = KEEP_BYTES):
        self.pin = pin
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes, owned by the caller until :meth:`give`."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # the smallest that fits (by index: tensors do not compare as list items)
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = 1 << max(20, (nbytes - 1).bit_length())
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def take_slices(self, sizes: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One buffer cut into slices of ``sizes`` bytes (each aligned); give back the buffer."""
        buf = self.take(sum(aligned(n) for n in sizes))
        slices, off = [], 0
        for n in sizes:
            slices.append(buf[off:off + n])
            off += aligned(n)
        return slices, buf

    def give(self, buf: torch.Tensor) -> None:
        """Back for reuse (no copy into or out of it may still be in flight)."""
        with self._lock:
            if sum(b.numel() for b in self._free) + buf.numel() <= self.keep_bytes:
                self._free.append(buf)
