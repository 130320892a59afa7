"""Scheduler role: chunk keys per request, lookups, load plans, store decisions.

Runs in vLLM's engine-core process, on the scheduler thread.  Call order per
step (vLLM): ``get_num_new_matched_tokens`` (maybe several times per request,
side-effect free for vLLM) -> ``update_state_after_alloc`` ->
``build_connector_meta`` (once) ... later ``update_connector_output`` with the
workers' aggregated results of an earlier step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.format import HEADER_SIZE
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
from vllm_kvplugin.planner import GroupCost, LoadPlan, max_loadable_tokens, plan_load
from vllm_kvplugin.tiers.local_cpu import LocalIndex, slots_for_budget
from vllm_kvplugin.tiers.mp import ServerIndex, TierTrouble

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
    local_hits: int = 0  # leading chunks in the local tier at the last lookup
    server_hits: int = 0  # leading chunks on the server at the last lookup
    lease: int = 0  # the server lease of the last lookup, until a load takes it over


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
        self.world_size = _common.model_parallel_world(vllm_config)
        self.slot_bytes = sum(c.bytes_per_token for c in self.costs) * self.chunk_size
        self.index = LocalIndex(slots_for_budget(cfg.cpu_bytes, self.slot_bytes), self.slot_bytes)
        self.server = (ServerIndex(cfg, len(self.groups), self.world_size, f"scheduler-{os.getpid()}")
                       if cfg.server else None)
        #: bytes one chunk position occupies on the server (every group and rank, headers included)
        self.server_chunk_bytes = self.world_size * sum(
            HEADER_SIZE + c.bytes_per_token * self.chunk_size for c in self.costs)
        self._load_leases: dict[str, tuple[int, int]] = {}  # req id -> (lease, planned server bytes)
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
        if tr is None or (self.index.num_slots == 0 and self.server is None):
            return 0, False
        if not tr.looked_up:
            tr.looked_up = True
            counters.SCHEDULER.add(lookup_requests=1, lookup_tokens=tr.prompt_len)
        tr.local_hits = self.index.prefix_hits(tr.keys)
        tr.server_hits = self._server_lookup(tr, num_computed_tokens)
        hits = max(tr.local_hits, tr.server_hits)
        tr.plan = plan_load(tr.prompt_len, num_computed_tokens, hits, self.chunk_size, self.costs)
        if tr.plan is None:
            self._release(tr.lease)
            tr.lease = tr.server_hits = 0
            return 0, False
        return tr.plan.num_tokens, False

    def _server_lookup(self, tr: RequestTracker, num_computed_tokens: int) -> int:
        """Leading chunks on the server, pinned under ``tr.lease`` (a repeated lookup drops the old lease)."""
        if self.server is None:
            return 0
        self._release(tr.lease)
        tr.lease = 0
        wanted = max_loadable_tokens(tr.prompt_len, self.chunk_size) // self.chunk_size
        if wanted <= max(tr.local_hits, num_computed_tokens // self.chunk_size):
            return 0  # nothing the server could add
        try:
            found = self.server.lookup(tr.keys[:wanted])
        except TierTrouble as e:
            counters.SCHEDULER.add(server_lookup_errors=1)
            logger.warning("vllm-kvplugin: server lookup failed (%s); the prompt is computed", e)
            return 0
        tr.lease = found.lease
        return found.hits

    def _release(self, lease: int, planned: int | None = None) -> None:
        """Unpin a lease; with ``planned``, compare the bytes the server served with the plan."""
        if not lease or self.server is None:
            return
        try:
            _, served = self.server.release(lease)
        except TierTrouble as e:
            logger.warning("vllm-kvplugin: releasing server lease %d failed (%s); it expires", lease, e)
            return
        if planned is not None:
            counters.SCHEDULER.add(server_planned_bytes=planned, server_served_bytes=served)
            if served != planned:
                counters.SCHEDULER.add(server_bytes_mismatches=1)
                logger.warning("vllm-kvplugin: lease %d planned %d bytes, the server served %d",
                               lease, planned, served)

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
        local_end = min(last_chunk, max(tr.local_hits, plan.first_chunk))
        slots = self.index.pin(tr.keys[plan.first_chunk:local_end])
        jobs = []
        for ci in range(plan.first_chunk, last_chunk):
            local = ci < local_end
            jobs.append(ChunkJob(tr.keys[ci], ci, slots[ci - plan.first_chunk] if local else -1,
                                 blocks_for_chunk(block_ids, ci, self.chunk_size, self.block_sizes),
                                 skip=plan.skip_tokens(ci),
                                 take=min(self.chunk_size, plan.end - ci * self.chunk_size),
                                 lease=0 if local else tr.lease))
        remote = last_chunk - local_end
        if remote:
            self._load_leases[request.request_id] = (tr.lease, remote * self.server_chunk_bytes)
            counters.SCHEDULER.add(server_hit_tokens=min(plan.end, last_chunk * self.chunk_size)
                                   - max(plan.start, local_end * self.chunk_size))
        else:
            self._release(tr.lease)
        tr.lease = 0
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
        """Chunks completed by this step: into the local tier (once per key, while there is room,
        a prefix only) and to the server (past what its lookup found; it drops what it has)."""
        jobs: list[ChunkJob] = []
        local_open = self.index.num_slots > 0
        for ci in range(tr.stored_upto, done):
            key = tr.keys[ci]
            slot = -1
            if local_open and not self.index.contains(key):
                got = self.index.allocate(key)
                if got is None:  # no room: a later chunk without this one is useless
                    counters.SCHEDULER.add(store_skipped_chunks=done - ci)
                    local_open = False
                else:
                    slot, evicted = got
                    if evicted:
                        counters.SCHEDULER.add(evicted_bytes=evicted)
                    self._slot_chunk[slot] = ci
            to_server = self.server is not None and ci >= tr.server_hits
            if slot >= 0 or to_server:
                jobs.append(ChunkJob(key, ci, slot,
                                     blocks_for_chunk(tr.block_ids, ci, self.chunk_size, self.block_sizes),
                                     to_server=to_server))
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
                if rid in self._load_leases:
                    self._release(*self._load_leases.pop(rid))
            else:
                self._load_acks[rid] = acks
        for slot in meta.load_failed:
            self.index.drop(slot)

    def request_finished(self, request: Any) -> None:
        tr = self._reqs.pop(request.request_id, None)
        if tr is not None:
            self._release(tr.lease)  # looked up but never loaded

    def reset_cache(self) -> bool:
        self.index.clear()
        return True
