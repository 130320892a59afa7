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

from vllm_kvplugin import counters, ops
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.format import ChunkError, ChunkExpect, ChunkHeader, check_chunk
from vllm_kvplugin.chunk.keys import model_fingerprint
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import ChunkJob, KVPluginMetadata, KVPluginWorkerMeta
from vllm_kvplugin.layout import KVLayout, LayoutError, build_layout, certify
from vllm_kvplugin.tiers.local_cpu import LocalPool, slots_for_budget

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
        slot_bytes = sum(lay.chunk_nbytes(self.chunk_size) for lay in self.layouts)
        num_slots = slots_for_budget(self.cfg.cpu_bytes, slot_bytes)
        pin = self.device.type == "cuda"
        self.pool = LocalPool([lay.chunk_shape(self.chunk_size) for lay in self.layouts],
                              [lay.dtype for lay in self.layouts], num_slots, pin_memory=pin)

    def _expect(self, layout: KVLayout, job: ChunkJob) -> ChunkExpect:
        start = job.chunk_index * self.chunk_size
        return ChunkExpect(self.fingerprint, job.key, int(layout.kind), layout.dtype,
                           layout.chunk_shape(self.chunk_size), start, start + self.chunk_size,
                           self.tp_size, self.tp_rank, layout.group_index)

    def _slots(self, layout: KVLayout, job: ChunkJob) -> torch.Tensor:
        s = token_slots(job.block_ids[layout.group_index], layout.block_size, self.chunk_size,
                        job.skip, job.take)
        return s.to(self.device)

    def _move(self, to_chunk: bool, layout: KVLayout, slots: torch.Tensor, chunk: torch.Tensor) -> None:
        """One gather/scatter between the paged cache and a pool chunk (staged via the device)."""
        layers = self.layers[layout.group_index]
        fn = ops.gather if to_chunk else ops.scatter
        if chunk.device == self.device:
            fn(layers, slots, layout.strides, layout.block_size, layout.kernel_block_size,
               layout.num_blocks, chunk)
            return
        staging = chunk.to(self.device, non_blocking=False) if not to_chunk else torch.empty_like(chunk, device=self.device)
        fn(layers, slots, layout.strides, layout.block_size, layout.kernel_block_size,
           layout.num_blocks, staging)
        if to_chunk:
            chunk.copy_(staging)
        else:
            torch.cuda.current_stream().synchronize()

    # -------------------------------------------------------------------- loads
    def start_load(self, meta: KVPluginMetadata) -> None:
        for req in meta.loads:
            t0 = time.perf_counter()
            moved = [0] * len(self.layouts)
            failed_at = None
            reason = ""
            try:
                for n, job in enumerate(req.jobs):
                    try:
                        self._load_job(job, moved)
                    except ChunkError as e:
                        failed_at, reason = n, e.reason
                        self._meta.load_failed[job.slot] = e.reason
                        logger.warning("vllm-kvplugin: load of %s chunk %d failed (%s); recomputing",
                                       req.req_id, job.chunk_index, e)
                        break
                if failed_at is None and tuple(moved) != tuple(req.expected_bytes):
                    failed_at, reason = 0, "byte_mismatch"
                    logger.warning("vllm-kvplugin: %s moved %s bytes, planned %s; recomputing",
                                   req.req_id, moved, list(req.expected_bytes))
            except Exception:  # never crash the engine: recompute instead
                logger.exception("vllm-kvplugin: load of %s failed", req.req_id)
                failed_at, reason = 0 if failed_at is None else failed_at, "error"
            if failed_at is None:
                counters.WORKER.add(loaded_tokens=sum(j.take - j.skip if j.take >= 0 else self.chunk_size - j.skip for j in req.jobs),
                                 loaded_bytes=sum(moved), load_seconds=time.perf_counter() - t0)
            else:
                counters.WORKER.failure(reason)
                for job in req.jobs[failed_at:]:
                    first = job.skip // self.layouts[0].block_size
                    self._invalid_blocks.update(job.block_ids[0][first:])
            self._meta.loads_done[req.req_id] = self._meta.loads_done.get(req.req_id, 0) + 1

    def _load_job(self, job: ChunkJob, moved: list[int]) -> None:
        assert self.pool is not None
        if not 0 <= job.slot < self.pool.num_slots:
            raise ChunkError("missing", f"slot {job.slot} outside the pool")
        for layout in self.layouts:  # verify every group before writing anything
            header = self.pool.header(layout.group_index, job.slot)
            if header is None:
                raise ChunkError("missing", f"slot {job.slot} holds no chunk")
            check_chunk(header, self.pool.payload_bytes(layout.group_index, job.slot),
                        self._expect(layout, job), self.cfg.verify_checksums)
        for layout in self.layouts:
            slots = self._slots(layout, job)
            self._move(False, layout, slots, self.pool.payload(layout.group_index, job.slot))
            moved[layout.group_index] += int((slots >= 0).sum()) * layout.bytes_per_token

    # ------------------------------------------------------------------- stores
    def store(self, meta: KVPluginMetadata) -> None:
        assert self.pool is not None
        for req in meta.stores:
            for job in req.jobs:
                t0 = time.perf_counter()
                try:
                    nbytes = self._store_job(job)
                except Exception:
                    logger.exception("vllm-kvplugin: store of %s chunk %d failed", req.req_id, job.chunk_index)
                    for layout in self.layouts:
                        self.pool.set_header(layout.group_index, job.slot, None)
                    self._meta.store_failed.add(job.slot)
                    continue
                counters.WORKER.add(stored_tokens=self.chunk_size, stored_bytes=nbytes,
                                 store_seconds=time.perf_counter() - t0)
                self._meta.stored[job.slot] = self._meta.stored.get(job.slot, 0) + 1

    def _store_job(self, job: ChunkJob) -> int:
        assert self.pool is not None
        nbytes = 0
        for layout in self.layouts:
            g = layout.group_index
            self.pool.set_header(g, job.slot, None)
            self._move(True, layout, self._slots(layout, job), self.pool.payload(g, job.slot))
            payload = self.pool.payload_bytes(g, job.slot)
            header = ChunkHeader.for_payload(self._expect(layout, job), payload)
            self.pool.set_header(g, job.slot, header.pack())
            nbytes += payload.nbytes
        return nbytes

    # ------------------------------------------------------------------ results
    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def take_meta(self) -> KVPluginWorkerMeta | None:
        if self._meta.is_empty():
            return None
        out, self._meta = self._meta, KVPluginWorkerMeta()
        return out
