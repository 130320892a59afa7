"""Worker role: layouts at registration, loads before attention, stores after the forward.

Runs in each vLLM worker process.  Call order per step (vLLM): metadata bound
-> ``start_load`` (before the forward whenever a request has a synchronous
load, which is all this connector asks for) -> forward -> ``store`` (from
``wait_for_save``) -> ``take_invalid_blocks`` / ``take_meta``.

Nothing here may crash the engine or serve doubtful KV: every load checks the
chunk header and checksum before a byte reaches the KV cache, any failure is
counted by reason and reported to vLLM as invalid blocks (vLLM recomputes
them), and store failures only drop the chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.checksums import payload_checksums
from vllm_kvplugin.chunk.format import (
    HEADER_SIZE,
    ChunkError,
    ChunkExpect,
    ChunkHeader,
    check_chunk,
    dtype_name,
)
from vllm_kvplugin.chunk.keys import model_fingerprint
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import ChunkJob, KVPluginMetadata, KVPluginWorkerMeta
from vllm_kvplugin.layout import KVLayout, LayoutError, build_layout, certify
from vllm_kvplugin.tiers.local_cpu import LocalPool, slots_for_budget
from vllm_kvplugin.tiers.mp import ServerStore, TierTrouble
from vllm_kvplugin.transfer import TransferEngine, engine_for

logger = logging.getLogger(__name__)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def token_slots(block_ids: Sequence[int], block_size: int, chunk_size: int, skip: int = 0,
                take: int = -1) -> torch.Tensor:
    """``[1, T]`` paged slots of a chunk's tokens; tokens outside ``[skip, take)`` are -1."""
    take = chunk_size if take < 0 else take
    t = torch.arange(chunk_size, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if blocks.numel() * block_size != chunk_size:
        raise ChunkError("plan", f"{blocks.numel()} blocks of {block_size} for a chunk of {chunk_size}")
    slots = blocks[t // block_size] * block_size + t % block_size
    slots[:skip] = -1
    slots[take:] = -1
    return slots.view(1, chunk_size)


class WorkerSide:
    """The worker half of :class:`~vllm_kvplugin.connector.KVPluginConnector`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: KVPluginConfig,
                 adapter: Any, vllm_version: str):
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.adapter = adapter
        self.vllm_version = vllm_version
        self.chunk_size = cfg.chunk_size
        self.fingerprint = model_fingerprint(_common.model_identity(vllm_config, cfg.model_id))
        self.rank, self.world = 0, _common.model_parallel_world(vllm_config)
        self.server: ServerStore | None = None
        self.layouts: list[KVLayout] = []
        self.layers: list[list[torch.Tensor]] = []
        self.pool: LocalPool | None = None
        self.device = torch.device("cpu")
        self._invalid_blocks: set[int] = set()
        self._meta = KVPluginWorkerMeta()
        self._pending_stores: list[tuple[list[Any], list[ChunkJob], list, float]] = []
        self._bytes_per_token = 0
        self.engine: TransferEngine | None = None

    # ------------------------------------------------------------- registration
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build and certify one layout per group, then allocate the pool (start-up errors raise)."""
        self.rank, self.world = _common.model_parallel_rank(self.vllm_config)
        sources = self.adapter.describe_groups(self.vllm_config, self.kv_cache_config, kv_caches,
                                               self.vllm_version)
        expected = _common.group_infos(self.kv_cache_config)
        for (src, tensors), info in zip(sources, expected):
            layout, layers = build_layout(src, tensors)
            if layout.bytes_per_token != info.bytes_per_token():
                raise LayoutError(
                    f"vllm-kvplugin: {layout.describe()} holds {layout.bytes_per_token} bytes per "
                    f"token but the KV cache spec implies {info.bytes_per_token()}")
            if self.cfg.certify:
                certify(layout, layers)
            logger.info("vllm-kvplugin worker %d/%d: %s", self.rank, self.world, layout.describe())
            self.layouts.append(layout)
            self.layers.append(layers)
        self.device = self.layers[0][0].device
        self.engine = engine_for(self.device)
        self._bytes_per_token = sum(lay.bytes_per_token for lay in self.layouts)
        slot_bytes = sum(lay.chunk_nbytes(self.chunk_size) for lay in self.layouts)
        num_slots = slots_for_budget(self.cfg.cpu_bytes, slot_bytes)
        pin = self.device.type == "cuda"
        self.pool = LocalPool([lay.chunk_shape(self.chunk_size) for lay in self.layouts],
                              [lay.dtype for lay in self.layouts], num_slots, pin_memory=pin)
        if self.cfg.server:
            self.server = ServerStore(self.cfg, self.rank, self.world, f"worker{self.rank}", pin_for_cuda=pin)

    def _expect(self, layout: KVLayout, job: ChunkJob) -> ChunkExpect:
        start = job.chunk_index * self.chunk_size
        return ChunkExpect(self.fingerprint, job.key, int(layout.kind), dtype_name(layout.dtype),
                           layout.chunk_shape(self.chunk_size), start, start + self.chunk_size,
                           self.world, self.rank, layout.group_index)

    def _slots(self, layout: KVLayout, jobs: Sequence[ChunkJob]) -> torch.Tensor:
        """``[C, T]`` paged slots of ``jobs`` in ``layout``'s group."""
        return torch.cat([token_slots(j.block_ids[layout.group_index], layout.block_size,
                                      self.chunk_size, j.skip, j.take) for j in jobs])

    # -------------------------------------------------------------------- loads
    def start_load(self, meta: KVPluginMetadata) -> None:
        """Verify, then scatter every planned chunk; failures become invalid blocks."""
        for req in meta.loads:
            t0 = time.perf_counter()
            moved = [0] * len(self.layouts)
            try:
                bufs, good, reason = self._sources(req.req_id, req.jobs)
                if good:
                    self._load_jobs(req.jobs[:good], bufs, moved)
                if reason is None and tuple(moved) != tuple(req.expected_bytes):
                    good, reason = 0, "byte_mismatch"
                    logger.warning("vllm-kvplugin: %s moved %s bytes, planned %s; recomputing",
                                   req.req_id, moved, list(req.expected_bytes))
            except Exception:  # never crash the engine: recompute instead
                logger.exception("vllm-kvplugin: load of %s failed; recomputing", req.req_id)
                good, reason = 0, "error"
            if reason is None:
                counters.WORKER.add(loaded_tokens=sum(moved) // max(1, self._bytes_per_token),
                                    loaded_bytes=sum(moved), load_seconds=time.perf_counter() - t0)
            else:
                counters.WORKER.failure(reason)
                block_size = self.layouts[0].block_size
                for job in req.jobs[good:]:
                    self._invalid_blocks.update(job.block_ids[0][job.skip // block_size:])
                    if job.slot >= 0:
                        self._meta.load_failed.setdefault(job.slot, reason)
            self._meta.loads_done[req.req_id] = self._meta.loads_done.get(req.req_id, 0) + 1

    def _sources(self, req_id: str, jobs: Sequence[ChunkJob]) -> tuple[list[list[torch.Tensor]], int, str | None]:
        """Per group, the checked host chunks of the leading valid jobs; how many; why not more."""
        bufs: list[list[torch.Tensor]] = [[] for _ in self.layouts]
        remote: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layouts]
        trouble: TierTrouble | None = None
        leased = [j for j in jobs if j.lease]
        if leased:
            try:
                if self.server is None:
                    raise TierTrouble("server_unavailable", "no server configured in this worker")
                for layout in self.layouts:
                    offs = self.server.resolve(leased[0].lease, [j.key for j in leased], layout.group_index)
                    remote[layout.group_index] = [self.server.views(o, n) for o, n in offs]
            except TierTrouble as e:
                trouble = e
        n_remote = 0
        checked: list[list[tuple[int, memoryview, torch.Tensor]]] = []  # per job, per group
        failure: tuple[int, ChunkError | TierTrouble] | None = None
        for n, job in enumerate(jobs):
            try:
                got = []
                for layout in self.layouts:
                    g = layout.group_index
                    if job.lease:
                        if trouble is not None:
                            raise trouble
                        header_t, payload_t = remote[g][n_remote]
                        header, payload = bytes(header_t.numpy()), payload_t
                    else:
                        if self.pool is None or not 0 <= job.slot < self.pool.num_slots:
                            raise ChunkError("missing", f"slot {job.slot} outside the pool")
                        header, payload = self.pool.header(g, job.slot), self.pool.payload(g, job.slot)
                        if header is None:
                            raise ChunkError("missing", f"slot {job.slot} holds no chunk")
                    expect = self._expect(layout, job)
                    data = _bytes_of(payload)
                    checksum = check_chunk(header, data, expect, verify_checksum=False).checksum
                    got.append((checksum, data, payload.view(layout.dtype).view(1, *expect.shape)))
                checked.append(got)
                n_remote += bool(job.lease)
            except (ChunkError, TierTrouble) as e:
                failure = (n, e)
                break
        if self.cfg.verify_checksums:  # every payload hashed (in parallel) before any byte moves
            sums = iter(payload_checksums([data for got in checked for _, data, _ in got]))
            for n, got in enumerate(checked):
                if any(want != next(sums) for want, _, _ in got):
                    failure = (n, ChunkError("checksum", "payload bytes do not match the header checksum"))
                    checked = checked[:n]
                    break
        for got in checked:
            for g, (_, _, t) in enumerate(got):
                bufs[g].append(t)
        if failure is not None:
            n, e = failure
            logger.warning("vllm-kvplugin: %s chunk %d not served (%s); recomputing",
                           req_id, jobs[n].chunk_index, e)
            return bufs, n, e.reason
        return bufs, len(jobs), None

    def _load_jobs(self, jobs: Sequence[ChunkJob], bufs: list[list[torch.Tensor]], moved: list[int]) -> None:
        for layout in self.layouts:
            g = layout.group_index
            slots = self._slots(layout, jobs)
            self.engine.load(layout, self.layers[g], slots, bufs[g])
            moved[g] += int((slots >= 0).sum()) * layout.bytes_per_token

    # ------------------------------------------------------------------- stores
    def store(self, meta: KVPluginMetadata) -> None:
        """Issue the gathers of every chunk completed by this step's forward."""
        jobs = [job for req in meta.stores for job in req.jobs]
        if not jobs:
            return
        t0 = time.perf_counter()
        local = [j for j in jobs if j.slot >= 0]
        remote = self._reserve([j for j in jobs if j.to_server])
        try:
            tickets = []
            for layout in self.layouts:
                g = layout.group_index
                targets: list[tuple[ChunkJob, torch.Tensor]] = []
                for job in local:
                    self.pool.set_header(g, job.slot, None)
                    targets.append((job, self.pool.payload(g, job.slot)))
                for job, views in remote:
                    targets.append((job, views[g][1].view(layout.dtype).view(1, *layout.chunk_shape(self.chunk_size))))
                if targets:
                    tickets.append(self.engine.store(layout, self.layers[g], self._slots(layout, [j for j, _ in targets]),
                                                     [t for _, t in targets]))
        except Exception:
            logger.exception("vllm-kvplugin: store of %d chunks failed", len(jobs))
            self._meta.store_failed.update(j.slot for j in local)
            if remote and self.server is not None:
                self.server.abort([oid for job, _ in remote for oid in self._oids(job)])
            return
        self._pending_stores.append((tickets, local, remote, t0))
        self._finish_stores()

    def _oids(self, job: ChunkJob) -> list[bytes]:
        assert self.server is not None
        return [self.server.object_id(job.key, lay.group_index) for lay in self.layouts]

    def _reserve(self, jobs: list[ChunkJob]) -> list[tuple[ChunkJob, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Server room for every group of each job; jobs the server already has (or cannot take) drop out."""
        if not jobs or self.server is None:
            return []
        sizes = [HEADER_SIZE + lay.chunk_nbytes(self.chunk_size) for lay in self.layouts]
        try:
            offs = self.server.reserve([(oid, n) for job in jobs for oid, n in zip(self._oids(job), sizes)])
            out, unwanted = [], []
            G = len(self.layouts)
            for i, job in enumerate(jobs):
                mine = offs[i * G:(i + 1) * G]
                if all(o is not None for o in mine):
                    out.append((job, [self.server.views(o, n) for o, n in zip(mine, sizes)]))
                else:  # already on the server (or no room): give back what was reserved
                    unwanted += [oid for oid, o in zip(self._oids(job), mine) if o is not None]
            if unwanted:
                self.server.abort(unwanted)
            return out
        except TierTrouble as e:
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: storing to the server skipped (%s)", e)
            return []

    def _finish_stores(self, wait: bool = False) -> None:
        """Write headers (with checksums) of stores whose bytes reached the host; publish them.

        Called after issuing stores (``wait=False``: whatever is done already) and
        at the end of every step (``wait=True``). The end of a step waits for the
        step's DMAs: the scheduler learns of a stored chunk only from a step's
        output, and an idle engine runs no further step, so a store finished
        later would stay invisible to the next request (measured on the H200: a
        repeated 16k-token prompt missed). The wait costs the step the rest of its
        stores' link time, as vLLM's own CPU offloading pays in its cold requests.
        """
        still = []
        for tickets, local, remote, t0 in self._pending_stores:
            if wait:
                for t in tickets:
                    self.engine.wait(t)
            elif not all(self.engine.done(t) for t in tickets):
                still.append((tickets, local, remote, t0))
                continue
            payloads = [_bytes_of(self.pool.payload(lay.group_index, job.slot))
                        for job in local for lay in self.layouts]
            done = iter(zip(payloads, payload_checksums(payloads)))
            nbytes = sum(p.nbytes for p in payloads)
            for job in local:
                for layout in self.layouts:
                    g = layout.group_index
                    header = ChunkHeader.for_payload(self._expect(layout, job), *next(done))
                    self.pool.set_header(g, job.slot, header.pack())
                self._meta.stored[job.slot] = self._meta.stored.get(job.slot, 0) + 1
            nbytes += self._publish(remote)
            counters.WORKER.add(stored_tokens=self.chunk_size * (len(local) + len(remote)), stored_bytes=nbytes,
                                store_seconds=time.perf_counter() - t0)
        self._pending_stores = still

    def _publish(self, remote) -> int:
        """Headers into the server's pool, then commit: the objects become visible only now."""
        if not remote:
            return 0
        payloads = [_bytes_of(payload_t) for _, views in remote for _, payload_t in views]
        done = iter(zip(payloads, payload_checksums(payloads)))
        nbytes = sum(p.nbytes for p in payloads)
        oids = []
        for job, views in remote:
            for layout, (header_t, _) in zip(self.layouts, views):
                header = ChunkHeader.for_payload(self._expect(layout, job), *next(done)).pack()
                header_t.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            oids += self._oids(job)
        try:
            ok = self.server.commit(oids)
        except TierTrouble as e:
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: commit to the server failed (%s)", e)
            return 0
        if not all(ok):
            counters.WORKER.add(server_store_errors=1)
            logger.warning("vllm-kvplugin: the server refused %d of %d objects", ok.count(False), len(ok))
        return nbytes

    def fence(self) -> None:
        """Before a step's forward: the compute stream must not overwrite blocks stores still read."""
        self.engine.fence()

    # ------------------------------------------------------------------ results
    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_meta(self) -> KVPluginWorkerMeta | None:
        self._finish_stores(wait=True)
        if self._meta.is_empty():
            return None
        out, self._meta = self._meta, KVPluginWorkerMeta()
        return out
