"""The remote tier inside the server's state machine: write-through, probe, promote, delete.

Mixed into :class:`~.store.Store`; only the server's main thread calls these (the
store itself is :mod:`.remote`).

* **Write-through.**  A committed object (``commit``: its header named it, so its
  model fingerprint is known) is queued for the store, pinned in L1 until the put is
  done; when the store is down, or the puts waiting already pin a quarter of L1
  (``QUEUED_SHARE``), it is skipped and counted -- L1 never fills with objects waiting
  for a slow store.  Only committed
  objects go out: what a client aborted or never committed (a failed step's stores)
  never reaches the store.
* **Lookups.**  When L1/L2 do not hold the whole prompt, one probe asks the store for the
  sizes of every missing object of the prompt at once (one pipeline; one per node on a
  cluster), under the lookup's fingerprint; the hit is then chosen again from what L1, L2
  and the store hold, the missing objects it needs are read into L1 blocks and verified
  (``PROMOTING`` until then, like L2 promotions), and the lease is made from what arrived
  within the lookup's time budget.
* **Corrupt values** (bad header, another object, size, checksum, another fingerprint) are
  deleted from the store and counted; an object a client reports corrupt is deleted there
  too.
"""

from __future__ import annotations

import logging

from vllm_kvplugin.chunk.rules import best_hit
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.l2 import Job
from vllm_kvplugin.server.objects import PROMOTING, READY, RESERVED, W_QUEUED, Obj
from vllm_kvplugin.server.pool import block_size_for
from vllm_kvplugin.server.protocol import KEY_SIZE, oid_suffix
from vllm_kvplugin.server.remote import (
    GET_BATCH_BYTES,
    DeleteJob,
    GetJob,
    ProbeJob,
    PutJob,
    RemoteStore,
    RemoteWorkers,
)

logger = logging.getLogger(__name__)

#: the share of L1 that objects waiting for their put may pin; past it new puts are skipped
QUEUED_SHARE = 0.25

REMOTE_COUNTERS = (
    "remote_puts", "remote_put_bytes", "remote_put_exists", "remote_put_too_large", "remote_put_full",
    "remote_put_errors", "remote_puts_skipped_down", "remote_puts_skipped_backlog", "remote_budget_evictions",
    "remote_probes", "remote_probe_errors", "remote_probes_skipped_down", "remote_probe_found_objects",
    "remote_gets_started", "remote_hit_objects", "remote_hit_bytes", "remote_get_failures",
    "remote_corrupt_objects", "remote_deletes", "remote_delete_errors", "remote_internal_errors",
)
#: a value that is there but is not the object it should be: deleted from the store
_CORRUPT = {"checksum", "header_mismatch", "short_read", "bad_magic", "version", "header_checksum",
            "foreign_fingerprint", "size_changed"}


class RemoteOps:
    """Uses the store's objects, LRU, allocator, pending lookups and stats."""

    remote: RemoteWorkers | None = None
    _remote_queued_bytes = 0

    def _start_remote(self, pool_view: memoryview, wake_fd: int) -> None:
        for name in REMOTE_COUNTERS:
            self.stats[name] = 0
        rc = self.cfg.remote
        if rc is None:
            return
        store = RemoteStore(rc)
        if store.ping():
            logger.info("remote store %s: connected", rc.url)
        else:
            logger.warning("remote store %s: not reachable at start; serving from L1/L2 until it is", rc.url)
        self.remote = RemoteWorkers(store, pool_view, 2, wake_fd)

    # ------------------------------------------------------------------ write-through
    def _remote_put(self, e: Obj) -> None:
        r = self.remote
        if r is None or not e.fp:
            return
        if not r.store.up:
            self.stats["remote_puts_skipped_down"] += 1
            return
        if self._remote_queued_bytes + e.nbytes > QUEUED_SHARE * self.alloc.capacity:
            self.stats["remote_puts_skipped_backlog"] += 1
            return
        self._remote_queued_bytes += e.nbytes
        e.pins += 1  # the writer reads its bytes: not evicted meanwhile
        self.lru.pop(e.oid, None)
        r.writes.put(PutJob(e.oid, e.fp, e.offset, e.nbytes, e))

    def _remote_delete(self, e: Obj) -> None:
        if self.remote is not None and e.fp:
            self.remote.writes.put(DeleteJob(e.oid, e.fp))

    # ------------------------------------------------------------------ lookups
    def _remote_probe(self, p, fingerprint: bytes, n: int) -> bool:
        """Ask the store about every object of chunks ``[p.first, n)`` that L1/L2 lack; True if asked."""
        r = self.remote
        if r is None or not fingerprint or p.deadline <= self.now:
            return False
        if not r.store.up:
            self.stats["remote_probes_skipped_down"] += 1
            return False
        get = self.objs.get
        sfx = [oid_suffix(g, rk, p.world) for g in range(len(p.needs)) for rk in range(p.ranks)]
        missing = []
        for pos in range(p.first, n):
            key = p.keys[pos * KEY_SIZE:(pos + 1) * KEY_SIZE]
            missing += [key + x for x in sfx if get(key + x) is None]
        if not missing:
            return False
        p.probing, p.fingerprint = True, fingerprint
        self.stats["remote_probes"] += 1
        r.reads.put(ProbeJob(fingerprint, missing, p))
        return True

    def _probe_done(self, job: ProbeJob) -> None:
        p = job.token
        p.probing = False
        if job.result != "ok":
            self.stats["remote_probe_errors"] += 1
            return
        if p not in self.pending:
            return  # answered already (its time ran out)
        found = {oid: size for oid, size in zip(job.oids, job.sizes) if size > HEADER_SIZE}
        self.stats["remote_probe_found_objects"] += len(found)
        if not found:
            return
        get, keys = self.objs.get, p.keys
        sfx = [[oid_suffix(g, r, p.world) for r in range(p.ranks)] for g in range(len(p.needs))]

        def usable(pos: int, g: int) -> bool:
            key = keys[pos * KEY_SIZE:(pos + 1) * KEY_SIZE]
            for x in sfx[g]:
                e = get(key + x)
                if e is None:
                    if key + x not in found:
                        return False
                elif e.state == RESERVED or e.doomed:
                    return False
            return True

        hit = best_hit(len(keys) // KEY_SIZE, p.first, p.needs, usable)
        if hit <= p.hit:
            return
        needed = [oid for oid in self._needed(keys, p.needs, p.first, hit, sfx) if oid not in p.pinned]
        for oid in needed:  # first pin what this server holds: making room below must not evict it
            e = get(oid)
            if e is not None:
                self._pin_for(p, e)
        for e in [p.pinned[oid] for oid in needed if oid in p.pinned]:
            if not self._promote_for(p, e):  # L2 only and no room: the hit ends before it
                break
        batch, batch_bytes = [], 0
        for oid in needed:
            if oid in p.pinned or oid not in found:
                continue
            size = found[oid]
            bsize = block_size_for(size)
            off = self._alloc(bsize) if bsize <= self.alloc.capacity else None
            if off is None:
                break  # no room: the hit ends before it
            e = Obj(oid, size, PROMOTING)  # only in the store: read into this L1 block
            e.block, e.bsize, e.fp = off, bsize, p.fingerprint
            self.objs[oid] = e
            p.waiting.add(oid)
            self._pin_for(p, e)
            batch.append((oid, e.offset, size, e))
            batch_bytes += size
            if batch_bytes >= GET_BATCH_BYTES:
                self._remote_get(p.fingerprint, batch)
                batch, batch_bytes = [], 0
        if batch:
            self._remote_get(p.fingerprint, batch)
        p.hit = hit  # _make_lease chooses again from what is READY when the lookup is answered

    def _remote_get(self, fingerprint: bytes, items: list) -> None:
        self.stats["remote_gets_started"] += len(items)
        self.remote.reads.put(GetJob(fingerprint, items))

    def _get_done(self, job: GetJob) -> None:
        errors = job.errors if job.result == "ok" else [job.result] * len(job.items)
        for (oid, _off, nbytes, e), err in zip(job.items, errors):
            if err is None and not e.doomed:
                e.state = READY
                self.committed_objects += 1
                self.committed_bytes += nbytes
                self.stats["remote_hit_objects"] += 1
                self.stats["remote_hit_bytes"] += nbytes
                if e.pins == 0:
                    self.lru[oid] = e
                if self.workers is not None:  # keep a copy in this machine's L2 too
                    e.wstate = W_QUEUED
                    self.workers.writes.put(Job("write", oid, e.offset, nbytes, e))
            else:
                self.stats["remote_get_failures"] += 1
                if err in _CORRUPT:
                    self.stats["remote_corrupt_objects"] += 1
                    logger.warning("remote object %s is not what its key names (%s): deleted", oid.hex(), err)
                    self.remote.writes.put(DeleteJob(oid, job.fingerprint))
                if not e.doomed:  # (a value merely gone is not deleted: another server may write it)
                    self._drop(e, "remote_failed")
                self._maybe_free(e)
            for p in self.pending:
                if oid in p.waiting:
                    p.waiting.discard(oid)
                    if err is None:
                        p.remote_promoted += 1

    # ------------------------------------------------------------------ completions
    def process_remote(self) -> None:
        if self.remote is None:
            return
        q = self.remote.done
        while True:
            try:
                job = q.get_nowait()
            except Exception:
                return
            try:
                if isinstance(job, PutJob):
                    self._put_done(job)
                elif isinstance(job, ProbeJob):
                    self._probe_done(job)
                elif isinstance(job, GetJob):
                    self._get_done(job)
                elif isinstance(job, DeleteJob):
                    self.stats["remote_deletes" if job.result == "ok" else "remote_delete_errors"] += 1
            except Exception:  # a bug here must not take the server down; its lookup times out
                logger.exception("remote tier: handling a finished %s failed", type(job).__name__)
                self.stats["remote_internal_errors"] += 1

    def _put_done(self, job: PutJob) -> None:
        e: Obj = job.token
        self._remote_queued_bytes -= job.nbytes
        self.stats["remote_budget_evictions"] += job.evicted
        if job.result == "ok":
            self.stats["remote_puts"] += 1
            self.stats["remote_put_bytes"] += job.nbytes
        elif job.result == "exists":
            self.stats["remote_put_exists"] += 1
        elif job.result == "too_large":
            self.stats["remote_put_too_large"] += 1
        elif job.result == "full":
            self.stats["remote_put_full"] += 1
        elif job.result == "down":
            self.stats["remote_puts_skipped_down"] += 1
        elif job.result == "corrupt":  # L1 bytes changed under their header: never serve them
            self.stats["l1_corrupt_objects"] += 1
            if not e.doomed:
                self._drop(e, "corrupt_l1")
        else:
            self.stats["remote_put_errors"] += 1
        self._unpin(e)

    def remote_snapshot(self) -> dict:
        r = self.remote
        return dict(remote_enabled=int(r is not None), remote_up=int(r is not None and r.store.connected),
                    remote_queued_puts=r.queued_puts if r else 0, remote_queued_bytes=self._remote_queued_bytes,
                    remote_failures=r.store.failures if r else 0,
                    remote_reconnects=r.store.reconnects if r else 0)
