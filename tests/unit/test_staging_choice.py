"""The staging policy of the CUDA transfer engine (``transfer/staging_choice.py``), on sizes
written out by hand; the GPU lane runs it inside ``CudaTransfer``."""

from __future__ import annotations

import pytest

from vllm_kvplugin.transfer.staging_choice import (
    StagingChoice,
    StagingState,
    choose_staging,
    held_limit,
)

MiB, GiB = 1 << 20, 1 << 30


def buf(nbytes, *, held=False, pacing=False, idle=True, last_use=0):
    return StagingState(nbytes, held, pacing, idle, last_use)


def cap_of(n):
    return lambda: n


def test_held_limit_is_a_quarter_more_and_at_least_64_mib():
    assert held_limit(482 * MiB) == 482 * MiB + 120 * MiB + MiB // 2
    assert held_limit(8 * MiB) == 72 * MiB
    assert held_limit(4 * GiB) == 5 * GiB


def test_a_store_takes_the_smallest_idle_buffer_that_is_large_enough_however_large():
    pool = [buf(3 * GiB), buf(1 * GiB, idle=False), buf(2 * GiB), buf(100 * MiB)]
    assert choose_staging(pool, 500 * MiB, False, cap_of(8 * GiB), 4) == StagingChoice(2)


def test_a_prefetch_does_not_keep_a_buffer_much_larger_than_it_needs():
    pool = [buf(int(2.4 * GiB)), buf(int(2.4 * GiB))]
    # room under the count and the cap: a new buffer of its own size
    assert choose_staging(pool, 482 * MiB, True, cap_of(8 * GiB), 4) == StagingChoice(None)
    # one within a quarter: taken as it is
    pool.append(buf(560 * MiB))
    assert choose_staging(pool, 482 * MiB, True, cap_of(8 * GiB), 4) == StagingChoice(2)


def test_a_prefetch_at_the_count_replaces_the_least_recently_used_large_buffer():
    pool = [buf(int(2.4 * GiB), last_use=5), buf(int(2.4 * GiB), last_use=2),
            buf(int(2.4 * GiB), last_use=9), buf(int(2.4 * GiB), last_use=7)]
    assert choose_staging(pool, 482 * MiB, True, cap_of(16 * GiB), 4) == StagingChoice(1, resize=True)
    # a store takes an idle one as it is (the first of the smallest)
    assert choose_staging(pool, 482 * MiB, False, cap_of(16 * GiB), 4) == StagingChoice(0)


def test_past_the_cap_the_least_recently_used_buffer_is_reused_stores_still_pacing_last():
    pool = [buf(3 * GiB, pacing=True, last_use=1), buf(3 * GiB, idle=False, last_use=4)]
    # two buffers of four, but a third of 3 GiB would pass the 8 GiB cap
    assert choose_staging(pool, 3 * GiB, False, cap_of(8 * GiB), 4) == StagingChoice(1)
    # too small for the call: grown
    assert choose_staging(pool, 4 * GiB, False, cap_of(8 * GiB), 4) == StagingChoice(1, resize=True)


def test_every_buffer_held_means_one_more_beyond_the_counts():
    pool = [buf(GiB, held=True), buf(GiB, held=True)]
    assert choose_staging(pool, 2 * GiB, True, cap_of(GiB), 2) == StagingChoice(None)


def test_the_cap_is_read_only_when_no_free_buffer_fits():
    def cap():
        raise AssertionError("cap read")
    assert choose_staging([buf(GiB)], 500 * MiB, False, cap, 4) == StagingChoice(0)
    assert choose_staging([], 500 * MiB, True, cap, 4) == StagingChoice(None)


def _burst(hold_as_prefetch: bool, n: int = 32) -> int:
    """The H100 serving run's burst: four idle 2.4 GB buffers left by 16k-token prefill
    stores, an 8 GiB cap, prefetches of 13 objects of 36 MiB each (468 MiB), none released meanwhile.
    How many prefetches are sent whole (``CudaTransfer.prefetch``: objects that fit the cap less
    the bytes held)."""
    cap, obj = 8 * GiB, 37_748_736
    pool = [buf(2_415_919_104, last_use=i) for i in range(4)]
    whole = 0
    for use in range(10, 10 + n):
        room = cap - sum(s.nbytes for s in pool if s.held)
        fits = min(13, max(0, room) // obj)
        if fits == 0:
            continue
        nbytes = fits * obj
        c = choose_staging(pool, nbytes, hold_as_prefetch, cap_of(cap), 4)
        size = pool[c.index].nbytes if c.index is not None and not c.resize else -(-nbytes // (2 * MiB)) * 2 * MiB
        state = StagingState(size, True, False, True, use)
        if c.index is None:
            pool.append(state)
        else:
            pool[c.index] = state
        whole += fits == 13
    return whole


@pytest.mark.parametrize("as_prefetch, whole", [(False, 4), (True, 17)])
def test_a_burst_of_prefetches_after_large_stores(as_prefetch, whole):
    """Chosen for like a store (as before the limit), four prefetches each hold a 2,304 MiB
    buffer and fill the cap; with the limit each holds its 468 MiB: 8,192 // 468 = 17."""
    assert _burst(as_prefetch) == whole
