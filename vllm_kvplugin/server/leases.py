"""Lookups, leases and resolves: the read side of the server's :class:`~.store.Store`.

A lookup names a prompt's chunk keys and, per KV cache group, what a hit needs
(:mod:`vllm_kvplugin.chunk.rules`: a prefix of chunks, a window of chunks before
the hit, or one state checkpoint at the hit).  It answers the largest hit every
group can restore from objects of every rank, and pins exactly the objects that
hit needs under a lease; objects only in L2 are read back first (within the
lookup's time budget), and the hit is chosen again from what actually arrived.
A resolve returns only objects its lease pins; a lookup may answer one rank's
offsets itself (``resolve_rank``), as a resolve of each group's objects would.
The reported hit is a pure function of the request and the objects present: the
server never extends it past the keys sent and never counts a missing,
uncommitted or corrupt object.
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass, field

from vllm_kvplugin.chunk.rules import GroupNeed, Need, best_hit
from vllm_kvplugin.server.l2 import Job
from vllm_kvplugin.server.objects import L2ONLY, PROMOTING, READY, RESERVED
from vllm_kvplugin.server.pool import block_size_for
from vllm_kvplugin.server.protocol import (
    E_INVALID,
    E_NOT_LEASED,
    E_UNKNOWN_LEASE,
    KEY_SIZE,
    OBJECT_ID_SIZE,
    LookupRep,
    ReleaseRep,
    oid_suffix,
)

#: a lookup names at most this many objects per chunk position (groups x ranks) ...
MAX_OBJECTS_PER_POSITION = 4096
#: ... and at most this many in all
MAX_LOOKUP_OBJECTS = 1 << 23


class RequestError(Exception):
    """An error reply: ``code`` is one of the protocol's E_* codes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Lease:
    lid: int
    owner: object                      # the Session that looked up
    world: int
    ranks: int
    pinned: dict                       # oid -> Obj, each pinned once by this lease
    deadline: float
    pinned_bytes: int = 0
    resolved_objects: int = 0
    resolved_bytes: int = 0


@dataclass(eq=False)
class PendingLookup:
    """A lookup waiting for L2 -> L1 promotions (or its time budget)."""

    ident: bytes
    req_id: int
    reply_frames: list
    session: object
    keys: bytes
    needs: list
    first: int
    ranks: int
    world: int
    hit: int                           # the hit chosen before the promotions
    pinned: dict                       # oid -> Obj, each pinned once
    deadline: float
    waiting: set = field(default_factory=set)  # oids still PROMOTING
    promoted: int = 0
    probing: bool = False              # the remote store's answer is on its way
    fingerprint: bytes = b""           # the remote namespace asked
    remote_promoted: int = 0
    resolve_rank: int = -1             # >= 0: the reply resolves this rank's objects


def parse_needs(raw: list) -> list[GroupNeed]:
    try:
        return [GroupNeed(Need(int(n)), int(w)) for n, w in raw]
    except (TypeError, ValueError) as exc:
        raise RequestError(E_INVALID, f"bad group needs {raw!r}: {exc}") from None


class LeaseOps:
    """Mixed into :class:`~.store.Store` (uses its objects, LRU, allocator, L2 workers)."""

    # ------------------------------------------------------------------ lookups
    def lookup(self, s, keys: bytes, needs: list[GroupNeed], ranks: int, world: int, first: int,
               wait_s: float, ident: bytes, req_id: int, reply_frames: list, now: float,
               fingerprint: bytes = b"", resolve_rank: int = -1):
        if len(keys) % KEY_SIZE:
            raise RequestError(E_INVALID, f"keys blob of {len(keys)} bytes is not a multiple of {KEY_SIZE}")
        if ranks > world:
            raise RequestError(E_INVALID, f"ranks {ranks} > world {world}")
        if resolve_rank >= ranks:
            raise RequestError(E_INVALID, f"resolve_rank {resolve_rank} is not one of the {ranks} ranks looked up")
        n = len(keys) // KEY_SIZE
        per = len(needs) * ranks
        if not needs or per > MAX_OBJECTS_PER_POSITION or per * n > MAX_LOOKUP_OBJECTS:
            raise RequestError(E_INVALID, f"lookup of {n} chunks x {len(needs)} groups x {ranks} ranks "
                                          f"exceeds the limits ({MAX_OBJECTS_PER_POSITION} objects per "
                                          f"chunk, {MAX_LOOKUP_OBJECTS} per lookup)")
        self.stats["lookups"] += 1
        self.stats["lookup_chunks"] += n
        sfx = [[oid_suffix(g, r, world) for r in range(ranks)] for g in range(len(needs))]
        get = self.objs.get

        def usable(pos: int, g: int) -> bool:
            key = keys[pos * KEY_SIZE:(pos + 1) * KEY_SIZE]
            for x in sfx[g]:
                e = get(key + x)
                if e is None or e.state == RESERVED or e.doomed:
                    return False
            return True

        hit = best_hit(n, first, needs, usable)
        p = PendingLookup(ident, req_id, reply_frames, s, keys, needs, first, ranks, world, hit, {},
                          now + wait_s, resolve_rank=resolve_rank)
        for oid in self._needed(keys, needs, first, hit, sfx) if hit else ():
            self._pin_for(p, get(oid))
        for e in p.pinned.values():  # bring L2-only objects back; without room they stay out of the hit
            if not self._promote_for(p, e):
                break
        if hit < n:  # the rest of the prompt may be in the remote store
            self._remote_probe(p, fingerprint, n)
        if not p.waiting and not p.probing:
            return self._make_lease(p, now)
        self.pending.append(p)
        return p

    def _pin_for(self, p: PendingLookup, e) -> None:
        """Pin ``e`` for lookup ``p`` (out of the LRU while pinned), once however often its key
        repeats in the lookup: the lease unpins each object it holds once."""
        if e.oid in p.pinned:
            return
        e.pins += 1
        if e.pins == 1:
            self.lru.pop(e.oid, None)
        p.pinned[e.oid] = e

    def _promote_for(self, p: PendingLookup, e) -> bool:
        """Start reading ``e`` back from L2 for ``p`` if it is only there; False if L1 has no room.
        One already on its way into L1 (another lookup's promotion, a remote get) is waited for
        too: otherwise ``p`` would end its hit before it at once."""
        if e.state == PROMOTING:
            p.waiting.add(e.oid)
            return True
        if e.state != L2ONLY:
            return True
        bsize = block_size_for(e.nbytes)
        off = self._alloc(bsize)
        if off is None:
            return False
        e.block, e.bsize, e.state = off, bsize, PROMOTING
        p.waiting.add(e.oid)
        self.workers.reads.put(Job("read", e.oid, e.offset, e.nbytes, e))
        self.stats["l2_reads_started"] += 1
        return True

    @staticmethod
    def _needed(keys: bytes, needs: list[GroupNeed], first: int, hit: int, sfx: list) -> list[bytes]:
        out = []
        for g, need in enumerate(needs):
            for pos in need.positions(hit, first):
                key = keys[pos * KEY_SIZE:(pos + 1) * KEY_SIZE]
                out += [key + x for x in sfx[g]]
        return out

    def _make_lease(self, p: PendingLookup, now: float) -> LookupRep:
        """Choose the hit again from the pinned objects that are READY; lease those it needs."""
        ready = {oid for oid, e in p.pinned.items() if e.state == READY and not e.doomed}
        promoting = len(p.waiting) + int(p.probing)
        sfx = [[oid_suffix(g, r, p.world) for r in range(p.ranks)] for g in range(len(p.needs))]
        keys = p.keys

        def present(pos: int, g: int) -> bool:
            key = keys[pos * KEY_SIZE:(pos + 1) * KEY_SIZE]
            return all(key + x in ready for x in sfx[g])

        hit = best_hit(p.hit, p.first, p.needs, present)
        keep = set(self._needed(keys, p.needs, p.first, hit, sfx)) if hit else set()
        for oid, e in list(p.pinned.items()):
            if oid not in keep:
                del p.pinned[oid]
                self._unpin(e)
        self.stats["lookup_hit_chunks"] += hit
        if hit == 0:
            return LookupRep(0, 0, 0, p.promoted, promoting=promoting)
        lid = secrets.randbits(63) or 1
        while lid in self.leases:
            lid = secrets.randbits(63) or 1
        nbytes = sum(e.nbytes for e in p.pinned.values())
        self.leases[lid] = Lease(lid, p.session, p.world, p.ranks, p.pinned, now + self.cfg.lease_s, nbytes)
        heapq.heappush(self.lease_deadlines, (now + self.cfg.lease_s, lid))
        p.session.leases.add(lid)
        self.stats["leases_created"] += 1
        self.stats["lookup_hit_objects"] += len(p.pinned)
        l2_hits = min(p.promoted, len(p.pinned))
        self.stats["l2_hit_objects"] += l2_hits
        self.stats["l1_hit_objects"] += max(0, len(p.pinned) - l2_hits - p.remote_promoted)
        if p.resolve_rank < 0:
            return LookupRep(hit, lid, nbytes, p.promoted, promoting=promoting)
        mine = [[row[p.resolve_rank]] for row in sfx]  # each group's suffix, of that rank alone
        offsets, sizes = self._resolved(self.leases[lid], self._needed(keys, p.needs, p.first, hit, mine))
        self.stats["lookup_resolves"] += 1
        return LookupRep(hit, lid, nbytes, p.promoted, offsets, sizes, self.instance, promoting)

    def _finish_pending(self, p: PendingLookup) -> LookupRep:
        self.pending.remove(p)
        if p.waiting:
            self.stats["lookup_promotion_timeouts"] += 1
        return self._make_lease(p, self.now)

    def poll_pending(self, now: float) -> list[tuple[PendingLookup, LookupRep]]:
        done = []
        for p in list(self.pending):
            if not (p.waiting or p.probing) or now >= p.deadline or p.session.ident not in self.sessions:
                done.append((p, self._finish_pending(p)))
        return done

    # ------------------------------------------------------------------ resolve / release
    def resolve(self, lid: int, keys: bytes, group: int, rank: int, world: int,
                now: float) -> tuple[list[int], list[int]]:
        lease = self.leases.get(lid)
        if lease is None:
            raise RequestError(E_UNKNOWN_LEASE, f"lease {lid} is unknown (released, expired, or "
                                                "from an earlier server)")
        if len(keys) % KEY_SIZE:
            raise RequestError(E_INVALID, f"keys blob of {len(keys)} bytes is not a multiple of {KEY_SIZE}")
        sfx = oid_suffix(group, rank, world)
        oids = []
        for i in range(0, len(keys), KEY_SIZE):
            oid = keys[i:i + KEY_SIZE] + sfx
            if oid not in lease.pinned:
                self.stats["resolve_not_leased"] += 1
                raise RequestError(E_NOT_LEASED, f"key #{i // KEY_SIZE} ({keys[i:i + KEY_SIZE].hex()}) of "
                                                 f"group {group} rank {rank}/{world} is not pinned by lease {lid}")
            oids.append(oid)
        lease.deadline = now + self.cfg.lease_s
        heapq.heappush(self.lease_deadlines, (lease.deadline, lid))
        self.stats["resolves"] += 1
        return self._resolved(lease, oids)

    def _resolved(self, lease: Lease, oids: list[bytes]) -> tuple[list[int], list[int]]:
        """(offsets, sizes) of objects ``lease`` pins, counted as served."""
        offsets = [lease.pinned[oid].offset for oid in oids]
        sizes = [lease.pinned[oid].nbytes for oid in oids]
        total = sum(sizes)
        lease.resolved_objects += len(sizes)
        lease.resolved_bytes += total
        self.stats["resolved_objects"] += len(sizes)
        self.stats["resolved_bytes"] += total
        return offsets, sizes

    def release(self, lid: int, expired: bool = False) -> ReleaseRep:
        lease = self.leases.pop(lid, None)
        if lease is None:
            return ReleaseRep(False)
        lease.owner.leases.discard(lid)
        for e in reversed(list(lease.pinned.values())):  # tail first: a prefix's head ends most recent
            self._unpin(e)
        self.stats["leases_expired" if expired else "leases_released"] += 1
        self.stats["lease_pinned_bytes"] += lease.pinned_bytes
        self.stats["lease_resolved_bytes"] += lease.resolved_bytes
        if lease.resolved_bytes != lease.pinned_bytes:
            self.stats["leases_partially_served"] += 1
        return ReleaseRep(True, len(lease.pinned), lease.pinned_bytes, lease.resolved_objects,
                          lease.resolved_bytes)

    # ------------------------------------------------------------------ reports
    def drop_reported(self, ids: bytes) -> int:
        """Objects a client found corrupt (header, size or checksum): gone from L1 and L2 at
        once, so that the next request recomputes and stores them again."""
        if len(ids) % OBJECT_ID_SIZE:
            raise RequestError(E_INVALID, f"id blob of {len(ids)} bytes is not a multiple of {OBJECT_ID_SIZE}")
        n = 0
        for i in range(0, len(ids), OBJECT_ID_SIZE):
            e = self.objs.get(ids[i:i + OBJECT_ID_SIZE])
            # only what a client can have read: a block still being filled (L2, remote) stays
            if e is not None and e.state == READY and not e.doomed:
                self._drop(e, "reported_corrupt")
                self._remote_delete(e)  # the bytes the client read may have come from there
                n += 1
        return n
