"""What the scheduler half keeps per request: its chunk keys, the blocks vLLM gave it, the hit
being verified (:class:`Fetch`) and how far its chunks were considered for storing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvplugin.connector.metadata import FetchJob
from vllm_kvplugin.planner import LoadPlan


@dataclass
class Fetch:
    """A planned hit whose objects the workers are verifying (or have verified)."""

    plan: LoadPlan
    jobs: list[FetchJob]
    lease: int  # the server lease pinning the objects (0: local tier)
    pins: list[tuple[int, int]]  # (group, slot) pinned in the local tier
    issued: float
    ranks: int = 0  # ranks that reported
    fewest: int | None = None  # fewest leading jobs verified by a rank that reported
    good: int = -1  # leading jobs every rank verified (-1: not all ranks reported yet)
    verified_at: float = 0.0
    serial: int = 0  # this scheduler's number of the fetch (a verdict posted directly names it)

    def verified(self) -> set[tuple[int, int]]:
        return {(j.position, j.group) for j in self.jobs[:max(0, self.good)]}


@dataclass
class RequestTracker:
    req_id: str
    prompt_len: int
    keys: list[bytes]  # full prompt chunks
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    num_computed: int = 0
    stored_upto: int = 0  # chunks below this were considered for storing
    server_hits: int = 0  # chunks the server holds (its last lookup)
    fetch: Fetch | None = None
    plan: LoadPlan | None = None  # granted by the last get_num_new_matched_tokens
    looked_up: bool = False
    waiting_since: float = 0.0  # for this engine's stores of its chunks to be acknowledged
    server_lookup: Any = None  # the server lookup in flight (a Future)
    server_lookup_first: int = 0  # the chunk it asked from (its lease pins nothing below it)
    server_answered_at: float | None = None  # when its last answer came back with nothing worth a lease
    unkeyed: Any = None  # (ids, key extras) while only the first chunks are keyed (a lone request's lookup)
