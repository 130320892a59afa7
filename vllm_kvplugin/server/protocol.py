"""Wire protocol of the cache server (shared by the server and :mod:`vllm_kvplugin.tiers.mp_client`).

Transport: ZMQ, server ROUTER, client DEALER.  Every message is exactly one
frame of msgpack (msgspec), never pickle.  A request is an :class:`Envelope`
(protocol version, request id, op name, the op's body as raw msgpack); a reply
is a :class:`ReplyEnvelope` carrying the same id.  The server decodes the
envelope first (bad bytes -> ``malformed``), then checks the version
(``version``), the op (``unknown_op``) and only then decodes the body with
the op's own type (``invalid``).  See ``README.md`` beside this file.

Everything here is torch-free: the server must run without torch.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from vllm_kvplugin.chunk.keys import KEY_SIZE

#: bumped on any incompatible change of the messages below (2: 32-byte keys, per-group
#: lookup rules, ``drop``; 3: mutual proof of the token, ``auth``; 4: reservation epochs;
#: 5: a lookup names its model fingerprint, the remote tier's namespace; 6: a lookup may
#: answer its objects' pool offsets, as a resolve would)
PROTOCOL_VERSION = 6
#: a request larger than this gets a ``too_large`` error reply
MAX_MESSAGE_BYTES = 16 << 20
#: ZMQ drops the connection of a peer sending more than this (no reply possible)
HARD_MESSAGE_BYTES = 64 << 20

_OID = struct.Struct("<HHH")
OBJECT_ID_SIZE = KEY_SIZE + _OID.size  # 38

#: payloads start on this alignment inside the pool (the object starts HEADER_SIZE before)
PAYLOAD_ALIGN = 256

U16 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
U63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, msgspec.Meta(ge=1, le=0xFFFF)]
ShortStr = Annotated[str, msgspec.Meta(max_length=256)]


def object_id(key: bytes, group: int, rank: int, world: int) -> bytes:
    """The 38-byte id of one stored object: chunk key, KV cache group, TP rank, TP world size."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"chunk key must be {KEY_SIZE} bytes, got {len(key)}")
    if not (0 <= group <= 0xFFFF and 0 <= rank < world <= 0xFFFF):
        raise ValueError(f"bad object coordinates group={group} rank={rank} world={world}")
    return bytes(key) + _OID.pack(group, rank, world)


def split_object_id(oid: bytes) -> tuple[bytes, int, int, int]:
    """Inverse of :func:`object_id`: (key, group, rank, world)."""
    if len(oid) != OBJECT_ID_SIZE:
        raise ValueError(f"object id must be {OBJECT_ID_SIZE} bytes, got {len(oid)}")
    g, r, w = _OID.unpack_from(oid, KEY_SIZE)
    return oid[:KEY_SIZE], g, r, w


def oid_suffix(group: int, rank: int, world: int) -> bytes:
    return _OID.pack(group, rank, world)


# --------------------------------------------------------------------- envelopes
class Envelope(msgspec.Struct, frozen=True):
    v: int
    id: U63
    op: ShortStr
    body: msgspec.Raw = msgspec.Raw(b"\x80")  # {} by default


class ReplyEnvelope(msgspec.Struct, frozen=True):
    v: int
    id: int
    ok: bool
    code: str = ""
    error: str = ""
    body: msgspec.Raw = msgspec.Raw(b"\x80")


# error codes of ReplyEnvelope.code
E_MALFORMED = "malformed"          # not a msgpack envelope, or more than one frame
E_TOO_LARGE = "too_large"          # over MAX_MESSAGE_BYTES
E_VERSION = "version"              # protocol version differs
E_UNKNOWN_OP = "unknown_op"
E_INVALID = "invalid"              # body does not match the op's schema or its rules
E_AUTH = "auth"                    # no or a wrong proof of the token, or a request before it
E_HELLO = "hello_required"         # this connection has not said hello (or was reaped)
E_UNKNOWN_LEASE = "unknown_lease"  # released, expired, or from another server instance
E_NOT_LEASED = "not_leased"        # resolve asked for objects the lease does not pin
E_INTERNAL = "internal"


# --------------------------------------------------------------------- bodies
class Empty(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class HelloReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nonce: Nonce                       # the client's: the server's proof covers it (server/auth.py)
    client_name: ShortStr = ""
    pid: int = 0


class AuthReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    proof: Annotated[bytes, msgspec.Meta(max_length=64)]  # the client's proof of the token


class HelloRep(msgspec.Struct, frozen=True):
    server_version: str
    protocol: int
    instance: str          # random per server start: a new one means leases/offsets are gone
    pool_path: str
    pool_size: int
    header_size: int
    payload_align: int
    heartbeat_s: float
    lease_s: float
    reserve_s: float
    max_message_bytes: int
    prefaulted: bool = False  # every pool page allocated: clients map with MAP_POPULATE
    auth_required: bool = False  # the server has a token: ``auth`` before anything else
    server_nonce: bytes = b""
    proof: bytes = b""           # the server's proof of the token (empty without one)


class LookupReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: bytes            # n * 32 bytes, chunk keys in prefix order
    #: per KV cache group g (objects (g, r) for every r < ranks): what a hit needs, as
    #: (chunk.rules.Need, window chunks) -- a prefix, a window before the hit, or one point
    needs: Annotated[list[tuple[Annotated[int, msgspec.Meta(ge=0, le=2)], U16]],
                     msgspec.Meta(min_length=1, max_length=0xFFFF)]
    ranks: Count
    world: Count
    first: Annotated[int, msgspec.Meta(ge=0)] = 0  # chunks the client already holds
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 0  # budget for L2/remote -> L1 promotion
    #: the model fingerprint of the keys (chunk headers'): the remote store's namespace (empty: not asked)
    fingerprint: Annotated[bytes, msgspec.Meta(max_length=32)] = b""
    #: >= 0: the reply also resolves the lease's objects of this rank (< ranks), as one resolve
    #: of each group's would (an engine of one rank, whose worker then needs no resolve)
    resolve_rank: Annotated[int, msgspec.Meta(ge=-1, le=0xFFFE)] = -1


class LookupRep(msgspec.Struct, frozen=True):
    hits: int              # the hit ends at this chunk (0: no hit); its objects are pinned
    lease: int             # 0 when hits == 0
    pinned_bytes: int      # bytes of every object the lease pins (the planned transfer)
    l2_promoted: int       # objects brought from L2 into L1 for this lookup
    #: with ``resolve_rank``: the offsets and sizes (as :class:`ResolveRep`'s) of that rank's
    #: objects the lease pins, group by group, each group's in ``chunk.rules`` position order
    offsets: list[int] = []
    sizes: list[int] = []
    instance: str = ""     # with ``resolve_rank``: the server's (HelloRep.instance): whose pool
    #: objects still on their way into L1 (from L2 or the remote store, +1 while the remote
    #: store's answer is) when the wait ran out: asked again with a longer wait, the hit may be
    #: longer (0 from servers before this field)
    promoting: int = 0


class ResolveReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lease: U63
    keys: bytes
    group: U16
    rank: U16
    world: Count


class ResolveRep(msgspec.Struct, frozen=True):
    offsets: list[int]     # object offsets in the pool (header first, payload after HEADER_SIZE)
    sizes: list[int]       # object sizes (HEADER_SIZE + payload bytes)


class LeaseReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lease: U63


class ReleaseRep(msgspec.Struct, frozen=True):
    found: bool
    pinned_objects: int = 0
    pinned_bytes: int = 0
    resolved_objects: int = 0
    resolved_bytes: int = 0


class ReserveReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ids: bytes             # n * 38 bytes
    sizes: list[Annotated[int, msgspec.Meta(ge=0)]]


RESERVE_EXISTS = -1
RESERVE_NO_ROOM = -2


class ReserveRep(msgspec.Struct, frozen=True):
    offsets: list[int]     # >= 0: object offset; RESERVE_EXISTS; RESERVE_NO_ROOM
    epochs: list[int]      # per reservation, a number never handed out before (0 where none)


class CommitReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ids: bytes             # n * 38 bytes
    epochs: list[Annotated[int, msgspec.Meta(ge=0)]]  # the epoch each reservation was given


class IdsReq(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ids: bytes             # n * 38 bytes


COMMIT_OK = 0
COMMIT_NOT_RESERVED = 1    # unknown, not ours, already committed, reclaimed, or another epoch
COMMIT_BAD_HEADER = 2      # the chunk header does not name this object / size


class CommitRep(msgspec.Struct, frozen=True):
    status: list[int]


class AbortRep(msgspec.Struct, frozen=True):
    aborted: int


class DropRep(msgspec.Struct, frozen=True):
    dropped: int


class StatsRep(msgspec.Struct, frozen=True):
    values: dict[str, Any]


#: op name -> (request body type, reply body type)
OPS: dict[str, tuple[type, type]] = {
    "hello": (HelloReq, HelloRep),
    "auth": (AuthReq, Empty),
    "heartbeat": (Empty, Empty),
    "wake": (Empty, Empty),        # a call follows: never answered (MPClient.wake)
    "lookup": (LookupReq, LookupRep),
    "resolve": (ResolveReq, ResolveRep),
    "release": (LeaseReq, ReleaseRep),
    "reserve": (ReserveReq, ReserveRep),
    "commit": (CommitReq, CommitRep),
    "abort": (IdsReq, AbortRep),
    "drop": (IdsReq, DropRep),     # objects the client found corrupt: gone from L1 and L2
    "stats": (Empty, StatsRep),
}

ENCODER = msgspec.msgpack.Encoder()
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
REPLY_DECODER = msgspec.msgpack.Decoder(ReplyEnvelope)
REQ_DECODERS = {op: msgspec.msgpack.Decoder(t[0]) for op, t in OPS.items()}
REP_DECODERS = {op: msgspec.msgpack.Decoder(t[1]) for op, t in OPS.items()}


def encode_request(op: str, req_id: int, body: msgspec.Struct, version: int = PROTOCOL_VERSION) -> bytes:
    return ENCODER.encode(Envelope(version, req_id, op, msgspec.Raw(ENCODER.encode(body))))


def encode_reply(req_id: int, body: msgspec.Struct | None = None, code: str = "", error: str = "") -> bytes:
    raw = msgspec.Raw(ENCODER.encode(body)) if body is not None else msgspec.Raw(b"\x80")
    return ENCODER.encode(ReplyEnvelope(PROTOCOL_VERSION, req_id, not code, code, error, raw))


def split_ids(blob: bytes, size: int) -> list[bytes]:
    if len(blob) % size:
        raise ValueError(f"id blob of {len(blob)} bytes is not a multiple of {size}")
    return [blob[i:i + size] for i in range(0, len(blob), size)]


# --------------------------------------------------------------------- addresses
@dataclass(frozen=True)
class Address:
    """A parsed ``--listen`` / client address."""

    kind: str          # "unix" or "tcp"
    path: str = ""     # unix
    host: str = ""     # tcp
    port: int = 0      # tcp (0: pick one)

    @property
    def zmq(self) -> str:
        if self.kind == "unix":
            return f"ipc://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port if self.port else '*'}"

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.kind == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


#: the longest Unix socket path the kernel accepts (sun_path minus the NUL)
MAX_UNIX_PATH = 107


def parse_address(text: str) -> Address:
    """``/path``, ``unix:///path``, ``ipc:///path`` or ``tcp://HOST:PORT``; raises ValueError."""
    if not isinstance(text, str) or not text:
        raise ValueError("empty address")
    if text.startswith(("unix://", "ipc://")):
        path = text.split("://", 1)[1]
    elif text.startswith("tcp://"):
        rest = text[len("tcp://"):]
        if rest.startswith("["):
            host, _, port = rest[1:].partition("]:")
        else:
            host, _, port = rest.rpartition(":")
        if not host or not port:
            raise ValueError(f"tcp address must be tcp://HOST:PORT, got {text!r}")
        if port == "*":
            port = "0"
        try:
            p = int(port)
        except ValueError:
            raise ValueError(f"bad port in {text!r}") from None
        if not 0 <= p <= 65535:
            raise ValueError(f"bad port in {text!r}")
        return Address("tcp", host=host, port=p)
    elif "://" in text:
        raise ValueError(f"unsupported address scheme in {text!r} (use unix:///path or tcp://HOST:PORT)")
    else:
        path = text
    if not path:
        raise ValueError(f"empty socket path in {text!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if len(path.encode()) > MAX_UNIX_PATH:
        raise ValueError(f"unix socket path is {len(path.encode())} bytes, the limit is {MAX_UNIX_PATH}: {path}")
    return Address("unix", path=path)


def default_socket_dir() -> str:
    """The private directory of the default socket: $XDG_RUNTIME_DIR/vllm-kvplugin or /tmp/vllm-kvplugin-$UID."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "vllm-kvplugin")
    return f"/tmp/vllm-kvplugin-{os.getuid()}"


def default_address() -> str:
    return f"unix://{os.path.join(default_socket_dir(), 'server.sock')}"
