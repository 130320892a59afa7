"""How a staged load groups its prefetched rows into scatter launches (transfer/cuda.py): runs of
consecutive rows within one piece of the copy while pieces may still be landing; runs of
consecutive rows alone once the whole copy has landed.  Checked against a row-by-row reference."""

from __future__ import annotations

import random

import pytest

from vllm_kvplugin.transfer.cuda_pieces import prefetch_pieces, staged_runs


def _reference(rows, pieces):
    """Row by row: a new run wherever the rows stop being consecutive or (pieces given) the
    piece changes."""
    def piece_of(r):
        return None if pieces is None else [k for k, (a, b) in enumerate(pieces) if a <= r < b][0]
    out = []
    for n, r in enumerate(rows):
        if out and rows[n - 1] + 1 == r and piece_of(rows[n - 1]) == piece_of(r):
            i, _, k = out[-1]
            out[-1] = (i, n + 1, k)
        else:
            out.append((n, n + 1, piece_of(r)))
    return out


def _pieces(n, step):
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def test_a_whole_prefetch_in_order_is_one_launch_once_landed_and_one_per_piece_before():
    rows = list(range(32))
    assert staged_runs(rows, None) == [(0, 32, None)]
    assert staged_runs(rows, _pieces(32, 4)) == [(4 * k, 4 * k + 4, k) for k in range(8)]


def test_runs_stop_where_the_rows_do():
    rows = [0, 1, 2, 5, 6, 3, 4]
    assert staged_runs(rows, None) == [(0, 3, None), (3, 5, None), (5, 7, None)]
    assert staged_runs(rows, [(0, 2), (2, 7)]) == [(0, 2, 0), (2, 3, 1), (3, 5, 1), (5, 7, 1)]
    assert staged_runs([], None) == [] and staged_runs([], [(0, 1)]) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_rows_match_the_reference(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 60)
    rows = list(range(n))
    if seed % 2:  # a load of some rows, some out of order
        rows = sorted(rnd.sample(rows, rnd.randint(1, n)))
        if seed % 4 == 1:
            rnd.shuffle(rows)
    pieces = _pieces(n, rnd.randint(1, 9))
    for p in (pieces, None):
        got = staged_runs(rows, p)
        assert got == _reference(rows, p)
        assert [r for i, j, _ in got for r in rows[i:j]] == rows  # every row once, in order


def test_a_prefetch_is_cut_into_pieces_that_end_with_its_last_object_alone():
    """``prefetch_pieces``: [0, n) covered in order by at most ``pieces`` copies, the last object
    a piece of its own (its digests are the only ones left after the copy's last byte), the
    others in equal pieces; written out by hand for the sizes a hit takes."""
    assert prefetch_pieces(0, 8) == [] and prefetch_pieces(1, 8) == [(0, 1)]
    assert prefetch_pieces(2, 8) == [(0, 1), (1, 2)]
    assert prefetch_pieces(10, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9), (9, 10)]
    assert prefetch_pieces(28, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 27), (27, 28)]
    assert prefetch_pieces(5, 1) == [(0, 5)]
    for n in range(2, 300):
        for pieces in (2, 3, 8):
            got = prefetch_pieces(n, pieces)
            assert got[0][0] == 0 and got[-1] == (n - 1, n) and len(got) <= pieces, (n, pieces, got)
            assert all(a < b for a, b in got) and all(b == a2 for (_, b), (a2, _) in zip(got, got[1:]))
