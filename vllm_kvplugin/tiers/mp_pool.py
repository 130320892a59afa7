"""The server pools one client process maps (the client's side of the shared memory).

:class:`PoolMaps` holds the current server's pool and the pools of earlier server instances
that views still use.  Only :class:`~vllm_kvplugin.tiers.mp_client.MPClient` calls it, under
its lock: ``map`` when a ``hello`` names a pool, ``unmap_unused`` on every call after a
restart.  An old pool is unmapped only once nothing uses it: a live view of unmapped memory
would crash the process, a view of a kept one only writes into an orphaned pool.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable
from typing import Any

#: references to an old pool's mmap that :meth:`PoolMaps.unmap_unused` itself holds while it
#: checks (its entry list, the local variable, getrefcount's argument)
_MMAP_BASE_REFS = 3


class PoolFileError(Exception):
    """The pool a server named cannot be opened or is not what the server says."""


class PoolMaps:
    """The current pool (``mm``: an ``mmap``, or None before the first ``hello``) and earlier ones."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None
        self.path: str | None = None
        self._tensor = None  # the pool as a torch tensor, made once per mapping
        self._old: list[list] = []  # [mmap, tensor or None] of earlier servers' pools
        #: called with an old pool's tensor before that pool is unmapped (e.g. cudaHostUnregister)
        self.before_unmap: Callable[[Any], None] | None = None

    def is_current(self, path: str, size: int) -> bool:
        return self.mm is not None and self.path == path and len(self.mm) == size

    def map(self, path: str, size: int, populate: bool, trust: Callable[[str, os.stat_result], None]) -> None:
        """Map the pool at ``path`` (``trust(path, stat)`` vets the open file first: raises to
        refuse it); the previous pool becomes an old one.  PoolFileError when it cannot be used."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise PoolFileError(f"cannot map the server's pool {path}: {exc} "
                                "(the server must run on this machine, as this user)") from None
        try:
            st = os.fstat(fd)
            trust(path, st)
            if st.st_size < size:
                raise PoolFileError(f"pool {path} has {st.st_size} bytes, server says {size}")
            # page tables are per process and a first touch costs a fault per 4 KiB page:
            # with a prefaulted pool, fill them all now (cheap) instead of on each first copy
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            m = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self.mm is not None:
            self._old.append([self.mm, self._tensor])  # views of it may still be out there
        self.mm, self._tensor, self.path = m, None, path
        self.unmap_unused()

    def tensor(self):
        """The current pool as one 1-D ``torch.uint8`` tensor (no copy; the same tensor until the
        pool changes)."""
        import torch

        assert self.mm is not None
        if self._tensor is None:
            self._tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self._tensor

    @property
    def has_old(self) -> bool:
        return bool(self._old)

    @property
    def count(self) -> int:
        """Pools mapped: the current one and earlier ones still in use."""
        return len(self._old) + (self.mm is not None)

    def unmap_unused(self) -> None:
        """Unmap the pools of earlier server instances that nothing uses any more, so that
        restarts do not pile up dead pools in this process (each as big as ``--l1-bytes``).

        In use means: a memoryview of it exists (``mmap.close`` refuses), or a torch view of it
        (the tensor :meth:`tensor` made, still held by someone, or a slice of it).
        ``before_unmap(tensor)`` runs first."""
        keep = []
        for entry in self._old:
            if entry[1] is not None:
                if _torch_views_alive(entry):
                    keep.append(entry)
                    continue
                if self.before_unmap is not None:
                    self.before_unmap(entry[1])
                entry[1] = None  # the last reference: its storage goes, and with it its hold on the mmap
            m = entry[0]
            if sys.getrefcount(m) > _MMAP_BASE_REFS:  # a tensor's storage (or anything else) holds it
                keep.append(entry)
                continue
            try:
                m.close()
            except BufferError:
                keep.append(entry)
        self._old = keep


def _torch_views_alive(entry: list) -> bool:
    """Whether anything but ``entry`` still uses the storage of its tensor ``entry[1]`` (another
    Python reference to it, or a view/slice of it).  Unknown (no such counter in this torch):
    assume so."""
    import torch

    if sys.getrefcount(entry[1]) > 2:  # the entry, getrefcount's argument
        return True
    tensor = entry[1]
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return True
    storage = tensor.untyped_storage()
    return use_count(storage._cdata) > 2  # this tensor and the ``storage`` wrapper
