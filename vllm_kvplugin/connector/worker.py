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
from vllm_kvplugin.chunk.format import ChunkError, ChunkExpect, ChunkHeader, check_chunk, dtype_name
from vllm_kvplugin.chunk.keys import model_fingerprint
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import ChunkJob, KVPluginMetadata, KVPluginWorkerMeta
from vllm_kvplugin.layout import KVLayout, LayoutError, build_layout, certify
from vllm_kvplugin.tiers.local_cpu import LocalPool, slots_for_budget
from vllm_kvplugin.transfer import TransferEngine, engine_for

logger = logging.getLogger(__name__)


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
        self.tp_size, _ = _common.parallel_sizes(vllm_config)
        self.tp_rank = 0
        self.layouts: list[KVLayout] = []
        self.layers: list[list[torch.Tensor]] = []
        self.pool: LocalPool | None = None
        self.device = torch.device("cpu")
        self._invalid_blocks: set[int] = set()
        self._meta = KVPluginWorkerMeta()
        self._pending_stores: list[tuple[list[Any], list[ChunkJob], float]] = []
        self._bytes_per_token = 0
        self.engine: TransferEngine | None = None

    # ------------------------------------------------------------- registration
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build and certify one layout per group, then allocate the pool (start-up errors raise)."""
        self.tp_rank = _common.tp_rank()
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
            logger.info("vllm-kvplugin worker %d: %s", self.tp_rank, layout.describe())
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

    def _expect(self, layout: KVLayout, job: ChunkJob) -> ChunkExpect:
        start = job.chunk_index * self.chunk_size
        return ChunkExpect(self.fingerprint, job.key, int(layout.kind), dtype_name(layout.dtype),
                           layout.chunk_shape(self.chunk_size), start, start + self.chunk_size,
                           self.tp_size, self.tp_rank, layout.group_index)

    def _slots(self, layout: KVLayout, jobs: Sequence[ChunkJob]) -> torch.Tensor:
        """``[C, T]`` paged slots of ``jobs`` in ``layout``'s group."""
        return torch.cat([token_slots(j.block_ids[layout.group_index], layout.block_size,
                                      self.chunk_size, j.skip, j.take) for j in jobs])

    # -------------------------------------------------------------------- loads
    def start_load(self, meta: KVPluginMetadata) -> None:
        """Verify, then scatter every planned chunk; failures become invalid blocks."""
        for req in meta.loads:
            t0 = time.perf_counter()
            good, reason = self._verify(req.req_id, req.jobs)
            moved = [0] * len(self.layouts)
            try:
                if good:
                    self._load_jobs(req.jobs[:good], moved)
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
                    self._meta.load_failed.setdefault(job.slot, reason)
            self._meta.loads_done[req.req_id] = self._meta.loads_done.get(req.req_id, 0) + 1

    def _verify(self, req_id: str, jobs: Sequence[ChunkJob]) -> tuple[int, str | None]:
        """How many leading jobs hold valid chunks, and why the next one does not."""
        assert self.pool is not None
        for n, job in enumerate(jobs):
            try:
                if not 0 <= job.slot < self.pool.num_slots:
                    raise ChunkError("missing", f"slot {job.slot} outside the pool")
                for layout in self.layouts:
                    header = self.pool.header(layout.group_index, job.slot)
                    if header is None:
                        raise ChunkError("missing", f"slot {job.slot} holds no chunk")
                    check_chunk(header, self.pool.payload_bytes(layout.group_index, job.slot),
                                self._expect(layout, job), self.cfg.verify_checksums)
            except ChunkError as e:
                logger.warning("vllm-kvplugin: %s chunk %d not served (%s); recomputing",
                               req_id, job.chunk_index, e)
                return n, e.reason
        return len(jobs), None

    def _load_jobs(self, jobs: Sequence[ChunkJob], moved: list[int]) -> None:
        assert self.pool is not None
        for layout in self.layouts:
            g = layout.group_index
            slots = self._slots(layout, jobs)
            self.engine.load(layout, self.layers[g], slots, [self.pool.payload(g, j.slot) for j in jobs])
            moved[g] += int((slots >= 0).sum()) * layout.bytes_per_token

    # ------------------------------------------------------------------- stores
    def store(self, meta: KVPluginMetadata) -> None:
        """Issue the gathers of every chunk completed by this step's forward."""
        assert self.pool is not None
        jobs = [job for req in meta.stores for job in req.jobs]
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            tickets = []
            for layout in self.layouts:
                g = layout.group_index
                for job in jobs:
                    self.pool.set_header(g, job.slot, None)
                tickets.append(self.engine.store(layout, self.layers[g], self._slots(layout, jobs),
                                                 [self.pool.payload(g, j.slot) for j in jobs]))
        except Exception:
            logger.exception("vllm-kvplugin: store of %d chunks failed", len(jobs))
            self._meta.store_failed.update(j.slot for j in jobs)
            return
        self._pending_stores.append((tickets, jobs, t0))
        self._finish_stores()

    def _finish_stores(self, wait: bool = False) -> None:
        """Write headers (with checksums) for stores whose bytes reached the host."""
        assert self.pool is not None
        still = []
        for tickets, jobs, t0 in self._pending_stores:
            if wait:
                for t in tickets:
                    self.engine.wait(t)
            if not all(self.engine.done(t) for t in tickets):
                still.append((tickets, jobs, t0))
                continue
            nbytes = 0
            for job in jobs:
                for layout in self.layouts:
                    g = layout.group_index
                    payload = self.pool.payload_bytes(g, job.slot)
                    header = ChunkHeader.for_payload(self._expect(layout, job), payload)
                    self.pool.set_header(g, job.slot, header.pack())
                    nbytes += payload.nbytes
                self._meta.stored[job.slot] = self._meta.stored.get(job.slot, 0) + 1
            counters.WORKER.add(stored_tokens=self.chunk_size * len(jobs), stored_bytes=nbytes,
                                store_seconds=time.perf_counter() - t0)
        self._pending_stores = still

    def fence(self) -> None:
        """Before a step's forward: the compute stream must not overwrite blocks stores still read."""
        self.engine.fence()

    # ------------------------------------------------------------------ results
    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_meta(self) -> KVPluginWorkerMeta | None:
        self._finish_stores()
        if self._meta.is_empty():
            return None
        out, self._meta = self._meta, KVPluginWorkerMeta()
        return out
