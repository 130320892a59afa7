"""How a staged load groups its prefetched rows into scatter launches (transfer/cuda.py): runs of
consecutive rows within one piece of the copy while pieces may still be landing; runs of
consecutive rows alone once the whole copy has landed.  Checked against a row-by-row reference."""

from __future__ import annotations

import random

import pytest

from vllm_kvplugin.transfer.cuda_pieces import staged_runs


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
