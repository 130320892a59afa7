"""The worker's private host buffers (``transfer/host_buffers.py``): ranges of one slab, the
leading objects that fit, ranges given back and merged."""

from __future__ import annotations

import pytest

from vllm_kvplugin.transfer.host_buffers import ALIGN, HostBuffers, aligned, default_capacity


def _offsets(hb: HostBuffers, slices) -> list[int]:
    return [s.data_ptr() - hb.slab.data_ptr() for s in slices]


def test_slices_are_aligned_ranges_of_the_slab():
    hb = HostBuffers(4 * ALIGN, pin=False)
    slices, buf = hb.take_slices([10, ALIGN, 3])
    assert [s.numel() for s in slices] == [10, ALIGN, 3]
    assert _offsets(hb, slices) == [0, ALIGN, 2 * ALIGN]
    assert buf.numel() == 3 * ALIGN and hb.free_bytes() == ALIGN
    assert [aligned(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]


def test_only_the_leading_objects_that_fit_are_given():
    hb = HostBuffers(3 * ALIGN, pin=False)
    slices, buf = hb.take_slices([ALIGN, 2 * ALIGN, ALIGN])  # 4 * ALIGN asked, 3 there
    assert [s.numel() for s in slices] == [ALIGN, 2 * ALIGN] and hb.free_bytes() == 0
    assert hb.take_slices([1]) == ([], None)  # full: nothing, never a wait
    hb.give(buf)
    assert hb.free_bytes() == 3 * ALIGN


def test_ranges_given_back_merge_into_room_for_a_larger_one():
    hb = HostBuffers(3 * ALIGN, pin=False)
    bufs = [hb.take_slices([ALIGN])[1] for _ in range(3)]
    hb.give(bufs[0])
    hb.give(bufs[2])
    assert hb.take_slices([2 * ALIGN]) == ([], None)  # 2 free, not next to each other
    hb.give(bufs[1])  # now one range of 3
    slices, _ = hb.take_slices([3 * ALIGN])
    assert _offsets(hb, slices) == [0]


def test_first_fit_reuses_the_room_of_an_earlier_range():
    hb = HostBuffers(4 * ALIGN, pin=False)
    a = hb.take_slices([ALIGN])[1]
    hb.take_slices([ALIGN])
    hb.give(a)
    slices, _ = hb.take_slices([ALIGN])
    assert _offsets(hb, slices) == [0]


def test_a_foreign_or_repeated_give_is_refused():
    hb = HostBuffers(2 * ALIGN, pin=False)
    _, buf = hb.take_slices([ALIGN])
    hb.give(buf)
    with pytest.raises(ValueError, match="twice"):
        hb.give(buf)
    with pytest.raises(ValueError, match="not a range"):
        hb.give(HostBuffers(ALIGN, pin=False).slab)


def test_no_room_at_all():
    hb = HostBuffers(0, pin=False)
    assert hb.take_slices([1]) == ([], None) and hb.free_bytes() == 0


MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize("step_bytes,undigested_max,want", [
    # no device digests (the CPU, the torch fallback): four steps of every object, 1-16 GiB
    ([(1_200 * MiB, False)], None, 4 * 1_200 * MiB),         # an 8B model's 8k-token step
    ([(10 * MiB, False)], None, 1 * GiB),                     # a tiny model: the floor
    ([(5 * GiB, False)], None, 16 * GiB),                     # the ceiling
    # digested calls go straight into the pool: at most 4 MiB a token group a step passes here
    ([(1_200 * MiB, False)], 4 * MiB, 64 * MiB),              # 4 x 4 MiB, under the floor
    ([(1_200 * MiB, False)] * 5, 4 * MiB, 5 * 4 * 4 * MiB),   # five token groups: 80 MiB
    ([(3 * MiB, False)], 4 * MiB, 64 * MiB),                  # a small call passes whole
    # states are read on the host: every state of a step passes
    ([(1_200 * MiB, False), (300 * MiB, True)], 4 * MiB, 4 * (4 + 300) * MiB),
])
def test_default_capacity_holds_four_steps_of_what_passes_through(step_bytes, undigested_max, want):
    assert default_capacity(step_bytes, undigested_max) == want
