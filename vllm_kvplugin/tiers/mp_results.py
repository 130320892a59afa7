"""What the cache server's client answers: its errors and result types (``mp_client.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


class TierUnavailable(Exception):
    """The server cannot be reached in time (dead, hung, restarted, not started); recompute."""


class ServerError(Exception):
    """The server refused a request; ``code`` is one of ``vllm_kvplugin.server.protocol.E_*``."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


class Reservation(int):
    """An object's offset in the pool (use it as an int), with the epoch of the reservation:
    :meth:`MPClient.commit` names it, so the server commits only this writer's reservation."""

    epoch: int

    def __new__(cls, offset: int, epoch: int) -> Reservation:
        r = super().__new__(cls, offset)
        r.epoch = epoch
        return r


@dataclass(frozen=True)
class LookupResult:
    hits: int            # the hit ends at this chunk; the objects it needs are pinned
    lease: int           # 0 when hits == 0
    pinned_bytes: int    # bytes of the pinned objects (all groups and ranks of the hit)
    l2_promoted: int     # objects read from L2 into L1 for this lookup
    #: with ``resolve_rank``: (group, chunk position) -> (offset, nbytes) of each of that rank's
    #: objects the lease pins, in the pool of the server ``instance`` that answered
    resolved: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    instance: str = ""
    #: objects still on their way into L1 when the server's wait ran out (``LookupRep.promoting``)
    promoting: int = 0


@dataclass(frozen=True)
class LeaseReport:
    found: bool          # False: unknown (expired, released twice, or an earlier server)
    pinned_objects: int
    pinned_bytes: int
    resolved_objects: int
    resolved_bytes: int
