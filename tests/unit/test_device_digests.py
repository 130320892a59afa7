"""``DeviceDigests`` (transfer/cuda_handles.py) on this CPU, with events played by hand: a row's
digest is combined from its segments' values only once its piece's event is in, early ones
while the caller polls (``advance``), and ``result`` gives every row's digest as
``combine_segments`` computes it from the values the device wrote (an independent reference)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvplugin.chunk.checksums import join_checksums
from vllm_kvplugin.chunk.format import combine_segments
from vllm_kvplugin.transfer.cuda_handles import DeviceDigests


class HandEvent:
    """A CUDA event's two calls the digests make, completed by the test."""

    def __init__(self):
        self.in_ = False
        self.waited = 0

    def query(self) -> bool:
        return self.in_

    def synchronize(self) -> None:
        self.waited += 1
        assert self.in_, "waited for an event that the test never completes"


def _segments(rows: int, per: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 62), 1 << 62, (rows, per), dtype=torch.int64, generator=g)


def test_rows_are_combined_as_their_pieces_land_and_never_before():
    written = _segments(5, 3, seed=1)  # what the device writes, piece by piece
    segments = torch.zeros_like(written)
    e1, e2, e3 = HandEvent(), HandEvent(), HandEvent()
    d = DeviceDigests(segments, [(0, 2, e1), (2, 4, e2), (4, 5, e3)], torch.device("cpu"))
    d.advance()  # nothing landed: nothing read
    segments[0:2] = written[0:2]
    e1.in_ = True
    d.advance()  # rows 0-1 combined now
    segments[0:2] = 7  # (a later write to those rows would not be seen: they were read when they landed)
    segments[2:4] = 9  # not landed: must not be read yet
    d.advance()
    segments[2:5] = written[2:5]
    e2.in_ = e3.in_ = True
    assert d.done()
    want = [combine_segments(row) for row in written.tolist()]
    assert d.result() == want
    assert d.result() == want  # (asked twice: the same)


def test_result_waits_for_the_last_event_and_combines_what_advance_left():
    written = _segments(4, 2, seed=2)
    e1, e2 = HandEvent(), HandEvent()
    d = DeviceDigests(written.clone(), [(0, 3, e1), (3, 4, e2)], torch.device("cpu"))
    e1.in_ = e2.in_ = True
    assert d.result() == [combine_segments(row) for row in written.tolist()] and e2.waited == 1
    joined = join_checksums([DeviceDigests(written[:1].clone(), [(0, 1, e1)], torch.device("cpu")),
                             DeviceDigests(written[1:].clone(), [(0, 3, e2)], torch.device("cpu"))])
    joined.advance()
    assert joined.result() == [combine_segments(row) for row in written.tolist()]


@pytest.mark.parametrize("marks", [[], [(0, 2)], [(1, 4)], [(0, 2), (3, 4)], [(0, 3), (2, 4)]])
def test_marks_must_cover_the_rows_in_order(marks):
    with pytest.raises(ValueError, match="do not cover rows"):
        DeviceDigests(torch.zeros((4, 1), dtype=torch.int64), [(a, b, HandEvent()) for a, b in marks],
                      torch.device("cpu"))


class BrokenEvent(HandEvent):
    """A device that cannot be asked any more (a CUDA error)."""

    def query(self) -> bool:
        raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")

    def synchronize(self) -> None:
        self.query()


def test_a_device_error_surfaces_in_result_alone():
    """Polling (``done``, ``advance``, ``when_done``) never raises: a caller that polls outside
    the verdict's error handling (a lone fetch's wait, on vLLM's scheduler thread) moves on to
    ``result``, which raises the error where the verdict handles it (nothing verified)."""
    good, broken = HandEvent(), BrokenEvent()
    good.in_ = True
    d = DeviceDigests(_segments(3, 2, seed=3), [(0, 1, good), (1, 3, broken)], torch.device("cpu"))
    d.advance()
    assert d.done()
    called = []
    d.when_done(lambda: called.append(1))
    assert called == [1]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        d.result()
