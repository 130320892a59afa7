"""Fail closed: every doubtful load is recomputed, counted by reason, and the engine keeps serving.

Each case stores a prompt, damages what the next load will read, and checks
that the warm request's output is still identical to a recompute, that the
failure was counted under its reason, and that the engine serves (and hits)
afterwards.  Faults are caused for real where they can be (bytes flipped in
the pool, headers swapped, chunks gone); a mock only where the local tier
cannot produce the fault itself (a short read, a failing copy, a wrong plan).
"""

from __future__ import annotations

import pytest
import torch
from harness import Probe, engine, generate, prompt, shutdown

import vllm_kvplugin
from vllm_kvplugin import counters

pytestmark = pytest.mark.engine

CHUNK = 64
LEN = 8 * CHUNK + 10  # 8 full chunks


def _slots_of(worker, tokens: list[int]) -> list[int]:
    """Pool slots holding the prompt's chunks, in chunk order (found by the keys in their headers)."""
    from vllm_kvplugin.chunk.format import ChunkHeader
    from vllm_kvplugin.chunk.keys import chunk_keys

    by_key = {ChunkHeader.unpack(h).key: s for s, h in enumerate(worker.pool.headers[0]) if h is not None}
    return [by_key[k] for k in chunk_keys(worker.fingerprint, tokens, CHUNK)]


def _missing(probe, monkeypatch, slots):
    for s in slots:
        probe.worker.pool.set_header(0, s, None)


def _checksum_middle(probe, monkeypatch, slots):
    payload = probe.worker.pool.payloads[0][slots[3]]
    payload.view(torch.uint8).view(-1)[1234] ^= 0x40


def _swapped_headers(probe, monkeypatch, slots):
    pool = probe.worker.pool
    a, b = pool.header(0, slots[0]), pool.header(0, slots[1])
    pool.set_header(0, slots[0], b)
    pool.set_header(0, slots[1], a)


def _short_read(probe, monkeypatch, slots):
    pool = probe.worker.pool
    orig = type(pool).payload
    monkeypatch.setattr(type(pool), "payload", lambda self, g, s: orig(self, g, s).reshape(-1)[:-100])


def _copy_error(probe, monkeypatch, slots):
    def boom(*a, **k):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(probe.worker.engine, "load", boom)


def _wrong_plan(probe, monkeypatch, slots):
    from vllm_kvplugin.connector import scheduler as smod

    orig = smod.SchedulerSide.build_connector_meta

    def build(self, so):
        meta = orig(self, so)
        for req in meta.loads:
            req.expected_bytes = tuple(b + 2048 for b in req.expected_bytes)
        return meta

    monkeypatch.setattr(smod.SchedulerSide, "build_connector_meta", build)


CASES = {
    "missing": _missing,
    "checksum": _checksum_middle,
    "header_mismatch": _swapped_headers,
    "short_read": _short_read,
    "error": _copy_error,
    "byte_mismatch": _wrong_plan,
}


@pytest.fixture(scope="module")
def prompts():
    return {name: prompt(LEN, seed=100 + i) for i, name in enumerate(CASES)}


@pytest.fixture(scope="module")
def baseline(qwen3_model, prompts):
    from test_cache_hits import _baseline

    names = list(prompts)
    after = prompt(LEN, seed=7)
    outs = _baseline(qwen3_model, 32, [[prompts[n]] for n in names] + [[after]], budget=CHUNK)
    return dict(zip(names, outs)), after, outs[-1]


def test_every_doubtful_load_is_recomputed(qwen3_model, prompts, baseline, monkeypatch):
    want, after_prompt, after_want = baseline
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            for reason, inject in CASES.items():
                p = prompts[reason]
                assert generate(llm, [p])[0].token_ids == want[reason], reason
                slots = _slots_of(probe.worker, p)
                assert len(slots) == 8
                before = vllm_kvplugin.stats()["load_failures"].get(reason, 0)
                with monkeypatch.context() as m:
                    inject(probe, m, slots)
                    probe.poison_all_blocks()
                    warm = generate(llm, [p])[0]
                    failures = vllm_kvplugin.stats()["load_failures"]
                assert failures.get(reason, 0) == before + 1, (reason, failures)
                assert warm.token_ids == want[reason], f"{reason}: served doubtful KV"
            # the engine keeps serving, and hits again
            assert generate(llm, [after_prompt])[0].token_ids == after_want
            probe.poison_all_blocks()
            again = generate(llm, [after_prompt])[0]
            assert again.token_ids == after_want and again.num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)
