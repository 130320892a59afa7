"""Scheduler role: chunk keys per request, lookups, load plans, store decisions.

Runs in vLLM's engine-core process, on the scheduler thread.  Call order per
step (vLLM): ``get_num_new_matched_tokens`` (maybe several times per request,
side-effect free for vLLM) -> ``update_state_after_alloc`` ->
``build_connector_meta`` (once) ... later ``update_connector_output`` with the
workers' aggregated results of an earlier step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.keys import chunk_keys, model_fingerprint
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import (
    ChunkJob,
    KVPluginMetadata,
    KVPluginWorkerMeta,
    LoadRequest,
    StoreRequest,
)
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.layout.descriptor import GroupKind
from vllm_kvplugin.planner import GroupCost, LoadPlan, plan_load
from vllm_kvplugin.tiers.local_cpu import LocalIndex, slots_for_budget

logger = logging.getLogger(__name__)

_KINDS = {"attention": GroupKind.ATTENTION, "mla": GroupKind.MLA}


@dataclass
class RequestTracker:
    req_id: str
    prompt_len: int
    keys: list[bytes]  # full prompt chunks
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    num_computed: int = 0
    stored_upto: int = 0  # chunks below this were considered for storing
    plan: LoadPlan | None = None
    looked_up: bool = False


def blocks_for_chunk(block_ids: list[list[int]], chunk_index: int, chunk_size: int,
                     block_sizes: list[int]) -> tuple[tuple[int, ...], ...]:
    out = []
    for ids, bs in zip(block_ids, block_sizes):
        per = chunk_size // bs
        out.append(tuple(ids[chunk_index * per:(chunk_index + 1) * per]))
    return tuple(out)


class SchedulerSide:
    """The scheduler half of :class:`~vllm_kvplugin.connector.KVPluginConnector`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: KVPluginConfig):
        self.cfg = cfg
        self.chunk_size = cfg.chunk_size
        self.groups = _common.group_infos(kv_cache_config)
        for g in self.groups:
            if g.spec_kind not in _KINDS:
                raise LayoutError(
                    f"vllm-kvplugin: KV cache group {g.group_index} has spec {g.spec_kind}; "
                    "supported: full attention, MLA")
            cfg.check_block_size(g.block_size)
        self.block_sizes = [g.block_size for g in self.groups]
        self.costs = [GroupCost(_KINDS[g.spec_kind], bytes_per_token=g.bytes_per_token())
                      for g in self.groups]
        self.fingerprint = model_fingerprint(_common.model_identity(vllm_config, cfg.model_id))
        _, self.world_size = _common.parallel_sizes(vllm_config)
        self.slot_bytes = sum(c.bytes_per_token for c in self.costs) * self.chunk_size
        self.index = LocalIndex(slots_for_budget(cfg.cpu_bytes, self.slot_bytes), self.slot_bytes)
        self._reqs: dict[str, RequestTracker] = {}
        self._pending_loads: list[LoadRequest] = []
        self._load_pins: dict[str, list[int]] = {}
        self._load_acks: dict[str, int] = {}
        self._store_acks: dict[int, int] = {}
        self._slot_chunk: dict[int, int] = {}
        logger.info("vllm-kvplugin scheduler: chunk %d tokens, %d local slots of %d bytes",
                    self.chunk_size, self.index.num_slots, self.slot_bytes)

    # ------------------------------------------------------------------ lookups
    def _tracker(self, request: Any) -> RequestTracker | None:
        tr = self._reqs.get(request.request_id)
        if tr is not None:
            return tr
        ids = _common.request_prompt_ids(request)
        if ids is None:
            return None
        keys = chunk_keys(self.fingerprint, ids, self.chunk_size, _common.request_extras(request))
        tr = RequestTracker(request.request_id, len(ids), keys)
        self._reqs[request.request_id] = tr
        return tr

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tr = self._tracker(request)
        if tr is None or self.index.num_slots == 0:
            return 0, False
        if not tr.looked_up:
            tr.looked_up = True
            counters.SCHEDULER.add(lookup_requests=1, lookup_tokens=tr.prompt_len)
        hits = self.index.prefix_hits(tr.keys)
        tr.plan = plan_load(tr.prompt_len, num_computed_tokens, hits, self.chunk_size, self.costs)
        if tr.plan is None:
            return 0, False
        return tr.plan.num_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tr = self._reqs.get(request.request_id)
        if tr is None or num_external_tokens <= 0 or tr.plan is None:
            return
        plan = tr.plan
        if num_external_tokens != plan.num_tokens:
            # vLLM granted fewer tokens than planned: load exactly what it granted
            plan = LoadPlan(plan.start, plan.start + num_external_tokens, self.chunk_size,
                            tuple(c.bytes_per_token * num_external_tokens for c in self.costs))
        block_ids = [list(b) for b in blocks.get_block_ids()]
        last_chunk = -(-plan.end // self.chunk_size)
        keys = tr.keys[plan.first_chunk:last_chunk]
        slots = self.index.pin(keys)
        jobs = []
        for ci, (key, slot) in enumerate(zip(keys, slots), start=plan.first_chunk):
            end_in_chunk = min(self.chunk_size, plan.end - ci * self.chunk_size)
            jobs.append(ChunkJob(key, ci, slot,
                                 blocks_for_chunk(block_ids, ci, self.chunk_size, self.block_sizes),
                                 skip=plan.skip_tokens(ci),
                                 take=end_in_chunk))
        self._pending_loads.append(LoadRequest(request.request_id, jobs, plan.expected_bytes))
        self._load_pins.setdefault(request.request_id, []).extend(slots)
        counters.SCHEDULER.add(hit_tokens=plan.num_tokens, planned_load_tokens=plan.num_tokens,
                            planned_load_bytes=sum(plan.expected_bytes))
        tr.plan = None

    # ------------------------------------------------------------------- stores
    def build_connector_meta(self, so: Any) -> KVPluginMetadata:
        meta = KVPluginMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for nr in so.scheduled_new_reqs:
            tr = self._reqs.get(nr.req_id)
            if tr is not None:
                tr.block_ids = [list(b) for b in nr.block_ids]
                tr.num_computed = nr.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            tr = self._reqs.get(rid)
            if tr is None:
                continue
            new = cached.new_block_ids[i]
            if rid in resumed:
                tr.block_ids = [list(b) for b in (new or ())]
            elif new:
                for g, ids in enumerate(new):
                    tr.block_ids[g].extend(ids)
            tr.num_computed = cached.num_computed_tokens[i]
        for rid, n_sched in so.num_scheduled_tokens.items():
            tr = self._reqs.get(rid)
            if tr is None or not tr.block_ids:
                continue
            done = min(tr.num_computed + n_sched, tr.prompt_len) // self.chunk_size
            jobs = self._store_jobs(tr, done)
            if jobs:
                meta.stores.append(StoreRequest(rid, jobs))
        return meta

    def _store_jobs(self, tr: RequestTracker, done: int) -> list[ChunkJob]:
        jobs: list[ChunkJob] = []
        for ci in range(tr.stored_upto, done):
            key = tr.keys[ci]
            if self.index.contains(key):
                continue
            got = self.index.allocate(key)
            if got is None:  # no room: a later chunk without this one is useless
                counters.SCHEDULER.add(store_skipped_chunks=done - ci)
                break
            slot, evicted = got
            if evicted:
                counters.SCHEDULER.add(evicted_bytes=evicted)
            self._slot_chunk[slot] = ci
            jobs.append(ChunkJob(key, ci, slot,
                                 blocks_for_chunk(tr.block_ids, ci, self.chunk_size, self.block_sizes)))
        tr.stored_upto = max(tr.stored_upto, done)
        self.index.touch(tr.keys[:done])
        return jobs

    # ---------------------------------------------------------- worker results
    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVPluginWorkerMeta):
            return
        for slot in sorted(meta.stored, key=lambda s: -self._slot_chunk.get(s, 0)):
            acks = self._store_acks.get(slot, 0) + meta.stored[slot]
            if acks >= self.world_size:
                self._store_acks.pop(slot, None)
                self._slot_chunk.pop(slot, None)
                self.index.commit(slot, slot not in meta.store_failed)
            else:
                self._store_acks[slot] = acks
        for slot in meta.store_failed:
            if slot not in meta.stored:
                self._store_acks.pop(slot, None)
                self._slot_chunk.pop(slot, None)
                self.index.commit(slot, False)
        for rid, n in meta.loads_done.items():
            acks = self._load_acks.get(rid, 0) + n
            if acks >= self.world_size:
                self._load_acks.pop(rid, None)
                for slot in self._load_pins.pop(rid, []):
                    self.index.unpin(slot)
            else:
                self._load_acks[rid] = acks
        for slot in meta.load_failed:
            self.index.drop(slot)

    def request_finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)

    def reset_cache(self) -> bool:
        self.index.clear()
        return True
