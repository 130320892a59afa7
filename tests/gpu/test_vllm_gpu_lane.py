"""The GPU lane: real vLLM (0.26, the seeds' version) on a GPU, the seeds' method.

FlashAttention and Triton use vLLM 0.26's fused K|V layout, the one the
leading peer served wrong KV on.  Per backend: an engine without the
connector gives the reference outputs; an engine with KVPluginConnector (the
CUDA kernels and transfer engine) runs every prompt cold, then warm after
every KV block was overwritten with noise and the load's target tokens
poisoned; outputs must be identical, the hit proven by ``num_cached_tokens``,
``stats()`` and the KV left in the blocks compared byte for byte with the KV
the cold forward computed.  The same through a real cache server process (the
workers copy between the GPU cache and the server's page-locked shared pool),
and with tensor parallelism over two GPUs where the machine has them.  Run by
``compat/gpulane/run.sh`` on the H200.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
vllm = pytest.importorskip("vllm")

from harness import Probe, engine, generate, prompt, seed_method, shutdown  # noqa: E402
from srvutil import ServerProc  # noqa: E402

import vllm_kvplugin  # noqa: E402
from vllm_kvplugin import counters  # noqa: E402
from vllm_kvplugin.layout.descriptor import ContentSemantics  # noqa: E402

CHUNK, BLOCK = 256, 16
LENGTHS = [2600, 8 * CHUNK, 8 * CHUNK + 1, 40 * CHUNK]  # the seed's ~2,600 tokens, multiples +-


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The GPU lane runs the plugin from a checkout (PYTHONPATH); ``compat/gpulane/run.sh`` adds
    a dist-info with its entry point, and this registers it too when tests/gpu runs without."""
    from vllm_kvplugin.plugin import register

    register()


@pytest.fixture(autouse=True)
def no_engine_left_over():
    """A failed test's traceback (kept by pytest as ``sys.last_traceback``) holds its engine;
    freed while the next engine profiles its memory, it fails that start ("Error in memory
    profiling"), so one failure would fail the next test too.  Free it before each test."""
    import gc

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def model(demo_model) -> str:
    """The demo's model (Qwen3-8B's per-layer KV), by the name this lane's tests use."""
    return demo_model


@pytest.fixture
def server(tmp_path):
    s = ServerProc(str(tmp_path), "--l1-bytes", "2GiB").start()
    yield s
    s.stop()


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_seed_method_on_gpu(model, backend):
    _seed_method_on_gpu(model, backend, {"cpu_bytes": 2 << 30})


def test_seed_method_on_gpu_through_the_server(model, server):
    """The in-process tier off: every hit comes from the server process's pool."""
    s = _seed_method_on_gpu(model, "FLASH_ATTN", {"cpu_bytes": 0, "server": server.address})
    assert s["server_hit_tokens"] == s["hit_tokens"] > 0
    assert s["server_served_bytes"] == s["server_planned_bytes"] > 0 and s["server_bytes_mismatches"] == 0
    # every object went straight into the pool, its checksum the device's digest of its bytes
    assert s["server_store_direct"] > 0 and s["server_store_errors"] == 0, s
    # so the private staging slab is sized for the small calls only (its floor), not for whole steps
    assert s["private_staging_bytes"] == 64 << 20 and s["server_store_skipped"] == 0, s


def test_repeat_after_the_engine_went_idle_hits(model):
    """A prompt answered in the step that stores it, then the engine idle: its repeat must hit
    (the stores' DMAs complete within that step; benchmarks/gpu_ttft.py found them missing)."""
    p = prompt(4 * CHUNK + 3, seed=11)
    counters.STATS.reset()
    llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 1 << 30}, max_model_len=4096, kv_bytes=1 << 30)
    try:
        cold = generate(llm, [p], max_tokens=1)[0]
        warm = generate(llm, [p], max_tokens=1)[0]
        assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 4 * CHUNK)
        s = vllm_kvplugin.stats()  # the bytes it serves are proven by the seeds' method above
        assert s["loaded_tokens"] == 4 * CHUNK and s["load_failures"] == {}
    finally:
        shutdown(llm)


def test_gdn_hybrid_on_gpu(monkeypatch):
    """The CPU lane's hybrid method on the GPU (vLLM 0.26): a tiny GatedDeltaNet + attention
    model, prefix caching on and reset before each warm run, every KV block and state poisoned,
    lengths k*C, +1, +4 up to 32 chunks: warm = cold = no connector, hit = the planner's, and
    the output changes when nothing, or only the states, are not restored.  (vLLM's Triton
    GatedDeltaNet prefill: its default on sm_90 is FlashInfer's, which the lane does not carry.)"""
    import test_hybrid
    from test_hybrid import CASES, test_hybrid_hit_is_identical_to_recompute

    monkeypatch.setattr(test_hybrid, "RECURRENT_KW", {**test_hybrid.RECURRENT_KW, "gdn_prefill_backend": "triton"})
    case = next(p.values[0] for p in CASES if p.values[0].arch == "qwen3next")
    # on the H200 the plugin's default chunk for this model is 272 tokens (the smallest multiple
    # >= 256 of the block sizes vLLM 0.26 picks there; 384 on the CPU: seen 2026-12-02); a step
    # ends on every chunk boundary, where vLLM keeps the recurrent state
    case = dataclasses.replace(case, chunk=272, budget=272, block=None)
    test_hybrid_hit_is_identical_to_recompute(case)


@pytest.mark.parametrize("tier", ["local", "server"])
def test_a_corrupt_object_is_refused_on_the_device_and_poisons_nothing(model, tmp_path, tier, monkeypatch):
    """One byte of a stored chunk's object flipped in its tier (the in-process pool, or the
    server's shared pool): the hit's digests, computed on the device over the bytes that
    landed -- no host hash of it runs -- refuse that chunk; only the prefix before it is
    served, the object is dropped, the output is right on poisoned KV, and the next runs
    (stored again) hit in full.  The lone hit of 8 chunks is sent in two prefetches of 4 from
    either tier (the scheduler splits a local hit, the worker a server one) and scattered by
    one load."""
    import test_integrity
    from test_integrity import _local_flip, _server_flip

    from vllm_kvplugin.connector import worker_fetch as fmod
    from vllm_kvplugin.transfer.cuda import CudaTransfer

    monkeypatch.setattr(test_integrity, "CHUNK", CHUNK)
    bad, p = test_integrity.BAD, prompt(8 * CHUNK + 10, seed=51)
    p2 = p + prompt(2 * CHUNK + 5, seed=52)
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    base = engine(model, BLOCK, None, **kw)
    try:
        want_p, want_p2 = (generate(base, [q])[0].token_ids for q in (p, p2))
    finally:
        shutdown(base)
    srv = ServerProc(str(tmp_path), "--l1-bytes", "2GiB").start() if tier == "server" else None
    cfg = {"chunk_size": CHUNK, **({"cpu_bytes": 0, "server": srv.address} if srv else {"cpu_bytes": 1 << 30})}
    counters.STATS.reset()
    hashed_on_host = []
    orig = fmod.start_payload_checksums
    monkeypatch.setattr(fmod, "start_payload_checksums", lambda ps: hashed_on_host.append(len(ps)) or orig(ps))
    rows, scatters, prefetch, load = [], [], CudaTransfer.prefetch, CudaTransfer.load
    monkeypatch.setattr(CudaTransfer, "prefetch", lambda eng, layout, bufs: _noted(rows, prefetch(eng, layout, bufs)))
    monkeypatch.setattr(CudaTransfer, "load", lambda eng, *a, staged=None: scatters.append(
        [len(r) for _, r in staged or ()]) or load(eng, *a, staged=staged))
    try:
        with Probe().installed() as probe:
            llm, client = engine(model, BLOCK, cfg, **kw), None
            try:
                assert probe.worker.engine.digests
                assert generate(llm, [p])[0].token_ids == want_p
                flip, client = _local_flip(probe, p) if srv is None else _server_flip(probe, p, srv.address)
                flip()
                probe.poison_all_blocks(seed=1)
                rows.clear()
                scatters.clear()
                r = generate(llm, [p2])[0]
                assert rows[:2] == [4, 4] and scatters[0] == [bad], (rows, scatters)  # (bad < 4: all from the first)
                s = vllm_kvplugin.stats()
                assert r.token_ids == want_p2
                assert r.num_cached_tokens == bad * CHUNK and s["loaded_tokens"] == bad * CHUNK
                assert s["load_failures"] == {"checksum": 1}
                if srv is None:
                    assert s["dropped_objects"] == 1
                for i in range(2):  # stored again where it failed: full hits on poisoned KV
                    for q, want in ((p2, want_p2), (p, want_p)):
                        probe.poison_all_blocks(seed=10 + i)
                        r = generate(llm, [q])[0]
                        assert r.token_ids == want and r.num_cached_tokens == (len(q) - 1) // CHUNK * CHUNK
                assert vllm_kvplugin.stats()["load_failures"] == {"checksum": 1}
                assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
                assert hashed_on_host == [], "the host hashed a hit the device should have verified"
                print(f"GPU LANE corrupt object ({tier}): refused on the device; stats {vllm_kvplugin.stats()}")
            finally:
                shutdown(llm)
                if srv is not None and client is not None:
                    client.close()  # (its heartbeat thread would outlive the test)
    finally:
        if srv is not None:
            srv.stop()


def _v1_model_runner(monkeypatch) -> None:
    """vLLM's V1 model runner for the engines made after this (the ``recompute`` policy needs it:
    ``BadBlocks.for_policy``, vLLM issue #49250)."""
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)


def test_recompute_with_the_v2_model_runner_is_refused_at_start_up(model):
    """vLLM's default model runner on this GPU (V2) recomputes a request whose load failed from
    stale positions (vLLM issue #49250: wrong outputs, measured here on an H100 with 0.26); the
    ``recompute`` policy with it is a start-up error that says so."""
    from harness import reset_vllm_globals

    try:
        with pytest.raises(Exception, match="V1 model runner.*#49250"):
            engine(model, BLOCK, {"chunk_size": CHUNK, "load_failure_policy": "recompute"}, async_scheduling=False,
                   max_model_len=12_000, kv_bytes=1 << 30)
    finally:
        reset_vllm_globals()  # (what the engine that did not start left behind)


def test_a_failed_claimed_load_fails_its_request_on_gpu(model):
    """``test_fail_closed``'s failed claimed load under the default policy (``fail``) and vLLM's
    defaults on this GPU (asynchronous scheduling, the V2 model runner): the request whose copy
    failed ends with an error, the next one, sharing its prefix, is right, and nothing computed
    over the blocks the load never wrote was stored."""
    from test_fail_closed import failed_claimed_load_scenario

    failed_claimed_load_scenario(model, "fail", CHUNK, BLOCK, max_model_len=12_000, kv_bytes=1 << 30)
    print(f"GPU LANE failed claimed load, fail: stats {vllm_kvplugin.stats()}")


def test_a_failed_claimed_load_is_recomputed_on_gpu(model, monkeypatch):
    """``test_fail_closed``'s failed claimed load under the ``recompute`` policy on the GPU, in the
    form whose second request runs alone (the first aborted after its load failed: bf16 sums
    depend on the batch), with the synchronous scheduling and V1 model runner that policy needs
    (``BadBlocks.for_policy``): the second request is right, and nothing computed over the
    blocks the load never wrote was stored."""
    from test_fail_closed import failed_claimed_load_scenario

    _v1_model_runner(monkeypatch)
    failed_claimed_load_scenario(model, "recompute", CHUNK, BLOCK, abort_first=True, async_scheduling=False,
                                 max_model_len=12_000, kv_bytes=1 << 30)
    print(f"GPU LANE failed claimed load, recompute: stats {vllm_kvplugin.stats()}")


def test_a_hit_claimed_before_its_verdict_and_refuted_on_the_device_is_recomputed(model, monkeypatch):
    """``scheduler_lone.CLAIM_BEFORE_VERDICT`` with the ``recompute`` policy (and the synchronous
    scheduling and V1 model runner it needs): a lone hit is claimed while its copy and digests
    run, and one byte of chunk 5's object is wrong.  The digests, awaited at the end of the step that loaded it,
    refute it: vLLM drops that step's output and recomputes from chunk 5.  The output is right
    on poisoned KV, the object dropped once, and the next runs hit in full, claimed early."""
    import test_integrity
    from test_integrity import _local_flip

    from vllm_kvplugin.connector import scheduler_lone

    monkeypatch.setattr(scheduler_lone, "CLAIM_BEFORE_VERDICT", True)
    monkeypatch.setattr(test_integrity, "CHUNK", CHUNK)
    _v1_model_runner(monkeypatch)
    p = prompt(8 * CHUNK + 10, seed=61)
    # one chunk of a prefill per step, in both engines: the recompute from chunk 5 then runs the
    # reference's own kernels over the same KV (a GPU's bf16 sums depend on their shapes)
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    want = _reference(model, p, **kw)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 1 << 30, "load_failure_policy": "recompute"},
                     async_scheduling=False, **kw)
        try:
            assert probe.worker.engine.digests
            assert generate(llm, [p])[0].token_ids == want
            flip, _ = _local_flip(probe, p, 5)
            flip()
            probe.poison_all_blocks(seed=1)
            assert generate(llm, [p])[0].token_ids == want
            s = vllm_kvplugin.stats()
            assert s["early_claims"] == 1 and s["load_failures"] == {"checksum": 1} and s["dropped_objects"] == 1, s
            for i in range(2):
                probe.poison_all_blocks(seed=10 + i)
                r = generate(llm, [p])[0]
                assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK
            s = vllm_kvplugin.stats()
            assert s["early_claims"] == 3 and s["load_failures"] == {"checksum": 1}, s
            print(f"GPU LANE early claim refuted on the device: stats {s}")
        finally:
            shutdown(llm)


def _noted(rows: list[int], pre):
    """A prefetch's rows noted (0: none sent); the prefetch."""
    rows.append(pre.rows if pre is not None else 0)
    return pre


def _reference(model: str, p: list[int], **kw) -> list[int]:
    """``p``'s output from an engine without the connector."""
    base = engine(model, BLOCK, None, **kw)
    try:
        return generate(base, [p])[0].token_ids
    finally:
        shutdown(base)


@pytest.mark.parametrize("bad", [1, 5])
def test_a_hit_partly_prefetched_is_verified_on_both_sides(model, bad, monkeypatch):
    """Staging room for 3 of a hit's 8 chunks: those are prefetched and verified on the device,
    the other 5 hashed on the host (and copied by the load).  A byte flipped in chunk ``bad``
    (1: a device-verified one, 5: a host-verified one) is refused either way; the prefix
    before it is served, the output is right on poisoned KV, and the next run hits in full."""
    import test_integrity
    from test_integrity import _local_flip

    from vllm_kvplugin.connector import worker_fetch as fmod

    monkeypatch.setattr(test_integrity, "CHUNK", CHUNK)
    monkeypatch.setattr(test_integrity, "BAD", bad)
    p = prompt(8 * CHUNK + 10, seed=53)
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    want = _reference(model, p, **kw)
    chunk_bytes = 8 * 2 * CHUNK * 8 * 128 * 2  # the lane's model: 8 layers of 8 KV heads x 128, bf16
    counters.STATS.reset()
    hashed_on_host = []
    orig = fmod.start_payload_checksums
    monkeypatch.setattr(fmod, "start_payload_checksums", lambda ps: hashed_on_host.append(len(ps)) or orig(ps))
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 1 << 30, "gpu_staging_bytes": 3 * chunk_bytes},
                     **kw)
        try:
            assert probe.worker.groups[0].object_bytes(CHUNK) == chunk_bytes
            assert generate(llm, [p])[0].token_ids == want
            flip, _ = _local_flip(probe, p)
            flip()
            probe.poison_all_blocks(seed=1)
            hashed_on_host.clear()
            r = generate(llm, [p])[0]
            assert hashed_on_host == [5], hashed_on_host  # the 5 chunks the staging could not hold
            assert r.token_ids == want and r.num_cached_tokens == bad * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {"checksum": 1}
            probe.poison_all_blocks(seed=2)
            r = generate(llm, [p])[0]
            assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
        finally:
            shutdown(llm)


@pytest.mark.parametrize("bad", [6, 1])
def test_a_lone_split_hit_is_sent_in_two_prefetches(model, bad, monkeypatch):
    """A lone repeat of 8 chunks is looked up in two parts (``metadata.FIRST_PART_CHUNKS``):
    two prefetches of 4 objects each, both verified on the device (no host hash), one verdict
    over both in order, and one load scattering from both.  A byte flipped in chunk ``bad`` (6:
    the second prefetch, 1: the first) ends the hit before it; the output is right on poisoned
    KV, and the next run, stored again, hits in full from two prefetches again."""
    import test_integrity
    from test_integrity import _local_flip

    from vllm_kvplugin.connector import worker_fetch as fmod
    from vllm_kvplugin.transfer.cuda import CudaTransfer

    monkeypatch.setattr(test_integrity, "CHUNK", CHUNK)
    p = prompt(8 * CHUNK + 10, seed=57)
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    want = _reference(model, p, **kw)
    counters.STATS.reset()
    hashed_on_host, rows = [], []
    orig, prefetch = fmod.start_payload_checksums, CudaTransfer.prefetch
    monkeypatch.setattr(fmod, "start_payload_checksums", lambda ps: hashed_on_host.append(len(ps)) or orig(ps))
    monkeypatch.setattr(CudaTransfer, "prefetch", lambda eng, layout, bufs: _noted(rows, prefetch(eng, layout, bufs)))
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 1 << 30}, **kw)
        try:
            assert generate(llm, [p])[0].token_ids == want
            assert probe.worker.finisher.drain(30)
            flip, _ = _local_flip(probe, p, bad)
            flip()
            for seed, hit in ((1, bad), (2, 8)):
                probe.poison_all_blocks(seed=seed)
                rows.clear()
                r = generate(llm, [p])[0]
                assert rows[:2] == [4, 4], rows
                assert r.token_ids == want and r.num_cached_tokens == hit * CHUNK
                assert probe.worker.finisher.drain(30)
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {"checksum": 1} and s["dropped_objects"] == 1
            assert s["lone_fetches"] == 2 and s["split_fetches"] == 2 and hashed_on_host == []
            assert [t for _, t in probe.loads] == [bad * CHUNK, 8 * CHUNK]  # both targets poisoned first
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
        finally:
            shutdown(llm)


def test_an_engine_shut_down_lets_go_of_its_worker_and_the_server_pool(model, server):
    """Two engines through the server, one after the other in this process.  After the first
    one's shutdown its worker is garbage (before, its store finisher's thread kept it -- KV cache
    views, staging -- and the lane's later engines ran short of device memory) and the pool
    mapping it page-locked is unregistered (unmapped while registered, CUDA would keep the old
    pages for a later mapping at that address).  The second engine hits the first one's stores
    in full, with the right output, on poisoned KV."""
    import gc
    import weakref

    from vllm_kvplugin.connector import worker as wmod

    p = prompt(8 * CHUNK + 10, seed=61)
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    want = _reference(model, p, **kw)
    cfg = {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address}
    llm = engine(model, BLOCK, cfg, **kw)
    try:
        assert generate(llm, [p])[0].token_ids == want
        worker = weakref.ref(wmod.registered())
        pool = worker().server._tensor
        assert pool is not None and pool.is_pinned()
    finally:
        shutdown(llm)
    del llm
    gc.collect()
    assert worker() is None
    assert not pool.is_pinned()
    del pool
    gc.collect()
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, cfg, **kw)
        try:
            probe.poison_all_blocks(seed=3)
            r = generate(llm, [p])[0]
            assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK
            assert vllm_kvplugin.stats()["load_failures"] == {}
            assert [t for _, t in probe.loads] == [8 * CHUNK]  # its target blocks poisoned first
        finally:
            shutdown(llm)


@pytest.mark.parametrize("fault", ["no_digest", "issue_fails"])
def test_a_store_into_the_pool_that_cannot_vouch_for_its_bytes_is_not_published(model, server, fault, monkeypatch):
    """Server objects the GPU copies straight into the shared pool: ``no_digest`` - the device's
    digests of a store go missing, so nothing vouches for the bytes the engine computed (the
    pool's are never hashed); ``issue_fails`` - the store call fails after its copies into the
    pool were issued, so its reservations are aborted only once those copies are done.  Either
    way nothing is published: the repeat, on poisoned KV, misses the server and is right; with
    the fault gone, the next store is published and the one after that hits in full."""
    from vllm_kvplugin.tiers import mp
    from vllm_kvplugin.transfer import cuda_stores

    p = prompt(8 * CHUNK + 10, seed=71)
    kw = dict(budget=8 * CHUNK, max_model_len=12_000, kv_bytes=1 << 30)
    want = _reference(model, p, **kw)
    counters.STATS.reset()
    orig_checksums, orig_store = cuda_stores.StorePath.checksums, cuda_stores.StorePath.store

    def failing_store(self, *a):
        orig_store(self, *a)  # its gathers and DMAs into the pool issued
        raise RuntimeError("fault injected after the store's copies were issued")

    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": server.address}, **kw)
        try:  # the fault from now on (the engine's warm-up at registration stores too)
            if fault == "no_digest":
                monkeypatch.setattr(cuda_stores.StorePath, "checksums", lambda self, ticket: {})
            else:
                monkeypatch.setattr(cuda_stores.StorePath, "store", failing_store)
            settled_at_abort = []  # each abort: were the store's paced DMAs all issued by then?
            orig_abort = mp.ServerStore.abort
            monkeypatch.setattr(mp.ServerStore, "abort", lambda self, oids: settled_at_abort.append(
                probe.worker.engine._paced.idle()) or orig_abort(self, oids))
            assert generate(llm, [p])[0].token_ids == want
            assert probe.worker.finisher.drain(30)
            assert settled_at_abort and all(settled_at_abort), settled_at_abort
            monkeypatch.setattr(mp.ServerStore, "abort", orig_abort)
            s = vllm_kvplugin.stats()
            assert s["server_store_direct"] >= 8 and s["server_store_errors"] >= 1, s
            probe.poison_all_blocks(seed=5)
            llm.reset_prefix_cache()
            r = generate(llm, [p])[0]
            assert r.token_ids == want and r.num_cached_tokens == 0, r.num_cached_tokens
            assert vllm_kvplugin.stats()["server_hit_tokens"] == 0
            monkeypatch.setattr(cuda_stores.StorePath, "checksums", orig_checksums)
            monkeypatch.setattr(cuda_stores.StorePath, "store", orig_store)
            llm.reset_prefix_cache()
            assert generate(llm, [p])[0].token_ids == want  # stored now
            assert probe.worker.finisher.drain(30)
            probe.poison_all_blocks(seed=6)
            llm.reset_prefix_cache()
            r = generate(llm, [p])[0]
            assert r.token_ids == want and r.num_cached_tokens == 8 * CHUNK
            assert [t for _, t in probe.loads] == [8 * CHUNK]  # its target blocks poisoned first
            assert vllm_kvplugin.stats()["load_failures"] == {}
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
        finally:
            shutdown(llm)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
@pytest.mark.parametrize("tier", ["local", "server"])
def test_tp2_on_two_gpus(qwen3_model, tmp_path, tier):
    """TP=2 engines on two GPUs (tests/e2e/tp_child.py): each rank loads exactly its half."""
    _two_ranks_on_two_gpus(qwen3_model, tmp_path, tier, pp=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="pipeline parallelism needs two GPUs")
@pytest.mark.parametrize("tier", ["local", "server"])
def test_pp2_on_two_gpus(qwen3_model, tmp_path, tier):
    """Two pipeline stages on two GPUs, two of the tiny model's four layers each: each rank
    stores and loads its own layers' KV, exactly its half (on the CPU: ``test_pp2_local_tier``)."""
    _two_ranks_on_two_gpus(qwen3_model, tmp_path, tier, pp=True)


def _two_ranks_on_two_gpus(qwen3_model: str, tmp_path, tier: str, pp: bool) -> None:
    from test_tensor_parallel import LENGTHS, _check, _run_tp

    from vllm_kvplugin.planner import max_loadable_tokens

    srv = ServerProc(str(tmp_path), "--l1-bytes", "1GiB").start() if tier == "server" else None
    try:
        res = _run_tp(qwen3_model, srv.address if srv else "", timeout=420, pp=pp)
    finally:
        if srv:
            srv.stop()
    print(f"GPU LANE {'PP' if pp else 'TP'}=2 {tier}: scheduler stats {res['scheduler']}; ranks {res['rows'][-1]['ranks']}")
    assert not _check(res), _check(res)
    hits = sum(max_loadable_tokens(n, 64) for n in LENGTHS)
    assert res["scheduler"]["server_hit_tokens" if srv else "hit_tokens"] == hits


def test_seed_method_on_gpu_compiled_with_cuda_graphs(model):
    """vLLM's default engine instead of the eager one of the other tests: torch.compile and CUDA
    graphs (FULL_AND_PIECEWISE).  A batch of one-token requests -- the warm step of a hit of k*C+1
    tokens, every decode step -- replays one full graph, in which no per-layer hook runs; other
    batches run graph pieces with the attention layers (and the hooks) between them.  A load is
    issued before the replay, on a stream the replay's stream waits for; a store after it.

    The reference is each prompt's recompute in this engine, not an engine without the
    connector: two engines compile the model apart, and with such a reference 3 of 4 prompts'
    tokens differed on the H100, cold ones too, while every loaded chunk equalled the KV its
    cold forward computed (a day before, they had matched; Inductor picks among its kernels'
    variants by timing them, the likely cause)."""
    _seed_method_on_gpu(model, "FLASH_ATTN", {"cpu_bytes": 2 << 30}, reference="recompute", enforce_eager=False,
                        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                            "cudagraph_capture_sizes": [1, 2, 4, 8]})


#: device cycles each scatter is held back in the slow-load test (~0.1 s at the H100's and H200's
#: ~2 GHz): far longer than the ~4 ms of input preparation between a load at allocation and its
#: forward, which without it would hide a forward that does not wait
SLOW_SCATTER_CYCLES = 200_000_000


@pytest.mark.parametrize("graphs", ["eager", "full-decode"])
def test_the_forward_waits_for_a_slow_load(model, graphs, monkeypatch):
    """However late a load's scatter runs on the device, the forward that reads its blocks comes
    after it: every scatter waits ~0.1 s behind a sleep kernel on the plugin's kernel stream,
    while the load's target blocks hold noise (the probe's poison) and the seeds' method
    compares each warm run with its cold run.  The forward must come after the scatter (a staged
    load's runs on the compute stream itself, a copied load's is waited for there), eager and when
    vLLM's ``FULL_DECODE_ONLY`` graphs replay the hit's one-token step (no hook of the connector
    runs in a replay).  A lone hit is loaded at its allocation, vLLM's
    input preparation (~4 ms) before its forward: on time, the scatter is done long before, and
    a missing wait would not show."""
    from vllm_kvplugin.transfer import cuda as cmod

    scatter, delayed = cmod.CudaTransfer._scatter, []

    def slow_scatter(self, *a, **k):
        torch.cuda._sleep(SLOW_SCATTER_CYCLES)  # on the current stream: the one the load scatters on
        delayed.append(1)
        return scatter(self, *a, **k)

    monkeypatch.setattr(cmod.CudaTransfer, "_scatter", slow_scatter)
    kw = {} if graphs == "eager" else {
        "enforce_eager": False,
        "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}}
    s = _seed_method_on_gpu(model, "FLASH_ATTN", {"cpu_bytes": 2 << 30}, reference="recompute", **kw)
    assert s["lone_fetches"] > 0 and s["loaded_tokens"] > 0, s
    assert len(delayed) > len(LENGTHS), len(delayed)  # the warm-up's scatter, then every hit's


def test_seed_method_on_gpu_with_rehearsed_loads(model, monkeypatch):
    """``worker_fetch.REHEARSE_LOADS`` on: a lone hit rehearses its load's host path while its
    copy ends (over no object: nothing moves), and every hit still equals its recompute."""
    from vllm_kvplugin.connector import worker_fetch
    from vllm_kvplugin.transfer import cuda as cmod

    rehearse, rehearsals = cmod.CudaTransfer.rehearse, []
    monkeypatch.setattr(worker_fetch, "REHEARSE_LOADS", True)
    monkeypatch.setattr(cmod.CudaTransfer, "rehearse",
                        lambda self, *a: rehearsals.append(a[2].count()) or rehearse(self, *a))
    s = _seed_method_on_gpu(model, "FLASH_ATTN", {"cpu_bytes": 2 << 30}, reference="recompute")
    assert s["lone_fetches"] > 0 and s["loaded_tokens"] > 0, s
    assert rehearsals and set(rehearsals) == {0}, rehearsals  # each of no token


def _seed_method_on_gpu(model: str, backend: str, tier: dict, reference: str = "engine", **engine_kw) -> dict:
    """``reference``: "engine", an engine of the same build without the connector; "recompute",
    each prompt's cold run in the connector's engine."""
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30, attention_config={"backend": backend},
              **engine_kw)
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    want = None
    if reference == "engine":
        base = engine(model, BLOCK, None, **kw)
        try:
            want = [generate(base, [p])[0].token_ids for p in prompts]
        finally:
            shutdown(base)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, **tier}, **kw)
        try:
            graphs = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name
            assert graphs == engine_kw.get("compilation_config", {}).get("cudagraph_mode", "NONE"), graphs
            layout = probe.worker.layouts[0]
            assert layout.semantics is ContentSemantics.GPU_FUSED and backend in layout.source, layout.describe()
            assert probe.worker.engine.name != "cpu" and probe.worker.device.type == "cuda"
            problems = seed_method(llm, probe, prompts, want, CHUNK)
            print(f"GPU LANE {backend} {sorted(tier)}: {layout.describe()}; engine {probe.worker.engine.name}; "
                  f"stats {vllm_kvplugin.stats()}; KV chunks compared {probe.kv_checked}")
            assert not problems, problems
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            assert vllm_kvplugin.stats()["load_failures"] == {}
            private = probe.worker._private
            return {**vllm_kvplugin.stats(), "private_staging_bytes": private.capacity if private else 0}
        finally:
            shutdown(llm)


def test_verify_command_on_gpu(model, tmp_path):
    """``vllm-kvplugin verify`` on the GPU (issue: the seeds' proof as one command): the model
    of this lane, 1, 8 and 40 chunks +-1, every length identical after a proven load.  Eager
    (``--enforce-eager``, passed on to vLLM): vLLM's default compiled engine is the graphs
    test's, and its first compile alone took about a minute of this lane's device time."""
    import json

    from harness import reset_vllm_globals

    from vllm_kvplugin import cli

    report = tmp_path / "verify.json"
    try:
        status = cli.main(["verify", "--model", model, "--lengths", f"{CHUNK},{8 * CHUNK},{40 * CHUNK}",
                           "--kv-transfer-config", json.dumps({"chunk_size": CHUNK, "cpu_bytes": 4 << 30}),
                           "--json", str(report), "--max-model-len", "12000", "--block-size", str(BLOCK),
                           "--gpu-memory-utilization", "0.5", "--enforce-eager"])
    finally:
        reset_vllm_globals()
    rep = json.loads(report.read_text())
    if os.environ.get("OUT"):  # the device tool brings $OUT back: the rows of a passing run too
        shutil.copy(report, os.path.join(os.environ["OUT"], "gpu-verify.json"))
    print("GPU LANE verify:", json.dumps([{k: r[k] for k in ("length", "hit", "verdict", "cold_ttft_s",
                                                              "warm_ttft_s")} for r in rep["rows"]]))
    assert status == 0 and rep["passed"], rep["rows"]
    assert all(r["hit"] == r["expected_hit"] and r["loads_proven"] for r in rep["rows"])
    # every length with a hit was judged against vLLM's own hit of exactly that hit, none by a margin
    assert all(r["as_vllm_hit"] is not None for r in rep["rows"] if r["hit"]), rep["rows"]
