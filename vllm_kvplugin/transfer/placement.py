"""Where a load's objects go in the paged cache, as vLLM's block ids (no per-token work).

The worker half builds a :class:`PlacedObjects` from its jobs' block ids on vLLM's thread, between
vLLM's allocation of a hit's blocks and the forward that reads them.  The CUDA transfer engine
hands the block ids straight to its scatter op, which computes each token's place in C++; every
other path asks for the per-token slots (:meth:`PlacedObjects.slots`, one vectorized numpy pass).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvplugin.chunk.format import ChunkError


@functools.lru_cache(maxsize=16)
def _token_index(tokens: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each token of an object: its index, its block's column, its offset in the block."""
    t = np.arange(tokens, dtype=np.int64)
    return t, t // block_size, t % block_size


@dataclass(frozen=True)
class PlacedObjects:
    """``C`` objects of ``tokens`` tokens each: object ``c`` in the blocks ``blocks[c]`` (block
    ``b`` holds tokens ``[b * block_size, (b + 1) * block_size)`` of the cache), of which only its
    tokens ``[spans[c, 0], spans[c, 1])`` are written.  ``blocks``: int64 ``[C, tokens //
    block_size]``; ``spans``: int64 ``[C, 2]`` within ``[0, tokens]``, start <= end.  Block ids
    are checked against the cache where they are used (the scatter op, the engine's slot check)."""

    blocks: np.ndarray
    spans: np.ndarray
    block_size: int
    tokens: int

    @classmethod
    def of(cls, block_rows: Sequence[Sequence[int]], block_size: int, tokens: int,
           skips: Sequence[int] | np.ndarray, takes: Sequence[int] | np.ndarray) -> PlacedObjects:
        """From each object's block ids and the token range ``[skips[c], takes[c])`` written
        (clipped to the object; an empty range writes nothing)."""
        bad = next((b for b in block_rows if len(b) * block_size != tokens), None)
        if bad is not None:
            raise ChunkError("plan", f"{len(bad)} blocks of {block_size} for an object of {tokens} tokens")
        C, per = len(block_rows), tokens // block_size
        blocks = np.fromiter(itertools.chain.from_iterable(block_rows), dtype=np.int64, count=C * per)
        spans = np.empty((C, 2), dtype=np.int64)
        spans[:, 0], spans[:, 1] = skips, takes
        np.maximum(spans, 0, out=spans)  # (ufuncs: np.clip's Python wrapper costs more than these)
        np.minimum(spans, tokens, out=spans)
        np.maximum(spans[:, 1], spans[:, 0], out=spans[:, 1])
        return cls(blocks.reshape(C, per), spans, block_size, tokens)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def count(self) -> int:
        """How many tokens are written."""
        return int((self.spans[:, 1] - self.spans[:, 0]).sum())

    def __getitem__(self, rows: slice) -> PlacedObjects:
        """The objects of ``rows`` (as a slots tensor's rows are taken)."""
        if not isinstance(rows, slice):
            raise TypeError(f"placed objects are taken by a slice, not {rows!r}")
        return PlacedObjects(self.blocks[rows], self.spans[rows], self.block_size, self.tokens)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks`` and ``spans`` as contiguous host int64 tensors (the scatter op's)."""
        return torch.from_numpy(np.ascontiguousarray(self.blocks)), torch.from_numpy(np.ascontiguousarray(self.spans))

    def slots(self) -> torch.Tensor:
        """``[C, T]`` paged slots, -1 for the tokens outside each span (one vectorized pass on
        vLLM's thread, in numpy: torch's CPU ops on these slots went to its intra-op thread pool
        and now and then took 20-35 ms on the H200's host)."""
        t, column, offset = _token_index(self.tokens, self.block_size)
        slots = self.blocks[:, column]
        slots *= self.block_size
        slots += offset
        lo, hi = self.spans[:, :1], self.spans[:, 1:]
        if lo.any() or (hi != self.tokens).any():
            slots[(t < lo) | (t >= hi)] = -1
        return torch.from_numpy(np.ascontiguousarray(slots))  # the column gather left it column-major

