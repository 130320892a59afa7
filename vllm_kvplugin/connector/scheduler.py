"""Scheduler role: chunk keys per request, lookups, verified hits, store decisions.

Runs in vLLM's engine-core process, on the scheduler thread.  Call order per
step (vLLM): ``get_num_new_matched_tokens`` (per waiting request) ->
``update_state_after_alloc`` -> ``build_connector_meta`` (once) ... later
``update_connector_output`` with the workers' aggregated results of an earlier
step.

A hit is claimed only once every rank verified its bytes (DESIGN.md rule 7):

1. the first ``get_num_new_matched_tokens`` looks the prompt up (local tier,
   cache server: its answer is waited for briefly, :data:`LOOKUP_GRACE_S`, else
   asked for again next step), pins what the plan needs and answers ``None``:
   vLLM holds the request back and asks again next step, while the workers fetch
   and verify;
2. their verdict arrives through ``update_connector_output`` (in an engine of one
   rank, straight from the worker half: ``connector/verdicts.py``);
3. the next ``get_num_new_matched_tokens`` plans again from the verified objects
   only and claims that many tokens; ``update_state_after_alloc`` turns the plan
   into loads of those verified bytes.

A request alone in an engine of one rank that runs both halves in one process goes
through the same three in one call: the lookup has the worker half fetch and verify
at once and waits for the verdict (``connector/scheduler_lone.py``), so the hit is
claimed in the step that looked it up.

So no step ever computes over blocks a failed load did not write.  Should a load
fail anyway after its claim (a copy error), the workers report its blocks to vLLM
and drop every store of that step, and this side moves ``stored_upto`` back and
bumps the metadata epoch so that no store computed over those blocks lands.  Under
vLLM's ``recompute`` policy those blocks, and what was computed over them, are
reported in every step until recomputed (``connector/bad_blocks.py``), and the
chunks of a request that computed over one are not stored.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.format import HEADER_SIZE
from vllm_kvplugin.chunk.keys import chunk_keys, model_fingerprint
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.bad_blocks import BadBlocks
from vllm_kvplugin.connector.metadata import (
    IDLE_WAIT_S,
    FetchJob,
    FetchRequest,
    KVPluginMetadata,
    KVPluginWorkerMeta,
    LoadJob,
    LoadRequest,
    Placement,
    StoreRequest,
)
from vllm_kvplugin.connector.scheduler_lone import LONE_LOOKUP_WAIT_S, LoneFetch
from vllm_kvplugin.connector.scheduler_stores import StoreDecisions
from vllm_kvplugin.connector.tracker import Fetch, RequestTracker
from vllm_kvplugin.connector.verdicts import open_box
from vllm_kvplugin.layout.build import LayoutError
from vllm_kvplugin.planner import LoadPlan, ObjectLoad, max_loadable_tokens, plan_load
from vllm_kvplugin.tiers.local_cpu import LocalIndex, slots_for_budget
from vllm_kvplugin.tiers.mp import Lookup, ServerIndex, TierTrouble

logger = logging.getLogger(__name__)

#: a server lookup is still on its way (``SchedulerSide._lookup``)
_ASKING = object()

#: how long one step's matching may wait, in all, for the cache server's answers to the lookups
#: it sends (the GIL released) before it holds their requests back a step instead.  A server on
#: the node answers in well under a millisecond; a request held back waits a whole step (on the
#: H200 an idle engine's step took 2.4 ms, a busy one's tens of milliseconds).
LOOKUP_GRACE_S = 0.002

#: how long the server's answer that it holds nothing a request could use stands for that
#: request, until vLLM first schedules it.  vLLM asks again about a request it did not schedule
#: (no token budget, no free blocks), often every step; each such ask would send one more lookup
#: and could hold the request back one more step.  Reusing the answer can only miss a hit
#: stored meanwhile: that prompt is then computed, which is always correct.  A request vLLM
#: scheduled (then preempted) is asked afresh: its own chunks may be on the server by then.
MISS_REUSE_S = 1.0


def _server_job(key: bytes, o: ObjectLoad, found: Lookup) -> FetchJob:
    """The job of planned object ``o`` of server hit ``found``, placed where the lookup said."""
    where = found.resolved.get((o.group, o.position))
    placed = Placement(found.instance, where[0], where[1], found.placed_until) if where else None
    return FetchJob(key, o.position, o.group, lease=found.lease, placed=placed)


class SchedulerSide(StoreDecisions, LoneFetch):
    """The scheduler half of :class:`~vllm_kvplugin.connector.KVPluginConnector`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: KVPluginConfig):
        self.cfg = cfg
        self.groups = _common.group_specs(kv_cache_config, vllm_config)
        for g in self.groups:
            why = g.unsupported()
            if why:
                raise LayoutError(f"vllm-kvplugin: {g.describe()}: {why}")
        self.chunk_size = cfg.resolve_chunk_size([g.block_size for g in self.groups])
        self.state_groups = [g for g in self.groups if g.is_state]
        #: a speculative drafter's last row of a chunk saw the next token: as vLLM does, a hit
        #: leaves the drafter its last chunk to recompute
        self.drafter = any(g.drafter for g in self.groups)
        _common.check_pipeline_split(vllm_config)
        self.fingerprint = model_fingerprint(_common.model_identity(vllm_config, cfg.model_id))
        self.namespace = b""  # a new random one after each reset_cache
        self.world_size = _common.model_parallel_world(vllm_config)
        object_bytes = [g.object_bytes(self.chunk_size) for g in self.groups]
        num_slots = slots_for_budget(cfg.cpu_bytes, object_bytes)
        self.local = [LocalIndex(num_slots, n) for n in object_bytes]
        self.server = (ServerIndex(cfg, [g.need(self.chunk_size) for g in self.groups], self.world_size,
                                   f"scheduler-{os.getpid()}", self.fingerprint) if cfg.server else None)
        #: bytes one object occupies on the server, per group (every rank, header included)
        self.server_object_bytes = [self.world_size * (HEADER_SIZE + n) for n in object_bytes]
        self.fetch_timeout_s = 2 * cfg.server_timeout_s + 5.0
        #: how long a lookup waits for this engine's own stores of the prompt to land
        self.store_wait_s = 2.0
        self._storing: dict[bytes, int] = {}  # chunk key -> store acknowledgements still due
        self.epoch = 0
        self._reqs: dict[str, RequestTracker] = {}
        self._pending_fetches: list[FetchRequest] = []
        self._pending_loads: list[LoadRequest] = []
        self._forget: list[str] = []
        self._holds: dict[str, tuple[list[tuple[int, int]], int, int]] = {}  # req -> pins, lease, server bytes
        self._load_acks: dict[str, int] = {}
        self._store_acks: dict[tuple[int, int], tuple[int, bool]] = {}  # (group, slot) -> acks, any failed
        self._slot_chunk: dict[tuple[int, int], int] = {}
        self._started: set[str] = set()  # requests scheduled and not finished (any of them)
        self._holding = False  # this step's scheduling held a request back for this connector
        self._fetches = 0  # fetches issued (their serials)
        #: blocks reported to vLLM until recomputed (``recompute`` policy, one KV cache group)
        self._bad = BadBlocks.for_policy(cfg.load_failure_policy, self.groups, _common.async_scheduling(vllm_config),
                                         _common.v2_model_runner(vllm_config))
        self._loaded_now: set[int] = set()  # blocks loaded at allocation since the last metadata
        self._grace_left = LOOKUP_GRACE_S  # of this step's wait for server lookups
        self._verdicts = open_box(_common.engine_id(vllm_config))  # a one-process engine's verdicts
        logger.info("vllm-kvplugin scheduler: chunk %d tokens, %d local slots per group, groups: %s",
                    self.chunk_size, num_slots, "; ".join(g.describe() for g in self.groups))

    # ------------------------------------------------------------------ lookups
    def _tracker(self, request: Any) -> RequestTracker | None:
        tr = self._reqs.get(request.request_id)
        if tr is not None:
            return tr
        ids = _common.request_prompt_ids(request)
        if ids is None:
            return None
        extras = _common.request_extras(request)
        self._wake_server(request.request_id)
        first = self._first_keys(request, ids)  # a lone request's lookup may start on its first chunks
        keys = chunk_keys(self.fingerprint, ids[:first * self.chunk_size] if first else ids, self.chunk_size,
                          extras, namespace=self.namespace)
        tr = RequestTracker(request.request_id, len(ids), keys, unkeyed=(ids, extras) if first else None)
        self._reqs[request.request_id] = tr
        return tr

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._take_verdicts()
        matched = self._match(request, num_computed_tokens)
        if matched[0] is None:
            self._holding = True  # a request waits on this connector (see build_connector_meta)
        return matched

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tr = self._tracker(request)
        if tr is None or _common.skips_prefix_cache(request) or (
                self.local[0].num_slots == 0 and self.server is None):
            if tr is not None:
                self._drop_fetch(tr)
            return 0, False
        if not tr.looked_up:
            tr.looked_up = True
            counters.SCHEDULER.add(lookup_requests=1, lookup_tokens=tr.prompt_len)
        f = tr.fetch
        now = time.monotonic()
        if f is not None and f.good < 0:
            if now - f.issued <= self.fetch_timeout_s:
                return None, False  # the workers are verifying: ask again next step
            logger.warning("vllm-kvplugin: %s: no verdict on its hit after %.0f s; the prompt is computed",
                           tr.req_id, now - f.issued)
            counters.SCHEDULER.add(fetch_timeouts=1)
            self._drop_fetch(tr)
            return 0, False
        if f is not None and f.lease and self.server is not None and now - f.verified_at > 0.5 * self.server.lease_s:
            self._drop_fetch(tr)  # its lease may lapse before the load: look up again
            f = None
        if f is not None:
            return self._claim(tr, f, num_computed_tokens)
        if self._being_stored(tr, now):
            return None, False  # this engine is storing chunks of the prompt: they land in a moment
        fetch, rest = self._first_part(tr, num_computed_tokens) if tr.unkeyed is not None else (None, None)
        if fetch is None:
            fetch = self._lookup(tr, num_computed_tokens)
            if fetch is _ASKING:
                return None, False  # the server's answer comes on its own thread: ask again next step
            if fetch is None:
                return 0, False
        self._fetches += 1
        tr.fetch, fetch.serial = fetch, self._fetches
        here = self._fetch_here(FetchRequest(tr.req_id, fetch.jobs, fetch.serial), rest)
        if rest is not None:
            rest()  # (the worker asked for it once the first part was on its way, unless it gave up before)
        if here is None:
            self._pending_fetches.append(FetchRequest(tr.req_id, fetch.jobs, fetch.serial))  # fetched in this step
        elif here:
            self._take_verdicts()
            if fetch.good >= 0:
                return self._claim(tr, fetch, num_computed_tokens)
        return None, False

    def _claim(self, tr: RequestTracker, f: Fetch, num_computed_tokens: int) -> tuple[int, bool]:
        """The tokens of ``f``'s verified objects that load after ``num_computed_tokens``."""
        if f.good == len(f.jobs) and num_computed_tokens == f.plan.start:
            tr.plan = f.plan  # every object verified and nothing new computed: planned again, it is the same
        else:
            verified = f.verified()
            tr.plan = plan_load(tr.prompt_len, num_computed_tokens, self.chunk_size, self.groups,
                                lambda pos, g: (pos, g) in verified, self._limit(tr))
        if tr.plan is None:
            self._drop_fetch(tr)
            return 0, False
        return tr.plan.num_tokens, False

    def _wait_for_a_lookup(self) -> None:
        """In a step that scheduled no tokens: wait, up to :data:`IDLE_WAIT_S` with the GIL
        released, for one of the server lookups in flight (their answers are read on a client
        thread, which a spinning engine thread keeps waiting for the GIL)."""
        pending = [tr.server_lookup for tr in self._reqs.values() if tr.server_lookup is not None]
        if pending and not any(f.done() for f in pending):
            futures_wait(pending, IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def _await_briefly(self, lookup, req_id: str) -> None:
        """Wait for a lookup just sent, within what is left of this step's grace
        (:data:`LOOKUP_GRACE_S`; for a request alone in the engine, whom nobody else waits for,
        at least :data:`~vllm_kvplugin.connector.scheduler_lone.LONE_LOOKUP_WAIT_S`): its answer
        then plans the hit in this very step."""
        wait = max(LONE_LOOKUP_WAIT_S, self._grace_left) if self._alone(req_id) is not None else self._grace_left
        if wait <= 0:
            return
        t0 = time.monotonic()
        futures_wait([lookup], wait)
        self._grace_left -= time.monotonic() - t0

    def _being_stored(self, tr: RequestTracker, now: float) -> bool:
        """Chunks of the prompt whose stores every rank has not acknowledged yet (their copies
        finish after their step): wait for them, a bounded time, rather than miss them."""
        if not self._storing or not any(k in self._storing for k in tr.keys[:self._limit(tr)]):
            return False
        if not tr.waiting_since:
            tr.waiting_since = now
        return now - tr.waiting_since <= self.store_wait_s

    def _lookup(self, tr: RequestTracker, num_computed: int):
        """Plan from the local tier or the server, whichever restores more; pin what it needs.
        :data:`_ASKING` while the server's answer is still on its way."""
        C = self.chunk_size
        max_hit = self._limit(tr)
        plan = self._local_plan(tr, num_computed, max_hit)
        server_hit = None
        local_end = plan.end // C if plan else 0
        if self.server is not None and local_end < max_hit and not self._miss_stands(tr, num_computed, local_end):
            if tr.server_lookup is None:
                first = num_computed // C
                tr.server_lookup = (self._lookup_here(tr.req_id, tr.keys[:max_hit], first)
                                    or self.server.lookup_async(tr.keys[:max_hit], first))
                tr.server_lookup_first = first
                if not tr.server_lookup.done():
                    self._await_briefly(tr.server_lookup, tr.req_id)
            if not tr.server_lookup.done():
                return _ASKING
            future, tr.server_lookup = tr.server_lookup, None
            try:
                found = future.result()
            except TierTrouble as e:
                counters.SCHEDULER.add(server_lookup_errors=1)
                logger.warning("vllm-kvplugin: server lookup failed (%s); the prompt is computed", e)
            else:
                if num_computed // C < tr.server_lookup_first or (found.resolved and num_computed // C > tr.server_lookup_first):
                    # vLLM stands before the chunk it was asked from (its prefix cache let blocks
                    # go meanwhile): the lease pins nothing below that chunk; or past it, and the
                    # lookup resolved objects the plan would not load (served != planned): ask again
                    self._release(found.lease)
                    return self._lookup(tr, num_computed)
                tr.server_hits = found.hits
                if found.hits > local_end and found.hits * C > num_computed:  # the server pinned that hit
                    plan = plan_load(tr.prompt_len, num_computed, C, self.groups, lambda pos, g: True,
                                     limit=found.hits)
                    server_hit = found
                else:
                    self._release(found.lease)
                    tr.server_answered_at = time.monotonic()
        if plan is None:
            return None
        pins: list[tuple[int, int]] = []
        if server_hit is not None:
            jobs = [_server_job(tr.keys[o.position], o, server_hit) for o in plan.objects]
        else:
            jobs = self._pinned_jobs(tr, plan.objects, pins)
        return Fetch(plan, jobs, server_hit.lease if server_hit else 0, pins, issued=time.monotonic())

    def _miss_stands(self, tr: RequestTracker, num_computed: int, local_end: int) -> bool:
        """The server's last answer for ``tr`` (within :data:`MISS_REUSE_S`, the request never
        scheduled since, no newer lookup on its way) holds nothing beyond what vLLM and the local
        tier have now, and it was asked from a chunk vLLM still stands at."""
        C = self.chunk_size
        return (tr.server_answered_at is not None and tr.server_lookup is None
                and time.monotonic() - tr.server_answered_at <= MISS_REUSE_S
                and tr.req_id not in self._started
                and num_computed // C >= tr.server_lookup_first
                and (tr.server_hits <= local_end or tr.server_hits * C <= num_computed))

    def _local_plan(self, tr: RequestTracker, num_computed: int, limit: int) -> LoadPlan | None:
        """The hit the local tier holds (chunks up to ``limit``), planned."""
        return plan_load(tr.prompt_len, num_computed, self.chunk_size, self.groups,
                         lambda pos, g: self.local[g].ready(tr.keys[pos]), limit)

    def _pinned_jobs(self, tr: RequestTracker, objects, pins: list[tuple[int, int]]) -> list[FetchJob]:
        """Fetch jobs of ``objects`` from the local tier, each pinned there (added to ``pins``)."""
        jobs = []
        for o in objects:
            key = tr.keys[o.position]
            slot = self.local[o.group].pin([key])[0]
            pins.append((o.group, slot))
            jobs.append(FetchJob(key, o.position, o.group, slot=slot))
        return jobs

    def _limit(self, tr: RequestTracker) -> int:
        """The largest hit, in chunks, a prompt may have (one less with a drafter group)."""
        return max(0, max_loadable_tokens(tr.prompt_len, self.chunk_size) // self.chunk_size - self.drafter)

    def _drop_fetch(self, tr: RequestTracker) -> None:
        """Give up a fetch: unpin, release, and tell the workers to forget what they verified."""
        f, tr.fetch, tr.plan = tr.fetch, None, None
        if f is None:
            return
        for g, slot in f.pins:
            self.local[g].unpin(slot)
        self._release(f.lease)
        self._forget.append(tr.req_id)

    def _release(self, lease: int, planned: int | None = None) -> None:
        """Unpin a lease (never waiting on the server); with ``planned``, compare the bytes the
        server served with the plan once it answers."""
        if not lease or self.server is None:
            return

        def account(pinned: int, served: int) -> None:
            counters.SCHEDULER.add(server_planned_bytes=planned, server_served_bytes=served)
            if served != planned:
                counters.SCHEDULER.add(server_bytes_mismatches=1)
                logger.warning("vllm-kvplugin: lease %d planned %d bytes, the server served %d",
                               lease, planned, served)

        self.server.release_async(lease, account if planned is not None else None)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tr = self._reqs.get(request.request_id)
        if tr is None or tr.plan is None or tr.fetch is None:
            return
        plan, f = tr.plan, tr.fetch
        if num_external_tokens <= 0:
            self._drop_fetch(tr)
            return
        if num_external_tokens != plan.num_tokens:
            plan = self._shrink(plan, num_external_tokens)
        block_ids = [list(b) for b in blocks.get_block_ids()]
        rows = [iter(spec.objects_blocks(block_ids[g], [o.position for o in plan.objects if o.group == g],
                                         self.chunk_size, plan.end)) for g, spec in enumerate(self.groups)]
        jobs = [LoadJob(tr.keys[o.position], o.position, o.group, next(rows[o.group]), o.lo, o.hi)
                for o in plan.objects]
        load = LoadRequest(tr.req_id, jobs, plan.expected_bytes, plan.num_tokens)
        if not self._load_here(load):
            self._pending_loads.append(load)
        elif self._bad is not None:
            self._loaded_now.update(b for j in jobs for b in j.block_ids)
        served = sum(self.server_object_bytes[j.group] for j in f.jobs) if f.lease else 0
        self._holds[tr.req_id] = (f.pins, f.lease, served)
        if f.lease:
            counters.SCHEDULER.add(server_hit_tokens=plan.num_tokens)
        counters.SCHEDULER.add(hit_tokens=plan.num_tokens, planned_load_tokens=plan.num_tokens,
                               planned_load_bytes=sum(plan.expected_bytes))
        tr.fetch = tr.plan = None

    def _shrink(self, plan: LoadPlan, tokens: int) -> LoadPlan:
        """vLLM granted fewer tokens than planned: load exactly those (prefix groups only)."""
        if not all(g.restores_prefix for g in self.groups):
            raise RuntimeError(f"vllm-kvplugin: vLLM granted {tokens} of the {plan.num_tokens} planned "
                               "tokens of a hybrid model's hit; only the planned hit can be restored")
        end = plan.start + tokens
        objects = tuple(ObjectLoad(o.position, o.group, o.lo, min(o.hi, end)) for o in plan.objects if o.lo < end)
        expected = tuple(tokens * g.bytes_per_token for g in self.groups)
        return LoadPlan(plan.start, end, plan.chunk_size, objects, expected)

    # ------------------------------------------------------------------- stores
    def build_connector_meta(self, so: Any) -> KVPluginMetadata:
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        self._started.update(nr.req_id for nr in so.scheduled_new_reqs)
        self._started.update(resumed)
        # nothing scheduled, no batch of an asynchronous scheduler in flight (whose output a wait
        # would hold back: any request started and not finished may be in one), a request held back
        idle = so.total_num_scheduled_tokens == 0 and not self._started and self._holding
        meta = KVPluginMetadata(fetches=self._pending_fetches, loads=self._pending_loads,
                                forget=self._forget, epoch=self.epoch, fingerprint=self.fingerprint, idle=idle)
        if idle:
            self._wait_for_a_lookup()
        self._pending_fetches, self._pending_loads, self._forget = [], [], []
        self._holding = False
        self._grace_left = LOOKUP_GRACE_S  # the next step's
        for nr in so.scheduled_new_reqs:
            tr = self._reqs.get(nr.req_id)
            if tr is not None:
                tr.block_ids = [list(b) for b in nr.block_ids]
                tr.num_computed = nr.num_computed_tokens
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
        for load in meta.loads:
            self._running_state_blocks(load, so.num_scheduled_tokens.get(load.req_id, 0))
        tainted = self._report_bad_blocks(meta, so)
        for rid, n_sched in so.num_scheduled_tokens.items():
            tr = self._reqs.get(rid)
            if tr is None or not tr.block_ids or rid in tainted:
                continue  # (a tainted request is recomputed: its chunks are stored then)
            end = tr.num_computed + n_sched
            jobs = self._store_jobs(tr, min(end, tr.prompt_len) // self.chunk_size) + self._state_jobs(tr, end)
            if jobs:
                meta.stores.append(StoreRequest(rid, jobs))
        return meta

    def _report_bad_blocks(self, meta: KVPluginMetadata, so: Any) -> frozenset[str]:
        """This step's report of bad blocks into ``meta`` (``connector/bad_blocks.py``), after the
        trackers took the step's block ids; returns the requests whose chunks it must not store."""
        if self._bad is None:
            return frozenset()
        loaded, self._loaded_now = self._loaded_now, set()
        if not self._bad:
            return frozenset()
        loaded.update(b for load in meta.loads for j in load.jobs for b in j.block_ids)
        scheduled = {rid: (tr.block_ids[0], tr.num_computed, n) for rid, n in so.num_scheduled_tokens.items()
                     if (tr := self._reqs.get(rid)) is not None and tr.block_ids}
        report = self._bad.step(scheduled, loaded)
        meta.bad_blocks = report.invalid
        if report.tainted:
            counters.SCHEDULER.add(tainted_requests=len(report.tainted))
        return report.tainted

    def _running_state_blocks(self, load: LoadRequest, n_sched: int) -> None:
        """A loaded state must also be in the block the step computes on.  vLLM ("align" mode)
        copies a request's state from the block of its hit's column into the block of the
        step's last column before the forward -- before the connector's load writes it -- and
        the kernels read the state there.  So the state goes into both blocks (the first stays
        what vLLM caches as the checkpoint of the hit)."""
        tr = self._reqs.get(load.req_id)
        if tr is None or not self.state_groups:
            return
        for job in load.jobs:
            spec = self.groups[job.group]
            if spec.is_state:
                col = -(-(tr.num_computed + n_sched) // spec.block_size) - 1
                block = tr.block_ids[job.group][col]
                if block not in job.block_ids:
                    job.block_ids = (*job.block_ids, block)

    # ---------------------------------------------------------- worker results
    def _verdict(self, rid: str, ranks: int, good: int, serial: int | None = None) -> None:
        """``ranks`` more workers verified the ``good`` leading objects of ``rid``'s fetch (numbered
        ``serial``, when the verdict names it); once every rank has, the fetch may be claimed."""
        tr = self._reqs.get(rid)
        f = tr.fetch if tr is not None else None
        if f is None or f.good >= 0 or (serial is not None and serial != f.serial):
            return  # given up meanwhile (its staged bytes were forgotten), or another fetch's
        f.ranks += ranks
        f.fewest = good if f.fewest is None else min(f.fewest, good)
        if f.ranks >= self.world_size:
            f.good, f.verified_at = f.fewest, time.monotonic()
            if f.lease and f.good < len(f.jobs):  # dropped from the server: this request stores it again
                tr.server_hits = min(tr.server_hits, f.jobs[f.good].position)

    def _take_verdicts(self) -> None:
        """What the worker half of a one-process, one-rank engine posted (connector/verdicts.py):
        finished stores, then verdicts -- the objects that failed dropped first, so that a
        claim's stores put them back."""
        posted = self._verdicts.take()
        self._stores_finished(posted.stored, posted.store_failed, posted.store_done)
        self._drop_bad(posted.bad)
        for rid, serial, good in posted.verdicts:
            self._verdict(rid, 1, good, serial)

    def _stores_finished(self, stored, failed, done) -> None:
        """Slots stored or failed (acknowledgements per slot), keys acknowledged (per key)."""
        self._settle_stores(stored, failed)
        for key, n in done.items():
            left = self._storing.get(key, 0) - n
            if left > 0:
                self._storing[key] = left
            else:
                self._storing.pop(key, None)

    def _drop_bad(self, slots) -> None:
        """Objects that failed verification: never offered again."""
        for g, slot in slots:
            self.local[g].drop(slot)
            counters.SCHEDULER.add(dropped_objects=1)

    def update_connector_output(self, output: Any) -> None:
        self._take_verdicts()  # finished stores commit their slots every step, requests waiting or not
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KVPluginWorkerMeta):
            return
        self._stores_finished(meta.stored, meta.store_failed, meta.store_done)
        for rid, (ranks, good) in meta.fetched.items():
            self._verdict(rid, ranks, good)
        self._drop_bad(meta.bad_slots)
        for rid, n in meta.loads_done.items():
            acks = self._load_acks.get(rid, 0) + n
            if acks < self.world_size:
                self._load_acks[rid] = acks
                continue
            self._load_acks.pop(rid, None)
            pins, lease, served = self._holds.pop(rid, ([], 0, 0))
            for g, slot in pins:
                self.local[g].unpin(slot)
            self._release(lease, served)
        if meta.load_failed:
            self.epoch += 1  # workers drop the stores of older metadata: computed over unloaded blocks
            if self._bad is not None:
                self._bad.failed(meta.failed_blocks, (tr.block_ids[0] for tr in self._reqs.values() if tr.block_ids))
        for rid, pos in [*meta.stores_cancelled.items(), *meta.load_failed.items()]:
            tr = self._reqs.get(rid)
            if tr is not None:  # stored again once recomputed
                tr.stored_upto = min(tr.stored_upto, pos)

    def _settle_stores(self, stored, store_failed) -> None:
        """A slot is committed once every rank reported on it: READY if none failed, else freed."""
        slots = set(stored) | set(store_failed)
        for slot in sorted(slots, key=lambda s: -self._slot_chunk.get(s, 0)):
            acks, failed = self._store_acks.get(slot, (0, False))
            acks += stored.get(slot, 0) + store_failed.get(slot, 0)
            failed = failed or slot in store_failed
            if acks < self.world_size:
                self._store_acks[slot] = (acks, failed)
                continue
            self._store_acks.pop(slot, None)
            self._slot_chunk.pop(slot, None)
            self.local[slot[0]].commit(slot[1], not failed)

    def request_finished(self, request: Any) -> None:
        self._started.discard(request.request_id)
        tr = self._reqs.pop(request.request_id, None)
        if tr is not None:
            self._drop_fetch(tr)  # looked up but never loaded
            self._abandon_lookup(tr)

    def _abandon_lookup(self, tr: RequestTracker) -> None:
        """A server lookup nobody will use: its lease is released once it arrives."""
        future, tr.server_lookup = tr.server_lookup, None
        if future is not None:
            future.add_done_callback(lambda f: f.exception() or self._release(f.result().lease))

    def reset_cache(self) -> bool:
        """Make everything stored so far unreachable: the local tier is emptied (objects still
        being stored or loaded included), and keys move to a new namespace, so that nothing this
        engine stored before -- on the server and in its L2 too -- is ever loaded again, and
        requests already running store nothing more."""
        for idx in self.local:
            idx.clear()
        self.namespace = os.urandom(16)
        for tr in self._reqs.values():  # keyed in the old namespace: forgotten, looked up afresh
            self._drop_fetch(tr)
            self._abandon_lookup(tr)
        self._reqs.clear()
        return True

    def close(self) -> None:
        """At vLLM's connector shutdown: the server connection closes (its heartbeat ends)."""
        if self.server is not None:
            self.server.close()
