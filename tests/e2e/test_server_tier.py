"""Real engines through a real ``vllm-kvplugin server`` process.

The seeds' method at any prefix length (up to 300 chunks, exact multiples
and +-1 around 127/128/129 chunks), two engine processes sharing one server,
and the server killed (``kill -9``) before a load, during a load and during a
store: the engine recomputes, keeps serving, and hits again once a server is
back (with L2 the data survives the restart).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from harness import Probe, engine, generate, prompt, seed_method, server_stats, shutdown
from test_cache_hits import _baseline

import vllm_kvplugin
from vllm_kvplugin import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from srvutil import ServerProc  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.server]

CHUNK = 32


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="kvs-e2e-", dir="/tmp") as d:
        yield d


@pytest.fixture
def server(workdir):
    # the pool's memory is allocated at start: keep it small on the shared CI box
    s = ServerProc(workdir, "--l1-bytes", "512MiB", "--l2-dir", os.path.join(workdir, "l2")).start()
    yield s
    s.stop()


def _delta(before: dict, after: dict, key: str):
    return after[key] - before[key]


@pytest.mark.slow
def test_hit_through_server_at_any_prefix_length(qwen3_model, server):
    lengths = [CHUNK // 2, CHUNK, CHUNK + 1]
    lengths += [128 * CHUNK - 1, 128 * CHUNK, 128 * CHUNK + 1]  # the seed's 128 chunks, -1 and +1
    lengths += [300 * CHUNK + 7]  # 300 chunks, one lookup and one lease (1,100 at the server level:
    # tests/server/test_server_roundtrip.py)
    prompts = [prompt(n, seed=3 * n) for n in lengths]
    want = _baseline(qwen3_model, 32, [[p] for p in prompts], budget=CHUNK, max_model_len=12_000)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address},
                     budget=CHUNK, max_model_len=12_000)
        try:
            def server_checks(before, after, hit):
                return {"server_hit_tokens": _delta(before, after, "server_hit_tokens") == hit,
                        "served==planned": _delta(before, after, "server_served_bytes")
                        == _delta(before, after, "server_planned_bytes")}

            problems = seed_method(llm, probe, prompts, want, CHUNK, server_checks)
            assert not problems, f"(length, failed checks, num_cached_tokens, planned) {problems}"
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            s = vllm_kvplugin.stats()
            assert s["server_bytes_mismatches"] == 0 and s["load_failures"] == {}
            assert s["server_planned_bytes"] > 0
            assert s["lone_fetches"] > 0 and s["split_fetches"] == 0  # a server hit is looked up whole
        finally:
            shutdown(llm)


def _child(python: str, code: str, timeout: int = 900) -> str:
    out = subprocess.run([python, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, cwd="/", env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                                                            TORCHDYNAMO_DISABLE="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


ENGINE_CHILD = """
    import json, random, sys
    sys.path.insert(0, {e2e!r})
    from harness import engine, generate, shutdown
    import vllm, vllm_kvplugin
    p = [random.Random(11).randrange(10, 4000) for _ in range({n})]
    res = {{"vllm": vllm.__version__}}
    if {baseline}:
        llm = engine({model!r}, 32, None, budget={chunk})
        res["baseline"] = generate(llm, [p])[0].token_ids
        shutdown(llm)
    llm = engine({model!r}, 32, {{"chunk_size": {chunk}, "cpu_bytes": 0, "server": {addr!r}}}, budget={chunk})
    r = generate(llm, [p])[0]
    res.update(tokens=r.token_ids, cached=r.num_cached_tokens, stats=vllm_kvplugin.stats())
    shutdown(llm)
    print("RESULT " + json.dumps(res))
"""


def _other_python() -> str:
    """Another CPU lane's interpreter (set by nox when its venv exists), else this one."""
    return os.environ.get("KVPLUGIN_OTHER_VLLM_PYTHON") or sys.executable


@pytest.mark.newest_lane
def test_two_engine_processes_share_the_server(qwen3_model, server):
    """One engine process stores; another process (another vLLM version where one is installed) hits."""
    import json

    n = 20 * CHUNK + 9
    common = dict(e2e=str(Path(__file__).parent), n=n, model=qwen3_model, chunk=CHUNK, addr=server.address)
    a = json.loads(_child(sys.executable, ENGINE_CHILD.format(baseline=False, **common)).split("RESULT ", 1)[1])
    b = json.loads(_child(_other_python(), ENGINE_CHILD.format(baseline=True, **common)).split("RESULT ", 1)[1])
    assert a["cached"] == 0 and a["stats"]["stored_tokens"] == 20 * CHUNK
    assert b["cached"] == 20 * CHUNK and b["stats"]["server_hit_tokens"] == 20 * CHUNK
    assert b["tokens"] == b["baseline"], f"vLLM {b['vllm']} served KV stored by vLLM {a['vllm']} wrongly"


@pytest.mark.newest_lane
@pytest.mark.parametrize("when", ["before-load", "during-load", "restarted-during-load", "stopped-during-load",
                                  "during-store", "stopped-during-store"])
def test_server_killed(qwen3_model, server, when, monkeypatch):
    """kill -9 (or restart, or SIGSTOP) the server: the engine recomputes (no hang), keeps
    serving, stores nothing computed over a load that did not happen, and hits again later.
    "...-during-load": between the scheduler's lookup and the workers' fetch of the hit.  The
    lookup of this engine of one rank answers where the hit's objects are (``LOOKUP_RESOLVES``):
    killed, the server leaves them mapped and pinned, and they are read and verified as any
    hit; restarted, and met by the worker's client first, its new instance voids them (not
    fetched).  Stopped: the worker's own resolve (the lookup resolving nothing, as an engine of
    several ranks does) gets no answer (not fetched).  "stopped-during-store": the first reserve
    reaches a stopped server, which carries it out once continued, after the engine gave up on
    it: the client gives that reservation back, so the next time the prompt is computed its
    store lands (kept, the server answered "exists" to it for 60 s: a hole at chunk 0)."""
    import signal

    from vllm_kvplugin.tiers import mp
    from vllm_kvplugin.tiers.mp_client import TierUnavailable

    p = prompt(12 * CHUNK + 5, seed=500)
    p2 = p + prompt(2 * CHUNK + 3, seed=502)
    q = prompt(9 * CHUNK + 3, seed=501)
    want_p, want_p2, want_q = _baseline(qwen3_model, 32, [[p], [p2], [q]], budget=CHUNK)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address,
                                       "server_timeout_s": 2}, budget=CHUNK)
        try:
            if when == "during-store":
                orig = mp.ServerStore.reserve

                def reserve_then_die(self, jobs, items):
                    targets = orig(self, jobs, items)
                    server.kill9()
                    return targets

                monkeypatch.setattr(mp.ServerStore, "reserve", reserve_then_die)
                assert generate(llm, [p])[0].token_ids == want_p
                monkeypatch.undo()
                assert vllm_kvplugin.stats()["server_store_errors"] >= 1
                server.start()  # same L2 directory: nothing of the killed store may be visible
                probe.poison_all_blocks()
                again = generate(llm, [p])[0]
                assert again.token_ids == want_p and again.num_cached_tokens == 0
            elif when == "stopped-during-store":
                orig = mp.ServerStore.reserve

                def reserve_then_stop(self, jobs, items):
                    monkeypatch.undo()
                    server.proc.send_signal(signal.SIGSTOP)
                    try:  # (stopped for the step's bound: less than the silence that reaps a client)
                        return orig(self, jobs, items)
                    finally:  # continued, it reserves the objects for nobody
                        server.proc.send_signal(signal.SIGCONT)

                assert generate(llm, [q])[0].token_ids == want_q  # the worker's session is open
                monkeypatch.setattr(mp.ServerStore, "reserve", reserve_then_stop)
                assert generate(llm, [p])[0].token_ids == want_p
                assert vllm_kvplugin.stats()["server_store_errors"] >= 1
                time.sleep(1.5)  # past the worker's back-off after the reserve it gave up on
                for i in range(3):
                    probe.poison_all_blocks(seed=i + 1)
                    back = generate(llm, [p])[0]
                    assert back.token_ids == want_p
                    if i:
                        assert back.num_cached_tokens == 12 * CHUNK, (i, vllm_kvplugin.stats())
                st = server_stats(server.address)
                assert st["aborted_objects"] >= 1 and st["clients_reaped"] == 0, st
            else:
                assert generate(llm, [p])[0].token_ids == want_p
                if when == "before-load":
                    server.kill9()
                else:
                    orig = mp.ServerIndex.lookup

                    def lookup_then_fault(self, keys, first, *a, **k):
                        found = orig(self, keys, first, *a, **k)
                        if found.hits:
                            monkeypatch.undo()
                            assert bool(found.resolved) == (when != "stopped-during-load")
                            if when == "stopped-during-load":
                                server.proc.send_signal(signal.SIGSTOP)
                            else:
                                server.kill9()
                                if when == "restarted-during-load":
                                    server.start()
                                    with pytest.raises(TierUnavailable):  # the worker's client meets it
                                        probe.worker.server._client.stats()
                        return found

                    if when == "stopped-during-load":
                        monkeypatch.setattr(mp, "LOOKUP_RESOLVES", False)
                    monkeypatch.setattr(mp.ServerIndex, "lookup", lookup_then_fault)
                probe.poison_all_blocks()
                t0 = time.monotonic()
                warm = generate(llm, [p2])[0]
                assert time.monotonic() - t0 < 30, "a request waited on a dead server"
                monkeypatch.undo()
                # a restarted server may be asked again once the client's back-off is over: it finds
                # the prefix in its L2 and that hit, verified like any other, is right
                again = when == "restarted-during-load" and warm.num_cached_tokens == 12 * CHUNK
                s = vllm_kvplugin.stats()
                if when == "during-load":  # read where the lookup placed them, verified: a hit
                    assert warm.token_ids == want_p2 and warm.num_cached_tokens == 12 * CHUNK, warm
                    assert s["load_failures"] == {} and s["hit_tokens"] == 12 * CHUNK, s
                else:
                    assert warm.token_ids == want_p2 and (warm.num_cached_tokens == 0 or again), warm
                if when == "before-load":
                    assert s["server_lookup_errors"] >= 1
                elif when != "during-load":  # the hit was found, then could not be fetched: never claimed
                    assert sum(s["load_failures"].values()) >= 1, s
                    assert s["hit_tokens"] == warm.num_cached_tokens, s
                if when == "stopped-during-load":
                    server.proc.send_signal(signal.SIGCONT)
                elif when != "restarted-during-load":
                    assert generate(llm, [q])[0].token_ids == want_q  # still serving, server down
                    server.start()  # L2 survived: the stored prefix is found again
                time.sleep(1.5)  # past the clients' back-off after their failed calls (retry_s = 1 s)
                for i in range(3):  # nothing computed over the failed fetch was stored
                    for tokens, want in ((p2, want_p2), (p, want_p)):
                        probe.poison_all_blocks(seed=i + 1)
                        back = generate(llm, [tokens])[0]
                        assert back.token_ids == want, (i, len(tokens))
                        if i:
                            assert back.num_cached_tokens == (len(tokens) - 1) // CHUNK * CHUNK, (i, len(tokens))
        finally:
            shutdown(llm)


@pytest.mark.newest_lane
def test_a_stopped_server_never_stalls_running_requests(qwen3_model, server, monkeypatch):
    """SIGSTOP the server right when the last of four requests' hits is claimed: their loads (verified
    bytes already in hand), the leases' release and the stores of a cold request prefilled
    meanwhile (reserve: bounded by server_step_timeout_s, then backed off) must not wait on it,
    and a request arriving meanwhile waits alone; every step of the running requests stays
    short, while a call waiting on the server would take server_timeout_s (10 s)."""
    import signal

    from vllm import SamplingParams

    from vllm_kvplugin.connector import scheduler as smod

    prompts = [prompt(6 * CHUNK + 3, seed=600 + i) for i in range(4)]
    late = prompt(3 * CHUNK + 1, seed=700)
    cold = prompt(24 * CHUNK + 1, seed=650)
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address,
                                   "server_timeout_s": 10.0, "server_step_timeout_s": 0.05}, budget=8 * CHUNK)
    try:
        want = [r.token_ids for r in generate(llm, prompts, max_tokens=24)]
        claim, claimed = smod.SchedulerSide.update_state_after_alloc, []
        match, cold_miss = smod.SchedulerSide.get_num_new_matched_tokens, []

        def claim_then_stop(self, request, blocks, n):
            claim(self, request, blocks, n)
            claimed.append(n)
            if len([c for c in claimed if c]) == 4:  # every hit verified and claimed: stop it now
                server.proc.send_signal(signal.SIGSTOP)

        def cold_after_stop(self, request, num_computed):
            """The cold request is looked up (a miss) while the server runs, and scheduled only
            once it is stopped: its prefill, and so its stores, always meet the stopped server."""
            if list(request.prompt_token_ids) != cold:  # (vLLM may rewrite request ids: 0.26 does)
                return match(self, request, num_computed)
            if not cold_miss:
                got = match(self, request, num_computed)
                if got[0] is None:
                    return got
                cold_miss.append(got)
            return cold_miss[0] if len([c for c in claimed if c]) >= 4 else (None, False)

        monkeypatch.setattr(smod.SchedulerSide, "update_state_after_alloc", claim_then_stop)
        monkeypatch.setattr(smod.SchedulerSide, "get_num_new_matched_tokens", cold_after_stop)
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        store_errors = counters.WORKER.snapshot()["server_store_errors"]
        eng = llm.llm_engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
        eng.add_request("cold", {"prompt_token_ids": cold}, sp)  # prefilled (and stored) once stopped
        steps, outs, added = [], {}, False
        while eng.has_unfinished_requests():
            t0 = time.monotonic()
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            steps.append(time.monotonic() - t0)
            if not added and len(steps) > 3:
                eng.add_request("late", {"prompt_token_ids": late}, sp)  # its lookup meets the stopped server
                added = True
            if all(r in outs for r in ("r0", "r1", "r2", "r3", "cold")):
                break
        server.proc.send_signal(signal.SIGCONT)
        assert [list(outs[f"r{i}"].outputs[0].token_ids) for i in range(4)] == want
        assert all(outs[f"r{i}"].num_cached_tokens == 6 * CHUNK for i in range(4))
        # a call that waited on the server would take 10 s; the slack is for a loaded 2-core box
        # (an unloaded run here: 64 ms at most, one reserve meeting the stopped server)
        assert max(steps) < 3.0, f"a step waited on the stopped server: {max(steps):.2f} s"
        assert counters.WORKER.snapshot()["server_store_errors"] > store_errors  # stores met it
    finally:
        server.proc.send_signal(signal.SIGCONT)
        shutdown(llm)


def _mapped_pools() -> set[str]:
    """The server pool files this process maps (deleted ones included)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if len(line.split(None, 5)) == 6 and "vllm-kvplugin-" in line and ".pool" in line}


@pytest.mark.newest_lane
def test_server_restarts_leave_one_pool_mapped(qwen3_model, workdir):
    """Five restarts under a running engine: each new server's pool is mapped, each old one is
    unmapped once the engine stops using it (before: every restart kept --l1-bytes mapped in
    every engine process), and hits come from the new server."""
    before = _mapped_pools()  # engines of earlier tests in this process may still map theirs
    srv = ServerProc(workdir, "--l1-bytes", "64MiB").start()
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": srv.address})
    try:
        base = prompt(4 * CHUNK + 5, seed=800)
        want = generate(llm, [base])[0].token_ids
        for i in range(5):
            assert srv.stop() == 0
            srv.start()
            new_pool = srv.banner.split("(pool ", 1)[1].split(",", 1)[0]
            # a call that met the server down backs the client off for 1 s (retry_s): after it,
            # the first calls to meet the new instance fail (a miss), then the pool is re-mapped.
            # The worker lets go of the old pool at its next call that reaches the server (a
            # store's reserve); a backoff begun late (its heartbeat met the server down) can
            # make a few quick requests' calls all fail first, so: requests until a deadline.
            time.sleep(1.2)
            deadline = time.monotonic() + 15
            for attempt in range(1000):
                generate(llm, [prompt(3 * CHUNK + 2, seed=810 + 1000 * i + attempt)])
                pools = _mapped_pools() - before
                if (attempt >= 2 and pools == {new_pool}) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert pools == {new_pool}, f"after restart {i + 1}: {sorted(pools)}, the new one {new_pool}"
        back = generate(llm, [base])[0]  # stored again into the current server, then a hit
        again = generate(llm, [base])[0]
        assert back.token_ids == want and again.token_ids == want
        assert again.num_cached_tokens == 4 * CHUNK
        assert _mapped_pools() - before == {new_pool}
    finally:
        shutdown(llm)
        srv.stop()


@pytest.mark.newest_lane
def test_server_objects_beyond_the_staging_room_are_not_stored(qwen3_model, server):
    """A worker gathers server objects into its own staging memory (allocated at start-up, never
    in a step); a step's objects that find no room there are not sent: counted, missed later,
    never wrong.  Room for none, then for 2 of a step's 4 objects: the server holds the leading 2."""
    from vllm_kvplugin.chunk.format import HEADER_SIZE
    from vllm_kvplugin.transfer.host_buffers import HostBuffers, aligned

    p, q = prompt(8 * CHUNK + 3, seed=600), prompt(8 * CHUNK + 5, seed=601)
    want_p, want_q = _baseline(qwen3_model, 32, [[p], [q]], budget=4 * CHUNK)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address,
                                       "server_staging_bytes": 1}, budget=4 * CHUNK)
        try:
            assert generate(llm, [p])[0].token_ids == want_p
            s = vllm_kvplugin.stats()
            assert s["server_store_skipped"] == 8 and s["stored_tokens"] == 0, s
            probe.poison_all_blocks()
            warm = generate(llm, [p])[0]
            assert warm.token_ids == want_p and warm.num_cached_tokens == 0
            w = probe.worker
            obj = aligned(HEADER_SIZE + w.groups[0].object_bytes(CHUNK))  # payloads: < obj each
            w._private = HostBuffers(2 * obj, pin=False)  # room for 2 of a step's 4 objects
            assert generate(llm, [q])[0].token_ids == want_q
            assert vllm_kvplugin.stats()["server_store_skipped"] >= 8 + 2
            probe.poison_all_blocks(seed=1)
            warm = generate(llm, [q])[0]
            assert warm.token_ids == want_q and warm.num_cached_tokens == 2 * CHUNK, warm.num_cached_tokens
        finally:
            shutdown(llm)


@pytest.mark.newest_lane
@pytest.mark.parametrize("grace_s,lone_s,here", [(5.0, 0.0, False), (0.0, 5.0, False), (0.0, 0.0, False),
                                                  (0.0, 0.0, True)])
def test_a_server_hit_is_fetched_in_the_step_that_looks_it_up(qwen3_model, server, monkeypatch, grace_s, lone_s,
                                                              here):
    """The scheduler waits briefly for the server's answer to a lookup it sends to the index's
    thread (the GIL released), so a hit on the server is fetched in the very step that looks it
    up rather than a step later: any request within the step's grace, a request alone in the
    engine (this repeat) up to ``LONE_LOOKUP_WAIT_S``.  With either long enough for any answer
    here the repeat's fetch is the first step's; with neither, the old behaviour (held back a
    step at least) -- so the waits are what make the difference.  ``here``: the lone request's
    lookup runs on vLLM's thread (``LOOKUP_HERE``), announced to the server before its keys
    (``server_wakes``), answered in that step with no wait.  Full
    hits and right outputs on poisoned KV every way."""
    from test_integrity import CHUNK, P
    from test_verdict_timing import _watch_verdicts

    from vllm_kvplugin.chunk.format import payload_checksum
    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.connector import scheduler_lone as slmod

    monkeypatch.setattr(smod, "LOOKUP_GRACE_S", grace_s)
    monkeypatch.setattr(smod, "LONE_LOOKUP_WAIT_S", lone_s)
    monkeypatch.setattr(slmod, "LOOKUP_HERE", here)
    want = _baseline(qwen3_model, 32, [[P]], budget=CHUNK)[0]
    events = _watch_verdicts(monkeypatch, payload_checksum)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address},
                     budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            assert probe.worker.finisher.drain(10)
            probe.poison_all_blocks()
            events.clear()
            warm = generate(llm, [P])[0]
            before_fetch = events[:events.index(("fetch", 0))]
            assert (before_fetch == []) if grace_s or lone_s or here else (len(before_fetch) >= 1), events
            assert warm.token_ids == want and warm.num_cached_tokens == (len(P) - 1) // CHUNK * CHUNK
            assert vllm_kvplugin.stats()["lone_server_lookups"] == int(here)
            # the repeat's lookup was announced (the first request's came before any session)
            assert vllm_kvplugin.stats()["server_wakes"] == int(here)
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)


def test_a_lookup_answered_after_vllm_computed_less_is_asked_again(qwen3_model, server, monkeypatch):
    """vLLM can pass a smaller ``num_computed_tokens`` than when a server lookup was sent (its own
    prefix cache evicted blocks in between).  The lease pins objects only from the chunk the lookup
    asked from, so its answer is not planned below that chunk: the lookup is sent again from where
    vLLM stands, and the hit is whole.  (The eviction is simulated: the first lookup is sent as if
    vLLM held two chunks, and answered a step later.)"""
    import threading
    from concurrent.futures import Future

    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.connector import scheduler_lone as slmod
    from vllm_kvplugin.tiers.mp import ServerIndex

    monkeypatch.setattr(slmod, "LOOKUP_HERE", False)  # (a late answer: the index's thread's)
    p = prompt(6 * CHUNK + 3, seed=880)
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address})
    try:
        want = generate(llm, [p])[0].token_ids
        llm.reset_prefix_cache()
        lookup_async, match = ServerIndex.lookup_async, smod.SchedulerSide.get_num_new_matched_tokens
        firsts: list[int] = []

        def late(self, keys, first):
            firsts.append(first)
            inner, done = lookup_async(self, keys, first), Future()

            def answer():
                e = inner.exception()
                done.set_exception(e) if e else done.set_result(inner.result())
            threading.Timer(smod.LONE_LOOKUP_WAIT_S + 0.05, answer).start()  # after the step that sent it
            return done

        def fewer_later(self, request, num_computed):
            return match(self, request, num_computed + (0 if firsts else 2 * CHUNK))

        monkeypatch.setattr(ServerIndex, "lookup_async", late)
        monkeypatch.setattr(smod.SchedulerSide, "get_num_new_matched_tokens", fewer_later)
        before = vllm_kvplugin.stats()
        back = generate(llm, [p])[0]
        after = vllm_kvplugin.stats()
        assert firsts == [2, 0]
        assert back.token_ids == want and back.num_cached_tokens == 6 * CHUNK
        assert after["load_failures"] == before["load_failures"]
        assert _delta(before, after, "server_hit_tokens") == 6 * CHUNK
    finally:
        shutdown(llm)


@pytest.mark.newest_lane
@pytest.mark.parametrize("reuse_s", [60.0, 0.0])
def test_a_miss_answer_stands_while_vllm_asks_again(qwen3_model, server, monkeypatch, reuse_s):
    """vLLM asks again about a request it did not schedule after asking (here: its prompt does
    not fit what is left of the step's token budget, chunked prefill off), often every step.
    The server's answer that it holds nothing for the prompt stands for
    :data:`MISS_REUSE_S`: one lookup per request however often vLLM asks.  With the reuse off
    (0 s) a re-ask sends a lookup again, so the reuse is what makes the difference.  The
    outputs are right either way, and the prompts were stored: a repeat of one is a hit."""
    from collections import Counter

    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.tiers.mp import ServerIndex

    monkeypatch.setattr(smod, "MISS_REUSE_S", reuse_s)
    prompts = [prompt(3 * CHUNK + 3, seed=900 + i) for i in range(5)]
    sched = {"budget": 4 * CHUNK, "max_model_len": 4 * CHUNK, "enable_chunked_prefill": False}
    want = _baseline(qwen3_model, 32, [prompts], **sched)
    asks, sent = Counter(), []
    lookup, match = ServerIndex.lookup, smod.SchedulerSide.get_num_new_matched_tokens

    def counted_lookup(self, keys, first, *a, **k):
        sent.append(first)
        return lookup(self, keys, first, *a, **k)

    def counted_match(self, request, num_computed):
        got = match(self, request, num_computed)
        asks[request.request_id, got[0] is None] += 1
        return got

    monkeypatch.setattr(ServerIndex, "lookup", counted_lookup)
    monkeypatch.setattr(smod.SchedulerSide, "get_num_new_matched_tokens", counted_match)
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address}, **sched)
    try:
        outs = generate(llm, prompts)
        assert [o.token_ids for o in outs] == want
        answered = {req: n for (req, held), n in asks.items() if not held}
        assert max(answered.values()) >= 2, asks  # vLLM asked again after an answer
        if reuse_s:
            assert len(sent) == len(prompts), (sent, asks)
        else:
            assert len(sent) > len(prompts), (sent, asks)
        back = generate(llm, prompts[:1])[0]  # a new request: no answer of the first to reuse
        assert back.num_cached_tokens == 3 * CHUNK and back.token_ids == outs[0].token_ids
    finally:
        shutdown(llm)


@pytest.mark.newest_lane
def test_a_preempted_request_is_looked_up_afresh(qwen3_model, server, monkeypatch):
    """A request vLLM preempted (here: a KV cache too small for two growing requests) is asked
    about again from 0 computed tokens.  The server's earlier answer that it held nothing does
    not stand for it (however long ``MISS_REUSE_S``): the prompt's own chunks, stored while it
    ran, are looked up afresh and restored from the server.  Outputs as without the plugin."""
    from collections import Counter

    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.tiers.mp import ServerIndex

    monkeypatch.setattr(smod, "MISS_REUSE_S", 60.0)
    prompts = [prompt(3 * CHUNK + 3, seed=950 + i) for i in range(2)]
    # 64 KiB a block of 32 tokens (4 layers, K and V, 2 heads of 64, bf16): 12 blocks, and each
    # request grows to 7 of them
    sched = {"budget": 4 * CHUNK, "max_model_len": 7 * CHUNK, "kv_bytes": 12 * 64 * 1024}
    llm = engine(qwen3_model, 32, None, **sched)
    try:
        want = [o.token_ids for o in generate(llm, prompts, max_tokens=3 * CHUNK)]
    finally:
        shutdown(llm)
    sent, resumed = Counter(), Counter()
    lookup, match = ServerIndex.lookup, smod.SchedulerSide.get_num_new_matched_tokens

    def counted_match(self, request, num_computed):
        if request.request_id in self._started:
            resumed[request.request_id] += 1
        return match(self, request, num_computed)

    monkeypatch.setattr(smod.SchedulerSide, "get_num_new_matched_tokens", counted_match)
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address}, **sched)
    try:
        def counted_lookup(self, keys, first, *a, **k):  # (on the index's thread or vLLM's)
            sent[keys[0]] += 1
            return lookup(self, keys, first, *a, **k)

        monkeypatch.setattr(ServerIndex, "lookup", counted_lookup)
        before = vllm_kvplugin.stats()
        outs = generate(llm, prompts, max_tokens=3 * CHUNK)
        after = vllm_kvplugin.stats()
        assert resumed, "no request was preempted"
        assert max(sent.values()) >= 2, sent
        assert _delta(before, after, "server_hit_tokens") >= 3 * CHUNK
        assert [o.token_ids for o in outs] == want
    finally:
        shutdown(llm)
