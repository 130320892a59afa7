"""The store half of the worker role: KV a step computed, copied into the tiers.

:class:`StorePath` is mixed into :class:`~vllm_kvplugin.connector.worker.WorkerSide` and uses
what its registration built (layouts, layer tensors, the local pool, the server store, the
transfer engine, the finisher and the private staging memory).  vLLM's thread calls
:meth:`StorePath.store` from ``wait_for_save``, after the step's forward: it issues the
gathers and copies and returns while they may still be in flight; the finisher thread calls
:meth:`StorePath._finish` once they are done (checksums, headers, the server's commit).  Nothing
stored is visible before that; a store of metadata built before a failed load was known is
dropped whole (the provenance rule).

Server objects: on a GPU whose store calls are digested on the device, the DMAs land straight
in the server's page-locked pool, and the checksum is the device's digest of the bytes vLLM
computed; otherwise they are gathered into private memory, hashed there, then copied into the
pool (``transfer/host_buffers.py`` says why the pool's own bytes are never hashed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from vllm_kvplugin import counters
from vllm_kvplugin.chunk.checksums import hash_then_copy, payload_checksums
from vllm_kvplugin.chunk.format import HEADER_SIZE, ChunkHeader
from vllm_kvplugin.connector.finisher import PendingStore
from vllm_kvplugin.connector.metadata import KVPluginMetadata, StoreJob
from vllm_kvplugin.layout.state import gather_state
from vllm_kvplugin.tiers.local_cpu import bytes_of
from vllm_kvplugin.tiers.mp import ServerTarget, TierTrouble

logger = logging.getLogger(__name__)


class StorePath:
    """Stores of the worker half (a mixin of ``WorkerSide``; see the module's docstring)."""

    def store(self, meta: KVPluginMetadata) -> None:
        """Issue the gathers of every object completed by this step's forward."""
        jobs = [job for req in meta.stores for job in req.jobs]
        if not jobs:
            return
        self._settle_unverified_loads()  # (a load of this step refuted now drops these stores)
        if meta.epoch <= self._failed_epoch:
            self._cancel(meta)
            return
        t0 = time.perf_counter()
        keys = [j.key for j in jobs]
        local = [j for j in jobs if j.slot >= 0]
        remote = self._reserve([j for j in jobs if j.to_server])
        tickets, private = [], None
        try:
            # server objects go straight into the pool where the device digests them, else are
            # gathered into this process's own memory (transfer/host_buffers.py) and hashed there
            direct = self._direct_groups(local, remote)
            via = [t for t in remote if t.job.group not in direct]
            slices: list[torch.Tensor] = []
            if via:
                slices, private = self._private.take_slices([t.payload.numel() for t in via])
                if len(slices) < len(via):  # no room for the rest: not sent (never waited for)
                    skipped = via[len(slices):]
                    counters.WORKER.add(server_store_skipped=len(skipped))
                    self.server.abort([t.oid for t in skipped])
                    remote = [t for t in remote if t.job.group in direct] + via[:len(slices)]
            if direct:
                counters.WORKER.add(server_store_direct=sum(t.job.group in direct for t in remote))
            it = iter(slices)
            sources = [t.payload if t.job.group in direct else next(it) for t in remote]
            for g, spec in enumerate(self.groups):
                targets: list[tuple[StoreJob, torch.Tensor]] = []
                for job in local:
                    if job.group == g:
                        self.pool.set_header(g, job.slot, None)
                        targets.append((job, self.pool.payload(g, job.slot)))
                for t, src in zip(remote, sources):
                    if t.job.group == g:
                        targets.append((t.job, src.view(self._dtype(g)).view(1, *self._shape(g))))
                if not targets:
                    continue
                if spec.is_state:  # the state at the step's end, read now
                    for job, t in targets:
                        gather_state(self.layers[g], job.block_ids[0], t.view(spec.num_layers, -1))
                    continue
                slots = self.object_slots([j for j, _ in targets])
                tickets.append(self.engine.store(self.layouts[g], self.layers[g], slots, [t for _, t in targets]))
        except Exception:
            logger.exception("vllm-kvplugin: store of %d objects failed", len(jobs))
            settled = self._settle_after_failure()
            self._fail_local(local)
            self.finisher.acknowledge(keys)
            if remote and self.server is not None:
                counters.WORKER.add(server_store_errors=1)
                if settled:  # else the server takes the room back once the reservation lapses
                    self.server.abort([t.oid for t in remote])
            if private is not None and settled:
                self._private.give(private)
            return
        self.finisher.submit(PendingStore(tickets, local, remote, keys, t0, sources, private))

    def _direct_groups(self, local: list[StoreJob], remote: list[ServerTarget]) -> set[int]:
        """The groups whose server objects the device copies straight into the page-locked pool:
        those whose store call the device digests whole (the digest is of the bytes computed, so
        the shared pool's bytes are never hashed); a recurrent group's state is read on the host."""
        cap = self.engine.undigested_store_max()
        if not remote or cap is None or not self.server.page_locked:
            return set()
        calls: dict[int, int] = {}
        for j in [*local, *(t.job for t in remote)]:
            calls[j.group] = calls.get(j.group, 0) + self.groups[j.group].object_bytes(self.chunk_size)
        return {g for g, nbytes in calls.items() if not self.groups[g].is_state and nbytes > cap}

    def _settle_after_failure(self) -> bool:
        """After a store failed while it was issued: True once the device has finished every copy
        issued or queued before the failure (which may still write the local tier, staging memory
        or the pool); False when even that cannot be known (the memory is then kept out of use)."""
        try:
            self.engine.settle()
        except Exception:
            logger.exception("vllm-kvplugin: a failed store's copies cannot be waited for; its staging "
                             "memory and server room are kept out of use")
            return False
        return True

    def _fail_local(self, jobs: Sequence[StoreJob]) -> None:
        for j in jobs:
            self._meta.store_failed[(j.group, j.slot)] = self._meta.store_failed.get((j.group, j.slot), 0) + 1

    def _cancel(self, meta: KVPluginMetadata) -> None:
        """A load failed after its claim: this metadata's stores may hold KV computed over blocks
        that load never wrote.  None of them lands; the scheduler stores them again later."""
        for req in meta.stores:
            self._fail_local([j for j in req.jobs if j.slot >= 0])
            self.finisher.acknowledge([j.key for j in req.jobs])
            first = min(j.position for j in req.jobs)
            self._meta.stores_cancelled[req.req_id] = min(first, self._meta.stores_cancelled.get(req.req_id, first))
        counters.WORKER.add(stores_cancelled=sum(len(r.jobs) for r in meta.stores))

    def _reserve(self, jobs: list[StoreJob]) -> list[ServerTarget]:
        """Server room for each object; objects the server already has (or cannot take) drop out."""
        if not jobs or self.server is None:
            return []
        items = [(self.server.object_id(j.key, j.group), HEADER_SIZE + self.groups[j.group].object_bytes(self.chunk_size))
                 for j in jobs]
        try:
            return self.server.reserve(jobs, items)
        except TierTrouble as e:
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: storing to the server skipped (%s)", e)
            return []

    def _finish(self, entry: PendingStore) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """On the finisher (its copies done): checksums and headers of the local objects, then the
        server's objects committed -- only now does any of them become visible.  (On the
        finisher thread: inference mode as on vLLM's thread, whose tensors these views are.)"""
        try:
            with torch.inference_mode():
                return self._finish_now(entry)
        finally:
            if entry.private is not None:
                self._private.give(entry.private)

    def _finish_now(self, entry: PendingStore) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        known: dict[int, int] = {}  # host address -> payload digest the device computed
        for ticket in entry.tickets:
            known.update(self.engine.checksums(ticket))
        tensors = [self.pool.payload(j.group, j.slot) for j in entry.local]
        payloads = [bytes_of(t) for t in tensors]
        nbytes = sum(p.nbytes for p in payloads)
        hashed = iter(payload_checksums([p for t, p in zip(tensors, payloads) if t.data_ptr() not in known]))
        for job, t, payload in zip(entry.local, tensors, payloads):
            checksum = known[t.data_ptr()] if t.data_ptr() in known else next(hashed)
            header = ChunkHeader.for_payload(self._expect(job.group, job.key, job.position), payload, checksum)
            self.pool.set_header(job.group, job.slot, header.pack())
        nbytes += self._publish(entry.remote, entry.sources, known)
        tokens = [j.hi - j.lo for j in [*entry.local, *(t.job for t in entry.remote)] if j.group == self._token_group]
        counters.WORKER.add(stored_tokens=sum(tokens), stored_bytes=nbytes,
                            store_seconds=time.perf_counter() - entry.t0)
        return [(j.group, j.slot) for j in entry.local], []

    def _publish(self, remote: list[ServerTarget], sources: list[torch.Tensor], known: dict[int, int]) -> int:
        """Each object's checksum: the device's digest of the bytes it computed (``known``, by
        address), or hashed in this process's own memory (``sources``) and then copied into the
        server's pool; its header written, and all committed: the objects become visible only
        now, and a checksum vouches for the bytes this worker computed, never for the pool's.
        An object copied straight into the pool (its source is its pool room) without a device
        digest is not published."""
        if not remote:
            return 0
        direct = [s.data_ptr() == t.payload.data_ptr() for t, s in zip(remote, sources)]
        keep = [i for i, (d, s) in enumerate(zip(direct, sources)) if not d or s.data_ptr() in known]
        if len(keep) < len(remote):
            kept = set(keep)
            lost = [t.oid for i, t in enumerate(remote) if i not in kept]
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: %d objects copied into the server's pool have no device digest; "
                           "not published", len(lost))
            self.server.abort(lost)
            remote, sources, direct = [remote[i] for i in keep], [sources[i] for i in keep], [direct[i] for i in keep]
        payloads = [bytes_of(s) for s in sources]
        try:
            via = [i for i, d in enumerate(direct) if not d]
            checksums = [known.get(s.data_ptr()) for s in sources]
            hashed = hash_then_copy([payloads[i] for i in via], [bytes_of(remote[i].payload) for i in via],
                                    [checksums[i] for i in via])
            for i, c in zip(via, hashed):
                checksums[i] = c
            for t, payload, checksum in zip(remote, payloads, checksums):
                header = ChunkHeader.for_payload(self._expect(t.job.group, t.job.key, t.job.position),
                                                 payload, checksum)
                bytes_of(t.header)[:] = header.pack()
        except Exception:
            self.server.abort([t.oid for t in remote])  # never committed: the server takes the room back
            raise
        try:
            ok = self.server.commit(remote)
        except TierTrouble as e:
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: commit to the server failed (%s)", e)
            return 0
        if not all(ok):
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: the server refused %d of %d objects", ok.count(False), len(ok))
        return sum(p.nbytes for p in payloads)
