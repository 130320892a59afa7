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


def _local_flip(probe, tokens, bad=None):
    """A function flipping one byte of chunk ``bad``'s (default BAD's) object in the local tier
    (twice: restored)."""
    import torch

    from vllm_kvplugin.chunk.format import ChunkHeader

    ws = probe.worker
    key = chunk_keys(ws.fingerprint, tokens, CHUNK)[BAD if bad is None else bad]
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


def _wrong_during_one_fetch(monkeypatch, flip) -> None:
    """The bytes ``flip`` changes are wrong while exactly one fetch reads and verifies them (with
    the step's metadata, or from the lookup: ``_fetch_here``), then right again."""
    from vllm_kvplugin.connector import worker as wmod

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


@pytest.mark.parametrize("tier", [  # the oldest lane: the local tier
    "local", *(pytest.param(t, marks=pytest.mark.newest_lane) for t in ("server", "local-late-outputs"))])
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
    handle = None
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, cfg, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want_p
            flip, handle = _local_flip(probe, P) if tier == "local" else _server_flip(probe, P, srv.address)
            _wrong_during_one_fetch(monkeypatch, flip)
            probe.poison_all_blocks(seed=1)
            before = vllm_kvplugin.stats()
            bad = generate(llm, [P2])[0]
            after = vllm_kvplugin.stats()
            assert bad.token_ids == want_p2
            # only the verified prefix was claimed: a failed load is not a hit
            assert bad.num_cached_tokens == BAD * CHUNK
            assert after["hit_tokens"] - before["hit_tokens"] == BAD * CHUNK
            assert after["loaded_tokens"] - before["loaded_tokens"] == BAD * CHUNK
            assert [t for _, t in probe.loads[-1:]] == [BAD * CHUNK]  # (every claimed target poisoned first)
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
            if tier == "server" and handle is not None:
                handle.close()  # (its heartbeat thread would outlive the test)


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
