"""Fail closed: every doubtful load is recomputed, counted by reason, and poisons nothing.

Each case stores a prompt, damages what the next load will read, and generates
the prompt extended by two chunks: its output must still be identical to a
recompute and the failure counted under its reason.  Then the fault is gone and
the extended and the original prompt are generated twice more, every KV block
overwritten with noise first: identical outputs prove that nothing computed over
the failed load was stored (the chunks completed in the failing step are
computed over blocks the load may not have written).  Faults are caused for real
where they can be (bytes flipped in the pool, headers swapped, chunks gone); a
mock only where the local tier cannot produce the fault itself (a short read, a
failing copy, a wrong plan).  The first four are found while verifying, before
the hit is claimed, and recomputed; the last two after it (the copy itself
fails): vLLM ends that request with an error (its "fail" policy, the plugin's
default) or, under "recompute", recomputes it while the connector reports the
blocks the load never wrote until they are recomputed; either way no other
request is served them.
"""

from __future__ import annotations

import pytest
import torch
from harness import Probe, engine, generate, prompt, reset_vllm_globals, shutdown

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
    orig = type(pool).views

    def short(self, g, s):
        data, payload = orig(self, g, s)
        return data[:-100], payload.reshape(-1)[:-100]
    monkeypatch.setattr(type(pool), "views", short)


def _copy_error(probe, monkeypatch, slots):
    def boom(*a, **k):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(probe.worker.engine, "load", boom)


def _wrong_plan(probe, monkeypatch, slots):
    from vllm_kvplugin.connector import worker as wmod

    orig = wmod.WorkerSide._load  # (the probe's: it poisons the targets first)

    def load(self, req, epoch):  # the plan the scheduler sent disagrees with what would move
        req.expected_bytes = tuple(b + 2048 for b in req.expected_bytes)
        return orig(self, req, epoch)

    monkeypatch.setattr(wmod.WorkerSide, "_load", load)


CASES = {
    "missing": _missing,
    "checksum": _checksum_middle,
    "header_mismatch": _swapped_headers,
    "short_read": _short_read,
    "error": _copy_error,
    "byte_mismatch": _wrong_plan,
}


CLAIMED = ("error", "byte_mismatch")  # found after the hit was claimed


@pytest.fixture(scope="module")
def prompts():
    """Per case: the prompt and its extension by two chunks and a bit."""
    out = {}
    for i, name in enumerate(CASES):
        p = prompt(LEN, seed=100 + i)
        out[name] = (p, p + prompt(2 * CHUNK + 5, seed=200 + i))
    return out


@pytest.fixture(scope="module")
def baseline(qwen3_model, prompts):
    from test_cache_hits import _baseline

    names = list(prompts)
    after = prompt(LEN, seed=7)
    outs = _baseline(qwen3_model, 32, [[prompts[n][0]] for n in names] + [[prompts[n][1]] for n in names]
                     + [[after]], budget=CHUNK)
    n = len(names)
    return {name: (outs[i], outs[n + i]) for i, name in enumerate(names)}, after, outs[-1]


#: on every lane, one reason found before the claim and one after (vLLM's failure policy); the
#: others take the same paths through vLLM, on the newest lane
EVERY_LANE = ("checksum", "error")


@pytest.mark.parametrize("reasons", [
    pytest.param(EVERY_LANE, id="every-lane"),
    pytest.param(tuple(r for r in CASES if r not in EVERY_LANE), id="others", marks=pytest.mark.newest_lane),
])
def test_every_doubtful_load_is_recomputed(qwen3_model, prompts, baseline, monkeypatch, reasons):
    want, after_prompt, after_want = baseline
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            for reason in reasons:
                inject = CASES[reason]
                (p, p2), (want_p, want_p2) = prompts[reason], want[reason]
                assert generate(llm, [p])[0].token_ids == want_p, reason
                slots = _slots_of(probe.worker, p)
                assert len(slots) == 8
                before = vllm_kvplugin.stats()
                with monkeypatch.context() as m:
                    inject(probe, m, slots)
                    probe.poison_all_blocks()
                    warm = generate(llm, [p2])[0]
                    after = vllm_kvplugin.stats()
                failures = after["load_failures"]
                assert failures.get(reason, 0) == before["load_failures"].get(reason, 0) + 1, (reason, failures)
                if reason in CLAIMED:  # vLLM ends the request (its "fail" policy, the default) and
                    # the step's stores, computed over the failed load, are dropped
                    assert warm.token_ids == [], f"{reason}: a request whose claimed load failed was served"
                    assert after["stores_cancelled"] > before["stores_cancelled"], reason
                else:  # found before the claim: recomputed, only the verified prefix counts as a hit
                    assert warm.token_ids == want_p2, f"{reason}: served doubtful KV"
                    assert after["hit_tokens"] - before["hit_tokens"] == warm.num_cached_tokens < 8 * CHUNK
                for i in range(2):  # nothing wrong was stored: poisoned KV, right outputs, then hits too
                    for q, want_q in ((p2, want_p2), (p, want_p)):
                        probe.poison_all_blocks(seed=i + 1)
                        r = generate(llm, [q])[0]
                        assert r.token_ids == want_q, f"{reason}: a chunk computed over the failed load was stored"
                        if i:
                            assert r.num_cached_tokens == (len(q) - 1) // CHUNK * CHUNK, (reason, len(q))
                assert vllm_kvplugin.stats()["load_failures"] == failures, f"{reason}: failed again"
            # the engine keeps serving, and hits again
            assert generate(llm, [after_prompt])[0].token_ids == after_want
            probe.poison_all_blocks()
            again = generate(llm, [after_prompt])[0]
            assert again.token_ids == after_want and again.num_cached_tokens == 8 * CHUNK
        finally:
            shutdown(llm)


@pytest.mark.parametrize("policy,abort_first", [("fail", False), ("recompute", False), ("recompute", True)])
def test_a_failed_claimed_load_is_served_to_no_other_request(qwen3_model, policy, abort_first):
    """A copy fails after the hit was claimed (mocked: the copy cannot be made to fail for
    real), with vLLM's prefix cache on, every block poisoned before, and a scheduler that lets
    a second request in while the first has not yet recomputed its prompt (at most one chunk
    of a long prefill per step).  The second request shares the prefix.  vLLM's own
    "recompute" keeps the blocks the load never wrote in its prefix cache and served them to
    the second request (wrong output on vLLM 0.32, before ``connector/bad_blocks.py``).
    - "fail" (the default): the first request ends with an error, the second is right.
    - "recompute": the connector reports those blocks, and the ones the second request
      computed over them, in every step until recomputed: both requests are right, and
      the second's chunks of the step that read them are not stored.
    Either way both prompts are right afterwards on poisoned KV (nothing computed over the
    failed load was stored).  ``abort_first``: the first request is aborted right after the
    step whose load failed, leaving its blocks in vLLM's prefix cache, unwritten; the second
    reads them alone (the GPU lane's form: its bf16 sums depend on the batch, so the outputs of
    two requests computed side by side need not match the reference's, computed alone)."""
    failed_claimed_load_scenario(qwen3_model, policy, CHUNK, 32, abort_first=abort_first)


def test_recompute_where_vllms_own_recompute_is_wrong_stops_the_engine(qwen3_model, monkeypatch):
    """``recompute`` with vLLM's V2 model runner (vLLM issue #49250) is a start-up error naming
    the way out.  This machine's vLLM has no V2 runner (no Triton): the adapter's answer is
    mocked; the GPU lane starts a real V2 engine."""
    from vllm_kvplugin.adapters import _common

    monkeypatch.setattr(_common, "v2_model_runner", lambda cfg: True)
    try:
        with pytest.raises(Exception, match=r"V1 model runner \(VLLM_USE_V2_MODEL_RUNNER=0\)"):
            engine(qwen3_model, 32, {"chunk_size": CHUNK, "load_failure_policy": "recompute"})
    finally:
        reset_vllm_globals()
    llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "load_failure_policy": "fail"})  # the default starts
    shutdown(llm)


def failed_claimed_load_scenario(model: str, policy: str, chunk: int, block: int, abort_first: bool = False,
                                 **engine_kw) -> None:
    """The scenario of ``test_a_failed_claimed_load_is_served_to_no_other_request`` with
    chunks and blocks of these sizes (the GPU lane runs it too)."""
    from vllm import SamplingParams

    p = prompt(8 * chunk + 10, seed=300)
    first, second = p + prompt(2 * chunk + 5, seed=301), p + prompt(2 * chunk + 7, seed=302)
    sched = dict(budget=4 * chunk, long_prefill_token_threshold=chunk, **engine_kw)
    # the reference: the same scheduling (one chunk of a long prefill per step), no connector
    base = engine(model, block, None, **sched)
    try:
        want = [generate(base, [q])[0].token_ids for q in (first, second)]
    finally:
        shutdown(base)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, block, {"chunk_size": chunk, "load_failure_policy": policy},
                     enable_prefix_caching=True, **sched)
        try:
            generate(llm, [p])
            llm.reset_prefix_cache()  # the first request's hit comes from the plugin
            probe.poison_all_blocks(seed=5)
            copies = probe.worker.engine.load
            failed = []

            def boom(*a, **k):
                failed.append(1)
                raise RuntimeError("injected copy failure")

            probe.worker.engine.load = boom
            eng = llm.llm_engine
            eng.add_request("first", {"prompt_token_ids": first}, sp)
            for _ in range(50):  # until its claimed load has failed
                eng.step()
                if failed:
                    break
            probe.worker.engine.load = copies
            assert failed, "the first request's load never ran"
            if abort_first:
                eng.abort_request(["first"])
            eng.add_request("second", {"prompt_token_ids": second}, sp)
            got = {}
            for _ in range(500):
                if not eng.has_unfinished_requests():
                    break
                for o in eng.step():
                    if o.finished:
                        got[o.request_id] = list(o.outputs[0].token_ids)
            assert not eng.has_unfinished_requests()
            assert got.get("second") == want[1], "a request was served blocks a failed load never wrote"
            stats = vllm_kvplugin.stats()
            if policy == "fail" or abort_first:
                assert not got.get("first"), "the request whose claimed load failed was served"
            else:
                assert got.get("first") == want[0], "the request whose claimed load failed was not recomputed"
            if policy == "recompute":
                assert stats["tainted_requests"] >= 1, "the second request read the bad blocks unnoticed"
            assert stats["load_failures"] == {"error": 1}
            for i in range(2):  # nothing computed over the failed load was stored or kept
                for q, want_q in zip((first, second), want):
                    llm.reset_prefix_cache()
                    probe.poison_all_blocks(seed=10 + i)
                    assert generate(llm, [q])[0].token_ids == want_q
        finally:
            shutdown(llm)


@pytest.mark.parametrize("failing", [1, 2])
def test_a_hit_whose_device_digests_cannot_start_is_recomputed_and_kept(qwen3_model, baseline, prompts,
                                                                        monkeypatch, failing):
    """On a GPU a hit's prefetched objects are verified by digests on the device; should those
    not start (mocked here: the CPU engine prefetches nothing), the objects get no verdict: the
    hit ends before them (this lone repeat's 8 chunks are sent in two prefetches of 4, and the
    digests of the ``failing`` one do not start: no hit, or the first 4 chunks), counted as
    ``verify_error``, the objects are not dropped (nothing is known to be wrong with them), and
    the next run hits in full on poisoned KV."""
    want, _, _ = baseline
    p, want_p = prompts["checksum"][0], want["checksum"][0]

    class Staged:  # what a CUDA prefetch tells the worker: how many leading objects it holds, their bytes
        def __init__(self, bufs):
            self.rows = len(bufs)
            self.nbytes = sum(b.nbytes for b in bufs)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [p])[0].token_ids == want_p
            eng = probe.worker.engine
            started = []

            def digest_fails_once(pre):
                started.append(pre.rows)
                if len(started) == failing:
                    raise RuntimeError("injected: no device memory for the digests")
                return None  # the host verifies, as on an engine without device digests
            made, loads, load = [], [], eng.load

            def staged_load(layout, layers, slots, bufs, staged=None):  # which prefetch rows a load takes
                loads.append([(made.index(pre), list(rows)) for pre, rows in staged] if staged else None)
                return load(layout, layers, slots, bufs, staged)
            monkeypatch.setattr(eng, "prefetch", lambda layout, bufs: made.append(Staged(bufs)) or made[-1])
            monkeypatch.setattr(eng, "digest", digest_fails_once)
            monkeypatch.setattr(eng, "load", staged_load)
            probe.poison_all_blocks()
            r = generate(llm, [p])[0]
            s = vllm_kvplugin.stats()
            assert started == [4, 4]
            assert r.token_ids == want_p and r.num_cached_tokens == (failing - 1) * 4 * CHUNK
            assert s["load_failures"] == {"verify_error": 1} and s["dropped_objects"] == 0
            probe.poison_all_blocks(seed=1)
            r = generate(llm, [p])[0]
            assert started == [4, 4, 4, 4]
            assert r.token_ids == want_p and r.num_cached_tokens == 8 * CHUNK
            assert loads[-1] == [(2, [0, 1, 2, 3]), (3, [0, 1, 2, 3])], loads  # each part from its prefetch, one call
            assert vllm_kvplugin.stats()["load_failures"] == {"verify_error": 1}
        finally:
            shutdown(llm)


@pytest.mark.parametrize("bad", [3, 0])
def test_a_hit_claimed_before_its_verdict_and_refuted_is_recomputed(qwen3_model, monkeypatch, bad):
    """``scheduler_lone.CLAIM_BEFORE_VERDICT`` under the ``recompute`` policy: a lone request's
    hit is claimed and loaded while its objects are still being verified, and one byte of chunk
    ``bad``'s object is wrong.  The verdict, awaited at the end of the step that loaded it,
    refutes the load: its blocks from that chunk on go to vLLM, which drops the step's output
    and recomputes them.  The output is right on poisoned KV, the object is dropped once and
    counted under ``checksum``, nothing computed over the refuted bytes is stored, and the next
    runs hit in full."""
    from test_integrity import _local_flip

    from vllm_kvplugin.connector import scheduler_lone
    from vllm_kvplugin.connector import worker_fetch as fmod

    monkeypatch.setattr(scheduler_lone, "CLAIM_BEFORE_VERDICT", True)
    hashes = fmod.start_payload_checksums
    monkeypatch.setattr(fmod, "start_payload_checksums", lambda payloads: _NotInYet(hashes(payloads)))
    monkeypatch.setattr("test_integrity.CHUNK", CHUNK)
    p = prompt(LEN, seed=400 + bad)
    base = engine(qwen3_model, 32, None)
    try:
        want = generate(base, [p])[0].token_ids
    finally:
        shutdown(base)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, 32, {"chunk_size": CHUNK, "load_failure_policy": "recompute"})
        try:
            assert generate(llm, [p])[0].token_ids == want
            flip, _ = _local_flip(probe, p, bad)
            flip()
            probe.poison_all_blocks(seed=3)
            assert generate(llm, [p])[0].token_ids == want
            s = vllm_kvplugin.stats()
            assert s["early_claims"] == 1 and s["load_failures"] == {"checksum": 1}, s
            assert s["dropped_objects"] == 1
            for i in range(2):  # stored again where it failed: full hits (claimed early) on poisoned KV
                probe.poison_all_blocks(seed=10 + i)
                r = generate(llm, [p])[0]
                assert r.token_ids == want and r.num_cached_tokens == (len(p) - 1) // CHUNK * CHUNK
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {"checksum": 1} and s["early_claims"] == 3, s
        finally:
            shutdown(llm)


class _NotInYet:
    """The host's hashes of a hit, in only once asked for.  The tiny model's objects are hashed
    at once, before a claim could come first; a GPU's digests of an 8B model's hit take as long
    as its copy (the GPU lane claims those early for real)."""

    def __init__(self, inner):
        self.inner, self.asked = inner, False

    def done(self) -> bool:
        return self.asked

    def when_done(self, callback) -> None:
        pass  # (never waited on: settled when asked)

    def result(self) -> list[int]:
        self.asked = True
        return self.inner.result()

    def advance(self) -> None:
        pass
