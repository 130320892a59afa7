"""Nobody but the intended engines may use the cache server, and a client trusts no impostor.

Real server processes, and for the impostor cases a fake server (a ZMQ socket in this
process answering the protocol) that points clients at a file of the user's: the client
must refuse it before mapping anything, the file must not change, and a client holding a
token must never send it (it proves it instead, after the server proved it first).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading

import msgspec
import pytest
import zmq
from srvutil import PY

from vllm_kvplugin.server import auth
from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.tiers.mp_client import MPClient, ServerError

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]

TOKEN = "correct-horse-battery-staple"


class FakeServer(threading.Thread):
    """Answers ``hello`` with a chosen pool path (and optionally a proof); records every byte."""

    def __init__(self, address: str, pool_path: str, pool_size: int, auth_required=False, proof=b""):
        super().__init__(daemon=True)
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(P.parse_address(address).zmq)
        self.rep = P.HelloRep("fake", P.PROTOCOL_VERSION, "feedface", pool_path, pool_size, HEADER_SIZE,
                              P.PAYLOAD_ALIGN, 1.0, 30.0, 60.0, P.MAX_MESSAGE_BYTES,
                              auth_required=auth_required, server_nonce=os.urandom(16), proof=proof)
        self.received: list[bytes] = []
        self.ops: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, msg = self.sock.recv_multipart()
            self.received.append(msg)
            env = P.ENVELOPE_DECODER.decode(msg)
            self.ops.append(env.op)
            if env.op == "hello":
                self.sock.send_multipart([ident, P.encode_reply(env.id, self.rep)])
            else:
                self.sock.send_multipart([ident, P.encode_reply(env.id, P.Empty())])

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.sock.close(0)
        self.ctx.term()


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def victim(short_tmp):
    """A private file of the user's: what an impostor would like engines to write into."""
    path = os.path.join(short_tmp, "id_ed25519")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(1 << 16))
    return path


@pytest.mark.parametrize("kind", ["plain-file", "pool-named-hard-link"])
def test_impostor_pointing_at_a_users_file_is_refused(short_tmp, victim, kind):
    target = victim
    if kind == "pool-named-hard-link":  # named like a pool, but the user's file under another name
        target = os.path.join(short_tmp, f"vllm-kvplugin-{os.getuid()}-1-abcdef.pool")
        os.link(victim, target)
    before = _digest(victim)
    fake = FakeServer(f"unix://{short_tmp}/fake.sock", target, 1 << 16)
    fake.start()
    try:
        with MPClient(f"unix://{short_tmp}/fake.sock", heartbeat=False) as c, pytest.raises(ServerError) as ei:
            c.reserve([(P.object_id(b"k" * 32, 0, 0, 1), HEADER_SIZE + 100)])
        assert ei.value.code == "auth"
        assert "reserve" not in fake.ops  # refused before anything but hello was sent
    finally:
        fake.close()
    assert _digest(victim) == before


def test_a_token_is_never_sent_and_an_unproven_server_is_refused(short_tmp, victim):
    for auth_required in (True, False):  # a bogus proof, or none at all
        fake = FakeServer("tcp://127.0.0.1:0", victim, 1 << 16, auth_required=auth_required, proof=os.urandom(32))
        port = fake.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        fake.start()
        try:
            with MPClient(f"tcp://127.0.0.1:{port}", token=TOKEN, heartbeat=False) as c, \
                    pytest.raises(ServerError) as ei:
                c.stats()
            assert ei.value.code == "auth" and "did not prove" in str(ei.value)
        finally:
            fake.close()
        assert fake.ops == ["hello"]  # no auth, no stats: nothing after hello
        assert not any(TOKEN.encode() in m for m in fake.received)


def test_a_socket_in_a_directory_others_can_write_is_not_trusted(short_tmp, victim):
    shared = os.path.join(short_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # like a /tmp/... another user could have pre-created
    fake = FakeServer(f"unix://{shared}/s.sock", victim, 1 << 16)
    fake.start()
    try:
        with MPClient(f"unix://{shared}/s.sock", heartbeat=False) as c, pytest.raises(ServerError) as ei:
            c.stats()
        assert ei.value.code == "auth" and "cannot be trusted" in str(ei.value)
    finally:
        fake.close()
    assert fake.received == []  # refused before connecting


def test_a_client_that_does_not_prove_the_token_gets_nothing(server_factory, short_tmp):
    """Raw protocol: hello, then requests without auth, then a wrong proof: all refused."""
    token = os.path.join(short_tmp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(TOKEN)
    s = server_factory("--l1-bytes", "16MiB", "--token-file", token, listen="tcp://127.0.0.1:0")
    ctx = zmq.Context(1)
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(P.parse_address(s.address).zmq)

    def ask(op, body, rid):
        d.send(P.encode_request(op, rid, body))
        assert d.poll(5000)
        return P.REPLY_DECODER.decode(d.recv())

    try:
        nonce = auth.new_nonce()
        hello = ask("hello", P.HelloReq(nonce, "raw"), 1)
        rep = msgspec.msgpack.decode(hello.body, type=P.HelloRep)
        assert rep.auth_required and auth.check_proof(rep.proof, auth.server_proof(TOKEN, nonce, rep.server_nonce))
        for rid, op, body in ((2, "stats", P.Empty()), (3, "lookup", P.LookupReq(b"k" * 32, [(0, 0)], 1, 1))):
            r = ask(op, body, rid)
            assert not r.ok and r.code == "auth", (op, r)
        r = ask("auth", P.AuthReq(auth.client_proof("wrong-token-of-16-chars", nonce, rep.server_nonce)), 4)
        assert not r.ok and r.code == "auth"
        r = ask("stats", P.Empty(), 5)
        assert not r.ok and r.code == "hello_required"  # the session was dropped
    finally:
        d.close(0)
        ctx.term()
    with MPClient(s.address, token=TOKEN) as c:
        assert c.stats()["clients_refused"] == 1


def test_hellos_without_the_token_cannot_grow_the_servers_state(server_factory, short_tmp):
    """Sessions that said hello but never proved the token are capped: past the cap the oldest
    is dropped (before, each stayed until reaped), and a client with the token is served."""
    from vllm_kvplugin.server.app import MAX_UNPROVEN_SESSIONS

    token = os.path.join(short_tmp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(TOKEN)
    s = server_factory("--l1-bytes", "16MiB", "--token-file", token, listen="tcp://127.0.0.1:0")
    ctx = zmq.Context(1)
    n = MAX_UNPROVEN_SESSIONS + 40
    try:
        for i in range(n):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(P.parse_address(s.address).zmq)
            d.send(P.encode_request("hello", 1, P.HelloReq(auth.new_nonce(), f"flood-{i}")))
            assert d.poll(5000) and P.REPLY_DECODER.decode(d.recv()).ok
            d.close(0)
    finally:
        ctx.term()
    with MPClient(s.address, token=TOKEN) as c:  # its own hello was one more unproven one, briefly
        st = c.stats()
        assert st["clients_unproven"] == n + 1 - MAX_UNPROVEN_SESSIONS
        assert st["clients"] == MAX_UNPROVEN_SESSIONS  # the rest unproven, and this client


_OTHER_USER_HELLO = r"""
import os, sys, zmq
from vllm_kvplugin.server import auth, protocol as P
os.setgid(65534); os.setuid(65534)
d = zmq.Context(1).socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
d.connect(sys.argv[1])
d.send(P.encode_request("hello", 1, P.HelloReq(auth.new_nonce(), "other-user")))
assert d.poll(5000), "no answer"
r = P.REPLY_DECODER.decode(d.recv())
print(r.ok, r.code, r.error)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_a_process_of_another_user_is_refused_even_through_open_modes(server_factory, short_tmp):
    """SO_PEERCRED: with the socket's modes opened up (a careless admin), another uid reaches the
    socket but the server refuses its hello; the owner's clients go on."""
    s = server_factory("--l1-bytes", "16MiB")
    path = P.parse_address(s.address).path
    os.chmod(os.path.dirname(path), 0o711)
    os.chmod(path, 0o666)
    r = subprocess.run([PY, "-c", _OTHER_USER_HELLO, P.parse_address(s.address).zmq],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("False auth") and f"uid {os.getuid()} only" in r.stdout, r.stdout
    os.chmod(os.path.dirname(path), 0o700)
    with MPClient(s.address) as c:
        assert c.stats()["clients_refused"] == 1


_OTHER_USER_REUSES = r"""
import os, sys, zmq
from vllm_kvplugin.server import protocol as P
os.setgid(65534); os.setuid(65534)
d = zmq.Context(1).socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
d.setsockopt(zmq.ROUTING_ID, bytes.fromhex(sys.argv[2]))
d.connect(sys.argv[1])
d.send(P.encode_request("stats", 1, P.Empty()))
assert d.poll(5000), "no answer"
r = P.REPLY_DECODER.decode(d.recv())
print(r.ok, r.code, r.error)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user")
def test_another_user_reusing_an_engines_routing_id_is_refused(server_factory, short_tmp):
    """A session outlives its connection until it is reaped: a process of another uid that
    connects with the routing id of an engine's session (modes opened up) is refused too, not
    served as that engine (the peer check ran only for routing ids without a session)."""
    s = server_factory("--l1-bytes", "16MiB")
    zaddr = P.parse_address(s.address).zmq
    path = P.parse_address(s.address).path
    rid = os.urandom(12)
    ctx = zmq.Context(1)
    engine = ctx.socket(zmq.DEALER)
    engine.setsockopt(zmq.LINGER, 0)
    engine.setsockopt(zmq.ROUTING_ID, rid)
    engine.connect(zaddr)
    engine.send(P.encode_request("hello", 1, P.HelloReq(auth.new_nonce(), "engine")))
    assert engine.poll(5000) and P.REPLY_DECODER.decode(engine.recv()).ok
    engine.close(0)
    os.chmod(os.path.dirname(path), 0o711)
    os.chmod(path, 0o666)
    try:
        r = subprocess.run([PY, "-c", _OTHER_USER_REUSES, zaddr, rid.hex()], capture_output=True, text=True,
                           timeout=60)
    finally:
        os.chmod(os.path.dirname(path), 0o700)
        ctx.term()
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("False auth") and f"uid {os.getuid()} only" in r.stdout, r.stdout
    with MPClient(s.address) as c:
        assert c.stats()["clients_refused"] == 1


def test_l2_directory_with_foreign_files_is_refused_and_untouched(short_tmp):
    l2 = os.path.join(short_tmp, "data")
    os.mkdir(l2)
    mine = {"notes.tmp": b"draft", "old.kvc": b"not a chunk", "sub/keep.tmp": b"x"}
    for name, data in mine.items():
        os.makedirs(os.path.dirname(os.path.join(l2, name)), exist_ok=True)
        with open(os.path.join(l2, name), "wb") as f:
            f.write(data)
    os.chmod(l2, 0o755)
    r = subprocess.run([PY, "-m", "vllm_kvplugin.server", "--listen", f"unix://{short_tmp}/s.sock",
                        "--l1-bytes", "16MiB", "--l2-dir", l2], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not the cache server's" in r.stderr, r.stderr[-2000:]
    for name, data in mine.items():
        with open(os.path.join(l2, name), "rb") as f:
            assert f.read() == data
    assert oct(os.stat(l2).st_mode & 0o777) == "0o755"


def test_a_new_l2_directory_is_marked_and_reused(server_factory, short_tmp):
    l2 = os.path.join(short_tmp, "l2")
    s = server_factory("--l1-bytes", "16MiB", "--l2-dir", l2)
    s.stop()
    assert os.path.isfile(os.path.join(l2, ".vllm-kvplugin-l2"))
    server_factory("--l1-bytes", "16MiB", "--l2-dir", l2)  # its own directory: accepted


def test_a_pool_larger_than_shared_memory_fails_at_start(short_tmp):
    """A clear start-up error, never a SIGBUS in an engine later; no pool file of it is left
    (its own: other tests' servers may come and go in /dev/shm meanwhile)."""
    fs = os.statvfs("/dev/shm")
    # more than the whole file system: never fits, whatever other tests' servers free meanwhile
    too_big = fs.f_blocks * fs.f_frsize + (1 << 30)
    proc = subprocess.Popen([PY, "-m", "vllm_kvplugin.server", "--listen", f"unix://{short_tmp}/s.sock",
                             "--l1-bytes", str(too_big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # (a server that started after all must not outlive the test)
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "--l1-bytes" in err and "bytes free" in err, err[-2000:]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"vllm-kvplugin-{os.getuid()}-{proc.pid}-")]


def test_the_sweep_keeps_a_live_pool_whatever_its_pid(server_factory, short_tmp):
    """A pool whose server lives in another PID namespace (here: a pid that does not exist in
    ours) is kept as long as its server holds it; only an unheld one is swept."""
    from vllm_kvplugin.server.pool import sweep_stale_pools

    s = server_factory("--l1-bytes", "16MiB")
    with MPClient(s.address) as c:
        live = c.hello()["pool_path"]
    foreign = os.path.join(os.path.dirname(live), f"vllm-kvplugin-{os.getuid()}-999999999-0123456789ab.pool")
    os.link(live, foreign)  # the live pool seen under a pid of no process here
    try:
        sweep_stale_pools(os.path.dirname(live))
        assert os.path.exists(live) and os.path.exists(foreign)
        s.stop()  # its server is gone: nothing holds it now
        sweep_stale_pools(os.path.dirname(live))
        assert not os.path.exists(foreign)
    finally:
        if os.path.exists(foreign):
            os.unlink(foreign)


def test_a_fifo_of_a_pools_name_neither_hangs_the_sweep_nor_goes(server_factory, short_tmp):
    """Anyone may create files in /dev/shm: a FIFO named like one of this user's pools (here in a
    private stand-in directory) must not block the start-up's sweep (opening it for reading
    waited for a writer forever) and is not removed; a stale pool file beside it is."""
    from vllm_kvplugin.server.pool import sweep_stale_pools

    shm = os.path.join(short_tmp, "shm")
    os.mkdir(shm, 0o700)
    fifo = os.path.join(shm, f"vllm-kvplugin-{os.getuid()}-1-00.pool")
    os.mkfifo(fifo, 0o666)
    stale = os.path.join(shm, f"vllm-kvplugin-{os.getuid()}-2-00.pool")
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    t = threading.Thread(target=lambda: sweep_stale_pools(shm), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the sweep blocked on the FIFO"
    assert os.path.exists(fifo) and not os.path.exists(stale)
    srv = server_factory("--l1-bytes", "8MiB", "--shm-dir", shm)  # its start-up sweeps the same directory
    with MPClient(srv.address) as c:
        assert os.path.dirname(c.hello()["pool_path"]) == shm
    assert os.path.exists(fifo)


def test_token_files_must_be_private(short_tmp):
    path = os.path.join(short_tmp, "t")
    with open(path, "w") as f:
        f.write(TOKEN)
    os.chmod(path, 0o640)
    with pytest.raises(auth.AuthError, match="nobody else"):
        auth.read_token(path, "server_token_file")
    os.chmod(path, 0o600)
    assert auth.read_token(path, "server_token_file") == TOKEN


# ------------------------------------------------------------------ sharing with a group
GROUP, MEMBER, OUTSIDER = 54320, 54321, 54322


def _as_user(uid: int, groups: list[int], fn) -> str:
    """``fn()`` in a forked child that became another user (the test runs as root); what it
    returned, or ``ERROR <exception>``.  (A fork, not an exec: the venv's interpreter may sit
    in a directory other users cannot read.)"""
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(groups[0])
            os.setuid(uid)
            out = str(fn())
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            out = f"ERROR {type(exc).__name__}: {exc}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the client as another user hung")
        time.sleep(0.05)
    with os.fdopen(r) as f:
        return f.read()


def _serve_me(address: str, seed: int = 5):
    def run() -> str:
        from srvutil import keys_for, load_and_check, oids_for, store

        with MPClient(address, server_uid=0, timeout_s=3) as c:
            keys = keys_for(seed, 3)
            assert all(store(c, oids_for(keys, 1, 1, 1), 4096))
            load_and_check(c, keys, 1, 1, 1, 4096)
        return "SERVED"
    return run


def _open(path: str):
    def run() -> str:
        with open(path, "rb"):
            return "OPENED"
    return run


@pytest.mark.skipif(os.geteuid() != 0, reason="running clients as other users needs root")
def test_allow_gid_serves_the_group_and_nobody_else(server_factory):
    """``--allow-gid G``: a process of another user in G stores and loads (its client checks
    the server's uid on the directory and the pool); one outside G is refused (it cannot reach
    the socket, nor open the pool); a server without the flag refuses the member even where
    the file modes let it reach the socket (SO_PEERCRED)."""
    import stat
    import tempfile

    base = tempfile.mkdtemp(prefix="kvs-grp-", dir="/tmp")
    os.chmod(base, 0o755)
    s = server_factory("--l1-bytes", "64MiB", "--allow-gid", str(GROUP), listen=f"unix://{base}/sock/s.sock")
    pool = s.banner.split("(pool ", 1)[1].split(",", 1)[0]
    st = os.stat(pool)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP
    sock_dir = os.stat(os.path.join(base, "sock"))
    assert stat.S_IMODE(sock_dir.st_mode) == 0o710 and sock_dir.st_gid == GROUP
    assert _serve_me(s.address, seed=1)() == "SERVED"  # as root first: every module imported before the fork
    assert _as_user(MEMBER, [GROUP], _serve_me(s.address)) == "SERVED"
    assert _as_user(OUTSIDER, [OUTSIDER], _serve_me(s.address)).startswith("ERROR")
    assert "PermissionError" in _as_user(OUTSIDER, [OUTSIDER], _open(pool))
    s2 = server_factory("--l1-bytes", "64MiB", listen=f"unix://{base}/own/s.sock")
    os.chmod(os.path.join(base, "own"), 0o711)
    os.chmod(s2.address.split("://", 1)[1], 0o666)
    got = _as_user(MEMBER, [GROUP], _serve_me(s2.address))
    assert got.startswith("ERROR") and "uid 0 only" in got, got
    with MPClient(s2.address) as c:
        assert c.stats()["clients_refused"] >= 1
