"""The server process: socket set-up, the ZMQ loop, request validation and dispatch."""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import stat
import sys
import time
from collections import OrderedDict

import msgspec
import zmq

from vllm_kvplugin.server import auth
from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.config import ServerConfig, ServerConfigError, config_from_args
from vllm_kvplugin.server.leases import PendingLookup, RequestError, parse_needs
from vllm_kvplugin.server.pool import SharedPool
from vllm_kvplugin.server.protocol import default_socket_dir
from vllm_kvplugin.server.store import Store

logger = logging.getLogger("vllm_kvplugin.server")

try:
    from vllm_kvplugin import __version__ as _VERSION
except Exception:  # pragma: no cover
    _VERSION = "0.0.0+unknown"

TICK_S = 0.05
MAX_BATCH = 256


def _prepare_unix_path(path: str, group: int | None = None) -> None:
    """Private parent directory (created 0700 when it is the default one; 0710 and given to
    ``group`` with ``--allow-gid``), no live server on ``path``.

    Clients trust a socket only in a directory of the server's user that nobody else can
    write (``server/auth.py``): a socket elsewhere is refused here already."""
    parent = os.path.dirname(path)
    mode = 0o700 if group is None else 0o710
    if parent == default_socket_dir() or not os.path.exists(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        st = os.lstat(parent)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ServerConfigError(f"--listen {path!r}: {parent} is not a directory owned by this user")
        if group is not None and st.st_gid != group:
            os.chown(parent, -1, group)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(parent, mode)
    if group is not None:
        _check_reachable(path, group)
    try:
        auth.check_socket_dir(path)
    except auth.AuthError as exc:
        raise ServerConfigError(f"--listen {path!r}: {exc}") from None
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise ServerConfigError(f"--listen {path!r}: exists and is not a socket")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(path)
        except OSError:
            os.unlink(path)  # stale: its server is gone
        else:
            raise ServerConfigError(f"--listen {path!r}: another server is listening there")
        finally:
            s.close()


def _check_reachable(path: str, group: int) -> None:
    """With ``--allow-gid``: the group's members must be able to reach the socket (every
    directory above it searchable by them)."""
    d = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(d)
        m = stat.S_IMODE(st.st_mode)
        if not (m & 0o001 or (m & 0o010 and st.st_gid == group)):
            raise ServerConfigError(f"--allow-gid {group}: members of the group cannot reach the socket: {d} "
                                    f"(mode {oct(m)}, gid {st.st_gid}) is not searchable by them; listen in "
                                    "a directory they can reach")
        if d == "/":
            return
        d = os.path.dirname(d)


#: sessions that said hello but have not proven the token yet (TCP): past this many the oldest
#: is dropped, so that hellos without the token cannot grow the server's state until reaped
MAX_UNPROVEN_SESSIONS = 256


class Server:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self._unproven: OrderedDict[bytes, None] = OrderedDict()  # routing ids, oldest first
        self.instance = os.urandom(8).hex()
        self.ctx = zmq.Context(1)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.HARD_MESSAGE_BYTES)
        self.router.setsockopt(zmq.SNDHWM, 10000)
        self.router.setsockopt(zmq.RCVHWM, 10000)
        self.pool = SharedPool(cfg.shm_dir, cfg.l1_bytes, cfg.prefault, cfg.allow_gid)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            self.store = Store(cfg, self.pool.view, self._wake_w, self.instance)
            self.address = self._bind()
        except BaseException:
            self.router.close(0)
            self.pool.close()
            raise
        self.running = True
        self.hello_rep = P.HelloRep(
            server_version=_VERSION, protocol=P.PROTOCOL_VERSION, instance=self.instance,
            pool_path=self.pool.path, pool_size=self.pool.size, header_size=HEADER_SIZE,
            payload_align=P.PAYLOAD_ALIGN, heartbeat_s=cfg.heartbeat_s, lease_s=cfg.lease_s,
            reserve_s=cfg.reserve_s, max_message_bytes=P.MAX_MESSAGE_BYTES,
            prefaulted=cfg.prefault)

    def _bind(self) -> P.Address:
        a = self.cfg.listen
        if a.kind == "unix":
            group = self.cfg.allow_gid
            _prepare_unix_path(a.path, group)
            old = os.umask(0o177)
            try:
                self.router.bind(a.zmq)
            finally:
                os.umask(old)
            if group is not None:
                os.chown(a.path, -1, group)
            os.chmod(a.path, 0o600 if group is None else 0o660)
            return a
        if ":" in a.host:
            self.router.setsockopt(zmq.IPV6, 1)
        self.router.bind(a.zmq)
        ep = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        return P.parse_address(ep.replace("tcp://0.0.0.0", f"tcp://{a.host}"))

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        # what exists now (an L2 index of possibly millions of objects) never needs collecting
        gc.collect()
        gc.freeze()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = 0.0
        while self.running:
            now = time.monotonic()
            timeout = max(0.0, min(next_tick, self._next_pending_deadline()) - now)
            try:
                events = dict(poller.poll(timeout * 1000))
            except zmq.ZMQError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            now = time.monotonic()
            self.store.now = now
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            self.store.process_l2()
            self.store.process_remote()
            if self.router in events:
                for _ in range(MAX_BATCH):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames, now)
            if now >= next_tick:
                self.store.tick(now)
                next_tick = now + TICK_S
            for p, rep in self.store.poll_pending(now):
                self._send(p.reply_frames, P.encode_reply(p.req_id, rep))
        return 0

    def _next_pending_deadline(self) -> float:
        return min((p.deadline for p in self.store.pending), default=float("inf"))

    def _send(self, head: list, payload: bytes) -> None:
        try:
            self.router.send_multipart([*head, payload], zmq.NOBLOCK)
        except zmq.ZMQError:  # peer gone or not reading: nobody to tell
            self.store.stats["replies_dropped"] += 1

    def _error(self, head: list, req_id: int, code: str, message: str) -> None:
        self.store.stats[f"errors_{code}"] += 1
        self._send(head, P.encode_reply(req_id, code=code, error=message))

    def _peer_allowed(self, frame: zmq.Frame) -> bool:
        """A Unix peer must run as this server's user, or be in the ``--allow-gid`` group
        (``SO_PEERCRED`` of the connection; supplementary groups from ``/proc``)."""
        if self.address.kind != "unix":
            return True  # TCP: the token decides
        try:
            pid, uid, gid = auth.peer_creds(frame.get(zmq.SRCFD))
        except (OSError, zmq.ZMQError):
            return False
        if uid == os.getuid():
            return True
        g = self.cfg.allow_gid
        return g is not None and (gid == g or g in auth.process_groups(pid))

    def _handle(self, zframes: list[zmq.Frame], now: float) -> None:
        ident = zframes[0].bytes
        # every message, not only a new routing id's: a session outlives its connection (until
        # reaped), and a peer of another uid presenting a known routing id must not inherit it
        if not self._peer_allowed(zframes[-1]):
            self.store.stats["clients_refused"] += 1
            who = f"uid {os.getuid()}" + ("" if self.cfg.allow_gid is None else f" and group {self.cfg.allow_gid}")
            self._error([ident], 0, P.E_AUTH, f"this server serves processes of {who} only")
            return
        if len(zframes) == 2:
            head, body = [ident], zframes[1]
        elif len(zframes) == 3 and len(zframes[1]) == 0:  # a REQ client
            head, body = [ident, b""], zframes[2]
        else:
            self._error([ident], 0, P.E_MALFORMED, f"expected one message frame, got {len(zframes) - 1}")
            return
        if len(body) > P.MAX_MESSAGE_BYTES:  # refused before its bytes are copied out of the frame
            self._error(head, 0, P.E_TOO_LARGE,
                        f"message of {len(body)} bytes exceeds the limit of {P.MAX_MESSAGE_BYTES}")
            return
        msg = body.bytes
        try:
            env = P.ENVELOPE_DECODER.decode(msg)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._error(head, 0, P.E_MALFORMED, f"not a request envelope: {exc}")
            return
        if env.v != P.PROTOCOL_VERSION:
            self._error(head, env.id, P.E_VERSION,
                        f"protocol version {env.v} is not supported; this server speaks "
                        f"{P.PROTOCOL_VERSION} (vllm-kvplugin {_VERSION})")
            return
        types = P.OPS.get(env.op)
        if types is None:
            self._error(head, env.id, P.E_UNKNOWN_OP, f"unknown op {env.op!r}; known: {sorted(P.OPS)}")
            return
        try:
            body = P.REQ_DECODERS[env.op].decode(env.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._error(head, env.id, P.E_INVALID, f"{env.op}: {exc}")
            return
        self.store.stats[f"op_{env.op}"] += 1
        try:
            rep = self._dispatch(env.op, body, ident, env.id, head, now)
        except RequestError as exc:
            self._error(head, env.id, exc.code, str(exc))
            return
        except Exception as exc:  # never let one request take the server down
            logger.exception("internal error in %s", env.op)
            self._error(head, env.id, P.E_INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        if rep is not None:
            self._send(head, P.encode_reply(env.id, rep))

    def _dispatch(self, op: str, body, ident: bytes, req_id: int, head: list, now: float):
        st = self.store
        if op == "hello":
            s = st.hello(ident, body.client_name, body.pid, now)
            s.client_nonce, s.server_nonce = body.nonce, auth.new_nonce()
            s.authed = self.cfg.token is None
            if self.cfg.token is None:
                return self.hello_rep
            self._unproven[ident] = None
            self._unproven.move_to_end(ident)
            while len(self._unproven) > MAX_UNPROVEN_SESSIONS:
                old = st.sessions.get(self._unproven.popitem(last=False)[0])
                if old is not None and not old.authed:
                    st.reap(old, "unproven")
            return msgspec.structs.replace(self.hello_rep, auth_required=True, server_nonce=s.server_nonce,
                                           proof=auth.server_proof(self.cfg.token, body.nonce, s.server_nonce))
        s = st.sessions.get(ident)
        if s is None:
            raise RequestError(P.E_HELLO, "say hello first (new connection, or this client was reaped)")
        s.last_seen = now
        if op == "auth":
            if self.cfg.token is None or not auth.check_proof(
                    body.proof, auth.client_proof(self.cfg.token, s.client_nonce, s.server_nonce)):
                st.reap(s, "refused")
                raise RequestError(P.E_AUTH, "wrong proof of the token")
            s.authed = True
            self._unproven.pop(ident, None)
            return P.Empty()
        if not s.authed:
            raise RequestError(P.E_AUTH, "this server needs the token: auth first")
        if op == "heartbeat":
            return P.Empty()
        if op == "wake":  # only woken: a call follows (MPClient.wake)
            return None
        if op == "lookup":
            r = st.lookup(s, body.keys, parse_needs(body.needs), body.ranks, body.world, body.first,
                          body.wait_ms / 1000.0, ident, req_id, head, now, body.fingerprint, body.resolve_rank)
            return None if isinstance(r, PendingLookup) else r
        if op == "resolve":
            offsets, sizes = st.resolve(body.lease, body.keys, body.group, body.rank, body.world, now)
            return P.ResolveRep(offsets, sizes)
        if op == "release":
            return st.release(body.lease)
        if op == "reserve":
            r = P.ReserveRep(*st.reserve(s, body.ids, body.sizes, now))
            st.evict_to_watermark()
            return r
        if op == "commit":
            return P.CommitRep(st.commit(s, body.ids, body.epochs))
        if op == "abort":
            return P.AbortRep(st.abort(s, body.ids))
        if op == "drop":
            return P.DropRep(st.drop_reported(body.ids))
        if op == "stats":
            d = st.snapshot()
            d["instance"] = self.instance
            d["pool_path"] = self.pool.path
            return P.StatsRep(d)
        raise RequestError(P.E_UNKNOWN_OP, op)  # pragma: no cover

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        try:
            self.router.close(0)
        except Exception:
            pass
        if self.store.workers is not None:
            self.store.workers.stop(timeout=10.0)  # let queued L2 writes finish
        if self.store.remote is not None:
            self.store.remote.stop(timeout=5.0)
        self.pool.close()
        if self.address.kind == "unix":
            try:
                os.unlink(self.address.path)
            except OSError:
                pass
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    """``vllm-kvplugin server`` / ``python -m vllm_kvplugin.server``; returns the exit status."""
    try:
        cfg = config_from_args(argv)
    except ServerConfigError as exc:
        print(f"vllm-kvplugin server: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, cfg.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        server = Server(cfg)
    except (ServerConfigError, OSError, zmq.ZMQError) as exc:
        print(f"vllm-kvplugin server: error: {exc}", file=sys.stderr)
        return 1

    def _stop(signum, _frame):
        server.running = False

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    l2 = f"L2 {cfg.l2_dir} ({cfg.l2_bytes} bytes)" if cfg.l2_dir else "no L2"
    print(f"vllm-kvplugin server listening on {server.address} "
          f"(pool {server.pool.path}, {server.pool.size} bytes; {l2}; pid {os.getpid()})", flush=True)
    try:
        return server.run()
    finally:
        server.close()
