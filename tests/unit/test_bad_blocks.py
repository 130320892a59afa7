"""The scheduler half's record of bad blocks (``connector/bad_blocks.py``): what a step reports
to vLLM, which requests it taints, and when a block is good again."""

from __future__ import annotations

import pytest

from vllm_kvplugin.connector.bad_blocks import BadBlocks, StepReport

B = 16


def test_nothing_bad_reports_nothing():
    bad = BadBlocks(B)
    assert bad.step({"a": ([1, 2, 3], 0, 48)}) == StepReport()
    assert not bad


def test_a_failed_load_taints_every_later_block_of_its_holders():
    bad = BadBlocks(B)
    # the failed load wrote blocks 5 and 6 of request a; b shares 5 (a prefix hit) and went on past it
    bad.failed([5, 6, 0], [[4, 5, 6, 7], [4, 5, 9, 10], [4, 11]])
    assert bad.blocks == {5, 6, 7, 9, 10}  # (0: vLLM's null block; c holds none of them)


def test_a_request_reading_a_bad_block_is_tainted_and_what_it_writes_is_bad():
    bad = BadBlocks(B)
    bad.failed([5], [])
    # b has 2 blocks computed (4, 5) and computes tokens 32..63 into 8 and 9
    report = bad.step({"b": ([4, 5, 8, 9], 32, 32), "c": ([1, 2], 0, 32)})
    assert report.tainted == {"b"}
    assert report.invalid == {5, 8, 9}  # reported in this very step: vLLM truncates b now
    assert bad.blocks == {5, 8, 9}
    # next step: b (truncated by vLLM to block 1) recomputes 5, 8 and 9 over clean block 4
    report = bad.step({"b": ([4, 5, 8, 9], 16, 48)})
    assert report.tainted == frozenset() and report.invalid == {5, 8, 9}
    assert not bad
    assert bad.step({"b": ([4, 5, 8, 9], 64, 1)}) == StepReport()


def test_a_block_is_good_again_only_when_written_from_its_first_token():
    bad = BadBlocks(B)
    bad.failed([7], [])
    # a request whose computed tokens end inside block 7 (a decode step into it) read it: tainted
    report = bad.step({"d": ([3, 7], 20, 1)})
    assert report.tainted == {"d"} and 7 in bad.blocks
    # a chunked recompute: tokens 16..23 of block 7 first, from its first token: good again
    report = bad.step({"d": ([3, 7], 16, 8)})
    assert report.tainted == frozenset() and report.invalid == {7}
    assert not bad


def test_loaded_blocks_are_good_before_the_step_reads_them():
    bad = BadBlocks(B)
    bad.failed([12, 13], [])
    # a new request's verified load writes blocks 12 and 13 (freed, then given to it) before its
    # forward; its computed tokens (the hit) cover them
    report = bad.step({"e": ([12, 13, 14], 32, 5)}, loaded=[12, 13])
    assert report == StepReport()
    assert not bad


def test_a_clean_and_a_tainted_writer_of_one_block_leave_it_bad():
    bad = BadBlocks(B)
    bad.failed([2], [])
    report = bad.step({"clean": ([1, 6], 16, 16), "tainted": ([2, 6], 16, 16)})
    assert report.tainted == {"tainted"}
    assert bad.blocks == {2, 6}


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        BadBlocks(0)


def _groups(n: int):
    from types import SimpleNamespace

    return [SimpleNamespace(block_size=B) for _ in range(n)]


def test_only_the_recompute_policy_with_one_group_keeps_a_record():
    assert BadBlocks.for_policy("fail", _groups(1), async_scheduling=True) is None
    bad = BadBlocks.for_policy("recompute", _groups(1), async_scheduling=False)
    assert isinstance(bad, BadBlocks) and bad.block_size == B


def test_recompute_with_several_groups_keeps_none_and_says_so(caplog):
    assert BadBlocks.for_policy("recompute", _groups(2), async_scheduling=False) is None
    assert "with 2 KV cache groups" in caplog.text


def test_recompute_under_asynchronous_scheduling_is_a_startup_error():
    from vllm_kvplugin.config import ConfigError

    with pytest.raises(ConfigError, match="load_failure_policy 'recompute' needs vLLM's synchronous scheduling"):
        BadBlocks.for_policy("recompute", _groups(1), async_scheduling=True)


def test_recompute_with_vllms_v2_model_runner_is_a_startup_error():
    from vllm_kvplugin.config import ConfigError

    with pytest.raises(ConfigError, match="needs vLLM's V1 model runner"):
        BadBlocks.for_policy("recompute", _groups(1), async_scheduling=False, v2_model_runner=True)
    assert BadBlocks.for_policy("fail", _groups(1), async_scheduling=False, v2_model_runner=True) is None
