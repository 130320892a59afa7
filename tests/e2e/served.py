"""An engine as ``vllm serve`` runs it, for tests: ``AsyncLLM``, whose engine core runs in a
process of its own (``EngineCoreProc``: it sleeps 1 ms after a step that ran no model), and the
plugin's counters as the front end's Prometheus metrics hold them (what ``/metrics`` serves).
The caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (the tests' default runs engines in-process),
and ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` where this process has CUDA initialized."""

from __future__ import annotations

import asyncio
import time

from harness import plugin_counter

COUNTERS = ("lone_fetches", "loaded_tokens", "hit_tokens", "server_hit_tokens", "server_wakes")


async def _serve(model: str, connector: dict, prompts: list[list[int]], block: int, engine_kw: dict) -> tuple[list, list[dict]]:
    import vllm.envs
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # the caller's environment must count: an in-process engine that ran earlier in this process
    # froze vLLM's view of it at its start (``enable_envs_cache``), e.g. the start method "fork"
    vllm.envs.disable_envs_cache()
    ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                           kv_connector_extra_config=connector)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, max_model_len=4096, kv_cache_memory_bytes=256 << 20, block_size=block,
        enable_prefix_caching=False, enforce_eager=True, seed=0, kv_transfer_config=ktc, **engine_kw))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, seen = [], []
    base = {k: plugin_counter(k) for k in COUNTERS}  # another engine of this process may have counted
    try:
        for i, p in enumerate(prompts):
            t0, ttft, last = time.perf_counter(), None, None
            async for out in llm.generate({"prompt_token_ids": p}, sp, request_id=f"r{i}"):
                ttft = ttft or time.perf_counter() - t0
                last = out
            await asyncio.sleep(0.2)  # the last step's stats reach the front end's loggers
            outs.append(last)
            seen.append({"ttft_s": round(ttft or 0.0, 4), **{k: plugin_counter(k) - base[k] for k in COUNTERS}})
    finally:
        llm.shutdown()
    return outs, seen


def serve_alone(model: str, connector: dict, prompts: list[list[int]], block: int,
                **engine_kw) -> tuple[list, list[dict]]:
    """Each prompt alone in one served engine, in turn (12 greedy tokens).  Per prompt: its
    ``RequestOutput``, and its time to first token with the plugin's counters after it (counted
    from the engine's start).  ``engine_kw``: more of ``AsyncEngineArgs``."""
    return asyncio.run(_serve(model, connector, prompts, block, engine_kw))
