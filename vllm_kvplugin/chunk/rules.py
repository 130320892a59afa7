"""What a KV cache group needs from a tier to restore a hit: the one rule for planner and server.

A hit ends at a chunk boundary ``hit`` (in chunks; tokens ``[0, hit * C)`` are then
computed).  vLLM already holds chunks below ``first`` (its own prefix cache).  Each
group needs, by its kind:

* ``PREFIX`` (full attention, MLA): every chunk ``[first, hit)``;
* ``WINDOW`` (sliding window): the last ``window`` chunks before the hit, not
  below ``first`` -- the tokens the window of the first computed token still sees;
* ``POINT`` (Mamba / GatedDeltaNet): the state checkpoint stored at chunk
  ``hit - 1``, i.e. the recurrent state after exactly ``hit * C`` tokens.

:func:`best_hit` picks the largest hit that every group can restore, given what is
present.  Torch-free: the cache server answers lookups with the same function.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Need(enum.IntEnum):
    PREFIX = 0
    WINDOW = 1
    POINT = 2


@dataclass(frozen=True)
class GroupNeed:
    need: Need
    window: int = 0  # WINDOW: chunks before the hit

    def __post_init__(self) -> None:
        if self.need is Need.WINDOW and self.window < 1:
            raise ValueError(f"a WINDOW need covers at least one chunk, got {self.window}")

    def positions(self, hit: int, first: int) -> range:
        """Chunk positions this group restores for a hit ending at chunk ``hit`` (``hit > first``)."""
        if self.need is Need.PREFIX:
            return range(first, hit)
        if self.need is Need.WINDOW:
            return range(max(first, hit - self.window), hit)
        return range(hit - 1, hit)


def best_hit(max_hit: int, first: int, needs: Sequence[GroupNeed],
             present: Callable[[int, int], bool]) -> int:
    """The largest ``hit`` in ``(first, max_hit]`` whose every group's positions are present
    (``present(position, group)``), or 0 when there is none.

    Linear in groups x chunks, whatever the windows: ``present`` is asked at most once per
    position of a prefix or window group and once per candidate hit of a point group (the
    cache server answers lookups with it; re-checking a whole window per candidate made a
    lookup's cost grow with chunks x window)."""
    if max_hit <= first or not needs:
        return 0
    top = max_hit
    for g, need in enumerate(needs):  # a prefix group caps the hit at its first gap
        if need.need is Need.PREFIX:
            pos = first
            while pos < top and present(pos, g):
                pos += 1
            top = pos
    # a window group: how many positions in a row are present, ending at each position
    runs: dict[int, list[int]] = {}
    for g, need in enumerate(needs):
        if need.need is Need.WINDOW:
            run, r = [], 0
            for pos in range(first, top):
                r = r + 1 if present(pos, g) else 0
                run.append(r)
            runs[g] = run
    for hit in range(top, first, -1):
        for g, need in enumerate(needs):
            if need.need is Need.WINDOW:
                if runs[g][hit - 1 - first] < min(need.window, hit - first):
                    break
            elif need.need is Need.POINT and not present(hit - 1, g):
                break
        else:
            return hit
    return 0
