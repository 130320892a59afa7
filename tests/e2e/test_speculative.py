"""Speculative decoding with an EAGLE drafter: the drafter rule.

EAGLE's layer shares the target's KV cache group, and vLLM (its KV cache coordinator)
then drops a hit's last block in every group: the drafter's KV of a block's last token
was computed with the next token, which a shorter prompt does not have.  The plugin
leaves the same: a hit of floor((L - 1) / C) * C - C tokens, one chunk less than
without a drafter.  The seeds' method, with a random-init one-layer EAGLE drafter:
outputs equal the no-connector engine's (same drafter), every KV block overwritten with
noise before the warm run.
"""

from __future__ import annotations

import pytest
from harness import Probe, engine, generate, prompt, shutdown

from vllm_kvplugin import tiny_model
from vllm_kvplugin.planner import max_loadable_tokens

pytestmark = pytest.mark.engine

CHUNK = 64


def test_eagle_drafter_gets_one_chunk_less(llama_model):
    spec = {"method": "eagle", "model": str(tiny_model.build_eagle_drafter(tiny_model.build(tiny_model.LLAMA))),
            "num_speculative_tokens": 2}
    lengths = [4 * CHUNK, 4 * CHUNK + 1, 4 * CHUNK + 4, 7 * CHUNK + 2]
    prompts = [prompt(n, seed=5 * n) for n in lengths]
    kw = dict(speculative_config=spec, enable_prefix_caching=True, budget=CHUNK, max_model_len=4096)
    ref = engine(llama_model, 32, None, **kw)
    try:
        want = [generate(ref, [p])[0].token_ids for p in prompts]
    finally:
        shutdown(ref)
    with Probe().installed() as probe:
        llm = engine(llama_model, 32, {"chunk_size": CHUNK, "cpu_bytes": 1 << 30}, **kw)
        try:
            for n, p, expect in zip(lengths, prompts, want):
                assert generate(llm, [p])[0].token_ids == expect
                llm.reset_prefix_cache()  # any hit is the plugin's
                probe.poison_all_blocks(seed=n)
                warm = generate(llm, [p])[0]
                assert warm.token_ids == expect, n
                assert warm.num_cached_tokens == max_loadable_tokens(n, CHUNK) - CHUNK, (n, warm.num_cached_tokens)
            assert all(g.drafter for g in probe.worker.groups)
            assert not probe.kv_mismatches
        finally:
            shutdown(llm)
