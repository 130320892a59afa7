"""``async_loads``: a hit claimed at once and loaded while vLLM holds its request, on real engines.

The seed's method (every KV block poisoned before each warm run, every target token poisoned
before its load) with the connector's asynchronous claim: vLLM allocates the blocks, parks the
request until the worker reports the load in ``get_finished``, then runs it.  ``path``: the
request alone in the engine (its fetch started by the lookup) or its fetch sent with the step's
metadata (as with other requests running).  A chunk that fails verification is not written: its
blocks go to vLLM as failed, which recomputes from there, and every later request is still right
(``test_integrity.py``'s transient fault, ``async`` cases).
"""

from __future__ import annotations

import contextlib

import pytest
from harness import Probe, engine, generate, prompt, seed_method, shutdown
from test_cache_hits import _baseline
from test_integrity import BLOCK, CHUNK, not_alone

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


@contextlib.contextmanager
def _stored_in_step(model: str, monkeypatch, length: int, seed: int):
    """An async-loads engine whose fetches go with the step's metadata (a lone fetch's few objects
    are hashed as the lookup starts it, so its verdict would come before the claim), with one
    prompt stored by its cold run: (engine, probe, prompt, its reference output, the reports)."""
    not_alone(monkeypatch)
    p = prompt(length, seed=seed)
    (want,) = _baseline(model, BLOCK, [[p]], budget=CHUNK)
    counters.STATS.reset()
    reported = _reported(monkeypatch)
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "async_loads": True}, budget=CHUNK)
        try:
            assert generate(llm, [p])[0].token_ids == want
            yield llm, probe, p, want, reported
        finally:
            shutdown(llm)


def _policy(llm) -> str:
    return llm.llm_engine.vllm_config.kv_transfer_config.kv_load_failure_policy


@pytest.mark.parametrize("path", ["lone", pytest.param("step", marks=pytest.mark.newest_lane)])
def test_an_async_hit_is_identical_to_recompute(qwen3_model, path, monkeypatch):
    if path == "step":
        not_alone(monkeypatch)
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


def test_a_hit_that_cannot_be_verified_is_not_claimed_again(qwen3_model, monkeypatch):
    """Hashing fails for every fetch of one request (nothing known bad, so its objects stay): the
    asynchronous claim writes nothing, vLLM drops back to token 0 and asks again -- the range is
    not claimed a second time (it would fail the same way, forever), the prompt is computed."""
    from vllm_kvplugin.chunk import checksums

    with _stored_in_step(qwen3_model, monkeypatch, 4 * CHUNK + 3, 77) as (llm, probe, p, want, reported):
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


def test_a_verdict_that_raises_holds_up_nothing(qwen3_model, monkeypatch):
    """Waiting for an asynchronous load's verdict raises inside ``get_finished``: nothing reaches
    vLLM, the load is written from what was verified, and the output is right."""
    from vllm_kvplugin.connector import worker_fetch as fmod

    with _stored_in_step(qwen3_model, monkeypatch, 3 * CHUNK + 9, 78) as (llm, probe, p, want, reported):
        raised = []

        def failing(ws, *a, **k):
            raised.append(1)
            raise RuntimeError("injected: a verdict that cannot be waited for")
        monkeypatch.setattr(fmod.FetchPath, "_await_verdicts", failing)
        probe.poison_all_blocks(seed=5)
        r = generate(llm, [p])[0]
        assert raised and r.token_ids == want and r.num_cached_tokens == 3 * CHUNK
        assert vllm_kvplugin.stats()["loaded_tokens"] == 3 * CHUNK and len(reported) == 1
        assert not probe.kv_mismatches and probe.kv_checked > 0
