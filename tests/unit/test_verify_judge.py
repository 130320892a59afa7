"""``vllm-kvplugin verify``'s verdicts (pure functions; the command itself runs on real engines in
tests/e2e/test_verify.py and on the GPU lane)."""

from __future__ import annotations

from vllm_kvplugin.adapters.offline import Completion
from vllm_kvplugin.verify.run import PASSING, judge, lengths_for


def run(tokens, top=None):
    """A completion whose chosen token has logprob -0.5 and a runner-up at -0.5 - margin."""
    top = top or [0.5] * len(tokens)
    return Completion(list(tokens), [{t: -0.5, t + 1: -0.5 - m} for t, m in zip(tokens, top)], 100)


def test_equal_runs_are_identical():
    assert judge(run([5, 6, 7]), run([5, 6, 7]), None, 0.02)[4] == "identical"


def test_a_divergence_is_different_unless_a_near_tie():
    cold = run([5, 6, 7], top=[0.5, 0.25, 0.5])
    verdict = judge(cold, run([5, 9, 7]), None, 0.02)
    assert verdict[:3] == (False, 1, 0.25) and verdict[4] == "DIFFERENT" and "DIFFERENT" not in PASSING
    assert judge(run([5, 6, 7], top=[0.5, 0.01, 0.5]), run([5, 9, 7]), None, 0.02)[4] == "near tie"


def test_a_divergence_that_vllms_own_hit_shows_too_is_the_plugin_being_exact():
    cold, warm = run([5, 6, 7], top=[0.5, 0.25, 0.5]), run([5, 9, 7])
    assert judge(cold, warm, run([5, 9, 7]), 0.02)[4] == "as vLLM's hit"
    # the reference must agree in every token and every logprob, or it proves nothing
    assert judge(cold, warm, run([5, 9, 8]), 0.02)[4] == "DIFFERENT"
    off = run([5, 9, 7])
    off.logprobs[2][7] = -0.49
    assert judge(cold, warm, off, 0.02)[4] == "DIFFERENT"


def test_lengths_are_chunk_multiples_and_one_either_side():
    assert lengths_for(256, [256, 2048], None) == [255, 256, 257, 2047, 2048, 2049]
    assert lengths_for(256, [4096], 4096) == [4095, 4096]
