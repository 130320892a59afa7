"""The seeds' method on real vLLM engines: a cache hit is byte-identical to a recompute.

Prefix caching off; the same prompt twice, greedy; every KV block overwritten
with noise between the two requests, and the load's target tokens overwritten
with noise right before the load; outputs compared with the cold run and with
an engine without the connector; the hit proven by vLLM's own
``num_cached_tokens`` and by ``vllm_kvplugin.stats()`` (tokens and bytes equal
to the plan); a never-seen prompt afterwards still matches its cold output.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from harness import (
    Probe,
    engine,
    generate,
    plugin_counter,
    prompt,
    reset_vllm_globals,
    seed_method,
    shutdown,
)

import vllm_kvplugin
from vllm_kvplugin import counters

pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class Config:
    model: str  # fixture name
    block: int
    chunk: int
    long_chunks: int = 0  # an extra prompt of this many chunks (exact multiple, and +1)

    @property
    def id(self) -> str:
        return f"{self.model}-block{self.block}-chunk{self.chunk}"

    def lengths(self) -> list[int]:
        c = self.chunk
        out = [c // 2, c - 1, c, c + 1, 3 * c - 1, 3 * c, 3 * c + 1]
        if self.long_chunks:
            out += [self.long_chunks * c, self.long_chunks * c + 1]
        return out


CONFIGS = [  # the oldest lane: one config per model (the layouts differ by version, the plans do not)
    pytest.param(Config("qwen3_model", 32, 32, long_chunks=128), marks=pytest.mark.newest_lane),
    Config("qwen3_model", 32, 128),
    pytest.param(Config("qwen3_model", 128, 128, long_chunks=128), marks=pytest.mark.slow),
    pytest.param(Config("qwen3_model", 128, 256), marks=pytest.mark.newest_lane),
    pytest.param(Config("llama_model", 32, 64, long_chunks=130), marks=pytest.mark.slow),
    Config("llama_model", 128, 128),
]


def _baseline(model: str, block: int, batches: list[list[list[int]]], budget: int, **kw) -> list[list[int]]:
    """Outputs of an engine without the connector, batch by batch as the test sends them
    and with the same token budget (both change the prefill schedule, hence bf16 rounding)."""
    llm = engine(model, block, None, budget=budget, **kw)
    try:
        return [r.token_ids for batch in batches for r in generate(llm, batch)]
    finally:
        shutdown(llm)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: getattr(c, "id", None))
def test_hit_is_identical_to_recompute(cfg: Config, request):
    model = request.getfixturevalue(cfg.model)
    lengths = cfg.lengths()
    prompts = [prompt(n, seed=n) for n in lengths]
    unseen = prompt(3 * cfg.chunk + 7, seed=999_999)
    want = _baseline(model, cfg.block, [[p] for p in prompts] + [[unseen]], budget=cfg.chunk)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, cfg.block, {"chunk_size": cfg.chunk, "cpu_bytes": 1 << 30}, budget=cfg.chunk)
        try:
            problems = seed_method(llm, probe, prompts, want, cfg.chunk)
            assert not problems, f"{cfg.id}: (length, failed checks, num_cached_tokens, planned) {problems}"
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            assert generate(llm, [unseen])[0].token_ids == want[-1], "a never-seen prompt after the hits"
            assert vllm_kvplugin.stats()["load_failures"] == {}
        finally:
            shutdown(llm)


def test_skipped_load_is_caught(qwen3_model):
    """Negative control: claiming the hit without writing the blocks changes the output."""
    p = prompt(700, seed=1)
    want = _baseline(qwen3_model, 32, [[p]], budget=64)[0]
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": 64}, budget=64)
        try:
            assert generate(llm, [p])[0].token_ids == want
            probe.poison_all_blocks()
            probe.skip_loads = True
            warm = generate(llm, [p])[0]
            assert warm.num_cached_tokens == 640  # the hit was claimed ...
            assert warm.token_ids != want  # ... and the poisoned blocks show
        finally:
            shutdown(llm)


class _LateTicket:
    waited = False


def test_store_finishing_after_its_step_reaches_the_next_request(qwen3_model, monkeypatch):
    """On a GPU a store's DMA completes after the step that issued it, and an engine that
    goes idle after that step runs no other: the store must still reach the next request.
    Simulated on the CPU (the one thing here that cannot happen for real): the transfer
    engine's tickets complete only when waited for. The prompt is prefilled and answered in
    one step, so the request is done in the step that stores it. (That a hit serves the
    right bytes is what the seeds' method tests above prove.)"""
    from vllm_kvplugin.transfer.cpu import CpuTransfer

    copy = CpuTransfer.store
    monkeypatch.setattr(CpuTransfer, "store", lambda self, *a: copy(self, *a) or _LateTicket())
    monkeypatch.setattr(CpuTransfer, "done", lambda self, t: t is None or t.waited)
    monkeypatch.setattr(CpuTransfer, "wait", lambda self, t: t is not None and setattr(t, "waited", True))
    p = prompt(3 * 32 + 5, seed=5)
    counters.STATS.reset()
    llm = engine(qwen3_model, 32, {"chunk_size": 32})
    try:
        cold = generate(llm, [p], max_tokens=1)[0]
        warm = generate(llm, [p], max_tokens=1)[0]
        s = vllm_kvplugin.stats()
        assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 96)
        assert s["stored_tokens"] == 96 and s["loaded_tokens"] == 96 and s["load_failures"] == {}
    finally:
        shutdown(llm)


def test_shared_prefix_in_one_batch(qwen3_model):
    """Several requests with a common prefix, scheduled in one step: correct, stored once, all hit.

    The reference is vLLM's own prefix cache (same block size, same token budget): it
    computes exactly what a plugin hit leaves to compute, in the same steps, so the outputs
    must agree bit for bit, and within one step neither may hit chunks still being computed.
    """
    chunk = 64
    prefix = prompt(4 * chunk, seed=5)
    cold = [prefix + prompt(40 + 30 * i, seed=10 + i) for i in range(3)]
    warm = [prefix + prompt(90, seed=20 + i) for i in range(2)]
    ref = engine(qwen3_model, chunk, None, budget=2048, enable_prefix_caching=True)
    try:
        want = [[r.token_ids for r in generate(ref, batch)] for batch in (cold, warm)]
    finally:
        shutdown(ref)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, chunk, {"chunk_size": chunk}, budget=2048)
        try:
            got = generate(llm, cold)
            assert [r.token_ids for r in got] == want[0]
            assert [r.num_cached_tokens for r in got] == [0, 0, 0]  # nothing hit what was in flight
            s = vllm_kvplugin.stats()
            # the 4 prefix chunks once, plus each request's own full chunks (suffixes 40/70/100 tokens)
            assert s["stored_tokens"] == (4 + 0 + 1 + 1) * chunk
            probe.poison_all_blocks()
            got = generate(llm, warm)
            assert [r.token_ids for r in got] == want[1]
            assert [r.num_cached_tokens for r in got] == [4 * chunk, 4 * chunk]  # the shared prefix
            assert vllm_kvplugin.stats()["loaded_tokens"] == 2 * 4 * chunk
            assert not probe.kv_mismatches and probe.kv_checked == 8
        finally:
            shutdown(llm)


def test_eviction_under_budget_keeps_serving_correctly(qwen3_model):
    """A budget of a few chunks: LRU eviction, counters, and still identical outputs."""
    chunk = 64
    prompts = [prompt(6 * chunk + 5, seed=40 + i) for i in range(4)]
    want = _baseline(qwen3_model, 32, [[p] for p in prompts], budget=chunk)
    counters.STATS.reset()
    with Probe().installed() as probe:
        bytes_per_chunk = 2048 * chunk  # tiny Qwen3: 4 layers x K,V x 2 heads x 64 x bf16
        llm = engine(qwen3_model, 32, {"chunk_size": chunk, "cpu_bytes": 8 * bytes_per_chunk}, budget=chunk)
        try:
            assert probe.worker.pool.num_slots == 8
            for p, w in zip(prompts, want):
                assert generate(llm, [p])[0].token_ids == w
            s = vllm_kvplugin.stats()
            assert s["evicted_bytes"] >= (4 * 6 - 8) * bytes_per_chunk
            probe.poison_all_blocks()
            last = generate(llm, [prompts[-1]])[0]  # the most recent prompt is still cached
            assert last.token_ids == want[-1] and last.num_cached_tokens == 6 * chunk
            first = generate(llm, [prompts[0]])[0]  # the oldest was evicted: recomputed
            assert first.token_ids == want[0] and first.num_cached_tokens == 0
        finally:
            shutdown(llm)


def test_counters_reach_vllm_prometheus(qwen3_model):
    """The plugin's counters arrive in vLLM's own stats pipeline and Prometheus registry."""
    p = prompt(9 * 64 + 3, seed=77)
    before = plugin_counter("loaded_bytes")
    llm = engine(qwen3_model, 32, {"chunk_size": 64}, disable_log_stats=False)
    try:
        generate(llm, [p])
        generate(llm, [p])
        s = vllm_kvplugin.stats()
    finally:
        shutdown(llm)
    assert plugin_counter("loaded_bytes") - before == 9 * 64 * 2048
    assert plugin_counter("hit_tokens") >= 9 * 64
    assert s["loaded_bytes"] >= 9 * 64 * 2048


def test_certification_failure_stops_the_engine(qwen3_model, monkeypatch):
    """A kernel that disagrees with the layout reference: the engine does not start."""
    from vllm_kvplugin import ops

    real = ops.gather

    def off_by_one_token(layers, slots, *a):
        return real(layers, slots.roll(1, dims=1), *a)

    monkeypatch.setattr(ops, "gather", off_by_one_token)
    try:
        with pytest.raises(Exception, match="certification.*CPU_ATTN"):
            engine(qwen3_model, 32, {"chunk_size": 64})
    finally:
        reset_vllm_globals()


def test_a_rehearsal_of_the_load_reaches_the_engine_empty(qwen3_model, monkeypatch):
    """``WorkerSide._rehearse_load`` (a lone hit's rehearsal while its copy ends on a GPU,
    ``worker_fetch.REHEARSE_LOADS``) on a real engine's worker: one placement of no token per
    attention group reaches the transfer engine, and the next hit still equals the cold run."""
    from vllm_kvplugin.connector import worker as wmod
    from vllm_kvplugin.transfer.cpu import CpuTransfer

    seen = []
    monkeypatch.setattr(CpuTransfer, "rehearse", lambda self, layout, layers, placed: seen.append(
        (layout.block_size, placed.tokens, placed.count(), len(placed), len(layers))))
    p = prompt(3 * 32 + 5, seed=7)
    llm = engine(qwen3_model, 32, {"chunk_size": 64})
    try:
        cold = generate(llm, [p])[0]
        ws = wmod.registered()
        ws._rehearse_load()
        assert seen == [(32, 64, 0, 1, len(ws.layers[0]))], seen
        warm = generate(llm, [p])[0]
        assert warm.num_cached_tokens == 64 and warm.token_ids == cold.token_ids
    finally:
        shutdown(llm)
