"""How a transfer of ``C`` chunk objects is cut into launches and copies (pure functions, no
device): the pipelining groups, a prefetch's pieces, the runs of rows a staged load scatters per piece of it,
and the runs of adjacent host buffers one DMA can move.  Used by ``transfer/cuda.py`` and
``transfer/cuda_stores.py``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: pipelining: at most this many gather/scatter launches per call
MAX_GROUPS = 8


def launch_groups(n: int, max_groups: int = MAX_GROUPS) -> list[tuple[int, int]]:
    """[0, n) in pieces of 1, 1, 2, 4, ... (at most ``max_groups``, the last takes the rest)."""
    bounds = [0]
    while bounds[-1] < n and len(bounds) <= max_groups:
        k = len(bounds) - 1
        bounds.append(min(n, bounds[-1] + (1 if k == 0 else 1 << (k - 1))))
    bounds[-1] = n
    return list(zip(bounds, bounds[1:]))


def prefetch_pieces(n: int, pieces: int) -> list[tuple[int, int]]:
    """A prefetch of ``n`` objects as at most ``pieces`` copies ``[a, b)``: the last object alone,
    the others in equal pieces before it.  Each piece's digests start when its copy lands, so
    only the last piece's run after the copy's last byte, on the hit's critical path: one
    object's rather than an eighth of the hit's (which took 0.12-0.22 ms at 8k-32k on an H100)."""
    if n <= 1 or pieces <= 1:
        return [(0, n)] if n else []
    step = -(-(n - 1) // (pieces - 1))
    return [(a, min(n - 1, a + step)) for a in range(0, n - 1, step)] + [(n - 1, n)]


def staged_runs(rows: Sequence[int], pieces: Sequence[tuple[int, int]] | None) -> list[tuple[int, int, int | None]]:
    """A staged load's ``rows`` (its objects' rows of a prefetch, in load order) as maximal runs
    ``[i, j)`` of consecutive rows within one piece of the copy, with the index of that piece in
    ``pieces`` ((first row, end row) each).  ``pieces`` None: the whole copy has landed, so a run
    stops only where the rows do, and names no piece to wait for."""
    def piece_of(row: int) -> int | None:
        return None if pieces is None else next(k for k, (a, b) in enumerate(pieces) if a <= row < b)

    out: list[tuple[int, int, int | None]] = []
    i = 0
    while i < len(rows):
        k = piece_of(rows[i])
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1 and piece_of(rows[j]) == k:
            j += 1
        out.append((i, j, k))
        i = j
    return out


def host_runs(bufs: Sequence[torch.Tensor], a: int, b: int) -> list[tuple[int, int, torch.Tensor]]:
    """Maximal runs of adjacent host buffers in ``bufs[a:b]`` as (start, end, one view)."""
    out: list[tuple[int, int, torch.Tensor]] = []
    i = a
    while i < b:
        first = bufs[i]
        j = i + 1
        nbytes = first.nbytes
        storage = first.untyped_storage().data_ptr()
        while (j < b and bufs[j].untyped_storage().data_ptr() == storage
               and bufs[j].data_ptr() == first.data_ptr() + (j - i) * nbytes):
            j += 1
        if j - i == 1:
            view = first
        else:
            view = torch.empty(0, dtype=first.dtype).set_(
                first.untyped_storage(), first.storage_offset(), (j - i, *first.shape[1:]))
        out.append((i, j, view))
        i = j
    return out
