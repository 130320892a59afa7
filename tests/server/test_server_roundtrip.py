"""Real server processes, real sockets and shared memory: store, lookup, resolve, read back."""

from __future__ import annotations

import os
import stat
import subprocess
import textwrap

import pytest
import zmq
from srvutil import (
    PY,
    keys_for,
    load_and_check,
    make_object,
    oids_for,
    payload_for,
    store,
    wait_for,
)

from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, pack_header, payload_checksum
from vllm_kvplugin.server.protocol import object_id
from vllm_kvplugin.tiers.mp_client import MPClient, ServerError

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]

NB = 256  # payload bytes per object (the layout does not matter to the server)


def test_prefix_lengths_byte_identical(server):
    """1..1,100 chunks incl. 127/128/129, 2 groups x 2 ranks: hit == stored prefix, never more."""
    g, r, w = 2, 2, 2
    with MPClient(server.address, client_name="t") as c:
        for seed, n in enumerate([1, 2, 127, 128, 129, 1000, 1100]):
            keys = keys_for(1000 + seed, n)
            assert all(store(c, oids_for(keys, g, r, w), NB))
            assert load_and_check(c, keys, g, r, w, NB)[0] == n
            # a longer prompt: exactly the stored prefix hits, not one chunk more
            longer = keys + keys_for(5000 + seed, 3)
            assert load_and_check(c, longer, g, r, w, NB)[0] == n
            # a shorter request (the client's `end`): never more than the keys sent
            for k in {0, 1, n // 2, n - 1}:
                hits, lease = c.lookup(keys[:k], g, r, w)
                assert hits == k
                c.release(lease)
            # fewer ranks than stored is fine; a wider world is another object set: miss
            assert c.lookup(keys, g, 1, w)[0] == n
            assert c.lookup(keys, g, r, w + 1)[0] == 0
            assert c.lookup(keys, g + 1, r, w)[0] == 0
        st = c.stats()
        assert st["leases"] <= 40  # only the un-released ones from the loop above
        assert st["resolved_bytes"] > 0


def test_partial_chunk_position_is_a_miss(server):
    """A chunk counts only when every (group, rank) object is committed; the hit stops before it."""
    g, r, w, n = 2, 4, 4, 300
    keys = keys_for(7, n)
    with MPClient(server.address) as c:
        oids = oids_for(keys, g, r, w)
        hole = object_id(keys[129], 1, 3, w)  # one object of chunk 129 missing
        reserved = object_id(keys[200], 0, 2, w)  # one object of chunk 200 reserved, not committed
        assert all(store(c, [o for o in oids if o not in (hole, reserved)], NB))
        off = c.reserve([(reserved, HEADER_SIZE + NB)])[0]
        assert off is not None
        assert load_and_check(c, keys, g, r, w, NB)[0] == 129
        assert c.lookup(keys[130:], g, r, w)[0] == 70
        # resolve never hands out what the lease does not pin
        hits, lease = c.lookup(keys, g, r, w)
        with pytest.raises(ServerError) as ei:
            c.resolve(lease, keys[:hits + 1], 0, 0, w)
        assert ei.value.code == "not_leased"
        with pytest.raises(ServerError):
            c.resolve(lease, keys[:1], 0, 0, w + 1)
        assert len(c.resolve(lease, keys[:hits], 1, 3, w)) == hits
        # any sub-run or any order of the pinned keys resolves to the same objects
        full = dict(zip(keys[:hits], c.resolve(lease, keys[:hits], 1, 2, w)))
        for sub in (keys[40:90], keys[128:129], [keys[5], keys[2], keys[5], keys[128]]):
            assert c.resolve(lease, sub, 1, 2, w) == [full[k] for k in sub]
        rep = c.release(lease)
        assert rep.found and rep.resolved_bytes < rep.pinned_bytes  # partially served: visible
        assert not c.release(lease).found
        with pytest.raises(ServerError) as ei:
            c.resolve(lease, keys[:1], 0, 0, w)
        assert ei.value.code == "unknown_lease"
        # completing the chunk makes the whole prefix visible
        assert all(store(c, [hole], NB))
        assert c.lookup(keys, g, r, w)[0] == 200
        assert c.abort([reserved]) == 1


def test_reserve_commit_rules(server):
    key = keys_for(9, 1)[0]
    oid = object_id(key, 0, 0, 1)
    with MPClient(server.address) as a, MPClient(server.address) as b:
        off = a.reserve([(oid, HEADER_SIZE + NB)])[0]
        assert off is not None and (off + HEADER_SIZE) % 256 == 0  # payload aligned
        assert a.reserve([(oid, HEADER_SIZE + NB)]) == [None]  # reserved already
        assert b.reserve([(oid, HEADER_SIZE + NB)]) == [None]
        assert b.commit([oid], [off]) == [False]  # not b's reservation
        # a header that names another object is refused at commit
        pl = payload_for(oid, NB)
        wrong = pack_header(key=key, group=0, rank=0, world=2, payload_nbytes=NB,
                            checksum=payload_checksum(pl))
        a.write_object(off, wrong, pl)
        assert a.commit([oid], [off]) == [False]
        assert a.lookup([key])[0] == 0
        assert a.stats()["commit_bad_header"] == 1
        # written right, it commits once; the second commit and a late abort do nothing
        off = a.reserve([(oid, HEADER_SIZE + NB)])[0]
        a.write_object(off, *make_object(oid, NB))
        assert a.commit([oid], [off]) == [True]
        assert a.commit([oid], [off]) == [False] and a.abort([oid]) == 0
        assert a.reserve([(oid, HEADER_SIZE + NB)]) == [None]  # exists
        assert load_and_check(b, [key], 1, 1, 1, NB)[0] == 1
        with pytest.raises(ServerError) as ei:  # bad object (rank >= world) is a request error
            a.reserve([(key + b"\0\0\3\0\2\0", 200)])
        assert ei.value.code == "invalid"


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from srvutil import keys_for, oids_for, store
    from vllm_kvplugin.tiers.mp_client import MPClient
    c = MPClient({addr!r}, client_name="writer")
    keys = keys_for(42, {n})
    assert all(store(c, oids_for(keys, 1, 2, 2), {nb}))
    c.close()
    print("stored", len(keys))
""")
READER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from srvutil import keys_for, load_and_check
    from vllm_kvplugin.tiers.mp_client import MPClient
    c = MPClient({addr!r}, client_name="reader")
    keys = keys_for(42, {n})
    hits, _ = load_and_check(c, keys, 1, 2, 2, {nb})
    print("hits", hits)
""")


def test_two_client_processes(server):
    """One process stores, another (a different engine) looks up and reads the same bytes."""
    here = os.path.dirname(__file__)
    fmt = dict(here=here, addr=server.address, n=129, nb=4096)
    w = subprocess.run([PY, "-c", WRITER.format(**fmt)], capture_output=True, text=True, timeout=120)
    assert w.returncode == 0, w.stderr
    r = subprocess.run([PY, "-c", READER.format(**fmt)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["hits", "129"]


def test_default_start_private_dirs(server_factory, short_tmp):
    """No flags: a Unix socket in a private 0700 directory; socket and pool 0600."""
    env = dict(os.environ, XDG_RUNTIME_DIR=short_tmp)
    s = server_factory(listen="", env=env)
    assert s.address == f"unix://{short_tmp}/vllm-kvplugin/server.sock"
    d = os.path.join(short_tmp, "vllm-kvplugin")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    sock = os.path.join(d, "server.sock")
    assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    with MPClient(s.address) as c:
        pool = c.hello()["pool_path"]
        assert pool.startswith("/dev/shm/") and stat.S_IMODE(os.stat(pool).st_mode) == 0o600
        assert c.hello()["pool_size"] == 4 << 30
    # a second server on the same address refuses to steal it
    again = subprocess.run([PY, "-m", "vllm_kvplugin.server"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode != 0 and "another server" in again.stderr
    assert s.stop() == 0
    assert not os.path.exists(sock) and not os.path.exists(pool)


def test_tcp_needs_a_token_and_both_ends_prove_it(server_factory, short_tmp):
    r = subprocess.run([PY, "-m", "vllm_kvplugin.server", "--listen", "tcp://127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "VLLM_KVPLUGIN_TOKEN"})
    assert r.returncode == 2 and "--token-file" in r.stderr and "--listen" in r.stderr
    token = os.path.join(short_tmp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("correct-horse-battery-staple")
    t = server_factory("--l1-bytes", "16MiB", "--token-file", token, listen="tcp://0.0.0.0:0")
    port = t.address.rsplit(":", 1)[1]
    addr = f"tcp://127.0.0.1:{port}"
    for wrong in (None, "wrong-token-of-16-chars"):
        with MPClient(addr, token=wrong) as c, pytest.raises(ServerError) as ei:
            c.stats()
        assert ei.value.code == "auth"
    with MPClient(addr, token="correct-horse-battery-staple") as c:
        assert c.lookup(keys_for(1, 3))[0] == 0
        assert c.stats()["lookups"] == 1
    # the token read from the environment, as the connector does without server_token_file
    env_token = subprocess.run([PY, "-c", "from vllm_kvplugin.server.auth import read_token; print(read_token(None, 'x'))"],
                               capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, VLLM_KVPLUGIN_TOKEN="correct-horse-battery-staple"))
    assert env_token.stdout.strip() == "correct-horse-battery-staple"


def test_pool_tensor_is_the_pool(server):
    torch = pytest.importorskip("torch")
    with MPClient(server.address) as c:
        t = c.pool_tensor()
        assert t.dtype == torch.uint8 and t.numel() == c.pool_size
        key = keys_for(3, 1)[0]
        oid = object_id(key, 0, 0, 1)
        off = c.reserve([(oid, HEADER_SIZE + NB)])[0]
        h, pl = make_object(oid, NB)
        t[off:off + HEADER_SIZE] = torch.frombuffer(bytearray(h), dtype=torch.uint8)
        t[off + HEADER_SIZE:off + HEADER_SIZE + NB] = torch.frombuffer(bytearray(pl), dtype=torch.uint8)
        assert bytes(c.object_view(off, HEADER_SIZE + NB)) == h + pl
        assert c.commit([oid], [off]) == [True]
        wait_for(lambda: c.stats()["objects"] == 1)


def test_threads_share_one_client_and_prefaulted_pool(server_factory):
    """Several threads on one client (one lock around the socket) plus its heartbeat thread."""
    import threading

    srv = server_factory("--l1-bytes", "64MiB", "--prefault", "--heartbeat-s", "0.05")
    errors: list[BaseException] = []
    with MPClient(srv.address, client_name="threads") as c:
        assert c.hello()["prefaulted"] is True

        def work(t: int) -> None:
            try:
                for rnd in range(5):
                    keys = keys_for(10_000 + 100 * t + rnd, 20)
                    assert all(store(c, oids_for(keys, 1, 2, 2), NB))
                    assert load_and_check(c, keys, 1, 2, 2, NB)[0] == 20
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        st = c.stats()
        assert st["objects"] == 4 * 5 * 20 * 2 and st["leases"] == 0 and st["clients"] == 1
        wait_for(lambda: c.stats().get("op_heartbeat", 0) > 0)


def test_a_lookup_that_resolves_answers_what_resolve_would(server):
    """``resolve_rank``: the lookup also answers where that rank's pinned objects are, as one
    resolve per group would, each object's bytes the ones stored, counted as served."""
    w, n, first = 2, 20, 3
    needs = [(0, 0), (1, 2), (2, 0)]  # a prefix, a window of 2 chunks, a state at the hit
    keys = keys_for(77, n)
    with MPClient(server.address) as c:
        assert all(store(c, oids_for(keys, len(needs), w, w), NB))
        before = c.stats()
        r = c.lookup_detail(keys, needs, ranks=w, world=w, first=first, resolve_rank=1)
        assert r.hits == n and r.instance == c.instance
        # the positions each rule restores, written out here (not from chunk.rules)
        want = ([(0, p) for p in range(first, n)] + [(1, n - 2), (1, n - 1)] + [(2, n - 1)])
        assert sorted(r.resolved) == sorted(want)
        for (g, p), (off, size) in r.resolved.items():
            header, payload = make_object(object_id(keys[p], g, 1, w), NB)
            assert size == HEADER_SIZE + NB and bytes(c.object_view(off, size)) == header + payload
        after = c.stats()
        assert after["lookup_resolves"] - before["lookup_resolves"] == 1
        assert after["resolves"] == before["resolves"]  # no resolve was sent
        # the same answer as the resolves of each group (which count as served again)
        for g in range(len(needs)):
            ps = [p for gg, p in want if gg == g]
            assert c.resolve(r.lease, [keys[p] for p in ps], g, 1, w) == [r.resolved[(g, p)] for p in ps]
        rep = c.release(r.lease)
        assert rep.pinned_objects == 2 * len(want)  # both ranks pinned, rank 1 resolved twice
        assert rep.resolved_objects == 2 * len(want) and rep.resolved_bytes == rep.pinned_bytes
        # a lookup that resolves no rank answers no offsets; a miss answers none
        plain = c.lookup_detail(keys, needs, ranks=w, world=w)
        assert plain.resolved == {} and plain.instance == ""
        c.release(plain.lease)
        assert c.lookup_detail(keys_for(78, 4), needs, ranks=w, world=w, resolve_rank=0).resolved == {}
        # a rank that was not looked up is refused by the server (the client refuses it first)
        with pytest.raises(ValueError):
            c.lookup_detail(keys, needs, ranks=1, world=w, resolve_rank=1)
        with pytest.raises(ServerError) as ei:
            c._call("lookup", P.LookupReq(b"".join(keys), needs, 1, w, 0, 0, b"", 1))
        assert ei.value.code == "invalid"


def test_a_wake_is_sent_only_on_a_session_and_never_answered(server):
    """``wake`` (a lone request's lookup announced before its keys are computed) goes out only
    when the client has a session and no call in flight, gets no reply (nothing to read before
    the next call), and the next call gets its own answer; a closed client sends nothing."""
    keys = keys_for(31, 8)
    c = MPClient(server.address, client_name="waker", heartbeat=False)
    assert c.wake() is False  # no session yet: nothing sent (a first call connects, not a wake)
    with c:
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        before = c.stats().get("op_wake", 0)
        for _ in range(3):
            assert c.wake() is True
        assert c._sock.poll(200, zmq.POLLIN) == 0  # no reply to a wake
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 8
        assert c.stats()["op_wake"] - before == 3
        with c._lock:  # a call in flight: the server is awake anyway, and the socket is busy
            assert c.wake() is False
    assert c.wake() is False
