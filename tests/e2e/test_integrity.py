"""Provenance (DESIGN.md rule 7): nothing computed over a failed load is stored or served.

The integrity issue's repro, on real engines, through the in-process tier and a real
cache server: a prompt P (8 chunks + 10) is stored; the bytes of one of its middle
chunks are wrong for the duration of one load only (as after a failed read); P
extended by two chunks is generated; then both prompts three more times, every KV
block overwritten with noise first.  Every output must equal an engine without the
connector's; only the verified prefix counts as a hit; the bad object is dropped at
its first failure; and a reset makes everything stored before unloadable.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from harness import Probe, engine, generate, prompt, shutdown
from test_cache_hits import _baseline
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

import vllm_kvplugin
from vllm_kvplugin import counters
from vllm_kvplugin.chunk.format import HEADER_SIZE
from vllm_kvplugin.chunk.keys import chunk_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from srvutil import wait_for  # noqa: E402

pytestmark = pytest.mark.engine

CHUNK, BLOCK = 64, 32
P = prompt(8 * CHUNK + 10, seed=31)
P2 = P + prompt(2 * CHUNK + 5, seed=32)
BAD = 3  # the chunk whose bytes are wrong during one load


def _local_flip(probe, tokens):
    """A function flipping one byte of chunk BAD's object in the local tier (twice: restored)."""
    import torch

    from vllm_kvplugin.chunk.format import ChunkHeader

    ws = probe.worker
    key = chunk_keys(ws.fingerprint, tokens, CHUNK)[BAD]
    slot = next(s for s, h in enumerate(ws.pool.headers[0]) if h is not None and ChunkHeader.unpack(h).key == key)

    def flip():
        ws.pool.payloads[0][slot].view(-1).view(torch.uint8)[4321] ^= 0x40
    return flip, slot


def _server_flip(probe, tokens, address):
    """The same on the cache server: the object's bytes in the server's shared pool."""
    from vllm_kvplugin.tiers.mp_client import MPClient

    key = chunk_keys(probe.worker.fingerprint, tokens, CHUNK)[BAD]
    c = MPClient(address, client_name="test-flip")
    r = c.lookup_detail([key], [(2, 0)])  # a point lookup: just this object
    assert r.hits == 1
    (off, n), = c.resolve(r.lease, [key], 0, 0, 1)
    c.release(r.lease)
    view = c.pool_view()

    def flip():
        view[off + HEADER_SIZE + 4321] ^= 0x40
    return flip, c


def _outputs_a_step_late(monkeypatch) -> None:
    """vLLM's async scheduling (its default on a GPU; the CPU platform turns it off) hands a
    step's output to the connector only after the next step was scheduled: emulated here by
    applying each output one call later."""
    from vllm_kvplugin.connector.scheduler import SchedulerSide

    orig, held = SchedulerSide.update_connector_output, {}

    def late(self, output):
        prev, held[id(self)] = held.get(id(self)), output
        if prev is not None:
            orig(self, prev)
    monkeypatch.setattr(SchedulerSide, "update_connector_output", late)


@pytest.mark.parametrize("tier", ["local", "server", "local-late-outputs"])
def test_transient_fault_poisons_nothing(qwen3_model, tier, request, monkeypatch):
    """``local-late-outputs``: the worker's outputs reach the scheduler a step late (as under
    async scheduling), while its verdicts go straight to the scheduler: the object that failed
    must still be dropped before the hit is claimed, or the request would never store it again."""
    if tier == "local-late-outputs":
        _outputs_a_step_late(monkeypatch)
        tier = "local"
    want_p, want_p2 = _baseline(qwen3_model, BLOCK, [[P], [P2]], budget=CHUNK)
    cfg = {"chunk_size": CHUNK}
    srv = None
    if tier == "server":
        srv = request.getfixturevalue("server")
        cfg.update(cpu_bytes=0, server=srv.address)
    counters.STATS.reset()
    from vllm_kvplugin.connector import worker as wmod

    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            flip, handle = _local_flip(probe, P) if tier == "local" else _server_flip(probe, P, srv.address)
            orig, calls = wmod.WorkerSide._fetch, []

            def fetch_once_wrong(ws, req):  # wrong bytes while exactly one fetch reads and verifies them
                calls.append(req.req_id)  # (with the step's metadata, or from the lookup: _fetch_here)
                if len(calls) == 1:
                    flip()
                try:
                    return orig(ws, req)
                finally:
                    if len(calls) == 1:
                        flip()

            wmod.WorkerSide._fetch = fetch_once_wrong
            try:
                probe.poison_all_blocks(seed=1)
                before = vllm_kvplugin.stats()
                bad = generate(llm, [P2])[0]
                after = vllm_kvplugin.stats()
            finally:
                wmod.WorkerSide._fetch = orig
            assert bad.token_ids == want_p2
            # only the verified prefix was claimed: a failed load is not a hit
            assert bad.num_cached_tokens == BAD * CHUNK
            assert after["hit_tokens"] - before["hit_tokens"] == BAD * CHUNK
            assert after["loaded_tokens"] - before["loaded_tokens"] == BAD * CHUNK
            assert after["load_failures"] == {"checksum": 1}
            # the object that failed is gone from its tier at once (then stored again, recomputed)
            if tier == "local":
                assert after["dropped_objects"] == 1
            else:
                assert wait_for(lambda: handle.stats()["dropped_reported_corrupt"] == 1)
            for i in range(3):  # everything stored since is right: poisoned KV, full hits, right output
                for p, want in ((P2, want_p2), (P, want_p)):
                    probe.poison_all_blocks(seed=10 + i)
                    r = generate(llm, [p])[0]
                    assert r.token_ids == want, f"run {i}, {len(p)} tokens: a wrong chunk was stored"
                    assert r.num_cached_tokens == (len(p) - 1) // CHUNK * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {"checksum": 1}
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)


@pytest.mark.newest_lane
def test_a_stores_checksum_is_of_its_own_bytes_not_the_shared_pools(qwen3_model, server, monkeypatch):  # noqa: F811
    """Writer fencing, the bytes: the server's pool is mapped writable by every engine, and a
    writer that stalled past its reservation may still be copying into room since given to
    another.  Such a write -- made here for real, through another mapping of the pool -- into
    the object of chunk BAD of a store lands (1) after the worker computed its bytes and before
    it hashed them: the checksum is of the worker's own copy, which then overwrites the pool,
    so the object is right and served in full; (2) after the worker published it, before the
    commit: the object fails its checksum and is recomputed.  Every output is
    right, and the next runs, on poisoned KV, hit in full."""
    from vllm_kvplugin.connector import worker as wmod
    from vllm_kvplugin.tiers import mp as mpmod
    from vllm_kvplugin.tiers.mp_client import MPClient

    q = prompt(8 * CHUNK + 10, seed=33)
    wants = dict(zip(("before the hash", "before the commit"), _baseline(qwen3_model, BLOCK, [[P], [q]], budget=CHUNK)))
    other = MPClient(server.address, client_name="test-stalled-writer")
    pool = other.pool_view()
    written = []
    publish, commit = wmod.WorkerSide._publish, mpmod.ServerStore.commit

    def scribble(ws, remote, tokens):
        key = chunk_keys(ws.fingerprint, tokens, CHUNK)[BAD]
        for t in remote:
            if t.job.key == key:
                off = t.payload.data_ptr() - ws.server._pool().data_ptr()
                pool[off + 4321] ^= 0x40
                written.append(off)

    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address},
                     budget=CHUNK)
        try:
            for (when, want), tokens in zip(wants.items(), (P, q)):
                failed_before = vllm_kvplugin.stats()["load_failures"].get("checksum", 0)
                if when == "before the hash":
                    monkeypatch.setattr(wmod.WorkerSide, "_publish", lambda ws, remote, *src, t=tokens: (
                        scribble(ws, remote, t) or publish(ws, remote, *src)))
                else:
                    monkeypatch.setattr(mpmod.ServerStore, "commit", lambda st, remote, t=tokens: (
                        scribble(probe.worker, remote, t) or commit(st, remote)))
                written.clear()
                assert generate(llm, [tokens])[0].token_ids == want
                monkeypatch.undo()
                assert len(written) == 1, (when, written)
                probe.poison_all_blocks(seed=1)
                warm = generate(llm, [tokens])[0]
                assert warm.token_ids == want, when
                fails = vllm_kvplugin.stats()["load_failures"].get("checksum", 0) - failed_before
                if when == "before the hash":  # overwritten by the worker's own bytes: a full hit
                    assert (warm.num_cached_tokens, fails) == (8 * CHUNK, 0)
                else:  # the changed byte fails the checksum (the load's, or first the server's as it
                    # writes the object to L2): never served, the prefix before it is the hit
                    st = other.stats()
                    assert warm.num_cached_tokens == BAD * CHUNK
                    assert fails + st["l1_corrupt_objects"] == 1, (fails, st["l1_corrupt_objects"])
                for i in range(2):  # stored again where it failed: full hits, poisoned KV
                    probe.poison_all_blocks(seed=10 + i)
                    r = generate(llm, [tokens])[0]
                    assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK, (when, i)
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)
            other.close()


@pytest.mark.newest_lane
@pytest.mark.parametrize("where", ["staging", "copy"])
def test_a_store_that_cannot_get_host_memory_stores_nothing(qwen3_model, server, monkeypatch, where):  # noqa: F811
    """A server store fails while it is issued (mocked: it cannot be caused on purpose here):
    taking its staging memory, or copying into it.  That step stores nothing, its reservations
    go back, its staging room too, the engine goes on; the prompt is right, recomputed where the
    chunk is missing, stored again, and then hits in full on poisoned KV."""
    from vllm_kvplugin.transfer import cpu as cpu_transfer
    from vllm_kvplugin.transfer import host_buffers

    want_p, = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)
    owner, name = ((host_buffers.HostBuffers, "take_slices") if where == "staging"
                   else (cpu_transfer.CpuTransfer, "store"))
    orig, calls = getattr(owner, name), []

    def first_call_fails(*a):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"{where} failed (test)")
        return orig(*a)

    monkeypatch.setattr(owner, name, first_call_fails)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address},
                     budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            assert len(calls) > 1 and vllm_kvplugin.stats()["server_store_errors"] == 1
            probe.poison_all_blocks(seed=1)
            again = generate(llm, [P])[0]  # chunk 0 was never stored: no prefix to hit
            assert again.token_ids == want_p and again.num_cached_tokens == 0
            for i in range(2):
                probe.poison_all_blocks(seed=10 + i)
                r = generate(llm, [P])[0]
                assert r.token_ids == want_p and r.num_cached_tokens == 8 * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {}
            assert not probe.kv_mismatches and probe.kv_checked > 0
            assert probe.worker.finisher.drain(10)
            staging = probe.worker._private
            assert staging.free_bytes() == staging.capacity  # the failed store's room came back
        finally:
            shutdown(llm)


def test_reset_makes_everything_stored_before_unloadable(qwen3_model, server):  # noqa: F811
    """reset_prefix_cache(reset_connector=True): nothing stored before -- in the local tier or
    on the server (and its L2) -- is loaded again; what is stored afterwards is."""
    want_p, = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "server": server.address}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            probe.poison_all_blocks(seed=1)
            assert generate(llm, [P])[0].num_cached_tokens == 8 * CHUNK  # stored, both tiers
            assert llm.reset_prefix_cache(reset_connector=True)
            probe.poison_all_blocks(seed=2)
            before = vllm_kvplugin.stats()
            r = generate(llm, [P])[0]
            assert r.token_ids == want_p and r.num_cached_tokens == 0
            assert vllm_kvplugin.stats()["loaded_tokens"] == before["loaded_tokens"]
            probe.poison_all_blocks(seed=3)
            again = generate(llm, [P])[0]  # stored again after the reset: hits
            assert again.token_ids == want_p and again.num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)


def test_prompt_logprobs_never_read_a_cached_prefix(qwen3_model):
    """A request that must compute its whole prompt (prompt logprobs) gets no hit, on every
    vLLM version (0.26's scheduler does not zero a connector's hit itself)."""
    from vllm import SamplingParams

    llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
    try:
        generate(llm, [P])
        sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        out = llm.generate([{"prompt_token_ids": P}], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert len(out.prompt_logprobs) == len(P) and all(lp for lp in out.prompt_logprobs[1:])
        assert generate(llm, [P])[0].num_cached_tokens == 8 * CHUNK  # others still hit
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

    def here(self, req):  # a lone request's fetch, from its lookup (before its hashes start)
        at = len(events)
        events.append(("fetch", 0))
        done = fetch_here(self, req)
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


@pytest.mark.parametrize("fault,first", [("intact", None), ("checksum", None), ("checksum", 2), ("checksum", 4)])
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
    (no step held back for it); full hit, right output on poisoned KV, the loaded blocks poisoned
    before the load and equal to the computed KV after it.  With another request running, a hit
    is fetched with a step's metadata and claimed in a later step, as before: a wait in the
    lookup would stall the running request's steps."""
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
