"""``vllm-kvplugin verify`` on real engines (the tiny models): it passes where the plugin is
right, and fails where hits are claimed but not written (the negative control)."""

from __future__ import annotations

import json

import pytest
from harness import reset_vllm_globals
from test_hybrid import GDN_BLOCK, RECURRENT_KW
from test_server_tier import server, workdir  # noqa: F401  (fixtures)

from vllm_kvplugin import cli, tiny_model

pytestmark = pytest.mark.engine


def _verify(tmp_path, model: str, chunk: int, lengths: str, *extra: str, connector: dict | None = None):
    report = tmp_path / "report.json"
    cfg = {"chunk_size": chunk, "cpu_bytes": 1 << 30, **(connector or {})}
    argv = ["verify", "--model", model, "--lengths", lengths, "--kv-transfer-config", json.dumps(cfg),
            "--json", str(report), "--max-tokens", "8", "--quiet",
            # vLLM's CPU attention is not batch-invariant: one chunk per step makes the cold run's
            # last step compute exactly what a hit leaves to compute (tests/e2e/harness.py)
            "--max-num-batched-tokens", str(chunk), "--max-num-seqs", "4", "--max-model-len", "4096",
            "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), *extra]
    try:
        status = cli.main(argv)
    finally:
        reset_vllm_globals()
    return status, json.loads(report.read_text())


def test_verify_passes_and_proves_the_loads(qwen3_model, tmp_path):
    status, rep = _verify(tmp_path, qwen3_model, 64, "64,256", "--block-size", "32")
    assert status == 0 and rep["passed"], rep["rows"]
    assert [r["length"] for r in rep["rows"]] == [63, 64, 65, 255, 256, 257]
    for r in rep["rows"]:
        assert r["verdict"] == "identical" and r["loads_proven"], r
        assert r["hit"] == r["expected_hit"] == (r["length"] - 1) // 64 * 64, r
    # vLLM's own hit of exactly the plugin's hit, for every length with one: from the cold run's
    # blocks at 65 and 257; built from a prefill of the hit's tokens at 255 and 256, where vLLM's
    # hit on the cold blocks reaches 224
    assert [r["as_vllm_hit"] for r in rep["rows"]] == [None, None, True, True, True, True], rep["rows"]


def test_verify_fails_when_hits_are_not_written(qwen3_model, tmp_path):
    status, rep = _verify(tmp_path, qwen3_model, 64, "256", "--block-size", "32", "--negative-control")
    assert status == 1 and not rep["passed"]
    assert all(r["verdict"] in ("DIFFERENT", "NO LOAD") and not r["loads_proven"] for r in rep["rows"]), rep["rows"]


@pytest.mark.newest_lane
def test_verify_through_the_server(qwen3_model, tmp_path, server):  # noqa: F811
    status, rep = _verify(tmp_path, qwen3_model, 64, "128", "--block-size", "32", "--server", server.address,
                          connector={"cpu_bytes": 0})
    assert status == 0 and all(r["hit"] == r["expected_hit"] > 0 for r in rep["rows"]), rep["rows"]


@pytest.mark.newest_lane  # the hybrid on 0.26: test_hybrid.py
def test_verify_on_a_gdn_hybrid(tmp_path):
    model = str(tiny_model.build(tiny_model.QWEN3NEXT))
    extra = [x for k, v in RECURRENT_KW.items() for x in ("--" + k.replace("_", "-"), v)]
    status, rep = _verify(tmp_path, model, GDN_BLOCK, str(3 * GDN_BLOCK), "--enable-prefix-caching",
                          "--block-size", str(GDN_BLOCK), *extra)
    assert status == 0 and rep["passed"], rep["rows"]
    assert {g for g in rep["ranks"][0]["groups"]} >= {"RECURRENT"}
    assert all(r["hit"] == r["expected_hit"] for r in rep["rows"])
