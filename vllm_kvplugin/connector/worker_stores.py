"""The store half of the worker role: KV a step computed, copied into the tiers.

:class:`StorePath` is mixed into :class:`~vllm_kvplugin.connector.worker.WorkerSide` and uses
what its registration built (layouts, layer tensors, the local pool, the server store, the
transfer engine, the finisher and the private staging memory).  vLLM's thread calls
:meth:`StorePath.store` from ``wait_for_save``, after the step's forward: it issues the
gathers and copies and returns while they may still be in flight; the finisher thread calls
:meth:`StorePath._finish` once they are done (checksums, headers, the server's commit).  Nothing
stored is visible before that; a store of metadata built before a failed load was known is
dropped whole (the provenance rule).
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
from vllm_kvplugin.layout.descriptor import GroupKind
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
        if meta.epoch <= self._failed_epoch:
            self._cancel(meta)
            return
        t0 = time.perf_counter()
        keys = [j.key for j in jobs]
        local = [j for j in jobs if j.slot >= 0]
        remote = self._reserve([j for j in jobs if j.to_server])
        try:
            tickets = []
            # server objects are gathered into this process's own memory (transfer/host_buffers.py)
            sources, private = [], None
            if remote:
                sources, private = self._private.take_slices([t.payload.numel() for t in remote])
                if len(sources) < len(remote):  # no room for the rest: not sent (never waited for)
                    skipped, remote = remote[len(sources):], remote[:len(sources)]
                    counters.WORKER.add(server_store_skipped=len(skipped))
                    self.server.abort([t.oid for t in skipped])
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
                if spec.kind is GroupKind.RECURRENT:  # the state at the step's end, read now
                    for job, t in targets:
                        gather_state(self.layers[g], job.block_ids[0], t.view(spec.num_layers, -1))
                    continue
                slots = self.object_slots([j for j, _ in targets])
                tickets.append(self.engine.store(self.layouts[g], self.layers[g], slots, [t for _, t in targets]))
        except Exception:
            logger.exception("vllm-kvplugin: store of %d objects failed", len(jobs))
            self._fail_local(local)
            self.finisher.acknowledge(keys)
            if remote and self.server is not None:
                counters.WORKER.add(server_store_errors=1)
                self.server.abort([t.oid for t in remote])
            if private is not None:
                self._give_back_after_failure(private, tickets)
            return
        self.finisher.submit(PendingStore(tickets, local, remote, keys, t0, sources, private))

    def _give_back_after_failure(self, private: torch.Tensor, tickets: list) -> None:
        """Staging room of a store that failed while it was issued: back once the device has
        finished every copy issued before the failure (which may still write it; the tickets'
        paced copies issued first); kept out of use for good when even that cannot be known."""
        try:
            for t in tickets:
                try:
                    self.engine.wait(t)
                except RuntimeError:
                    pass  # a DMA that failed to issue writes nothing
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:
            logger.exception("vllm-kvplugin: %d bytes of server staging memory are kept out of use",
                             private.numel())
            return
        self._private.give(private)

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
        """Each object hashed in this process's own memory (``sources``; or on the device, before
        its copy to there: ``known``, by address), then copied into the server's pool, its header
        written, and all committed: the objects become visible only now, and a checksum vouches
        for the bytes this worker computed, not for the pool's."""
        if not remote:
            return 0
        payloads = [bytes_of(s) for s in sources]
        try:
            checksums = hash_then_copy(payloads, [bytes_of(t.payload) for t in remote],
                                       [known.get(s.data_ptr()) for s in sources])
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
