"""Client of the node-local cache server (:mod:`vllm_kvplugin.server`): its calls.

One :class:`MPClient` per process (thread-safe).  How a call reaches the server -- the
connection, the token, the pool's mapping, heartbeats, bounds, restarts -- is
:class:`~vllm_kvplugin.tiers.mp_session.MPSession`'s; this module shapes the requests and
checks the replies.  Data never goes through the socket: the client maps the server's
shared-memory pool and reads/writes objects in place at the offsets the server hands out.
Object layout: ``[chunk header (HEADER_SIZE) | payload]``.

Store::

    offs = c.reserve([(oid, HEADER_SIZE + len(payload)), ...])   # None: exists / no room
    view = c.pool_view(); view[off:off + HEADER_SIZE] = header; view[off + HEADER_SIZE:...] = payload
    c.commit([oid, ...], [off, ...])                              # visible from now on

Load::

    r = c.lookup_detail(keys, needs, ranks, world)               # pins the hit under a lease
    for off, n in c.resolve(r.lease, keys[:r.hits], group, rank, world): ... copy out, check header ...
    c.release(r.lease)                                            # planned vs served bytes

Every call raises :class:`TierUnavailable` when the server cannot answer (see
:mod:`.mp_session`) and :class:`ServerError` with the protocol's code when it refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_kvplugin.chunk.rules import GroupNeed, Need
from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.protocol import object_id
from vllm_kvplugin.tiers.mp_results import (
    LeaseReport,
    LookupResult,
    Reservation,
    ServerError,
    TierUnavailable,
)
from vllm_kvplugin.tiers.mp_session import MPSession

__all__ = ["MPClient", "TierUnavailable", "ServerError", "LookupResult", "LeaseReport", "object_id",
           "HEADER_SIZE"]


class MPClient(MPSession):
    """Thread-safe client; see the module docstring (the arguments are :class:`MPSession`'s)."""

    def lookup(self, keys: Sequence[bytes], groups: int = 1, ranks: int = 1,
               world: int = 1) -> tuple[int, int]:
        """(leading chunks whose every (group < groups, rank < ranks) object is present, lease id).

        The hit is pinned under the lease until :meth:`release` or the server's lease time
        after the last lookup/resolve on it; 0 hits -> lease 0 (nothing to release).
        """
        r = self.lookup_detail(keys, [(0, 0)] * groups, ranks, world)
        return r.hits, r.lease

    def lookup_detail(self, keys: Sequence[bytes], needs: Sequence[tuple[int, int]], ranks: int = 1,
                      world: int = 1, first: int = 0, wait_s: float | None = None,
                      fingerprint: bytes = b"", resolve_rank: int = -1, timeout_s: float | None = None,
                      backoff: bool = True) -> LookupResult:
        """The largest hit (in chunks) every group can restore from objects of ranks ``< ranks``,
        per group's need ``(chunk.rules.Need, window chunks)``, not counting chunks below
        ``first``; the objects that hit needs are pinned under the returned lease.  With the
        keys' model ``fingerprint`` the server also asks its remote store, if it has one.
        ``resolve_rank`` >= 0: the result also holds where that rank's pinned objects are
        (``LookupResult.resolved``), as :meth:`resolve` of each group's would answer.
        ``wait_s``: how long the server may wait for objects it brings into L1 (L2, the remote
        store); ``timeout_s`` and ``backoff``: as for any call (see ``_exchange``)."""
        if not keys:
            return LookupResult(0, 0, 0, 0)
        blob = _key_blob(keys)
        if not (1 <= ranks <= world <= 0xFFFF and 1 <= len(needs) <= 0xFFFF and resolve_rank < ranks):
            raise ValueError(f"bad lookup shape groups={len(needs)} ranks={ranks} world={world} "
                             f"resolve_rank={resolve_rank}")
        wait = self.lookup_wait_s if wait_s is None else wait_s
        rep = self._call("lookup", P.LookupReq(blob, [(int(n), int(w)) for n, w in needs], ranks, world,
                                               int(first), int(wait * 1000), bytes(fingerprint), int(resolve_rank)),
                         timeout_s, backoff)
        if not (0 <= rep.hits <= len(keys)) or (rep.hits > 0) != (rep.lease != 0) or 0 < rep.hits <= first:
            raise ServerError(P.E_INTERNAL, f"impossible lookup reply: hit {rep.hits} of "
                                            f"{len(keys)} keys from chunk {first}, lease {rep.lease}")
        resolved = {}
        if resolve_rank >= 0 and rep.hits:
            where = [(g, pos) for g, (n, w) in enumerate(needs) for pos in GroupNeed(Need(n), w).positions(rep.hits, first)]
            if len(where) != len(rep.offsets) or len(rep.sizes) != len(rep.offsets) or not rep.instance:
                raise ServerError(P.E_INTERNAL, f"lookup reply resolves {len(rep.offsets)} offsets and "
                                                f"{len(rep.sizes)} sizes for the hit's {len(where)} objects "
                                                f"(server instance {rep.instance!r})")
            resolved = dict(zip(where, zip(rep.offsets, rep.sizes)))
        return LookupResult(rep.hits, rep.lease, rep.pinned_bytes, rep.l2_promoted, resolved, rep.instance,
                            rep.promoting)

    def resolve(self, lease_id: int, keys: Sequence[bytes], group: int, rank: int,
                world: int, timeout_s: float | None = None) -> list[tuple[int, int]]:
        """(offset, nbytes) of the (group, rank, world) object of each key, in key order.

        Only objects pinned by ``lease_id``: any other key fails the whole call
        (``ServerError('not_leased')``).  Also extends the lease.
        """
        if not keys:
            return []
        rep = self._call("resolve", P.ResolveReq(lease_id, _key_blob(keys), group, rank, world), timeout_s)
        if len(rep.offsets) != len(keys) or len(rep.sizes) != len(keys):
            raise ServerError(P.E_INTERNAL, f"resolve returned {len(rep.offsets)} objects for {len(keys)} keys")
        size = len(self._pools.mm) if self._pools.mm is not None else 0
        out = list(zip(rep.offsets, rep.sizes))
        for off, n in out:
            if off < 0 or n <= HEADER_SIZE or off + n > size:
                raise ServerError(P.E_INTERNAL, f"resolve returned an object outside the pool ({off}+{n})")
        return out

    def release(self, lease_id: int) -> LeaseReport:
        """Unpin a lease; the report says how many bytes it pinned and how many were resolved."""
        if lease_id == 0:
            return LeaseReport(False, 0, 0, 0, 0)
        r = self._call("release", P.LeaseReq(lease_id))
        return LeaseReport(r.found, r.pinned_objects, r.pinned_bytes, r.resolved_objects, r.resolved_bytes)

    def reserve(self, items: Iterable[tuple[bytes, int]],
                timeout_s: float | None = None) -> list[Reservation | None]:
        """Room for each (object_id, nbytes): its offset (a :class:`Reservation`), or None
        (exists already, or no room)."""
        items = list(items)
        if not items:
            return []
        ids = b"".join(oid for oid, _ in items)
        if len(ids) != P.OBJECT_ID_SIZE * len(items):
            raise ValueError(f"object ids must be {P.OBJECT_ID_SIZE} bytes (use object_id())")
        rep = self._call("reserve", P.ReserveReq(ids, [int(n) for _, n in items]), timeout_s)
        if len(rep.offsets) != len(items):
            raise ServerError(P.E_INTERNAL, "reserve reply has the wrong length")
        if len(rep.epochs) != len(items):
            raise ServerError(P.E_INTERNAL, "reserve reply has the wrong number of epochs")
        return [Reservation(o, e) if o >= 0 else None for o, e in zip(rep.offsets, rep.epochs)]

    def commit(self, object_ids: Sequence[bytes], reservations: Sequence[Reservation],
               timeout_s: float | None = None) -> list[bool]:
        """Make reserved objects visible (their bytes must be written), each naming the
        reservation :meth:`reserve` gave for it; False: not committed (not reserved by this
        client any more, a later reservation replaced it, or its header does not name the object)."""
        if len(object_ids) != len(reservations):
            raise ValueError(f"{len(object_ids)} object ids for {len(reservations)} reservations")
        if not object_ids:
            return []
        rep = self._call("commit", P.CommitReq(_id_blob(object_ids), [r.epoch for r in reservations]),
                         timeout_s)
        return [s == P.COMMIT_OK for s in rep.status]

    def abort(self, object_ids: Sequence[bytes], timeout_s: float | None = None) -> int:
        """Give reservations back without committing; the number given back."""
        if not object_ids:
            return 0
        return self._call("abort", P.IdsReq(_id_blob(object_ids)), timeout_s).aborted

    def drop(self, object_ids: Sequence[bytes], timeout_s: float | None = None) -> int:
        """Report objects that failed verification: the server drops them (L1 and L2)."""
        if not object_ids:
            return 0
        return self._call("drop", P.IdsReq(_id_blob(object_ids)), timeout_s).dropped

    def wake(self) -> bool:
        """Tell the server a call follows soon; it gets no reply and is not waited for.  A server
        idle for 20 ms answered a lookup sent 0.3-1 ms after a wake 0.1-0.4 ms sooner
        (``benchmarks/server_wake.py``: its threads and their cores already awake).  False: not
        sent (not connected, backing off, or a call in flight: the server is awake then anyway)."""
        return self._send_only("wake", P.Empty())

    def heartbeat(self) -> None:
        self._call("heartbeat", P.Empty())

    def stats(self) -> dict[str, Any]:
        return dict(self._call("stats", P.Empty()).values)

    # helpers for tests, tools and simple callers --------------------------------------
    def _view_of(self, generation: int | None) -> memoryview:
        view = self.pool_view()
        if generation is not None and generation != self._generation:
            raise TierUnavailable(f"offset of pool generation {generation}; the pool is now "
                                  f"generation {self._generation} (server restarted)")
        return view

    def write_object(self, offset: int, header: bytes, payload, generation: int | None = None) -> None:
        """Copy ``header`` and ``payload`` into the pool at a reserved ``offset`` (of pool
        ``generation``, when given: a different one raises TierUnavailable)."""
        view = self._view_of(generation)
        if len(header) != HEADER_SIZE:
            raise ValueError(f"header must be {HEADER_SIZE} bytes")
        p = memoryview(payload).cast("B")
        view[offset:offset + HEADER_SIZE] = header
        view[offset + HEADER_SIZE:offset + HEADER_SIZE + p.nbytes] = p

    def object_view(self, offset: int, nbytes: int, generation: int | None = None) -> memoryview:
        """The object's bytes in the pool (header first), no copy."""
        return self._view_of(generation)[offset:offset + nbytes]


def _key_blob(keys: Sequence[bytes]) -> bytes:
    blob = b"".join(keys)
    if len(blob) != P.KEY_SIZE * len(keys):
        raise ValueError(f"chunk keys must be {P.KEY_SIZE} bytes each")
    return blob


def _id_blob(ids: Sequence[bytes]) -> bytes:
    blob = b"".join(ids)
    if len(blob) != P.OBJECT_ID_SIZE * len(ids):
        raise ValueError(f"object ids must be {P.OBJECT_ID_SIZE} bytes each (use object_id())")
    return blob
