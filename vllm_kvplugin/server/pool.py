"""L1: the shared-memory pool file and the allocator that places objects in it.

The pool is a file under ``/dev/shm`` (mode 0600, created exclusively, every
page allocated at start).  Clients map it read/write by path, after checking
that it is a pool of their user (``server/auth.py``).  Its server holds a lock
on it, so that a later server can sweep the pools of servers that died by
SIGKILL without touching live ones.

The allocator is best-fit over free extents kept sorted by (size, offset),
with coalescing of neighbours.  A model has few distinct object sizes, so a
freed block is usually reused exactly.  Blocks are multiples of
:data:`~vllm_kvplugin.server.protocol.PAYLOAD_ALIGN`; an object sits at
``block + PAYLOAD_ALIGN - HEADER_SIZE`` so that its payload is aligned.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import secrets
import stat

from vllm_kvplugin.server.auth import POOL_NAME
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.config import ServerConfigError
from vllm_kvplugin.server.protocol import PAYLOAD_ALIGN

logger = logging.getLogger(__name__)

OBJECT_SHIFT = PAYLOAD_ALIGN - HEADER_SIZE
assert OBJECT_SHIFT >= 0


def block_size_for(nbytes: int) -> int:
    """Bytes of pool a ``nbytes`` object occupies (alignment pad included)."""
    n = OBJECT_SHIFT + nbytes
    return (n + PAYLOAD_ALIGN - 1) // PAYLOAD_ALIGN * PAYLOAD_ALIGN


class Allocator:
    """Best-fit allocator of ``[0, capacity)``; offsets and sizes in bytes, multiples of PAYLOAD_ALIGN."""

    def __init__(self, capacity: int):
        capacity -= capacity % PAYLOAD_ALIGN
        self.capacity = capacity
        self.used = 0
        self._by_off: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._sorted: list[tuple[int, int]] = []
        if capacity > 0:
            self._add(0, capacity)

    def _add(self, off: int, size: int) -> None:
        self._by_off[off] = size
        self._by_end[off + size] = off
        bisect.insort(self._sorted, (size, off))

    def _remove(self, off: int, size: int) -> None:
        del self._by_off[off]
        del self._by_end[off + size]
        i = bisect.bisect_left(self._sorted, (size, off))
        assert self._sorted[i] == (size, off)
        del self._sorted[i]

    def alloc(self, size: int) -> int | None:
        if size <= 0 or size % PAYLOAD_ALIGN:
            raise ValueError(f"bad block size {size}")
        i = bisect.bisect_left(self._sorted, (size, -1))
        if i == len(self._sorted):
            return None
        fsize, off = self._sorted[i]
        self._remove(off, fsize)
        if fsize > size:
            self._add(off + size, fsize - size)
        self.used += size
        return off

    def free(self, off: int, size: int) -> None:
        self.used -= size
        prev = self._by_end.get(off)
        if prev is not None:
            psize = self._by_off[prev]
            self._remove(prev, psize)
            off, size = prev, size + psize
        nxt_size = self._by_off.get(off + size)
        if nxt_size is not None:
            self._remove(off + size, nxt_size)
            size += nxt_size
        self._add(off, size)

    def largest_free(self) -> int:
        return self._sorted[-1][0] if self._sorted else 0

    @property
    def free_extents(self) -> int:
        return len(self._sorted)


class SharedPool:
    """The pool file, created by the server and mapped by it.

    Every page is allocated at start (``posix_fallocate``): a pool that does not fit in its
    directory's free space is a start-up error here, never a SIGBUS in a vLLM worker later.
    The server holds an exclusive ``flock`` on the file while it lives: a later server sweeps
    a stale pool only when it can take that lock (a live server in another PID namespace
    sharing ``/dev/shm`` keeps its pool).  ``prefault`` also makes clients map it populated.
    """

    def __init__(self, shm_dir: str, size: int, prefault: bool = False, group: int | None = None):
        size -= size % PAYLOAD_ALIGN
        self.size = size
        sweep_stale_pools(shm_dir)
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
        if free < size:
            raise ServerConfigError(f"--l1-bytes {size}: {shm_dir} has only {free} bytes free (a smaller "
                                    "pool, or --shm-dir on a larger filesystem)")
        name = f"vllm-kvplugin-{os.getuid()}-{os.getpid()}-{secrets.token_hex(6)}.pool"
        self.path = os.path.join(shm_dir, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if group is not None:  # shared with the processes of a group (--allow-gid)
                os.fchown(fd, -1, group)
            os.fchmod(fd, 0o600 if group is None else 0o660)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise ServerConfigError(f"--l1-bytes {size}: cannot allocate the pool in {shm_dir} "
                                        f"({free} bytes free): {exc.strerror}") from None
            self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._lock_fd = fd  # held (with its flock) for the server's life
        self.view = memoryview(self.mmap)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self.view.release()
            self.mmap.close()
        except BufferError:  # a reader thread still holds a slice; the OS cleans up at exit
            pass
        os.close(self._lock_fd)


def sweep_stale_pools(shm_dir: str) -> int:
    """Remove pool files of this user whose server is gone (killed by SIGKILL): those whose
    ``flock`` nobody holds -- true across PID namespaces, unlike a pid check.  Only regular
    files this user owns are touched, and none is opened in a way that can block: anyone may
    create a file of a pool's name in /dev/shm (a FIFO there hung the start-up)."""
    n = 0
    uid = os.getuid()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        m = POOL_NAME.match(name)
        if not m or int(m.group(1)) != uid:
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                logger.warning("not removing %s: not a regular file of uid %d (mode %o, uid %d)",
                               path, uid, st.st_mode, st.st_uid)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live server holds it
        finally:
            os.close(fd)
        try:
            os.unlink(path)
            n += 1
            logger.info("removed the pool of a server that is gone: %s", name)
        except OSError:
            pass
    return n
