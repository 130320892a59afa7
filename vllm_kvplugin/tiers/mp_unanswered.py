"""Calls a client gave up on that the server may still carry out, and what gives their state back.

A ``reserve`` or ``lookup`` that got no answer within its bound (``mp_session``'s ``_NoReply``:
the server was slow, or stopped and then continued) may still run on the server.  Its
reservations, or its lease, then belong to nobody the client knows of: a reservation makes every
later reserve of its object -- by this engine or any other -- answer "exists" for the server's
``reserve_s`` while no lookup can find it, and a lease pins its objects for ``lease_s``.

:class:`Unanswered` remembers such calls by request id.  Given the late answer, it names the
requests that give the state back (``abort`` of what was reserved, ``release`` of the lease).
The session sends them before its next request of its own: one connection's requests are
handled in order, so the server frees the state before it handles that request.  An abort can
only meet the orphaned reservation: a later reserve of the same object by this session either
came after the abort or was answered "exists".
"""

from __future__ import annotations

import msgspec

from vllm_kvplugin.server import protocol as P

#: the calls whose unanswered requests leave state on the server
STATEFUL_OPS = ("reserve", "lookup")
#: calls remembered at most (the oldest forgotten first: the server's own expiry frees theirs)
MAX_REMEMBERED = 256


class Unanswered:
    """Owned by one session; called with its lock held (not thread-safe on its own)."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[str, msgspec.Struct]] = {}

    def __bool__(self) -> bool:
        return bool(self._calls)

    def remember(self, req_id: int, op: str, body: msgspec.Struct) -> None:
        """``req_id`` (``op`` with ``body``) ended without an answer on the current connection."""
        if op not in STATEFUL_OPS:
            return
        if len(self._calls) >= MAX_REMEMBERED:
            del self._calls[next(iter(self._calls))]
        self._calls[req_id] = (op, body)

    def forget_all(self) -> None:
        """The connection is gone: its answers never come, and the server reaps the session that
        made them (its reservations and leases with it)."""
        self._calls.clear()

    def give_back(self, rep: P.ReplyEnvelope) -> list[tuple[str, msgspec.Struct]]:
        """The requests (op, body) that give back what the late answer ``rep`` says the server
        made for nobody; empty for an answer to any other request, a refusal or an unreadable body."""
        call = self._calls.pop(rep.id, None)
        if call is None or not rep.ok:
            return []
        op, body = call
        try:
            got = P.REP_DECODERS[op].decode(rep.body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return []
        if op == "reserve":
            n = P.OBJECT_ID_SIZE
            ids = b"".join(body.ids[i * n:(i + 1) * n] for i, off in enumerate(got.offsets) if off >= 0)
            return [("abort", P.IdsReq(ids))] if ids else []
        return [("release", P.LeaseReq(got.lease))] if got.lease else []
