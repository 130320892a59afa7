"""``async_loads``: a hit claimed at once and loaded while vLLM holds its request, on real engines.

The seed's method (every KV block poisoned before each warm run, every target token poisoned
before its load) with the connector's asynchronous claim: vLLM allocates the blocks, parks the
request until the worker reports the load in ``get_finished``, then runs it.  A chunk that fails
verification is not written: its blocks go to vLLM as failed, which recomputes from there, and
every later request is still right.  ``path``: the request alone in the engine (its fetch started
by the lookup) or its fetch sent with the step's metadata (as with other requests running).
"""

from __future__ import annotations

import pytest
from harness import Probe, engine, generate, prompt, seed_method, shutdown
from test_cache_hits import _baseline
from test_integrity import BAD, BLOCK, CHUNK, P2, _local_flip, _server_flip
from test_integrity import P as P1
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

import vllm_kvplugin
from vllm_kvplugin import counters

pytestmark = pytest.mark.engine

LENGTHS = (CHUNK + 1, 3 * CHUNK, 5 * CHUNK + 17)


def _reported(monkeypatch) -> list[set[str]]:
    """Every non-empty set the worker reports to vLLM as finished loads."""
    from vllm_kvplugin.connector import worker as wmod

    orig, seen = wmod.WorkerSide.finish_async_loads, []

    def finish(ws):
        done = orig(ws)
        if done:
            seen.append(set(done))
        return done
    monkeypatch.setattr(wmod.WorkerSide, "finish_async_loads", finish)
    return seen


def _path(monkeypatch, path: str) -> None:
    if path == "step":  # never alone: the fetch goes with the step's metadata
        from vllm_kvplugin.connector.scheduler_lone import LoneFetch

        monkeypatch.setattr(LoneFetch, "_alone", lambda self, req_id: None)


def _policy(llm) -> str:
    return llm.llm_engine.vllm_config.kv_transfer_config.kv_load_failure_policy


@pytest.mark.parametrize("path", ["lone", pytest.param("step", marks=pytest.mark.newest_lane)])
def test_an_async_hit_is_identical_to_recompute(qwen3_model, path, monkeypatch):
    _path(monkeypatch, path)
    prompts = [prompt(n, seed=n + 7) for n in LENGTHS]
    want = _baseline(qwen3_model, BLOCK, [[p] for p in prompts], budget=CHUNK)
    counters.STATS.reset()
    reported = _reported(monkeypatch)
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "async_loads": True}, budget=CHUNK)
        try:
            assert _policy(llm) == "recompute"  # every load asynchronous: no failed block is ever cached
            problems = seed_method(llm, probe, prompts, want, CHUNK)
            assert not problems, f"(length, failed checks, num_cached_tokens, planned) {problems}"
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            # each warm request was reported once, alone: its load was asynchronous
            assert len(reported) == len(prompts) and all(len(r) == 1 for r in reported), reported
            stats = vllm_kvplugin.stats()
            assert stats["load_failures"] == {}
            assert stats["lone_fetches"] == (len(prompts) if path == "lone" else 0)
        finally:
            shutdown(llm)


@pytest.mark.parametrize("tier,path", [("local", "step"), pytest.param("server", "step", marks=pytest.mark.newest_lane),
                                       pytest.param("local", "lone", marks=pytest.mark.newest_lane)])
def test_an_async_load_writes_only_what_was_verified(qwen3_model, tier, path, request, monkeypatch):
    """The integrity issue's repro with the claim before the verdict: chunk BAD's bytes are wrong
    while one fetch reads them; the claim covered the whole hit, the load writes the chunks before
    BAD, and vLLM recomputes from BAD.  Then everything is right, with full hits.  (``lone``: on the
    CPU the host hashes a lone fetch's few objects as the lookup starts it, so the verdict is in
    before the claim, which covers the verified chunks only.)"""
    _path(monkeypatch, path)
    want_p, want_p2 = _baseline(qwen3_model, BLOCK, [[P1], [P2]], budget=CHUNK)
    cfg = {"chunk_size": CHUNK, "async_loads": True}
    srv = None
    if tier == "server":
        srv = request.getfixturevalue("server")
        cfg.update(cpu_bytes=0, server=srv.address)
    counters.STATS.reset()
    from vllm_kvplugin.connector import worker as wmod

    handle = None
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
        try:
            assert generate(llm, [P1])[0].token_ids == want_p
            flip, handle = _local_flip(probe, P1) if tier == "local" else _server_flip(probe, P1, srv.address)
            orig, calls = wmod.WorkerSide._fetch, []

            def fetch_once_wrong(ws, req, *a, **k):
                calls.append(req.req_id)
                if len(calls) == 1:
                    flip()
                try:
                    return orig(ws, req, *a, **k)
                finally:
                    if len(calls) == 1:
                        flip()

            monkeypatch.setattr(wmod.WorkerSide, "_fetch", fetch_once_wrong)
            probe.poison_all_blocks(seed=1)
            before = vllm_kvplugin.stats()
            bad = generate(llm, [P2])[0]
            after = vllm_kvplugin.stats()
            monkeypatch.setattr(wmod.WorkerSide, "_fetch", orig)
            assert bad.token_ids == want_p2
            claimed = (len(P1) - 1) // CHUNK * CHUNK if path == "step" else BAD * CHUNK  # before its verdict: all
            assert bad.num_cached_tokens == claimed  # vLLM's count is the claim's (0.26 and 0.32), not what loaded
            assert after["hit_tokens"] - before["hit_tokens"] == claimed
            assert after["loaded_tokens"] - before["loaded_tokens"] == BAD * CHUNK  # written: the verified ones
            assert [t for _, t in probe.loads[-1:]] == [claimed]  # (every claimed target poisoned first)
            assert after["load_failures"] == {"checksum": 1}
            for i in range(3):  # the bad object was dropped, recomputed and stored again: full hits
                for p, want in ((P2, want_p2), (P1, want_p)):
                    probe.poison_all_blocks(seed=10 + i)
                    r = generate(llm, [p])[0]
                    assert r.token_ids == want, f"run {i}, {len(p)} tokens: a wrong chunk was stored"
                    assert r.num_cached_tokens == (len(p) - 1) // CHUNK * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {"checksum": 1}
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)
            if handle is not None and tier == "server":
                handle.close()


def test_a_hit_that_cannot_be_verified_is_not_claimed_again(qwen3_model, monkeypatch):
    """Hashing fails for every fetch of one request (nothing known bad, so its objects stay): the
    asynchronous claim writes nothing, vLLM drops back to token 0 and asks again -- the range is
    not claimed a second time (it would fail the same way, forever), the prompt is computed.  (The
    fetch goes with the step's metadata: a lone fetch's few objects are hashed as the lookup
    starts it, so its verdict would come before the claim.)"""
    from vllm_kvplugin.chunk import checksums

    _path(monkeypatch, "step")

    p = prompt(4 * CHUNK + 3, seed=77)
    (want,) = _baseline(qwen3_model, BLOCK, [[p]], budget=CHUNK)
    counters.STATS.reset()
    reported = _reported(monkeypatch)
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "async_loads": True}, budget=CHUNK)
        try:
            assert generate(llm, [p])[0].token_ids == want

            def broken(self):
                raise RuntimeError("hashing unavailable")
            monkeypatch.setattr(checksums.StartedChecksums, "result", broken)
            probe.poison_all_blocks(seed=3)
            before = vllm_kvplugin.stats()
            r = generate(llm, [p])[0]
            after = vllm_kvplugin.stats()
            monkeypatch.undo()
            assert r.token_ids == want
            assert r.num_cached_tokens == 0
            assert after["hit_tokens"] - before["hit_tokens"] == 4 * CHUNK  # claimed once, not twice
            assert after["loaded_tokens"] == before["loaded_tokens"]
            assert after["load_failures"] == {"verify_error": 1}
            assert len(reported) == 1
            probe.poison_all_blocks(seed=4)  # the objects were never bad: the next request loads them
            again = generate(llm, [p])[0]
            assert again.token_ids == want and again.num_cached_tokens == 4 * CHUNK
            assert not probe.kv_mismatches
        finally:
            shutdown(llm)
