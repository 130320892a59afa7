"""When a hit's verdict comes, against the engine's steps (the integrity issue's prompts of
``test_integrity``): a hit is verified while the engine goes on with other requests, an idle
step waits for the verdict instead of spinning, a lone request's hit is fetched and claimed in
the step that looks it up, a repeat waits for stores that finish after their step, and a hash
that fails is recomputed.  Every output equals the engine
without the connector's, on poisoned KV."""

from __future__ import annotations

import threading

import pytest
from harness import Probe, engine, generate, prompt, shutdown
from test_cache_hits import _baseline
from test_integrity import BAD, BLOCK, CHUNK, P, _local_flip
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

import vllm_kvplugin
from vllm_kvplugin import counters

pytestmark = pytest.mark.engine


def _watch_verdicts(monkeypatch, hash_one, after_meta=None) -> list[tuple[str, int]]:
    """Every fetch's hashes forced onto threads of their own running ``hash_one``; returns the
    scheduler's steps in order: ("meta", tokens scheduled), ("fetch", 0) (a step's metadata that
    carries fetches, or a lone request's fetch from its lookup, before its step's metadata),
    ("verdict", good), and ("hashes", payloads) for each time a fetch started hashing."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kvplugin.chunk.checksums import StartedChecksums
    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.connector import worker_fetch as fmod

    events: list[tuple[str, int]] = []
    pool = ThreadPoolExecutor(2)

    def start(ps):
        events.append(("hashes", len(ps)))
        return StartedChecksums(ps, [pool.submit(hash_one, p) for p in ps])
    monkeypatch.setattr(fmod, "start_payload_checksums", start)
    build, verdict = smod.SchedulerSide.build_connector_meta, smod.SchedulerSide._verdict

    def build_meta(self, so):
        meta = build(self, so)
        events.append(("fetch", 0) if meta.fetches else ("meta", so.total_num_scheduled_tokens))
        if after_meta:
            after_meta(events)
        return meta

    def on_verdict(self, rid, ranks, good, serial=None):  # from the step's metadata or the engine's box
        events.append(("verdict", good))
        return verdict(self, rid, ranks, good, serial)
    fetch_here = smod.SchedulerSide._fetch_here

    def here(self, req, more=None):  # a lone request's fetch, from its lookup (before its hashes start)
        at = len(events)
        events.append(("fetch", 0))
        done = fetch_here(self, req, more)
        if done is None:  # not fetched there: with the step's metadata
            del events[at]
        return done
    monkeypatch.setattr(smod.SchedulerSide, "build_connector_meta", build_meta)
    monkeypatch.setattr(smod.SchedulerSide, "_verdict", on_verdict)
    monkeypatch.setattr(smod.SchedulerSide, "_fetch_here", here)
    return events


def _steps_to_verdict(events) -> list[int]:
    """Tokens scheduled by each step between the (first) fetch and its verdict."""
    fetch = events.index(("fetch", 0))
    verdict = next(i for i, e in enumerate(events) if e[0] == "verdict")
    return [n for kind, n in events[fetch:verdict] if kind == "meta"]


@pytest.mark.parametrize("fault,first", [  # the oldest lane: one; the rest take the same path through vLLM
    ("checksum", None),
    *(pytest.param(*v, marks=pytest.mark.newest_lane) for v in (("intact", None), ("checksum", 2), ("checksum", 4))),
])
def test_a_hit_is_verified_while_the_engine_goes_on(qwen3_model, monkeypatch, fault, first):
    """A hit's payload hashes run on the hashing threads and a step that has other work does
    not wait for them: the verdict reaches the scheduler with the metadata of a later step, and
    until then vLLM holds the hit back and runs its other requests.  Forced here (the fetch's
    hashes held until a new prompt sent along with the repeat of P has had six steps with
    tokens): P's verdict must come only after those steps, then P hits in full (intact) or only
    up to the chunk whose byte was flipped (counted as ``checksum``, the object dropped); both
    outputs right on poisoned KV, and P again after.  ``first``: the hashes of that many
    objects start before the others are read (as for large objects, one per hashing thread),
    the flipped chunk among the rest (2) or among them (4)."""
    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import worker_fetch as fmod

    if first is not None:
        monkeypatch.setattr(fmod, "MAX_THREADS", first)
        monkeypatch.setattr(fmod, "PARALLEL_MIN_BYTES", 0)
    q = prompt(3 * CHUNK + 5, seed=41)
    want_p, want_q = _baseline(qwen3_model, BLOCK, [[P], [q]], budget=CHUNK)
    gate = threading.Event()

    def held(p):
        assert gate.wait(60), "the hashes were never released: no step ran after the fetch"
        return payload_checksum(p)

    def open_gate(events):
        since = events[next((i for i, e in enumerate(events) if e[0] == "fetch"), len(events)):]
        if sum(1 for kind, n in since if kind == "meta" and n > 0) >= 6:
            gate.set()  # the new prompt has run six steps since the fetch
    events = _watch_verdicts(monkeypatch, held, open_gate)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            if fault == "checksum":
                _local_flip(probe, P)[0]()
            probe.poison_all_blocks()
            events.clear()
            warm, other = generate(llm, [P, q])
            assert sum(1 for n in _steps_to_verdict(events) if n > 0) >= 6, events
            assert [n for kind, n in events if kind == "hashes"] == ([8] if first is None else [first, 8 - first])
            hit = 8 if fault == "intact" else BAD
            assert ("verdict", hit) in events
            assert warm.token_ids == want_p and warm.num_cached_tokens == hit * CHUNK
            assert other.token_ids == want_q and other.num_cached_tokens == 0
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == ({} if fault == "intact" else {"checksum": 1})
            assert s["dropped_objects"] == (0 if fault == "intact" else 1)
            probe.poison_all_blocks(seed=1)
            again = generate(llm, [P])[0]  # chunk BAD was stored again by the recompute
            assert again.token_ids == want_p and again.num_cached_tokens == 8 * CHUNK
        finally:
            gate.set()
            shutdown(llm)


@pytest.mark.parametrize("tier", ["local", pytest.param("server", marks=pytest.mark.newest_lane)])
def test_an_idle_step_waits_for_the_verdict(qwen3_model, monkeypatch, tier, request):
    """A step with nothing else to do waits (a bounded time, the GIL released) for what a
    held-back hit waits on instead of spinning empty steps: the server's answer to its lookup
    (one step, where a spinning engine took about 35 on this machine), then its hashes: a lone
    repeat whose 8 hashes take 0.1 s each on 2 threads (about 0.4 s) sees its verdict within a
    few steps of its fetch (spinning: thousands), then hits in full, right on poisoned KV."""
    import time

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector.metadata import IDLE_WAIT_S

    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    cfg = {"chunk_size": CHUNK}
    if tier == "server":
        cfg.update(cpu_bytes=0, server=request.getfixturevalue("server").address)
    events = _watch_verdicts(monkeypatch, lambda p: time.sleep(0.1) or payload_checksum(p))
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            probe.poison_all_blocks()
            events.clear()
            warm = generate(llm, [P])[0]
            assert len(events[:events.index(("fetch", 0))]) <= (2 if tier == "server" else 0), events
            steps = _steps_to_verdict(events)
            assert steps and not any(steps), events  # nothing else ran meanwhile
            assert len(steps) <= 0.4 / IDLE_WAIT_S + 4, events
            assert warm.token_ids == want and warm.num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)


def test_a_repeat_on_an_idle_engine_is_fetched_at_once(qwen3_model, monkeypatch):
    """Stores finish on the finisher's thread (as on a GPU), here slower than the engine's steps:
    once they are done the engine is idle, and a repeat of the prompt must be fetched in its
    first step -- the finisher hands what finished straight to the scheduler half of this
    one-process engine, rather than with the next step's output, until which the scheduler
    would count the prompt's chunks as being stored and hold the repeat back."""
    import time

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import finisher as fmod
    from vllm_kvplugin.connector import worker as wmod

    monkeypatch.setattr(fmod, "ASYNC_ON_HOST", True)
    finish = wmod.WorkerSide._finish
    monkeypatch.setattr(wmod.WorkerSide, "_finish", lambda self, entry: time.sleep(0.2) or finish(self, entry))
    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    events = _watch_verdicts(monkeypatch, payload_checksum)
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            assert probe.worker.finisher.drain(30)  # every store done, the engine idle since
            probe.poison_all_blocks()
            events.clear()
            warm = generate(llm, [P])[0]
            assert events[:events.index(("fetch", 0))] == [], events
            assert warm.token_ids == want and warm.num_cached_tokens == 8 * CHUNK
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)


def test_a_lone_hit_is_claimed_in_the_step_that_looks_it_up(qwen3_model, monkeypatch):
    """With no other request in the engine, a repeat's lookup has the worker half fetch and verify
    its hit right away (this one-process engine of one rank) and claims it in that very step: the
    verdict comes before any step's metadata and the first step computes the rest of the prompt
    (no step held back for it), and its load is issued inside vLLM's allocation of its blocks
    (``update_state_after_alloc``), not from the step's metadata; full hit, right output on
    poisoned KV, the loaded blocks poisoned before the load and equal to the computed KV after it.
    With another request running, a hit is fetched with a step's metadata and claimed and loaded
    in a later step, as before: a wait in the lookup would stall the running request's steps."""
    from vllm import SamplingParams

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import scheduler as smod

    q, other = prompt(4 * CHUNK + 3, seed=52), prompt(2 * CHUNK + 1, seed=53)
    want_p, want_q = _baseline(qwen3_model, BLOCK, [[P], [q]], budget=CHUNK)
    events = _watch_verdicts(monkeypatch, payload_checksum)
    build, steps = smod.SchedulerSide.build_connector_meta, []  # tokens each step scheduled
    monkeypatch.setattr(smod.SchedulerSide, "build_connector_meta",
                        lambda self, so: steps.append(so.total_num_scheduled_tokens) or build(self, so))
    counters.STATS.reset()
    with Probe().installed() as probe:
        at_alloc, claim = [], smod.SchedulerSide.update_state_after_alloc  # loads issued in vLLM's allocation

        def claimed(self, request, blocks, n):
            before = len(probe.loads)
            claim(self, request, blocks, n)
            at_alloc.extend(rid for rid, _ in probe.loads[before:])
        monkeypatch.setattr(smod.SchedulerSide, "update_state_after_alloc", claimed)
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            assert generate(llm, [q])[0].token_ids == want_q
            assert probe.worker.finisher.drain(30)
            assert vllm_kvplugin.stats()["lone_fetches"] == 0  # two misses
            probe.poison_all_blocks()
            events.clear()
            steps.clear()
            warm = generate(llm, [P])[0]
            assert events[:3] == [("fetch", 0), ("hashes", 8), ("verdict", 8)], events
            assert steps[0] == len(P) - 8 * CHUNK, steps  # its first step computes the rest: none held back
            assert warm.token_ids == want_p and warm.num_cached_tokens == 8 * CHUNK
            s = vllm_kvplugin.stats()
            assert s["lone_fetches"] == 1 and s["loaded_tokens"] == 8 * CHUNK and s["load_failures"] == {}
            assert len(probe.loads) == 1 and at_alloc == [probe.loads[0][0]], (probe.loads, at_alloc)
            # another request running: q's hit goes with a step's metadata
            engine_ = llm.llm_engine
            engine_.add_request("other", {"prompt_token_ids": other},
                                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            engine_.step()
            assert engine_.has_unfinished_requests()
            engine_.add_request("q", {"prompt_token_ids": q},
                                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            events.clear()
            outs = {}
            while engine_.has_unfinished_requests():
                outs.update({o.request_id: o for o in engine_.step() if o.finished})
            assert ("fetch", 0) in events and vllm_kvplugin.stats()["lone_fetches"] == 1, events
            assert events.index(("fetch", 0)) < next(i for i, e in enumerate(events) if e[0] == "verdict")
            assert list(outs["q"].outputs[0].token_ids) == want_q and outs["q"].num_cached_tokens == 4 * CHUNK
            assert not probe.kv_mismatches and probe.kv_checked > 0
            assert [t for rid, t in probe.loads] == [8 * CHUNK, 4 * CHUNK]  # both targets poisoned first
            assert at_alloc == [probe.loads[0][0]]  # q's load came with a step's metadata
        finally:
            shutdown(llm)


def test_no_idle_wait_while_a_batch_may_be_in_flight(qwen3_model, monkeypatch):
    """vLLM's asynchronous scheduling runs steps that schedule no tokens while a batch is still on
    the device; a wait there delays that batch's output (on the H200 every cold prompt of more
    than one step took up to 50 ms longer).  Such steps do not happen on the CPU lane (no
    asynchronous scheduling there), so one is emulated: a request scheduled in a step of the
    real scheduler's own kind and not finished while a repeat of P is held back for its
    verdict.  That step is not idle; once the request finishes, held steps are again; the repeat
    then hits in full, right on poisoned KV."""
    import time
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import scheduler as smod

    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    _watch_verdicts(monkeypatch, lambda p: time.sleep(0.1) or payload_checksum(p))
    build, steps, sides = smod.SchedulerSide.build_connector_meta, [], []

    def recording(self, so):
        meta = build(self, so)
        sides.append(self)
        steps.append((so.total_num_scheduled_tokens, meta.idle))
        return meta
    monkeypatch.setattr(smod.SchedulerSide, "build_connector_meta", recording)
    empty = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    started = SimpleNamespace(total_num_scheduled_tokens=1, num_scheduled_tokens={"in-flight": 1},
                              scheduled_new_reqs=[SimpleNamespace(req_id="in-flight", block_ids=([7],),
                                                                  num_computed_tokens=0)],
                              scheduled_cached_reqs=empty)
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            probe.poison_all_blocks()
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            llm.llm_engine.add_request("repeat", {"prompt_token_ids": P}, sp)
            steps.clear()
            llm.llm_engine.step()  # looks P up: its fetch goes out, the repeat is held back (idle)
            assert steps == [(0, True)] and probe.worker._verifying, steps
            side = sides[-1]
            meta = side.build_connector_meta(started)  # vLLM scheduled "in-flight" (never run here)
            assert not (meta.fetches or meta.loads or meta.stores)
            steps.clear()
            llm.llm_engine.step()  # the repeat still held (hashes of 0.1 s each), "in-flight" not done
            assert steps == [(0, False)] and probe.worker._verifying, steps
            side.request_finished(SimpleNamespace(request_id="in-flight"))
            outs = []
            while llm.llm_engine.has_unfinished_requests():
                outs += [o for o in llm.llm_engine.step() if o.finished]
            assert (0, True) in steps, steps  # held again with nothing unfinished: idle
            assert list(outs[0].outputs[0].token_ids) == want and outs[0].num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)


def test_a_hash_that_fails_is_recomputed(qwen3_model, monkeypatch):
    """The hashing of a hit raising (mocked: the hashing threads cannot be made to fail for
    real) ends in a recompute counted as ``verify_error``, the objects kept (nothing is known
    wrong with them) and the engine going on: right on poisoned KV, then a full hit once the
    hashing works again."""
    from vllm_kvplugin.chunk.format import payload_checksum

    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    broken = threading.Event()

    def hash_one(p):
        if broken.is_set():
            raise RuntimeError("injected hashing failure")
        return payload_checksum(p)
    _watch_verdicts(monkeypatch, hash_one)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            probe.poison_all_blocks()
            broken.set()
            cold = generate(llm, [P])[0]
            assert cold.token_ids == want and cold.num_cached_tokens == 0
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {"verify_error": 1} and s["dropped_objects"] == 0
            broken.clear()
            probe.poison_all_blocks(seed=1)
            warm = generate(llm, [P])[0]
            assert warm.token_ids == want and warm.num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)


@pytest.mark.parametrize("tier", ["local", pytest.param("server", marks=pytest.mark.newest_lane)])
def test_stores_finished_off_the_step_are_waited_for(qwen3_model, monkeypatch, tier, request):
    """On a GPU stores finish on the worker's finisher thread after their step (their copies
    cross the link while the next steps run). Forced here on the CPU, the stores held until a
    repeat of the prompt has started, then 0.1 s each: the repeat must wait for them (vLLM holds
    it back, and its idle steps wait for the finisher instead of spinning: a few dozen steps,
    where spinning takes thousands), then hit in full, with the right output, from the
    in-process tier or the server."""
    import time

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import finisher
    from vllm_kvplugin.connector import worker as wmod
    from vllm_kvplugin.connector.metadata import IDLE_WAIT_S

    monkeypatch.setattr(finisher, "ASYNC_ON_HOST", True)
    finish, gate, armed = wmod.WorkerSide._finish, threading.Event(), threading.Event()
    monkeypatch.setattr(wmod.WorkerSide, "_finish",
                        lambda self, e: (gate.wait(30), time.sleep(0.1), finish(self, e))[-1])
    p = prompt(5 * 32 + 3, seed=8)
    want = _baseline(qwen3_model, 32, [[p]], budget=32)[0]
    cfg = {"chunk_size": 32}
    if tier == "server":
        cfg.update(cpu_bytes=0, server=request.getfixturevalue("server").address)
    events = _watch_verdicts(monkeypatch, payload_checksum, lambda ev: armed.is_set() and gate.set())
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, cfg, budget=32)
        try:
            assert generate(llm, [p])[0].token_ids == want
            probe.poison_all_blocks()
            assert not gate.is_set() and probe.worker.finisher.busy()  # its stores wait
            events.clear()
            armed.set()  # the repeat's first step lets them go
            warm = generate(llm, [p])[0]
            held = events[:events.index(("fetch", 0))]
            assert 3 <= len(held) <= 0.5 / IDLE_WAIT_S + 15, events
            assert warm.token_ids == want and warm.num_cached_tokens == 5 * 32
            assert probe.worker.finisher.drain(10)
            s = vllm_kvplugin.stats()
            assert s["stored_tokens"] == 5 * 32 and s["load_failures"] == {}
            assert s["server_store_errors"] == 0
        finally:
            gate.set()
            shutdown(llm)
