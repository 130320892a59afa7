"""The ``mp`` tier: the connector's side of ``vllm-kvplugin server``.

Objects on the server are one chunk of one KV cache group of one rank
(``object_id(key, group, rank, world)``), laid out ``[header | payload]`` in
the server's shared-memory pool, which every client maps.

* :class:`ServerIndex` (scheduler role, engine-core process): prefix lookups
  that pin what they found under a lease, and the release of those leases
  with the planned-vs-served byte accounting.
* :class:`ServerStore` (worker role): resolves leased objects to pool views
  for loads; reserves, fills and commits objects for stores.

Any trouble with the server (gone, hung, restarted, refusing) surfaces as
:class:`TierTrouble` with a reason; the connector turns it into a miss or a
recompute and never waits longer than ``server_timeout_s`` per exchange.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_kvplugin.chunk.format import HEADER_SIZE
from vllm_kvplugin.chunk.rules import GroupNeed
from vllm_kvplugin.config import KVPluginConfig

logger = logging.getLogger(__name__)

#: a writer publishes a reservation only within this share of the server's reservation time
RESERVE_MARGIN = 0.8


class TierTrouble(Exception):
    """The server could not serve a request; ``reason`` names the counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _client(cfg: KVPluginConfig, name: str):
    from vllm_kvplugin.server.auth import read_token
    from vllm_kvplugin.tiers.mp_client import MPClient

    return MPClient(cfg.server, token=read_token(cfg.server_token_file, "server_token_file"),
                    timeout_s=cfg.server_timeout_s,
                    client_name=name, server_uid=cfg.server_uid)


def _call(fn, *args, **kw):
    from vllm_kvplugin.tiers.mp_client import ServerError, TierUnavailable

    try:
        return fn(*args, **kw)
    except TierUnavailable as e:
        raise TierTrouble("server_unavailable", str(e)) from e
    except ServerError as e:
        raise TierTrouble("server_error", str(e)) from e


def _call_fresh(client, fn, *args, **kw):
    """Like :func:`_call`, but once more when the failure was meeting a restarted server:
    the client re-mapped its pool and a request that names no old offset or lease is safe."""
    gen = client.pool_generation
    try:
        return _call(fn, *args, **kw)
    except TierTrouble:
        if client.pool_generation == gen:
            raise
        return _call(fn, *args, **kw)


#: an engine of one rank has its lookups answer where the hit's objects are in the pool, so that
#: its worker reads them without a resolve of its own: one round trip to the server less before
#: a hit's first byte (False: the worker resolves them, as an engine of several ranks does)
LOOKUP_RESOLVES = True


@dataclass(frozen=True)
class Lookup:
    hits: int
    lease: int
    pinned_bytes: int
    #: (group, chunk position) -> (offset, nbytes) of the pinned objects in the pool of server
    #: ``instance`` (:data:`LOOKUP_RESOLVES`), to be read before ``placed_until`` (monotonic: half
    #: the lease's time after the lookup was sent); empty: the worker resolves them
    resolved: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    instance: str = ""
    placed_until: float = 0.0
    #: objects the server was still bringing into L1 when it answered (a longer wait may hit more)
    promoting: int = 0


class ServerIndex:
    """Scheduler-side lookups on the server (one client per engine core).

    Nothing here may hold the scheduler's thread: a stopped or slow server would add its
    timeout to every running request's next token.  So lookups run on a thread of their own
    (:meth:`lookup_async`: the caller polls the future, vLLM holds the request back
    meanwhile) and releases are sent from it without waiting (:meth:`release_async`).  The one
    exception, :meth:`lookup_now`, is bounded by its caller (a request alone in the engine,
    whom nobody waits behind).
    """

    def __init__(self, cfg: KVPluginConfig, needs: Sequence[GroupNeed], world: int, name: str,
                 fingerprint: bytes = b""):
        self.needs = [(int(n.need), n.window) for n in needs]
        self.fingerprint = fingerprint  # the keys' model: the namespace of the server's remote store
        self.world = world
        self._client = _client(cfg, name)
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="kvplugin-server-index")

    def lookup_async(self, keys: Sequence[bytes], first: int) -> Future:
        """:meth:`lookup` on the index's thread; the future raises :class:`TierTrouble`."""
        return self._calls.submit(self.lookup, list(keys), first)

    def release_async(self, lease: int, done=None) -> None:
        """Unpin on the index's thread; ``done(pinned, served)`` after, on that thread."""
        def run():
            try:
                got = self.release(lease)
            except TierTrouble as e:
                logger.warning("vllm-kvplugin: releasing server lease %d failed (%s); it expires", lease, e)
                return
            if done is not None:
                done(*got)

        if lease:
            self._calls.submit(run)

    def wake(self) -> bool:
        """Tell the server a lookup follows (``MPClient.wake``: no reply, no wait), so that it is
        awake when the lookup comes; False: not sent."""
        return self._client.wake()

    def lookup_now(self, keys: Sequence[bytes], first: int, timeout_s: float, wait_s: float) -> Future | None:
        """:meth:`lookup` on the caller's thread, no hand-off to the index's and back, when the
        client is connected (a first call may connect: that is the index thread's); None
        otherwise.  A call the index's thread is making (a release) is waited for, within
        ``timeout_s``, which bounds the whole call (a lookup that outlasts it is not answered
        here, and later calls do not back off for it); the server waits at most ``wait_s`` for
        objects it brings into L1 (``Lookup.promoting``: those still on their way).  Returns a
        done future, as :meth:`lookup_async` would become."""
        if not self._client.ready:
            return None
        done: Future = Future()
        try:
            done.set_result(self.lookup(keys, first, timeout_s, wait_s, backoff=False))
        except TierTrouble as e:
            done.set_exception(e)
        return done

    def lookup(self, keys: Sequence[bytes], first: int, timeout_s: float | None = None,
               wait_s: float | None = None, backoff: bool = True) -> Lookup:
        """The largest hit every group can restore from the server (every rank's objects), past
        chunk ``first``; the objects it needs are pinned under a lease (and, in an engine of one
        rank, resolved).  ``timeout_s``, ``wait_s``, ``backoff``: see ``MPClient.lookup_detail``
        (default: the client's)."""
        if len(keys) <= first:
            return Lookup(0, 0, 0)
        resolve_rank = 0 if self.world == 1 and LOOKUP_RESOLVES else -1
        sent = time.monotonic()
        r = _call_fresh(self._client, self._client.lookup_detail, list(keys), self.needs, self.world,
                        self.world, first, wait_s, fingerprint=self.fingerprint, resolve_rank=resolve_rank,
                        timeout_s=timeout_s, backoff=backoff)
        return Lookup(r.hits, r.lease, r.pinned_bytes, r.resolved, r.instance, sent + 0.5 * self._client.lease_s,
                      r.promoting)

    @property
    def lease_s(self) -> float:
        """How long the server keeps a lease after its last lookup or resolve (0: not connected)."""
        return self._client.lease_s

    def release(self, lease: int) -> tuple[int, int]:
        """Unpin; (pinned bytes, bytes the workers resolved) of the lease."""
        if lease == 0:
            return 0, 0
        rep = _call(self._client.release, lease)
        return rep.pinned_bytes, rep.resolved_bytes

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        self._client.close()


def _page_lock(tensor) -> bool:
    """``cudaHostRegister`` a mapped CPU tensor unless CUDA already knows it as page-locked;
    whether this call registered it.

    A failed runtime call also leaves its error as the thread's "last error",
    which the next CUDA check in torch (any kernel launch or allocation) would
    raise as its own: consume it here, with a throwaway launch, so that the
    failure costs only speed (copies from pageable memory), never a store.
    """
    import torch

    if tensor.is_pinned():
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(err) == 0:
        return True
    logger.warning("vllm-kvplugin: cudaHostRegister of the server pool (%d bytes at %#x) failed "
                   "with CUDA error %d; copies run from pageable memory, and every server store "
                   "passes through the worker's private staging memory (server_staging_bytes: objects "
                   "beyond it are skipped, counted as server_store_skipped)", tensor.numel(),
                   tensor.data_ptr(), int(err))
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    import torch

    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:
        pass


@dataclass(frozen=True, eq=False)
class ServerTarget:
    """One object a store writes into the server's pool: where, and the reservation to name at
    commit.  ``deadline`` (monotonic): past it the server may have reclaimed the room, so the
    writer must not publish (the server would refuse the commit anyway: its epoch)."""

    job: Any
    oid: bytes
    reservation: Any
    header: Any
    payload: Any
    deadline: float


class ServerStore:
    """Worker-side access to the server's pool (one client per worker process).

    On CUDA machines the pool is page-locked (``cudaHostRegister``) once per
    mapping, so copies between the GPU and the pool run at DMA speed.
    """

    def __init__(self, cfg: KVPluginConfig, rank: int, world: int, name: str, pin_for_cuda: bool):
        self.rank, self.world = rank, world
        self._client = _client(cfg, name)
        #: calls on a step's path (resolve, reserve, and commit where stores finish in the step)
        #: wait at most this: a stopped server costs a miss, not the running requests' next token
        self.step_s = min(cfg.server_timeout_s, cfg.server_step_timeout_s)
        self._pin = pin_for_cuda
        self._tensor = None
        self._generation = -1
        self._registered: set[int] = set()  # addresses of mappings this store page-locked
        self._client.before_unmap = self._before_unmap

    def _before_unmap(self, tensor) -> None:
        """An old pool is about to be unmapped (no tensor uses it any more): unregister it first.
        A copy enqueued earlier may still read it (a prefetch of a request that was since
        forgotten keeps no view), so the device finishes its work before (only after a restart)."""
        self._unregister(tensor.data_ptr())

    def _unregister(self, ptr: int) -> None:
        if ptr in self._registered:
            import torch

            self._registered.discard(ptr)
            torch.cuda.synchronize()
            if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
                _clear_cuda_error()

    def _pool(self):
        """The pool as a uint8 tensor (re-made, and page-locked, after the server changed).

        A new server instance means a new mapping at a new address, so each mapping is
        registered once (and unregistered before the client unmaps it, once it is unused).
        """
        tensor = _call(self._client.pool_tensor, self.step_s)  # connects first: then read the generation
        gen = self._client.pool_generation
        if self._tensor is None or gen != self._generation or tensor.data_ptr() != self._tensor.data_ptr():
            if self._pin and _page_lock(tensor):
                self._registered.add(tensor.data_ptr())
            old, self._tensor, self._generation = self._tensor, tensor, gen
            if old is not None:
                del old
                self._client.unmap_unused()  # the old pool goes now, unless views of it are still out
        return self._tensor

    @property
    def page_locked(self) -> bool:
        """The pool's current mapping (that of the views the last call made) is page-locked:
        the GPU may copy straight into it."""
        return self._tensor is not None and self._tensor.data_ptr() in self._registered

    def object_id(self, key: bytes, group: int) -> bytes:
        from vllm_kvplugin.server.protocol import object_id

        return object_id(key, group, self.rank, self.world)

    def resolve(self, lease: int, keys: Sequence[bytes], group: int) -> list[tuple[int, int]]:
        """Offsets of leased objects; safe to retry on a restarted server (it checks the lease:
        one of an earlier instance is unknown there), and the views are then made of the new pool."""
        return _call_fresh(self._client, self._client.resolve, lease, list(keys), group, self.rank, self.world,
                           timeout_s=self.step_s)

    def serves(self, placed) -> bool:
        """Whether ``placed`` (a lookup's :class:`~vllm_kvplugin.connector.metadata.Placement`) is of
        the server instance this worker's client is connected to."""
        return self._client.instance == placed.instance

    def placed_views(self, placements: Sequence[Any]) -> list:
        """:meth:`views` of objects where the scheduler's lookup placed them (``Placement``s of one
        lookup).  TierTrouble when this worker's client is on another server instance (that lease,
        and so the offsets, are void there).  The pool mapping of the instance that answered stays
        put while the objects' views live, and nothing writes a pinned object, whether that server
        still runs or not."""
        pool = self._pool()  # (once: it is a call into the client)
        for placed in placements:
            if not self.serves(placed):
                raise TierTrouble("server_unavailable", f"object {placed.offset}+{placed.nbytes} was placed by "
                                                        f"server instance {placed.instance}; this worker is "
                                                        f"connected to {self._client.instance}")
        return [self._views_in(pool, p.offset, p.nbytes) for p in placements]

    def views(self, offset: int, nbytes: int):
        """(header bytes view, payload uint8 tensor) of an object in the pool."""
        return self._views_in(self._pool(), offset, nbytes)

    @staticmethod
    def _views_in(pool, offset: int, nbytes: int):
        if offset < 0 or offset + nbytes > pool.numel() or nbytes <= HEADER_SIZE:
            raise TierTrouble("short_read", f"object {offset}+{nbytes} outside the pool of {pool.numel()}")
        return pool[offset:offset + HEADER_SIZE], pool[offset + HEADER_SIZE:offset + nbytes]

    def reserve(self, jobs: Sequence[Any], items: Sequence[tuple[bytes, int]]) -> list[ServerTarget]:
        """Room for each job's object ``items[i] = (object id, bytes)``; the objects the server
        already has, or has no room for, drop out."""
        self._pool()
        t0 = time.monotonic()
        offsets = _call_fresh(self._client, self._client.reserve, list(items), timeout_s=self.step_s)
        self._pool()  # re-made if that call met a restarted server
        deadline = t0 + RESERVE_MARGIN * self._client.reserve_s
        return [ServerTarget(job, oid, off, *self.views(off, n), deadline)
                for job, off, (oid, n) in zip(jobs, offsets, items) if off is not None]

    def commit(self, targets: Sequence[ServerTarget]) -> list[bool]:
        """Publish written objects (False: refused, or past its reservation, so aborted)."""
        now = time.monotonic()
        late = [t for t in targets if now > t.deadline]
        if late:
            self.abort([t.oid for t in late])
        on_time = [t for t in targets if now <= t.deadline]
        ok = dict(zip((t.oid for t in on_time),
                      _call(self._client.commit, [t.oid for t in on_time], [t.reservation for t in on_time],
                            timeout_s=self.step_s)))
        return [ok.get(t.oid, False) for t in targets]

    def drop(self, oids: Sequence[bytes]) -> None:
        """Objects that failed verification: the server forgets them (best effort)."""
        try:
            _call(self._client.drop, list(oids), timeout_s=self.step_s)
        except TierTrouble as e:
            logger.warning("vllm-kvplugin: could not report %d corrupt objects (%s)", len(oids), e)

    def abort(self, oids: Sequence[bytes]) -> None:
        try:
            _call(self._client.abort, list(oids), timeout_s=self.step_s)
        except TierTrouble:
            pass  # the server reclaims reservations of clients it no longer hears from

    @property
    def generation(self) -> int:
        return self._client.pool_generation

    def close(self) -> None:
        """At the worker's shutdown: every mapping this store page-locked is unregistered (the
        device's copies finished first) before the connection closes.  The mapping itself goes
        when nothing holds it; unmapped while still registered, CUDA would keep its old pages,
        and a later mapping at the same address would be taken for page-locked."""
        for ptr in list(self._registered):
            self._unregister(ptr)
        self._tensor = None
        self._client.close()
