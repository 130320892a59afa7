"""The worker's private host buffers (``transfer/host_buffers.py``): sizes, reuse, the cap."""

from __future__ import annotations

from vllm_kvplugin.transfer.host_buffers import ALIGN, HostBuffers, aligned


def test_sizes_are_powers_of_two_of_at_least_a_mebibyte():
    hb = HostBuffers(pin=False)
    for n, want in ((1, 1 << 20), (1 << 20, 1 << 20), ((1 << 20) + 1, 2 << 20), (5 << 20, 8 << 20)):
        b = hb.take(n)
        assert b.numel() == want and b.is_contiguous() and b.element_size() == 1
    assert [aligned(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]


def test_the_smallest_kept_buffer_that_fits_is_reused():
    hb = HostBuffers(pin=False)
    big, small = hb.take(3 << 20), hb.take(1 << 20)
    hb.give(big)
    hb.give(small)  # kept after the big one: found by size, not by comparing tensors
    assert hb.take(1000) is small
    assert hb.take(1000) is big  # the only one left that fits
    fresh = hb.take(1000)
    assert fresh is not small and fresh is not big


def test_buffers_beyond_the_cap_are_not_kept():
    hb = HostBuffers(pin=False, keep_bytes=2 << 20)
    a, b = hb.take(2 << 20), hb.take(1 << 20)
    hb.give(a)
    hb.give(b)  # 3 MiB would be kept in all: over the cap, dropped
    assert hb.take(1 << 20) is a
    assert hb.take(1 << 20) is not b


def test_slices_are_aligned_and_cover_their_sizes():
    hb = HostBuffers(pin=False)
    slices, buf = hb.take_slices([10, ALIGN, 3])
    assert [s.numel() for s in slices] == [10, ALIGN, 3]
    assert [s.data_ptr() - buf.data_ptr() for s in slices] == [0, ALIGN, 2 * ALIGN]
