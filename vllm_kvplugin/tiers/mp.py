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
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvplugin.chunk.format import HEADER_SIZE
from vllm_kvplugin.chunk.rules import GroupNeed
from vllm_kvplugin.config import KVPluginConfig

logger = logging.getLogger(__name__)


class TierTrouble(Exception):
    """The server could not serve a request; ``reason`` names the counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _client(cfg: KVPluginConfig, name: str):
    from vllm_kvplugin.tiers.mp_client import MPClient

    return MPClient(cfg.server, token=cfg.server_token, timeout_s=cfg.server_timeout_s,
                    client_name=name)


def _call(fn, *args):
    from vllm_kvplugin.tiers.mp_client import ServerError, TierUnavailable

    try:
        return fn(*args)
    except TierUnavailable as e:
        raise TierTrouble("server_unavailable", str(e)) from e
    except ServerError as e:
        raise TierTrouble("server_error", str(e)) from e


def _call_fresh(client, fn, *args):
    """Like :func:`_call`, but once more when the failure was meeting a restarted server:
    the client re-mapped its pool and a request that names no old offset or lease is safe."""
    gen = client.pool_generation
    try:
        return _call(fn, *args)
    except TierTrouble:
        if client.pool_generation == gen:
            raise
        return _call(fn, *args)


@dataclass(frozen=True)
class Lookup:
    hits: int
    lease: int
    pinned_bytes: int


class ServerIndex:
    """Scheduler-side lookups on the server (one client per engine core)."""

    def __init__(self, cfg: KVPluginConfig, needs: Sequence[GroupNeed], world: int, name: str):
        self.needs = [(int(n.need), n.window) for n in needs]
        self.world = world
        self._client = _client(cfg, name)

    def lookup(self, keys: Sequence[bytes], first: int) -> Lookup:
        """The largest hit every group can restore from the server (every rank's objects), past
        chunk ``first``; the objects it needs are pinned under a lease."""
        if len(keys) <= first:
            return Lookup(0, 0, 0)
        r = _call_fresh(self._client, self._client.lookup_detail, list(keys), self.needs, self.world,
                        self.world, first)
        return Lookup(r.hits, r.lease, r.pinned_bytes)

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
        self._client.close()


def _page_lock(tensor) -> None:
    """``cudaHostRegister`` a mapped CPU tensor unless CUDA already knows it as page-locked.

    A failed runtime call also leaves its error as the thread's "last error",
    which the next CUDA check in torch (any kernel launch or allocation) would
    raise as its own: consume it here, with a throwaway launch, so that the
    failure costs only speed (copies from pageable memory), never a store.
    """
    import torch

    if tensor.is_pinned():
        return
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(err) != 0:
        logger.warning("vllm-kvplugin: cudaHostRegister of the server pool (%d bytes at %#x) failed "
                       "with CUDA error %d; copies run from pageable memory", tensor.numel(),
                       tensor.data_ptr(), int(err))
        try:
            torch.empty(1, device="cuda").zero_()
        except RuntimeError:
            pass


class ServerStore:
    """Worker-side access to the server's pool (one client per worker process).

    On CUDA machines the pool is page-locked (``cudaHostRegister``) once per
    mapping, so copies between the GPU and the pool run at DMA speed.
    """

    def __init__(self, cfg: KVPluginConfig, rank: int, world: int, name: str, pin_for_cuda: bool):
        self.rank, self.world = rank, world
        self._client = _client(cfg, name)
        self._pin = pin_for_cuda
        self._tensor = None
        self._generation = -1

    def _pool(self):
        """The pool as a uint8 tensor (re-made, and page-locked, after the server changed).

        A new server instance means a new mapping at a new address (the client keeps
        the old ones mapped), so each mapping is registered once.
        """
        tensor = _call(self._client.pool_tensor)  # connects first: then read the generation
        gen = self._client.pool_generation
        if self._tensor is None or gen != self._generation or tensor.data_ptr() != self._tensor.data_ptr():
            if self._pin:
                _page_lock(tensor)
            self._tensor, self._generation = tensor, gen
        return self._tensor

    def object_id(self, key: bytes, group: int) -> bytes:
        from vllm_kvplugin.server.protocol import object_id

        return object_id(key, group, self.rank, self.world)

    def resolve(self, lease: int, keys: Sequence[bytes], group: int) -> list[tuple[int, int]]:
        """Offsets of leased objects; safe to retry on a restarted server (it checks the lease:
        one of an earlier instance is unknown there), and the views are then made of the new pool."""
        return _call_fresh(self._client, self._client.resolve, lease, list(keys), group, self.rank, self.world)

    def views(self, offset: int, nbytes: int):
        """(header bytes view, payload uint8 tensor) of an object in the pool."""
        pool = self._pool()
        if offset < 0 or offset + nbytes > pool.numel() or nbytes <= HEADER_SIZE:
            raise TierTrouble("short_read", f"object {offset}+{nbytes} outside the pool of {pool.numel()}")
        return pool[offset:offset + HEADER_SIZE], pool[offset + HEADER_SIZE:offset + nbytes]

    def reserve(self, items: Sequence[tuple[bytes, int]]) -> list[int | None]:
        self._pool()
        offsets = _call_fresh(self._client, self._client.reserve, list(items))
        self._pool()  # re-made if that call met a restarted server
        return offsets

    def commit(self, oids: Sequence[bytes]) -> list[bool]:
        return _call(self._client.commit, list(oids))

    def drop(self, oids: Sequence[bytes]) -> None:
        """Objects that failed verification: the server forgets them (best effort)."""
        try:
            _call(self._client.drop, list(oids))
        except TierTrouble as e:
            logger.warning("vllm-kvplugin: could not report %d corrupt objects (%s)", len(oids), e)

    def abort(self, oids: Sequence[bytes]) -> None:
        try:
            _call(self._client.abort, list(oids))
        except TierTrouble:
            pass  # the server reclaims reservations of clients it no longer hears from

    @property
    def generation(self) -> int:
        return self._client.pool_generation

    def close(self) -> None:
        self._client.close()
