"""Which device staging buffer a staged call takes (a pure policy over the pool's sizes and
states, no device).  ``CudaTransfer._acquire`` applies it.

A store's staging is handed back as soon as its DMAs are issued; a prefetch *holds* its buffer
until its load, and the cap on held bytes decides how many hits are prefetched (and so verified
on the device) at once.  A held buffer therefore never keeps much more than its prefetch needs:
in a serving run on the H100 the 468 MiB prefetches of a burst of hits took the 2,304 MiB
buffers that 16k-token prefill steps' stores had left, four of them filled the 8 GiB cap, and
most of the burst's other hits were verified on the host instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StagingState:
    """One staging buffer as the policy sees it."""

    nbytes: int
    held: bool  # kept by a prefetch until its load or release
    pacing: bool  # a store whose DMAs from it are not all issued yet
    idle: bool  # the last copy or kernel that used it is done
    last_use: int  # the pool's use counter when it was last handed out


@dataclass(frozen=True)
class StagingChoice:
    """``index``: the pool's buffer to take (None: a new buffer of the call's size, appended);
    ``resize``: that buffer's memory is replaced by one of the call's size (the old memory goes
    back to the allocator once the streams that used it are done)."""

    index: int | None
    resize: bool = False


def held_limit(nbytes: int) -> int:
    """The largest buffer a prefetch of ``nbytes`` keeps: its size, a quarter more, at least
    64 MiB more (allocations are rounded up to 2 MiB granules)."""
    return nbytes + max(nbytes // 4, 64 << 20)


def choose_staging(pool: Sequence[StagingState], nbytes: int, hold: bool, cap: Callable[[], int],
                   max_buffers: int) -> StagingChoice:
    """The buffer for a call of ``nbytes`` (``hold``: a prefetch's).  In order:

    1. the smallest idle, unheld buffer that is large enough (for a prefetch, not larger than
       :func:`held_limit`);
    2. a new one, while the pool has fewer than ``max_buffers`` and ``cap()`` (bytes; read only
       here, it may ask the device) is not passed;
    3. a new one beyond the counts when every buffer is held;
    4. else the least recently used unheld buffer, those of stores still pacing last (the caller
       drains their DMAs first and waits on the device for the rest), resized where it is too
       small, or, for a prefetch, too large.
    """
    def fits(s: StagingState) -> bool:
        return s.nbytes >= nbytes and (not hold or s.nbytes <= held_limit(nbytes))

    free = [i for i, s in enumerate(pool) if not s.held and not s.pacing and s.idle and fits(s)]
    if free:
        return StagingChoice(min(free, key=lambda i: pool[i].nbytes))
    if not pool or (len(pool) < max_buffers and sum(s.nbytes for s in pool) + nbytes <= cap()):
        return StagingChoice(None)
    unheld = [i for i, s in enumerate(pool) if not s.held]
    if not unheld:
        return StagingChoice(None)
    i = min(unheld, key=lambda i: (pool[i].pacing, pool[i].last_use))
    return StagingChoice(i, resize=not fits(pool[i]))
