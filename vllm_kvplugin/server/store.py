"""The server's state machine: objects, sessions, leases, eviction, L2 index.

Only the server's main thread calls into :class:`Store` (the L2 threads talk
to it through :class:`~vllm_kvplugin.server.l2.L2Workers` queues).

Object states::

    reserve --> RESERVED (owner session; invisible) --commit, header names it--> READY
    RESERVED --abort--> freed;  --owner reaped / reserve timeout--> freed after quarantine
    READY --evicted, L2 on--> L2ONLY --lookup--> PROMOTING --read + checksum ok--> READY
    READY --evicted, L2 off--> gone;  PROMOTING --read or checksum fails--> gone (file deleted)

A READY object is evictable only while nothing pins it: a lease (lookup), a
pending lookup (promotion in flight) and the L2 writer (while it reads the
bytes) all pin.  Evictable objects sit in ``lru``; pinned ones do not.  An
object dropped while pinned (``doomed``) leaves the index at once and frees
its memory when the last pin goes.

Lookups, leases and resolves are in :mod:`.leases`.  An object a client found
corrupt is dropped from L1 and L2 at once (``drop``).
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, HeaderError, header_object_id, parse_header
from vllm_kvplugin.server.config import ServerConfig
from vllm_kvplugin.server.l2 import Job, L2Dir, L2Workers
from vllm_kvplugin.server.leases import Lease, LeaseOps, PendingLookup, RequestError
from vllm_kvplugin.server.objects import L2ONLY, PROMOTING, READY, RESERVED, W_NONE, W_QUEUED, Obj
from vllm_kvplugin.server.pool import Allocator, block_size_for
from vllm_kvplugin.server.protocol import (
    COMMIT_BAD_HEADER,
    COMMIT_NOT_RESERVED,
    COMMIT_OK,
    E_INVALID,
    OBJECT_ID_SIZE,
    RESERVE_EXISTS,
    RESERVE_NO_ROOM,
    split_object_id,
)
from vllm_kvplugin.server.remote_ops import RemoteOps

logger = logging.getLogger(__name__)

#: counters that always appear in ``stats`` (zero until they happen)
COUNTERS = (
    "lookups", "lookup_chunks", "lookup_hit_chunks", "lookup_hit_objects", "l1_hit_objects",
    "l2_hit_objects", "lookup_promotion_timeouts", "leases_created", "leases_released",
    "leases_expired", "lease_pinned_bytes", "lease_resolved_bytes", "leases_partially_served",
    "resolves", "lookup_resolves", "resolved_objects", "resolved_bytes", "resolve_not_leased", "reserved_objects",
    "reserve_exists", "reserve_no_room", "committed_objects", "committed_bytes", "commit_bad_header",
    "commit_not_reserved", "commit_fenced", "aborted_objects", "l1_evictions", "l1_evicted_bytes",
    "watermark_evictions", "l1_corrupt_objects", "clients_connected", "clients_reaped",
    "reservations_reclaimed", "reservations_timed_out", "l2_writes", "l2_write_bytes",
    "l2_write_errors", "l2_reads_started", "l2_promoted_objects", "l2_promoted_bytes",
    "l2_promote_failures", "l2_corrupt_files", "l2_evictions", "l2_reindexed_objects",
    "dropped_reported_corrupt", "clients_refused", "clients_unproven",
)


@dataclass(eq=False)
class Session:
    ident: bytes
    name: str
    pid: int
    last_seen: float
    reserved: set = field(default_factory=set)     # oids in RESERVED state owned by us
    leases: set = field(default_factory=set)       # lease ids we created
    authed: bool = False                           # may do more than hello (see server/auth.py)
    client_nonce: bytes = b""
    server_nonce: bytes = b""


class Store(LeaseOps, RemoteOps):
    def __init__(self, cfg: ServerConfig, pool_view: memoryview, wake_fd: int, instance: str = ""):
        self.cfg = cfg
        self.instance = instance  # the server's (a lookup that resolves names it)
        self.pool = pool_view
        self.alloc = Allocator(pool_view.nbytes)
        self.objs: dict[bytes, Obj] = {}
        self.lru: OrderedDict[bytes, Obj] = OrderedDict()      # evictable READY objects, oldest first
        self.sessions: dict[bytes, Session] = {}
        self.leases: dict[int, Lease] = {}
        # what ``tick`` expires, in deadline order, so that it touches only what is due: a
        # client holding a million reservations or leases must not slow every tick (entries of
        # what ended otherwise are dropped when they come due)
        self.lease_deadlines: list[tuple[float, int]] = []                     # heap (leases extend)
        self.reserve_deadlines: deque[tuple[float, bytes, Obj]] = deque()      # fixed reserve_s: FIFO
        self.pending: list[PendingLookup] = []
        self.quarantine: deque[tuple[float, int, int]] = deque()              # fixed quarantine_s: FIFO
        self.committed_bytes = 0
        self.committed_objects = 0
        self.epoch = 0  # the last reservation epoch handed out
        self.stats: dict[str, int] = defaultdict(int)
        for name in COUNTERS:
            self.stats[name] = 0
        self.now = 0.0  # the main loop's clock, set before each request
        self.l2: L2Dir | None = None
        self.workers: L2Workers | None = None
        self.l2_lru: OrderedDict[bytes, int] = OrderedDict()    # files, oldest first
        self.l2_used = 0
        if cfg.l2_dir:
            self.l2 = L2Dir(cfg.l2_dir)
            self.workers = L2Workers(self.l2, pool_view, cfg.l2_readers, wake_fd)
            self._reindex()
        self._start_remote(pool_view, wake_fd)

    # ------------------------------------------------------------------ L2 index
    def _reindex(self) -> None:
        assert self.l2 is not None
        found, bad = self.l2.scan()
        self.stats["l2_corrupt_files"] += bad
        for oid, size, _mtime in found:
            e = Obj(oid, size, L2ONLY)
            e.in_l2 = True
            self.objs[oid] = e
            self.l2_lru[oid] = size
            self.l2_used += size
        self.stats["l2_reindexed_objects"] = len(found)
        self._enforce_l2_budget()
        logger.info("L2 %s: %d objects, %d bytes re-indexed (%d bad files dropped)",
                    self.cfg.l2_dir, len(self.l2_lru), self.l2_used, bad)

    def _enforce_l2_budget(self) -> None:
        if self.l2 is None:
            return
        while self.l2_used > self.cfg.l2_bytes and self.l2_lru:
            victim = None
            for oid in self.l2_lru:
                e = self.objs.get(oid)
                # keep files being read, and those a lookup has pinned to promote
                if e is None or (e.state == READY or e.pins == 0) and e.state != PROMOTING:
                    victim = oid
                    break
            if victim is None:
                return
            self._drop_l2(victim)
            self.stats["l2_evictions"] += 1

    def _drop_l2(self, oid: bytes) -> None:
        size = self.l2_lru.pop(oid, None)
        if size is None:
            return
        self.l2_used -= size
        assert self.l2 is not None
        self.l2.delete(oid)
        e = self.objs.get(oid)
        if e is not None:
            e.in_l2 = False
            if e.state == L2ONLY:
                del self.objs[oid]

    # ------------------------------------------------------------------ L1 memory
    def _alloc(self, bsize: int) -> int | None:
        """A block of ``bsize`` bytes, evicting LRU objects if needed; None if none can be freed."""
        off = self.alloc.alloc(bsize)
        while off is None:
            if not self._evict_one():
                return None
            off = self.alloc.alloc(bsize)
        return off

    def _evict_one(self, wait_for_writer: bool = False) -> bool:
        """Evict the least recently used evictable object.  ``wait_for_writer``: skip objects
        the L2 writer has not written yet (background eviction leaves them to the writer;
        an allocation that finds no room writes them itself)."""
        victim = None
        for i, e in enumerate(self.lru.values()):
            if e.wstate == W_NONE or (e.wstate == W_QUEUED and not wait_for_writer):
                victim = e
                break
            if i >= 64:
                break
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _evict(self, e: Obj) -> None:
        """Take a READY, unpinned object out of L1 (into L2 first when L2 is on)."""
        self.lru.pop(e.oid, None)
        if self.workers is not None and e.wstate == W_QUEUED:
            with self.workers.claim_lock:
                claimed = e.wstate == W_QUEUED
                if claimed:
                    e.wstate = W_NONE
            if claimed:
                err = self.workers.write_now(Job("write", e.oid, e.offset, e.nbytes, e))
                self._write_done(e, err)
                if e.doomed or self.objs.get(e.oid) is not e:
                    return  # the write found it corrupt and dropped it
        self.stats["l1_evictions"] += 1
        self.stats["l1_evicted_bytes"] += e.nbytes
        self._uncommit(e)
        self.alloc.free(e.block, e.bsize)
        e.block, e.bsize = -1, 0
        if e.in_l2:
            e.state = L2ONLY
        else:
            del self.objs[e.oid]

    def _uncommit(self, e: Obj) -> None:
        if e.state == READY:
            self.committed_objects -= 1
            self.committed_bytes -= e.nbytes

    def _drop(self, e: Obj, reason: str) -> None:
        """Forget an object now (corrupt); its memory goes when the last pin does."""
        self.stats[f"dropped_{reason}"] += 1
        if self.objs.get(e.oid) is e:
            del self.objs[e.oid]
        self.lru.pop(e.oid, None)
        if e.in_l2:
            self._drop_l2(e.oid)
        self._uncommit(e)
        e.state = L2ONLY if e.block < 0 else e.state
        e.doomed = True
        self._maybe_free(e)

    def _maybe_free(self, e: Obj) -> None:
        if e.doomed and e.pins == 0 and e.wstate == W_NONE and e.block >= 0:
            self.alloc.free(e.block, e.bsize)
            e.block, e.bsize = -1, 0

    def _unpin(self, e: Obj) -> None:
        e.pins -= 1
        assert e.pins >= 0
        if e.pins == 0:
            if e.doomed:
                self._maybe_free(e)
            elif e.state == READY and self.objs.get(e.oid) is e:
                self.lru[e.oid] = e  # not in the LRU while pinned: this appends (most recent)

    def evict_to_watermark(self) -> None:
        cap = self.alloc.capacity
        if self.alloc.used <= self.cfg.high_watermark * cap:
            return
        target = self.cfg.low_watermark * cap
        while self.alloc.used > target and self._evict_one(wait_for_writer=True):
            self.stats["watermark_evictions"] += 1

    # ------------------------------------------------------------------ sessions
    def hello(self, ident: bytes, name: str, pid: int, now: float) -> Session:
        s = self.sessions.get(ident)
        if s is None:
            s = Session(ident, name, pid, now)
            self.sessions[ident] = s
            self.stats["clients_connected"] += 1
        s.last_seen = now
        return s

    def reap(self, s: Session, reason: str) -> None:
        if self.sessions.get(s.ident) is not s:
            return
        del self.sessions[s.ident]
        for p in [p for p in self.pending if p.session is s]:
            self._finish_pending(p)  # nobody to answer; its lease is released just below
        for lid in list(s.leases):
            self.release(lid)
        self._reclaim_reservations(s, list(s.reserved))
        self.stats[f"clients_{reason}"] += 1

    def _reclaim_reservations(self, s: Session, oids: list[bytes]) -> None:
        for oid in oids:
            s.reserved.discard(oid)
            e = self.objs.get(oid)
            if e is None or e.state != RESERVED or e.owner is not s:
                continue
            del self.objs[oid]
            # the writer may still be alive and writing: keep the memory out of use for a while
            self.quarantine.append((self.now + self.cfg.quarantine_s, e.block, e.bsize))
            e.block, e.bsize = -1, 0
            self.stats["reservations_reclaimed"] += 1

    # ------------------------------------------------------------------ L2 completions
    def process_l2(self) -> None:
        if self.workers is None:
            return
        q = self.workers.done
        while True:
            try:
                job = q.get_nowait()
            except Exception:
                return
            e: Obj = job.token
            if job.kind == "write":
                with self.workers.claim_lock:
                    e.wstate = W_NONE
                self._write_done(e, job.error)
            else:
                self._read_done(e, job.error)

    def _write_done(self, e: Obj, err: str | None) -> None:
        if err is None:
            self.stats["l2_writes"] += 1
            self.stats["l2_write_bytes"] += e.nbytes
            if not e.doomed and self.objs.get(e.oid) is e:
                e.in_l2 = True
                self.l2_lru[e.oid] = e.nbytes
                self.l2_used += e.nbytes
                self._enforce_l2_budget()
            elif self.l2 is not None:
                self.l2.delete(e.oid)
        elif err.startswith("os_error"):
            self.stats["l2_write_errors"] += 1
            logger.warning("L2 write of %s failed: %s", e.oid.hex(), err)
        else:  # the object in L1 is not what its header says: never serve it
            self.stats["l1_corrupt_objects"] += 1
            logger.warning("object %s in L1 failed verification (%s): dropped", e.oid.hex(), err)
            if not e.doomed:
                self._drop(e, "corrupt_l1")
        self._maybe_free(e)

    def _read_done(self, e: Obj, err: str | None) -> None:
        if err is None and not e.doomed:
            e.state = READY
            self.committed_objects += 1
            self.committed_bytes += e.nbytes
            self.stats["l2_promoted_objects"] += 1
            self.stats["l2_promoted_bytes"] += e.nbytes
            if e.oid in self.l2_lru:
                self.l2_lru.move_to_end(e.oid)
            if e.pins == 0:
                self.lru[e.oid] = e
        else:
            if err is not None:
                self.stats["l2_promote_failures"] += 1
                if err == "checksum" or err in ("header_mismatch", "short_read", "bad_magic",
                                                "version", "header_checksum"):
                    self.stats["l2_corrupt_files"] += 1
                logger.warning("L2 file of %s dropped: %s", e.oid.hex(), err)
            e.state = PROMOTING  # not READY: lookups waiting on it end their hit here
            if not e.doomed:
                self._drop(e, "l2_corrupt")
            self._maybe_free(e)
        for p in self.pending:
            if e.oid in p.waiting:
                p.waiting.discard(e.oid)
                if err is None:
                    p.promoted += 1

    # ------------------------------------------------------------------ stores
    def reserve(self, s: Session, ids: bytes, sizes: list[int], now: float) -> tuple[list[int], list[int]]:
        """Room for each object: (offsets or RESERVE_*, epochs).  Each reservation gets a fresh
        epoch that its commit must name: a writer that stalled past its reservation cannot
        commit into the one that replaced it, even from the same session."""
        if len(ids) % OBJECT_ID_SIZE or len(ids) // OBJECT_ID_SIZE != len(sizes):
            raise RequestError(E_INVALID, f"{len(ids)} id bytes for {len(sizes)} sizes")
        items = []
        for i, nbytes in enumerate(sizes):  # validate everything before reserving anything
            oid = ids[i * OBJECT_ID_SIZE:(i + 1) * OBJECT_ID_SIZE]
            _key, g, r, w = split_object_id(oid)
            bsize = block_size_for(nbytes)
            if not (r < w) or nbytes <= HEADER_SIZE or bsize > self.alloc.capacity:
                raise RequestError(E_INVALID, f"item {i}: bad object (group {g} rank {r} world {w}, "
                                              f"{nbytes} bytes; pool {self.alloc.capacity})")
            items.append((oid, nbytes, bsize))
        out, epochs = [], []
        for oid, nbytes, bsize in items:
            epochs.append(0)
            if oid in self.objs:
                self.stats["reserve_exists"] += 1
                out.append(RESERVE_EXISTS)
                continue
            off = self._alloc(bsize)
            if off is None:
                self.stats["reserve_no_room"] += 1
                out.append(RESERVE_NO_ROOM)
                continue
            e = Obj(oid, nbytes, RESERVED)
            e.block, e.bsize, e.owner, e.deadline = off, bsize, s, now + self.cfg.reserve_s
            self.reserve_deadlines.append((e.deadline, oid, e))
            self.epoch += 1
            e.epoch = epochs[-1] = self.epoch
            self.objs[oid] = e
            s.reserved.add(oid)
            self.stats["reserved_objects"] += 1
            out.append(e.offset)
        return out, epochs

    def commit(self, s: Session, ids: bytes, epochs: list[int]) -> list[int]:
        if len(ids) % OBJECT_ID_SIZE or len(ids) // OBJECT_ID_SIZE != len(epochs):
            raise RequestError(E_INVALID, f"{len(ids)} id bytes for {len(epochs)} epochs")
        out = []
        for n, i in enumerate(range(0, len(ids), OBJECT_ID_SIZE)):
            oid = ids[i:i + OBJECT_ID_SIZE]
            e = self.objs.get(oid)
            if e is None or e.state != RESERVED or e.owner is not s:
                self.stats["commit_not_reserved"] += 1
                out.append(COMMIT_NOT_RESERVED)
                continue
            if e.epoch != epochs[n]:  # a stale writer of an earlier reservation of this object
                self.stats["commit_fenced"] += 1
                out.append(COMMIT_NOT_RESERVED)
                continue
            s.reserved.discard(oid)
            try:
                h = parse_header(self.pool[e.offset:e.offset + HEADER_SIZE])
                ok = header_object_id(h) == oid and h.object_size == e.nbytes
                e.fp = h.fingerprint
            except (HeaderError, ValueError):
                ok = False
            if not ok:
                del self.objs[oid]
                self.alloc.free(e.block, e.bsize)
                self.stats["commit_bad_header"] += 1
                out.append(COMMIT_BAD_HEADER)
                continue
            e.state, e.owner = READY, None
            self.committed_objects += 1
            self.committed_bytes += e.nbytes
            self.stats["committed_objects"] += 1
            self.stats["committed_bytes"] += e.nbytes
            self.lru[oid] = e
            if self.workers is not None:
                e.wstate = W_QUEUED
                self.workers.writes.put(Job("write", oid, e.offset, e.nbytes, e))
            self._remote_put(e)
            out.append(COMMIT_OK)
        return out

    def abort(self, s: Session, ids: bytes) -> int:
        if len(ids) % OBJECT_ID_SIZE:
            raise RequestError(E_INVALID, f"id blob of {len(ids)} bytes is not a multiple of {OBJECT_ID_SIZE}")
        n = 0
        for i in range(0, len(ids), OBJECT_ID_SIZE):
            oid = ids[i:i + OBJECT_ID_SIZE]
            e = self.objs.get(oid)
            if e is None or e.state != RESERVED or e.owner is not s:
                continue
            s.reserved.discard(oid)
            del self.objs[oid]
            self.alloc.free(e.block, e.bsize)
            n += 1
        self.stats["aborted_objects"] += n
        return n

    # ------------------------------------------------------------------ housekeeping

    def tick(self, now: float) -> None:
        """Expire leases and reservations, reap silent clients, end quarantines, evict to the watermark."""
        self.now = now
        heap = self.lease_deadlines
        while heap and heap[0][0] < now:
            _, lid = heapq.heappop(heap)
            ls = self.leases.get(lid)
            if ls is not None and ls.deadline < now:  # (else released, or extended: a later entry)
                self.release(lid, expired=True)
        reap_before = now - self.cfg.reap_s
        for s in [s for s in self.sessions.values() if s.last_seen < reap_before]:
            logger.info("reaping client %r (pid %d): silent for %.1f s", s.name, s.pid, now - s.last_seen)
            self.reap(s, "reaped")
        late: dict[int, tuple[Session, list[bytes]]] = {}
        q = self.reserve_deadlines
        while q and q[0][0] < now:
            _, oid, e = q.popleft()
            s = e.owner
            if self.objs.get(oid) is e and e.state == RESERVED and s is not None and oid in s.reserved:
                late.setdefault(id(s), (s, []))[1].append(oid)
        for s, oids in late.values():
            self.stats["reservations_timed_out"] += len(oids)
            self._reclaim_reservations(s, oids)
        while self.quarantine and self.quarantine[0][0] <= now:
            _, off, size = self.quarantine.popleft()
            self.alloc.free(off, size)
        self.evict_to_watermark()

    def snapshot(self) -> dict:
        d: dict = dict(self.stats)
        d.update(
            objects=self.committed_objects,
            bytes=self.committed_bytes,
            indexed_objects=len(self.objs),
            reserved_now=sum(len(s.reserved) for s in self.sessions.values()),
            l1_capacity=self.alloc.capacity,
            l1_used=self.alloc.used,
            l1_free_extents=self.alloc.free_extents,
            l1_evictable_objects=len(self.lru),
            quarantined_bytes=sum(q[2] for q in self.quarantine),
            l2_enabled=int(self.l2 is not None),
            l2_objects=len(self.l2_lru),
            l2_bytes=self.l2_used,
            l2_capacity=self.cfg.l2_bytes if self.l2 is not None else 0,
            l2_write_queue=self.workers.writes.qsize() if self.workers else 0,
            leases=len(self.leases),
            leased_bytes=sum(ls.pinned_bytes for ls in self.leases.values()),
            pending_lookups=len(self.pending),
            clients=len(self.sessions),
        )
        d.update(self.remote_snapshot())
        return d
