"""One stored object of the server and its states (see :mod:`.store` for the transitions)."""

from __future__ import annotations

from vllm_kvplugin.server.pool import OBJECT_SHIFT

RESERVED, READY, PROMOTING, L2ONLY = 0, 1, 2, 3
#: where the L2 writer is with an object
W_NONE, W_QUEUED, W_WRITING = 0, 1, 2


class Obj:
    __slots__ = ("oid", "nbytes", "state", "block", "bsize", "pins", "owner", "deadline",
                 "in_l2", "wstate", "doomed", "epoch", "fp")

    def __init__(self, oid: bytes, nbytes: int, state: int):
        self.oid = oid
        self.nbytes = nbytes
        self.state = state
        self.block = -1
        self.bsize = 0
        self.pins = 0
        self.owner = None  # the Session that reserved it, while RESERVED
        self.deadline = 0.0
        self.in_l2 = False
        self.wstate = W_NONE
        self.doomed = False
        self.epoch = 0  # the reservation's number, which its commit must name (writer fencing)
        self.fp = b""  # the model fingerprint its header names, once known (the remote tier's namespace)

    @property
    def offset(self) -> int:
        return self.block + OBJECT_SHIFT
