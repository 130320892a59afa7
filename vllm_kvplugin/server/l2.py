"""L2: a directory of chunk files written behind L1 and read back on L1 misses.

A file holds one object exactly as it sits in L1: ``[chunk header | payload]``;
its name is the object id in hex (``ab/<44 hex>.kvc``, 256 sub-directories).
Files are written to a temporary name and renamed, so a server killed
mid-write leaves no file under a real name; the temporaries are removed at
start.  The directory is the server's own (a marker file says so): a non-empty
directory without the marker is refused, so the server never deletes or chmods
anything of the user's.  At start the directory is re-indexed from the headers: a file whose
header is unreadable or names another object or size is deleted and counted.
Payload checksums are verified when a file is promoted into L1 (and when an
object is written, before its file exists).

Threads: the server's main thread owns every index; :class:`L2Workers` runs
the file reads and writes and reports each finished job on a queue, waking
the main loop through a pipe.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass

from vllm_kvplugin.server.chunkhdr import (
    HEADER_SIZE,
    HeaderError,
    header_object_id,
    parse_header,
    payload_checksum,
)

logger = logging.getLogger(__name__)

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"


#: the file that makes a directory the server's own L2 (it touches no other directory)
MARKER = ".vllm-kvplugin-l2"
MARKER_TEXT = "vllm-kvplugin L2 directory, format 1: the cache server owns every file here\n"


class L2InUse(OSError):
    pass


class L2Foreign(OSError):
    """``--l2-dir`` names a directory with files that are not the server's."""


def _claim(root: str) -> None:
    """Create ``root`` as the server's, or accept it when it holds the marker; a non-empty
    directory without it is someone else's: refused, nothing in it touched."""
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise L2Foreign(f"--l2-dir {root} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"--l2-dir {root} belongs to uid {st.st_uid}, not to this user")
    marker = os.path.join(root, MARKER)
    if not os.path.lexists(marker):
        entries = sorted(os.listdir(root))
        if entries:
            raise L2Foreign(
                f"--l2-dir {root} holds files that are not the cache server's ({', '.join(entries[:3])}"
                f"{', ...' if len(entries) > 3 else ''}): give an empty or new directory (the server "
                f"marks its own with {MARKER} and touches nothing else)")
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, MARKER_TEXT.encode())
        finally:
            os.close(fd)
    elif not stat.S_ISREG(os.lstat(marker).st_mode):
        raise L2Foreign(f"--l2-dir {root}: {MARKER} is not a file")
    if stat.S_IMODE(st.st_mode) & 0o077:  # the server's own directory: private
        os.chmod(root, 0o700)


class L2Dir:
    def __init__(self, root: str):
        self.root = root
        _claim(root)
        # one server per directory: a second one would index and delete under the first
        self._lock_fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise L2InUse(f"--l2-dir {root} is in use by another server") from None

    def path(self, oid: bytes) -> str:
        h = oid.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    def scan(self) -> tuple[list[tuple[bytes, int, float]], int]:
        """Index the directory: ([(oid, size, mtime)] oldest first, number of bad files deleted)."""
        found: list[tuple[bytes, int, float]] = []
        bad = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                full = os.path.join(dirpath, name)
                if name.endswith(TMP_SUFFIX):
                    _unlink(full)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                try:
                    oid = bytes.fromhex(name[:-len(SUFFIX)])
                    with open(full, "rb") as f:
                        st = os.fstat(f.fileno())
                        h = parse_header(f.read(HEADER_SIZE))
                    if header_object_id(h) != oid:
                        raise HeaderError("header_mismatch", "file name and header name different objects")
                    if st.st_size != h.object_size:
                        raise HeaderError("short_read", f"file has {st.st_size} bytes, header says {h.object_size}")
                except (ValueError, OSError, HeaderError) as exc:
                    logger.warning("L2: dropping %s: %s", full, exc)
                    _unlink(full)
                    bad += 1
                    continue
                found.append((oid, st.st_size, st.st_mtime))
        found.sort(key=lambda t: t[2])
        return found, bad

    def write(self, oid: bytes, data: memoryview) -> None:
        final = self.path(oid)
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        tmp = f"{final}.{threading.get_ident()}{TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = data
            while view.nbytes:
                n = os.write(fd, view)
                view = view[n:]
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, final)

    def read_into(self, oid: bytes, dest: memoryview) -> None:
        """Read the whole file into ``dest`` (exactly its size); raises OSError/HeaderError."""
        fd = os.open(self.path(oid), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size != dest.nbytes:
                raise HeaderError("short_read", f"file has {size} bytes, expected {dest.nbytes}")
            got = 0
            while got < size:
                n = os.readv(fd, [dest[got:]])
                if n <= 0:
                    raise HeaderError("short_read", f"file ended at {got} of {size} bytes")
                got += n
        finally:
            os.close(fd)

    def delete(self, oid: bytes) -> None:
        _unlink(self.path(oid))

    def touch(self, oid: bytes) -> None:
        try:
            os.utime(self.path(oid))
        except OSError:
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("L2: cannot remove %s: %s", path, exc)


def verify_object(oid: bytes, data: memoryview) -> str | None:
    """None if ``data`` is a whole, intact chunk object named ``oid``; else the reason."""
    try:
        h = parse_header(data[:HEADER_SIZE])
    except HeaderError as exc:
        return exc.reason
    if header_object_id(h) != oid or h.object_size != data.nbytes:
        return "header_mismatch"
    if payload_checksum(data[HEADER_SIZE:]) != h.checksum:
        return "checksum"
    return None


@dataclass
class Job:
    kind: str            # "write" or "read"
    oid: bytes
    offset: int          # object offset in the pool
    nbytes: int
    token: object = None  # the main thread's handle (the object entry)
    error: str | None = None
    seconds: float = 0.0


class L2Workers:
    """One writer thread and ``readers`` reader threads; finished jobs go to ``done``."""

    def __init__(self, l2: L2Dir, pool_view: memoryview, readers: int, wake_fd: int):
        self.l2 = l2
        self.pool = pool_view
        self.wake_fd = wake_fd
        self.writes: queue.Queue[Job | None] = queue.Queue()
        self.reads: queue.Queue[Job | None] = queue.Queue()
        self.done: queue.Queue[Job] = queue.Queue()
        self.claim_lock = threading.Lock()  # guards Obj.wstate between the writer and the main thread
        self._threads = [threading.Thread(target=self._write_loop, name="l2-writer", daemon=True)]
        self._threads += [threading.Thread(target=self._read_loop, name=f"l2-reader-{i}", daemon=True)
                          for i in range(readers)]
        for t in self._threads:
            t.start()

    def _finish(self, job: Job) -> None:
        self.done.put(job)
        try:
            os.write(self.wake_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full: the main loop is awake anyway

    def _write_loop(self) -> None:
        while True:
            job = self.writes.get()
            if job is None:
                return
            entry = job.token
            with self.claim_lock:
                if entry.wstate != 1:  # QUEUED -> WRITING, unless the main thread took it back
                    continue
                entry.wstate = 2
            t0 = time.perf_counter()
            view = self.pool[job.offset:job.offset + job.nbytes]
            try:
                job.error = verify_object(job.oid, view)
                if job.error is None:
                    self.l2.write(job.oid, view)
            except OSError as exc:
                job.error = f"os_error: {exc}"
            finally:
                view.release()
            job.seconds = time.perf_counter() - t0
            self._finish(job)

    def _read_loop(self) -> None:
        while True:
            job = self.reads.get()
            if job is None:
                return
            t0 = time.perf_counter()
            view = self.pool[job.offset:job.offset + job.nbytes]
            try:
                self.l2.read_into(job.oid, view)
                job.error = verify_object(job.oid, view)
                if job.error is None:
                    self.l2.touch(job.oid)  # the file's mtime orders L2's LRU across restarts
            except HeaderError as exc:
                job.error = exc.reason
            except OSError as exc:
                job.error = f"os_error: {exc}"
            finally:
                view.release()
            job.seconds = time.perf_counter() - t0
            self._finish(job)

    def write_now(self, job: Job) -> str | None:
        """Write synchronously in the calling (main) thread; the reason on failure."""
        view = self.pool[job.offset:job.offset + job.nbytes]
        try:
            err = verify_object(job.oid, view)
            if err is None:
                self.l2.write(job.oid, view)
            return err
        except OSError as exc:
            return f"os_error: {exc}"
        finally:
            view.release()

    def stop(self, timeout: float) -> None:
        stop_threads(self._threads, self.writes, self.reads, timeout)


def stop_threads(threads: list[threading.Thread], writes: queue.Queue, reads: queue.Queue,
                 timeout: float) -> None:
    """End a writer (``threads[0]``, after what ``writes`` holds) and readers, waiting at most ``timeout``."""
    writes.put(None)
    for _ in threads[1:]:
        reads.put(None)
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
