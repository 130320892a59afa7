"""vLLM's offline API as ``vllm-kvplugin verify`` uses it: an engine, greedy requests with
logprobs, a function run in every worker process, the prefix cache reset.

These are vLLM's public entry points (``vllm.LLM``, ``vllm.SamplingParams``); they are
recorded in ``compat/api_surface.toml`` like every other name the plugin touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    #: per generated token, {token id: logprob} of the top candidates (the chosen one included)
    logprobs: list[dict[int, float]]
    num_cached_tokens: int


def build_llm(model: str, connector: dict, **engine_kwargs: Any):
    """An offline engine with ``KVPluginConnector`` configured by ``connector`` (its extra config)."""
    from vllm import LLM
    from vllm.config.kv_transfer import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=connector)
    return LLM(model=model, kv_transfer_config=ktc, **engine_kwargs)


def generate(llm, prompt_ids: Sequence[int], max_tokens: int, logprobs: int = 0) -> Completion:
    """One greedy request (every token generated, no stop at EOS)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs or None)
    out = llm.generate([{"prompt_token_ids": list(prompt_ids)}], sp, use_tqdm=False)[0]
    o = out.outputs[0]
    lps = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in (o.logprobs or [])]
    return Completion(list(o.token_ids), lps, int(out.num_cached_tokens or 0))


def on_workers(llm, fn: Callable, *args: Any) -> list:
    """``fn(vllm_worker, *args)`` in every worker process (rank order); their results."""
    return llm.collective_rpc(fn, args=args)


def shutdown(llm) -> None:
    """Stop the engine's core (and its worker processes) now; errors while stopping are ignored."""
    from contextlib import suppress

    with suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def reset_prefix_cache(llm, connector: bool = False) -> None:
    """vLLM's own prefix cache forgets everything; with ``connector``, so does the connector
    (nothing it stored before is loaded again), else its tiers keep theirs."""
    if not llm.reset_prefix_cache(reset_connector=connector):
        raise RuntimeError(f"vLLM refused reset_prefix_cache(reset_connector={connector}): a request still running?")
