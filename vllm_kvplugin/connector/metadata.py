"""What the scheduler tells the workers each step, and what they report back.

Both travel through vLLM (pickled inside ``SchedulerOutput`` / aggregated over
ranks in ``KVConnectorOutput``), so they are plain dataclasses of builtins.

A hit takes two steps (DESIGN.md rule 7, "verify before claim"):

1. :class:`FetchRequest` -- while vLLM holds the request back (the connector
   answered ``None`` to ``get_num_new_matched_tokens``), every worker reads the
   planned objects from their tier and checks header, size and checksum; it
   reports how many leading objects passed (:attr:`KVPluginWorkerMeta.fetched`; an engine
   of one rank whose scheduler half is in the worker's process posts it straight to it
   instead, ``connector/verdicts.py``);
2. :class:`LoadRequest` -- only after every rank verified them does the scheduler
   claim the tokens; the workers then copy the verified bytes into the KV cache
   before the step's forward.  Nothing can depend on bytes that were not verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvplugin.adapters.api import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class Placement:
    """Where the scheduler's server lookup placed a leased object: ``offset`` (``nbytes``, header
    included) in the pool of server ``instance``, to be read without a resolve before ``until``
    (monotonic: half the lease's time after the lookup was sent)."""

    instance: str
    offset: int
    nbytes: int
    until: float


@dataclass
class FetchJob:
    """One object to read and verify: group ``group``'s object of chunk ``position``.

    From the local tier (``slot`` >= 0) or from the cache server under ``lease``: where the
    lookup ``placed`` it, else where the worker's resolve finds it.
    """

    key: bytes
    position: int
    group: int
    slot: int = -1
    lease: int = 0
    placed: Placement | None = None


@dataclass
class FetchRequest:
    req_id: str
    jobs: list[FetchJob]  # ordered by (position, group)
    serial: int = 0  # the scheduler's number of this fetch (its verdict names it)


@dataclass
class LoadJob:
    """Write the verified object (``position``, ``group``) of the request's fetch.

    ``block_ids``: the group's blocks covering the object's tokens (recurrent: the block
    that holds the state at the hit, then the block the step's kernels read it from).  Of
    the object's tokens, those in ``[lo, hi)`` are written (absolute token indices).
    """

    key: bytes
    position: int
    group: int
    block_ids: tuple[int, ...]
    lo: int
    hi: int


@dataclass
class LoadRequest:
    req_id: str
    jobs: list[LoadJob]
    expected_bytes: tuple[int, ...]  # per group, from the planner
    num_tokens: int  # the tokens vLLM counts as loaded


@dataclass
class StoreJob:
    """Copy group ``group``'s tokens ``[lo, hi)`` of chunk ``position`` (recurrent: the state in
    ``block_ids``) into local tier ``slot`` (-1: none) and, with ``to_server``, to the server."""

    key: bytes
    position: int
    group: int
    block_ids: tuple[int, ...]
    lo: int
    hi: int
    slot: int = -1
    to_server: bool = False


@dataclass
class StoreRequest:
    req_id: str
    jobs: list[StoreJob]


#: the longest a step that scheduled no tokens waits, with the GIL released, for what a held-back
#: request waits on (scheduler: a server lookup; worker: a fetch's hashes or a store) rather than
#: spin empty steps, in which the engine's thread keeps the GIL from the threads doing that work.
#: A new request waits at most that.  (The hashes of a 16k-token hit took 31 ms on the H200's
#: host, a 64k one 143 ms.)
IDLE_WAIT_S = 0.05

#: a lone request's long hit is sent toward the device in two parts: its first chunks are keyed,
#: looked up and read before the rest are keyed (the scheduler's split of a local-tier hit,
#: ``connector/scheduler_lone.py``), or read before the rest are resolved and read (the worker's,
#: of a hit the scheduler did not split).  The first part: an eighth of the hit, at least this
#: many chunks.  0: never split.
FIRST_PART_CHUNKS = 4


def first_part(n: int) -> int:
    """How many of a hit's ``n`` chunks (or objects) go first (:data:`FIRST_PART_CHUNKS`); 0: the
    hit is too short to split (the rest must be at least as long as the first part)."""
    if FIRST_PART_CHUNKS <= 0:
        return 0
    first = max(FIRST_PART_CHUNKS, n // 8)
    return first if n >= 2 * first else 0


@dataclass
class KVPluginMetadata(KVConnectorMetadata):
    fetches: list[FetchRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    stores: list[StoreRequest] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)  # fetched requests that will not load
    #: bumped by the scheduler each time it learns of a failed load; a worker drops the
    #: stores of metadata older than its last failure (computed over blocks it never wrote)
    epoch: int = 0
    #: the model fingerprint (computed once, by the scheduler: it hashes the weights)
    fingerprint: bytes = b""
    #: the step schedules no tokens, no request scheduled before is unfinished (none can be in a
    #: batch still in flight, whose output a wait would delay: vLLM's asynchronous scheduling
    #: runs such steps), and a request is held back for this connector: the step may wait, up to
    #: :data:`IDLE_WAIT_S`, for what that request waits on (it holds up nothing else)
    idle: bool = False
    #: blocks every worker reports to vLLM as invalid in this step's output: a failed load's and
    #: those computed over them, until recomputed (``connector/bad_blocks.py``; ``recompute``
    #: policy only)
    bad_blocks: frozenset[int] = frozenset()


Slot = tuple[int, int]  # (group, local tier slot)


@dataclass
class KVPluginWorkerMeta(KVConnectorWorkerMetadata):
    """One step's results of one or (after :meth:`aggregate`) all ranks."""

    stored: dict[Slot, int] = field(default_factory=dict)  # slot -> ranks that stored it
    store_failed: dict[Slot, int] = field(default_factory=dict)  # slot -> ranks that failed it
    fetched: dict[str, tuple[int, int]] = field(default_factory=dict)  # req -> (ranks, fewest good jobs)
    bad_slots: dict[Slot, str] = field(default_factory=dict)  # failed verification -> reason
    loads_done: dict[str, int] = field(default_factory=dict)  # req id -> ranks done
    #: loads that failed after their tokens were claimed: req id -> first position not loaded
    load_failed: dict[str, int] = field(default_factory=dict)
    #: stores dropped because a load of their step failed: req id -> first position dropped
    stores_cancelled: dict[str, int] = field(default_factory=dict)
    #: chunk key -> store jobs of it that ended (stored, failed or cancelled), summed over ranks
    store_done: dict[bytes, int] = field(default_factory=dict)
    #: the blocks of the loads in ``load_failed`` (every rank's)
    failed_blocks: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPluginWorkerMeta:
        assert isinstance(other, KVPluginWorkerMeta)
        out = KVPluginWorkerMeta(dict(self.stored), dict(self.store_failed), dict(self.fetched),
                                 dict(self.bad_slots), dict(self.loads_done), dict(self.load_failed),
                                 dict(self.stores_cancelled), dict(self.store_done),
                                 self.failed_blocks | other.failed_blocks)
        for mine, theirs in ((out.stored, other.stored), (out.store_failed, other.store_failed),
                             (out.loads_done, other.loads_done), (out.store_done, other.store_done)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for k, (ranks, good) in other.fetched.items():
            r0, g0 = out.fetched.get(k, (0, good))
            out.fetched[k] = (r0 + ranks, min(g0, good))
        for mine, theirs in ((out.load_failed, other.load_failed),
                             (out.stores_cancelled, other.stores_cancelled)):
            for k, v in theirs.items():
                mine[k] = min(mine.get(k, v), v)
        for k, v in other.bad_slots.items():
            out.bad_slots.setdefault(k, v)
        return out

    def is_empty(self) -> bool:
        return not (self.stored or self.store_failed or self.fetched or self.bad_slots or self.loads_done
                    or self.load_failed or self.stores_cancelled or self.store_done or self.failed_blocks)
