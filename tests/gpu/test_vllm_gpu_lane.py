"""The GPU lane: real vLLM (0.26, the seeds' version) on a GPU, the seeds' method.

FlashAttention and Triton use vLLM 0.26's fused K|V layout, the one the
leading peer served wrong KV on.  Per backend: an engine without the
connector gives the reference outputs; an engine with KVPluginConnector (the
CUDA kernels and transfer engine) runs every prompt cold, then warm after
every KV block was overwritten with noise and the load's target tokens
poisoned; outputs must be identical, the hit proven by ``num_cached_tokens``,
``stats()`` and the KV left in the blocks compared byte for byte with the KV
the cold forward computed.  Run by ``compat/gpulane/run.sh`` on the H200.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
vllm = pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from harness import Probe, engine, generate, prompt, seed_method, shutdown  # noqa: E402

import vllm_kvplugin  # noqa: E402
from vllm_kvplugin import counters  # noqa: E402
from vllm_kvplugin.layout.descriptor import ContentSemantics  # noqa: E402

CHUNK, BLOCK = 256, 16
LENGTHS = [2600, 8 * CHUNK, 8 * CHUNK + 1, 40 * CHUNK]  # the seed's ~2,600 tokens, multiples +-


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The GPU lane runs the plugin from a checkout (PYTHONPATH), not a pip install, so vLLM
    finds no entry point: register the way the entry point does (tested in the CPU lanes)."""
    from vllm_kvplugin.plugin import register

    register()


@pytest.fixture(scope="module")
def model() -> str:
    from vllm_kvplugin import tiny_model

    # Qwen3-8B's per-layer KV: 8 KV heads x head dim 128, bf16
    return str(tiny_model.build(tiny_model.DEMO))


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_seed_method_on_gpu(model, backend):
    kw = dict(budget=CHUNK, max_model_len=12_000, kv_bytes=1 << 30, attention_config={"backend": backend})
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    base = engine(model, BLOCK, None, **kw)
    try:
        want = [generate(base, [p])[0].token_ids for p in prompts]
    finally:
        shutdown(base)
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 2 << 30}, **kw)
        try:
            layout = probe.worker.layouts[0]
            assert layout.semantics is ContentSemantics.GPU_FUSED and backend in layout.source, layout.describe()
            assert probe.worker.engine.name != "cpu" and probe.worker.device.type == "cuda"
            problems = seed_method(llm, probe, prompts, want, CHUNK)
            print(f"GPU LANE {backend}: {layout.describe()}; engine {probe.worker.engine.name}; "
                  f"stats {vllm_kvplugin.stats()}; KV chunks compared {probe.kv_checked}")
            assert not problems, problems
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
            assert vllm_kvplugin.stats()["load_failures"] == {}
        finally:
            shutdown(llm)
