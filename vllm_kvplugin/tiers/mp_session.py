"""The connection and session of a cache server client (:class:`MPSession`; the calls are
:class:`~vllm_kvplugin.tiers.mp_client.MPClient`'s).

One session per process (thread-safe: one lock around the socket).  It connects, proves the
token both ways (``server/auth.py``), maps the server's shared-memory pool, keeps the session
alive with heartbeats and makes each call a bounded request/reply (``_call``).

Every call is bounded by ``timeout_s``; a dead, hung or restarted server makes
the call raise :class:`TierUnavailable` and the next call reconnects (new
socket, hello, the pool re-mapped if the server's pool changed).  A call that
only got no answer within its bound keeps the connection and its session: the
heartbeats go on, and a late answer is read and dropped by the next call (on an
overloaded host a server descheduled past an engine step's 50 ms bound was
reaped as silent while the engine's client sat disconnected) -- except that what
a late ``reserve`` or ``lookup`` made on the server is given back before that
call's request goes (:mod:`.mp_unanswered`).  A session the server reaped while this process
was silent (stopped, starved) is opened again by the heartbeat thread, on the same connection
and for the same server instance only, so that the next call need not say hello itself.

Offsets and leases belong to one server instance.  The call that first meets
a new instance re-maps the pool, increments :attr:`MPSession.pool_generation`
and raises :class:`TierUnavailable` without sending its request, so a caller
that drops its in-flight offsets and leases on ``TierUnavailable`` can never
write an old offset into the new pool.  Views from :meth:`pool_view` /
:meth:`pool_tensor` taken earlier stay mapped to the old (orphaned) pool until
the last one is gone (:mod:`.mp_pool`), so late writes through them are
harmless; threads sharing one client should compare ``pool_generation``.  After a
failure, calls fail fast (no socket I/O) for ``retry_s`` so that a missing
server costs the caller nothing per request.  Server-side refusals (unknown
lease, invalid request) raise :class:`ServerError` with the protocol's code.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from vllm_kvplugin.server import auth
from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.tiers.mp_pool import PoolFileError, PoolMaps
from vllm_kvplugin.tiers.mp_results import ServerError, TierUnavailable
from vllm_kvplugin.tiers.mp_unanswered import Unanswered

logger = logging.getLogger(__name__)

#: how long a call waits for the connection to the server before it gives up
CONNECT_GRACE_S = 0.5
#: a heartbeat's bound (it holds the client's lock meanwhile)
HEARTBEAT_TIMEOUT_S = 1.0


class _SessionLost(Exception):
    pass


class _NoReply(TierUnavailable):
    """No answer within the call's bound: the server may only be slow (or stopped)."""


class MPSession:
    """A client's connection and session; see the module docstring.

    ``address``: ``unix:///path``, a bare path, or ``tcp://HOST:PORT``.
    ``token``: the server's token (``server/auth.py``: proven, never sent).  ``heartbeat``: send
    heartbeats from a daemon thread every ``heartbeat_s`` the server asks for.
    """

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 5.0,
                 client_name: str | None = None, heartbeat: bool = True, retry_s: float = 1.0,
                 lookup_wait_s: float | None = None, server_uid: int | None = None):
        self.address = P.parse_address(address)
        #: the user the server runs as: its socket directory and pool must be that user's
        self.server_uid = os.getuid() if server_uid is None else int(server_uid)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.token = token
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.client_name = (client_name or f"pid{os.getpid()}")[:200]
        self.lookup_wait_s = (min(0.5 * self.timeout_s, 2.0) if lookup_wait_s is None
                              else float(lookup_wait_s))
        self._heartbeat_on = heartbeat
        self._closed = False
        self._init_process_state()

    # ------------------------------------------------------------------ process state
    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._hello: P.HelloRep | None = None
        self._down_until = 0.0
        self._req_id = 0
        self._unanswered = Unanswered()  # calls of this connection that got no answer in time
        self._pools = PoolMaps()
        self._generation = 0
        self._instance: str | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child: nothing of the parent's socket is usable
            self._init_process_state()

    # ------------------------------------------------------------------ connection
    def _disconnect(self, backoff: bool) -> None:
        if self._sock is not None:
            try:
                self._sock.close(0)
            except Exception:
                pass
        self._sock = None
        self._hello = None
        self._unanswered.forget_all()
        if backoff:
            self._down_until = time.monotonic() + self.retry_s

    def _connect(self, deadline: float) -> bool:
        if self.address.kind == "unix":
            self._trust(auth.check_socket_dir, self.address.path, self.server_uid)  # before a byte is sent
        if self._ctx is None:
            self._ctx = zmq.Context(1)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)           # never queue requests for a server that is not there
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.MAXMSGSIZE, P.HARD_MESSAGE_BYTES)
        s.setsockopt(zmq.ROUTING_ID, os.urandom(12))
        if self.address.kind == "tcp" and ":" in self.address.host:
            s.setsockopt(zmq.IPV6, 1)
        s.connect(self.address.zmq)
        self._sock = s
        return self._connect_hello(deadline)

    def _connect_hello(self, deadline: float) -> bool:
        return self._after_hello(*self._say_hello(deadline), deadline)

    def _say_hello(self, deadline: float) -> tuple[P.HelloRep, bytes]:
        """The server's hello reply and the nonce it answers (nothing checked yet)."""
        nonce = auth.new_nonce()
        try:
            rep = self._exchange("hello", P.HelloReq(nonce, self.client_name, os.getpid()), deadline)
        except _SessionLost as exc:  # hello never needs a session; a server that says so is broken
            raise TierUnavailable(f"cache server refused hello: {exc}") from None
        return rep, nonce

    def _trust(self, check, *args) -> None:
        try:
            check(*args)
        except auth.AuthError as exc:
            self._disconnect(backoff=True)
            raise ServerError(P.E_AUTH, f"cache server {self.address}: {exc}") from None

    def _authenticate(self, rep: P.HelloRep, nonce: bytes, deadline: float) -> None:
        """Both sides prove the token (server/auth.py); the server first, so that nothing more
        goes to a peer that does not know it.  With a token configured, a server without one
        is not trusted either."""
        if not (rep.auth_required or self.token):
            return
        if not self.token:
            self._disconnect(backoff=True)
            raise ServerError(P.E_AUTH, f"cache server {self.address} requires a token: set server_token_file "
                                        f"or ${auth.TOKEN_ENV}")
        if not (rep.auth_required and auth.check_proof(rep.proof, auth.server_proof(self.token, nonce,
                                                                                      rep.server_nonce))):
            self._disconnect(backoff=True)
            raise ServerError(P.E_AUTH, f"cache server {self.address} did not prove it knows the token: "
                                        "not using it")
        try:
            self._exchange("auth", P.AuthReq(auth.client_proof(self.token, nonce, rep.server_nonce)), deadline)
        except _SessionLost as exc:
            raise TierUnavailable(f"cache server refused auth: {exc}") from None

    def _after_hello(self, rep: P.HelloRep, nonce: bytes, deadline: float) -> bool:
        """Check, authenticate, map the pool, start heartbeats; True when this is a new server
        instance (every offset and lease the caller holds from the previous one is void)."""
        if rep.protocol != P.PROTOCOL_VERSION or rep.header_size != HEADER_SIZE:
            self._disconnect(backoff=True)
            raise ServerError(P.E_VERSION, f"server speaks protocol {rep.protocol} with {rep.header_size}-byte "
                                           f"headers; this client {P.PROTOCOL_VERSION}/{HEADER_SIZE}")
        self._authenticate(rep, nonce, deadline)
        self._map_pool(rep)
        self._hello = rep
        changed = self._instance is not None and self._instance != rep.instance
        if self._instance != rep.instance:
            if changed:
                logger.warning("vllm-kvplugin: cache server %s restarted (instance %s -> %s)",
                               self.address, self._instance, rep.instance)
            self._instance = rep.instance
            self._generation += 1
        if self._heartbeat_on and (self._hb_thread is None or not self._hb_thread.is_alive()):
            self._hb_stop.clear()
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                               name="kvplugin-mp-heartbeat")
            self._hb_thread.start()
        return changed

    def _map_pool(self, rep: P.HelloRep) -> None:
        if self._pools.is_current(rep.pool_path, rep.pool_size):
            return
        try:
            self._pools.map(rep.pool_path, rep.pool_size, rep.prefaulted,
                            lambda path, st: self._trust(auth.check_pool_file, path, st, self.server_uid))
        except PoolFileError as exc:
            raise TierUnavailable(str(exc)) from None

    def unmap_unused(self) -> None:
        """Let go of earlier servers' pools that nothing uses any more (every call does this
        too); skipped when another thread is inside a call."""
        if self._pools.has_old and self._lock.acquire(timeout=0):
            try:
                self._pools.unmap_unused()
            finally:
                self._lock.release()

    @property
    def mapped_pools(self) -> int:
        """Pools this process still maps: the current one and earlier ones still in use."""
        return self._pools.count

    @property
    def before_unmap(self):
        """Called with an old pool's tensor before that pool is unmapped (e.g. cudaHostUnregister)."""
        return self._pools.before_unmap

    @before_unmap.setter
    def before_unmap(self, fn) -> None:
        self._pools.before_unmap = fn

    def _exchange(self, op: str, body: msgspec.Struct, deadline: float, backoff: bool = True):
        """One request/reply on the current socket; TierUnavailable on timeout or a dead socket.
        ``backoff`` False: a call that only got no answer in time leaves later calls free to go
        (the caller bounded it below the server's normal answer time on purpose)."""
        sock = self._sock
        assert sock is not None
        self._req_id += 1
        rid = self._req_id
        msg = P.encode_request(op, rid, body)
        if len(msg) > P.MAX_MESSAGE_BYTES:
            raise ValueError(f"{op} request of {len(msg)} bytes exceeds {P.MAX_MESSAGE_BYTES}; split it")
        bound = deadline - time.monotonic()
        try:
            # with IMMEDIATE set, a socket can take a message only once connected: a server
            # that is not there fails the call after the connect grace, not the whole timeout
            if not self._wait(sock, zmq.POLLOUT, min(deadline, time.monotonic() + CONNECT_GRACE_S)):
                raise TierUnavailable(f"cache server {self.address} is not reachable")
            while self._unanswered and sock.poll(0, zmq.POLLIN):  # late answers already here:
                self._late(sock, self._recv(sock))  # what they made is given back before msg
            sock.send(msg, zmq.NOBLOCK)
            while True:
                if not self._wait(sock, zmq.POLLIN, deadline):
                    self._unanswered.remember(rid, op, body)
                    raise _NoReply(f"cache server {self.address} did not answer {op} within {bound:.2g} s")
                rep = self._recv(sock)
                if rep.id != rid and rep.id != 0:
                    self._late(sock, rep)  # a late reply to an earlier request that timed out
                    continue
                if not rep.ok:
                    if rep.code == P.E_HELLO:  # reaped, or the server restarted under us
                        raise _SessionLost(rep.error)
                    if rep.id == 0 and rep.code not in (P.E_MALFORMED, P.E_TOO_LARGE, P.E_AUTH):
                        continue  # (a refused peer gets id 0: the server reads nothing of it)
                    raise ServerError(rep.code, rep.error)
                try:
                    return P.REP_DECODERS[op].decode(rep.body)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise TierUnavailable(f"cache server sent a bad {op} reply: {exc}") from None
        except _NoReply:
            if self._hello is None:  # (a hello or its proof: no session to keep)
                self._disconnect(backoff=True)
            elif backoff:  # the session stays (heartbeats go on); calls back off meanwhile
                self._down_until = time.monotonic() + self.retry_s
            raise
        except TierUnavailable:
            self._disconnect(backoff=True)
            raise
        except zmq.ZMQError as exc:
            self._disconnect(backoff=True)
            raise TierUnavailable(f"cache server {self.address}: {exc}") from None

    @staticmethod
    def _recv(sock: zmq.Socket) -> P.ReplyEnvelope:
        raw = sock.recv(zmq.NOBLOCK)
        try:
            return P.REPLY_DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TierUnavailable(f"cache server sent an unreadable reply: {exc}") from None

    def _late(self, sock: zmq.Socket, rep: P.ReplyEnvelope) -> None:
        """A reply to a request this connection gave up on: send what gives its state back
        (unanswered themselves; their replies are dropped as late ones)."""
        for op, body in self._unanswered.give_back(rep):
            self._req_id += 1
            sock.send(P.encode_request(op, self._req_id, body), zmq.NOBLOCK)

    def _send_only(self, op: str, body: msgspec.Struct) -> bool:
        """Send a request that gets no reply (``wake``) when the session is up and no call is in
        flight; never waits.  False: not sent."""
        if not self.ready or not self._lock.acquire(timeout=0):
            return False
        try:
            if self._sock is None or self._hello is None:
                return False
            self._req_id += 1
            self._sock.send(P.encode_request(op, self._req_id, body), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False
        finally:
            self._lock.release()

    @staticmethod
    def _wait(sock: zmq.Socket, event: int, deadline: float) -> bool:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sock.poll(int(left * 1000) + 1, event):
                return True

    def _call(self, op: str, body: msgspec.Struct, timeout_s: float | None = None, backoff: bool = True):
        if self._closed:
            raise TierUnavailable("client is closed")
        self._check_fork()
        t_call = time.monotonic()
        deadline = t_call + (timeout_s if timeout_s is not None else self.timeout_s)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TierUnavailable(f"cache server client busy for {deadline - t_call:.3g} s")
        try:
            if self._pools.has_old:
                self._pools.unmap_unused()
            if time.monotonic() < self._down_until and not (op == "hello" and self._hello is not None):
                raise TierUnavailable(f"cache server {self.address} unavailable (retrying in "
                                      f"{self._down_until - time.monotonic():.1f} s)")
            if self._sock is None or self._hello is None:
                self._disconnect(backoff=False)
                try:
                    changed = self._connect(deadline)
                except Exception:
                    self._disconnect(backoff=True)
                    raise
                if op == "hello":
                    return self._hello
                self._raise_if_restarted(changed, op)
            if op == "hello":
                return self._hello
            try:
                rep = self._exchange(op, body, deadline, backoff)
            except _SessionLost:
                # the server forgot us (reaped, or restarted and our socket reconnected): say
                # hello again and retry once; whatever state the request names (a lease, a
                # reservation) is checked by the server, so a retry cannot use a stale one
                self._hello = None
                try:
                    changed = self._connect_hello(deadline)
                    if op == "hello":
                        return self._hello
                    self._raise_if_restarted(changed, op)
                    rep = self._exchange(op, body, deadline, backoff)
                except _SessionLost as exc:
                    self._disconnect(backoff=True)
                    raise TierUnavailable(f"cache server {self.address} keeps refusing this "
                                          f"client's session: {exc}") from None
                except (TierUnavailable, ServerError):
                    raise
                except Exception:
                    self._disconnect(backoff=True)
                    raise
            return rep
        finally:
            self._lock.release()

    def _raise_if_restarted(self, changed: bool, op: str) -> None:
        if changed:
            # the pool was re-mapped: whatever offsets or leases the caller holds belong to the
            # old server; fail this call so that the caller drops them (the next call runs)
            raise TierUnavailable(f"cache server {self.address} restarted (new instance "
                                  f"{self._instance}, pool generation {self._generation}); "
                                  f"{op} not sent")

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self._hello.heartbeat_s if self._hello else 1.0):
            if self._closed or os.getpid() != self._pid:
                return
            if self._sock is None or not self._lock.acquire(timeout=0):
                continue  # disconnected (the next call reconnects) or a call is in flight
            try:
                # short: calls on an engine step wait for this lock (a missed beat is harmless)
                deadline = time.monotonic() + min(self.timeout_s, HEARTBEAT_TIMEOUT_S)
                if self._sock is None:
                    pass  # (disconnected while this thread waited for the lock)
                elif self._hello is None:
                    self._reopen(deadline)
                else:
                    try:
                        self._exchange("heartbeat", P.Empty(), deadline)
                        self._down_until = 0.0  # answered: calls need not back off any longer
                    except _SessionLost:  # reaped, or a restarted server
                        self._hello = None
                        self._reopen(deadline)
            except Exception as exc:
                logger.debug("vllm-kvplugin: heartbeat failed: %s", exc)
            finally:
                self._lock.release()

    def _reopen(self, deadline: float) -> None:
        """Heartbeat thread, lock held: open again, on the same connection, the session of a
        server instance that dropped it (silent past its reap time: a stopped or starved
        process), so that the next call -- an engine step's, bounded by 50 ms -- need not say
        hello and prove the token itself.  A new instance is left to the next call: it re-maps
        the pool in the caller's thread and raises, so that the caller drops its offsets."""
        rep, nonce = self._say_hello(deadline)
        if rep.instance != self._instance:
            self._disconnect(backoff=False)  # (the next call connects afresh)
            return
        self._after_hello(rep, nonce, deadline)

    # ------------------------------------------------------------------ API
    def hello(self) -> dict[str, Any]:
        """Connect (if needed): check the protocol version, authenticate both ends, map the pool;
        the server's hello fields."""
        return msgspec.structs.asdict(self._call("hello", None))

    def _ensure(self, timeout_s: float | None = None) -> None:
        if self._hello is None or self._pools.mm is None or os.getpid() != self._pid:
            self._call("hello", None, timeout_s)

    def pool_view(self) -> memoryview:
        """The whole pool, read/write (hello first if needed).  Invalid after a server restart:
        check :attr:`pool_generation`."""
        self._ensure()
        return memoryview(self._pools.mm)

    def pool_tensor(self, timeout_s: float | None = None):
        """The pool as a 1-D ``torch.uint8`` tensor over the same memory (no copy; the same
        tensor until the server changes); needs torch.  Drop it and its views after a restart:
        the old pool is unmapped once nothing holds any of them."""
        self._ensure(timeout_s)
        return self._pools.tensor()

    @property
    def ready(self) -> bool:
        """Whether a call would go straight to the server: connected, with a session, in this
        process, not backing off (no I/O; another thread may be mid-call)."""
        return (not self._closed and self._sock is not None and self._hello is not None
                and os.getpid() == self._pid and time.monotonic() >= self._down_until)

    @property
    def instance(self) -> str | None:
        """The server instance this client is connected to (None before its first hello):
        offsets and leases of any other are void."""
        return self._instance

    @property
    def pool_generation(self) -> int:
        """Bumped whenever the client connects to a new server instance (offsets/leases reset)."""
        return self._generation

    @property
    def lease_s(self) -> float:
        """The connected server's lease time (0 when not connected); no I/O."""
        hello = self._hello
        return float(hello.lease_s) if hello is not None else 0.0

    @property
    def reserve_s(self) -> float:
        """How long the connected server keeps a reservation uncommitted (0 when not connected)."""
        hello = self._hello
        return float(hello.reserve_s) if hello is not None else 0.0

    @property
    def pool_size(self) -> int:
        self._ensure()
        return len(self._pools.mm)

    def close(self) -> None:
        self._closed = True
        self._hb_stop.set()
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._disconnect(backoff=False)
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None

    def __enter__(self) -> MPSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
