"""Faults caused for real: kill -9 of server and clients, garbage, corrupt files, expiry, eviction, restarts
(stalled peers: test_server_stalls.py)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import stat
import subprocess
import textwrap
import time

import msgspec
import pytest
import torch
import zmq
from srvutil import PY, keys_for, load_and_check, make_object, oids_for, store, wait_for

from vllm_kvplugin.server import protocol as P
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.protocol import object_id
from vllm_kvplugin.tiers.mp_client import MPClient, ServerError, TierUnavailable

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]

NB = 4096


def _l2_settled(c: MPClient, n: int) -> bool:
    st = c.stats()
    return st["l2_objects"] >= n and st["l2_write_queue"] == 0


def test_kill9_during_load_and_store_then_restart_with_l2(server_factory, short_tmp):
    l2 = os.path.join(short_tmp, "l2")
    srv = server_factory("--l1-bytes", "64MiB", "--l2-dir", l2)
    keys = keys_for(11, 129)
    c = MPClient(srv.address, timeout_s=3.0, retry_s=0.2, client_name="engine", lookup_wait_s=2.5)
    assert all(store(c, oids_for(keys, 1, 2, 2), NB))
    wait_for(lambda: _l2_settled(c, 258))
    gen0 = c.pool_generation

    # a load in flight: lookup + first resolve done, then the server dies
    hits, lease = c.lookup(keys, 1, 2, 2)
    assert hits == 129
    c.resolve(lease, keys, 0, 0, 2)
    srv.kill9()
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable):
        c.resolve(lease, keys, 0, 1, 2)
    assert time.monotonic() - t0 < c.timeout_s + 2.0  # bounded: no hang (slack for a loaded machine)
    with pytest.raises(TierUnavailable):  # fails fast while the server is away
        c.lookup(keys, 1, 2, 2)

    # restart on the same address and L2: re-indexed, promoted on lookup, byte-identical
    srv.start()
    extra = keys_for(12, 5)
    wait_for(lambda: _try(lambda: c.stats()), timeout=10)
    assert c.pool_generation == gen0 + 1
    st = c.stats()
    assert st["l2_reindexed_objects"] == 258 and st["objects"] == 0
    with pytest.raises(ServerError) as ei:  # the old lease died with the old server
        c.resolve(lease, keys, 0, 1, 2)
    assert ei.value.code == "unknown_lease"
    assert load_and_check(c, keys, 1, 2, 2, NB)[0] == 129, c.stats()
    st = c.stats()
    assert st["l2_promoted_objects"] == 258 and st["objects"] == 258

    # a store in flight: reserved and written, the server dies before the commit
    oids = oids_for(extra, 1, 2, 2)
    offs = c.reserve([(o, HEADER_SIZE + NB) for o in oids])
    for o, off in zip(oids, offs):
        c.write_object(off, *make_object(o, NB))
    srv.kill9()
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable):
        c.commit(oids, offs)
    assert time.monotonic() - t0 < c.timeout_s + 2.0  # bounded: no hang (slack for a loaded machine)
    srv.start()
    wait_for(lambda: _try(lambda: c.stats()), timeout=10)
    assert c.lookup(extra, 1, 2, 2)[0] == 0  # never committed: not there
    assert load_and_check(c, keys, 1, 2, 2, NB)[0] == 129  # L2 still has the rest
    c.close()


def _try(fn):
    try:
        return fn() or True
    except (TierUnavailable, ServerError):
        return False


def test_no_server_fails_fast(short_tmp):
    c = MPClient(f"unix://{short_tmp}/nobody.sock", timeout_s=1.0, retry_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(TierUnavailable):
        c.lookup(keys_for(1, 2))
    assert time.monotonic() - t0 < 3.0  # within the 1 s timeout, not a hang
    t0 = time.monotonic()
    for _ in range(100):  # backing off: no socket work per call
        with pytest.raises(TierUnavailable):
            c.lookup(keys_for(1, 2))
    assert time.monotonic() - t0 < 0.5
    c.close()


MID_STORE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from srvutil import keys_for, oids_for, make_object
    from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
    from vllm_kvplugin.tiers.mp_client import MPClient
    c = MPClient({addr!r}, client_name="doomed-writer")
    oids = oids_for(keys_for(77, 50), 1, 1, 1)
    offs = c.reserve([(o, HEADER_SIZE + {nb}) for o in oids])
    assert all(o is not None for o in offs)
    for o, off in zip(oids[:30], offs):
        h, pl = make_object(o, {nb})
        c.write_object(off, h, pl[: {nb} // 2])  # half written
    print("reserved", flush=True)
    time.sleep(60)
""")


def test_client_killed_mid_store(server_factory):
    # reaped after 3 silent heartbeat periods (1.5 s); margins wide enough for a loaded CI machine
    srv = server_factory("--l1-bytes", "64MiB", "--heartbeat-s", "0.5", "--quarantine-s", "0.3")
    here = os.path.dirname(__file__)
    p = subprocess.Popen([PY, "-c", MID_STORE.format(here=here, addr=srv.address, nb=NB)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "reserved"
        c = MPClient(srv.address, client_name="observer")
        keys = keys_for(77, 50)
        assert c.stats()["reserved_now"] == 50
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert c.lookup(keys)[0] == 0  # nothing visible, ever
        st = wait_for(lambda: (s := c.stats())["clients_reaped"] >= 1 and s)
        assert st["reserved_now"] == 0 and st["reservations_reclaimed"] == 50
        wait_for(lambda: c.stats()["quarantined_bytes"] == 0)
        used = c.stats()["l1_used"]
        assert used == 0
        # the same objects can be stored again, completely this time
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 50
        # a live client keeps its session (heartbeats) well past the reap time ...
        hits, lease = c.lookup(keys)
        time.sleep(2.5)
        assert len(c.resolve(lease, keys, 0, 0, 1)) == 50
        c.release(lease)
        # ... a silent one (no heartbeats) is reaped with its leases; it joins again on its next call
        quiet = MPClient(srv.address, heartbeat=False, retry_s=0.0, client_name="quiet")
        hits, lease = quiet.lookup(keys)
        assert hits == 50
        reaped = c.stats()["clients_reaped"]
        wait_for(lambda: c.stats()["clients_reaped"] >= reaped + 1)
        time.sleep(0.5)
        assert c.stats()["clients_reaped"] == reaped + 1  # the quiet one only, not the live one
        with pytest.raises(ServerError) as ei:
            quiet.resolve(lease, keys, 0, 0, 1)
        assert ei.value.code == "unknown_lease"
        assert quiet.lookup(keys)[0] == 50
        quiet.close()
        c.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _raw_request(sock: zmq.Socket, payload: bytes | list, timeout_ms: int = 3000) -> P.ReplyEnvelope:
    if isinstance(payload, list):
        sock.send_multipart(payload)
    else:
        sock.send(payload)
    assert sock.poll(timeout_ms), "no reply"
    return P.REPLY_DECODER.decode(sock.recv())


def test_garbage_and_bad_messages_get_errors(server):
    path = server.address[len("unix://"):]
    # raw bytes that are not even ZMTP
    for blob in (b"\x00" * 10, os.urandom(5000), b"GET / HTTP/1.1\r\n\r\n"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(blob)
        s.close()
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(server.address.replace("unix://", "ipc://"))
    hello = P.encode_request("hello", 1, P.HelloReq(b"n" * 16, "raw"))
    cases = [
        (os.urandom(100), "malformed"),
        (b"", "malformed"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (msgspec.msgpack.encode({"v": 1, "id": -5, "op": "stats"}), "malformed"),
        (b"\x00" * (P.MAX_MESSAGE_BYTES + 1), "too_large"),
        (P.encode_request("stats", 2, P.Empty(), version=99), "version"),
        (P.encode_request("stats", 2, P.Empty(), version=0), "version"),
        (msgspec.msgpack.encode({"v": P.PROTOCOL_VERSION, "id": 3, "op": "drop_tables"}), "unknown_op"),
        (P.encode_request("lookup", 4, P.Empty()), "invalid"),
        (msgspec.msgpack.encode({"v": P.PROTOCOL_VERSION, "id": 5, "op": "lookup",
                                 "body": msgspec.Raw(msgspec.msgpack.encode(
                                     {"keys": b"x" * 32, "needs": [], "ranks": 1, "world": 1}))}),
         "invalid"),
        (P.encode_request("stats", 6, P.Empty()), "hello_required"),
        ([b"a", b"b"], "malformed"),
    ]
    for payload, code in cases:
        rep = _raw_request(d, payload)
        assert not rep.ok and rep.code == code, (code, rep)
    assert _raw_request(d, hello).ok
    for payload, code in [
        (msgspec.msgpack.encode({"v": P.PROTOCOL_VERSION, "id": 7, "op": "lookup",
                                 "body": msgspec.Raw(msgspec.msgpack.encode(
                                     {"keys": b"x" * 33, "needs": [[0, 0]], "ranks": 1, "world": 1}))}),
         "invalid"),
        (msgspec.msgpack.encode({"v": P.PROTOCOL_VERSION, "id": 7, "op": "lookup",
                                 "body": msgspec.Raw(msgspec.msgpack.encode(
                                     {"keys": b"x" * 32, "needs": [[1, 0]], "ranks": 1, "world": 1}))}),
         "invalid"),  # a window of no chunks
        (P.encode_request("lookup", 8, P.LookupReq(b"k" * 32, [(0, 0)], 2, 1)), "invalid"),
        (P.encode_request("lookup", 8, P.LookupReq(b"k" * 32, [(0, 0)] * 65535, 65535, 65535)), "invalid"),
        (P.encode_request("lookup", 8, P.LookupReq(b"k" * 32 * 100_000, [(0, 0)] * 100, 100, 100)), "invalid"),
        (P.encode_request("reserve", 9, P.ReserveReq(b"x" * 38, [1, 2])), "invalid"),
        (P.encode_request("resolve", 10, P.ResolveReq(12345, b"k" * 32, 0, 0, 1)), "unknown_lease"),
        (P.encode_request("commit", 11, P.IdsReq(b"x" * 37)), "invalid"),
        (P.encode_request("drop", 12, P.IdsReq(b"x" * 37)), "invalid"),
    ]:
        rep = _raw_request(d, payload)
        assert not rep.ok and rep.code == code, (code, rep)
    # a REQ socket works too
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.address.replace("unix://", "ipc://"))
    assert _raw_request(req, hello).ok
    d.close()
    req.close()
    ctx.term()
    assert server.alive()
    with MPClient(server.address) as c:
        keys = keys_for(5, 3)
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 3
        st = c.stats()
        assert st["errors_malformed"] >= 5 and st["errors_too_large"] == 1 and st["errors_version"] == 2
    assert server.alive()


def test_corrupt_l2_file_detected_and_dropped(server_factory, short_tmp):
    l2 = os.path.join(short_tmp, "l2")
    srv = server_factory("--l1-bytes", "64MiB", "--l2-dir", l2)
    keys = keys_for(21, 40)
    with MPClient(srv.address) as c:
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        wait_for(lambda: _l2_settled(c, 40))
    assert srv.stop() == 0
    files = glob.glob(os.path.join(l2, "*", "*.kvc"))
    assert len(files) == 40
    assert stat.S_IMODE(os.stat(l2).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)

    def path_of(i):
        return os.path.join(l2, object_id(keys[i], 0, 0, 1).hex()[:2], object_id(keys[i], 0, 0, 1).hex() + ".kvc")

    with open(path_of(25), "r+b") as f:  # one payload byte flipped: only the checksum can tell
        f.seek(HEADER_SIZE + 1000)
        b = f.read(1)
        f.seek(HEADER_SIZE + 1000)
        f.write(bytes([b[0] ^ 0x40]))
    with open(path_of(30), "r+b") as f:  # truncated: caught at re-index
        f.truncate(HEADER_SIZE + 10)
    junk = os.path.join(l2, os.path.basename(os.path.dirname(path_of(0))), "junk.kvc.123.tmp")
    with open(junk, "wb") as f:  # a write that a crash left half done
        f.write(b"partial")
    srv.start()
    with MPClient(srv.address) as c:
        assert not os.path.exists(junk)  # removed by the start-up re-index
        st = c.stats()
        assert st["l2_reindexed_objects"] == 39 and st["l2_corrupt_files"] == 1
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 25
        st = c.stats()
        assert st["l2_corrupt_files"] == 2 and st["l2_promote_failures"] == 1
        assert not os.path.exists(path_of(25)) and not os.path.exists(path_of(30))
        assert c.lookup(keys[26:])[0] == 4  # the rest up to the truncated one is fine
        # the dropped chunk can be stored again
        assert all(store(c, oids_for(keys[25:26], 1, 1, 1), NB))
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 30
        # 39 re-indexed - 1 dropped at promotion + 1 stored again; its L2 write is asynchronous
        wait_for(lambda: _l2_settled(c, 39))
    assert not glob.glob(os.path.join(l2, "**", "*.tmp"), recursive=True)
    # one server per L2 directory
    other = subprocess.run([PY, "-m", "vllm_kvplugin.server", "--listen", f"unix://{short_tmp}/o.sock",
                            "--l1-bytes", "8MiB", "--l2-dir", l2], capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "in use" in other.stderr and "--l2-dir" in other.stderr
    assert srv.alive()


def test_lease_expiry(server_factory):
    srv = server_factory("--l1-bytes", "16MiB", "--lease-s", "1.5")
    keys = keys_for(31, 8)
    with MPClient(srv.address) as c:
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        hits, lease = c.lookup(keys)
        assert hits == 8 and c.stats()["leases"] == 1
        time.sleep(1.0)
        c.resolve(lease, keys, 0, 0, 1)  # use extends the lease: 2 s after the lookup, still valid
        time.sleep(1.0)
        c.resolve(lease, keys, 0, 0, 1)
        wait_for(lambda: c.stats()["leases_expired"] == 1)  # unused: expires
        with pytest.raises(ServerError) as ei:
            c.resolve(lease, keys, 0, 0, 1)
        assert ei.value.code == "unknown_lease"
        st = c.stats()
        assert st["leases"] == 0 and st["leases_expired"] == 1 and st["l1_evictable_objects"] == 8
        assert not c.release(lease).found


def test_a_lookup_that_repeats_its_keys_pins_each_object_once(server_factory):
    """A key twice in one lookup (a client's bug or an attack) pins its objects once: released,
    every object is evictable again and others can store (before, each repeat added a pin that
    no release took back, and the objects were out of the LRU for the server's life)."""
    srv = server_factory("--l1-bytes", "16MiB")
    keys = keys_for(33, 8)
    with MPClient(srv.address) as c:
        assert all(store(c, oids_for(keys, 1, 1, 1), NB))
        hits, lease = c.lookup(keys + keys + keys[:3])
        assert hits == 19  # every position's object is there
        assert c.stats()["l1_evictable_objects"] == 0
        assert c.release(lease).found
        st = c.stats()
        assert st["leases"] == 0 and st["l1_evictable_objects"] == 8


def test_eviction_watermarks_never_evict_pinned(server_factory):
    nb = 64 << 10
    srv = server_factory("--l1-bytes", "8MiB", "--high-watermark", "0.9", "--low-watermark", "0.6")
    with MPClient(srv.address) as c:
        cap = c.stats()["l1_capacity"]
        pinned_keys = keys_for(41, 10)
        assert all(store(c, oids_for(pinned_keys, 1, 1, 1), nb))
        hits, lease = c.lookup(pinned_keys)
        assert hits == 10
        # three pools' worth of other chunks go through
        for round_ in range(3):
            more = keys_for(100 + round_, 120)
            ok = store(c, oids_for(more, 1, 1, 1), nb, batch=16)
            assert sum(ok) >= 100
            st = c.stats()
            assert st["l1_used"] <= cap
        st = c.stats()
        assert st["l1_evictions"] > 0
        wait_for(lambda: c.stats()["l1_used"] <= 0.9 * cap)
        # the pinned prefix is intact, byte for byte
        for g_off, n in zip(c.resolve(lease, pinned_keys, 0, 0, 1), range(10)):
            off, size = g_off
            h, pl = make_object(object_id(pinned_keys[n], 0, 0, 1), nb)
            assert bytes(c.object_view(off, size)) == h + pl
        c.release(lease)
        # unpinned, the old prefix ages out like anything else
        for round_ in range(3, 5):
            store(c, oids_for(keys_for(100 + round_, 120), 1, 1, 1), nb, batch=16)
        assert c.lookup(pinned_keys)[0] == 0
        # with everything pinned there is no room, and reserve says so instead of evicting
        leases = [c.lookup([k]) for k in keys_for(104, 120)]
        leases = [(k, lid) for k, (h, lid) in zip(keys_for(104, 120), leases) if h]
        assert len(leases) > 40
        big = [object_id(k, 0, 0, 1) for k in keys_for(999, 200)]
        offs = c.reserve([(o, HEADER_SIZE + nb) for o in big])
        assert None in offs
        for k, lid in leases:
            (off, size), = c.resolve(lid, [k], 0, 0, 1)
            h, pl = make_object(object_id(k, 0, 0, 1), nb)
            assert bytes(c.object_view(off, size)) == h + pl
            c.release(lid)
        c.abort([o for o, off in zip(big, offs) if off is not None])


def test_l1_eviction_to_l2_and_back(server_factory, short_tmp):
    """Evicted from a small L1, an object stays in L2 and is promoted on the next lookup."""
    nb = 64 << 10
    srv = server_factory("--l1-bytes", "4MiB", "--l2-dir", os.path.join(short_tmp, "l2"))
    keys = keys_for(51, 150)  # ~10 MiB: more than twice L1
    with MPClient(srv.address) as c:
        pending = oids_for(keys, 1, 1, 1)

        def all_stored() -> bool:
            # a full L1 whose objects L2's writer has not written out yet refuses new room (on a
            # loaded machine the writer lags): those are asked again once it caught up
            ok = store(c, pending, nb, batch=8)
            pending[:] = [o for o, k in zip(pending, ok) if not k]
            return not pending
        wait_for(all_stored, timeout=30, interval=0.2)
        wait_for(lambda: _l2_settled(c, 150))  # an empty queue alone can leave one write in flight
        st = c.stats()
        assert st["l1_evictions"] > 0 and st["l2_objects"] == 150
        assert load_and_check(c, keys[:40], 1, 1, 1, nb)[0] == 40
        assert c.stats()["l2_promoted_objects"] > 0


def test_reservation_timeout_and_quarantine(server_factory):
    srv = server_factory("--l1-bytes", "16MiB", "--reserve-s", "0.3", "--quarantine-s", "0.5")
    keys = keys_for(61, 4)
    oids = oids_for(keys, 1, 1, 1)
    with MPClient(srv.address) as c:
        offs = c.reserve([(o, HEADER_SIZE + NB) for o in oids])
        for o, off in zip(oids[:2], offs):
            c.write_object(off, *make_object(o, NB))
        assert c.commit(oids[:1], offs[:1]) == [True]
        st = wait_for(lambda: (s := c.stats())["reservations_timed_out"] == 3 and s)
        assert st["reserved_now"] == 0 and st["quarantined_bytes"] > 0
        assert c.commit(oids[1:2], offs[1:2]) == [False]  # too late: nothing becomes visible
        assert c.lookup(keys)[0] == 1
        wait_for(lambda: c.stats()["quarantined_bytes"] == 0)
        assert all(store(c, oids[1:], NB))
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 4


def test_a_stalled_writers_late_commit_is_fenced(server_factory):
    """Writer fencing: a writer that stalled past its reservation cannot commit into the
    reservation that replaced it -- not even from the same client (one worker process, two
    stores of one chunk) -- and its stale bytes never become visible."""
    srv = server_factory("--l1-bytes", "16MiB", "--reserve-s", "0.3", "--quarantine-s", "0.2")
    key = keys_for(62, 1)[0]
    oid = object_id(key, 0, 0, 1)
    with MPClient(srv.address) as c:
        stale = c.reserve([(oid, HEADER_SIZE + NB)])[0]
        h, pl = make_object(oid, NB)
        c.write_object(stale, h, b"\x5a" * NB)  # garbage under a valid header (a torn write)
        wait_for(lambda: c.stats()["reservations_timed_out"] == 1)
        fresh = c.reserve([(oid, HEADER_SIZE + NB)])[0]
        assert fresh is not None and fresh.epoch > stale.epoch
        c.write_object(fresh, h, b"\x5a" * NB)  # the stale writer's bytes land on the new room
        assert c.commit([oid], [stale]) == [False]  # its commit names the old epoch: fenced
        st = c.stats()
        assert st["commit_fenced"] == 1 and st["objects"] == 0 and c.lookup([key])[0] == 0
        c.write_object(fresh, h, pl)  # the current writer writes and commits its own bytes
        assert c.commit([oid], [fresh]) == [True]
        assert load_and_check(c, [key], 1, 1, 1, NB)[0] == 1


def test_a_worker_does_not_publish_past_its_reservation(server_factory):
    """The worker's side of the fence: past its reservation time it aborts instead of committing."""
    from vllm_kvplugin.config import KVPluginConfig
    from vllm_kvplugin.tiers.mp import ServerStore

    srv = server_factory("--l1-bytes", "16MiB", "--reserve-s", "0.5")
    keys = keys_for(63, 2)
    cfg = KVPluginConfig.from_extra_config({"server": srv.address, "cpu_bytes": 0})
    ws = ServerStore(cfg, rank=0, world=1, name="worker", pin_for_cuda=False)
    try:
        oids = oids_for(keys, 1, 1, 1)
        targets = ws.reserve(["a", "b"], [(o, HEADER_SIZE + NB) for o in oids])
        assert [t.job for t in targets] == ["a", "b"]
        for t, o in zip(targets, oids):
            h, pl = make_object(o, NB)
            t.header.copy_(torch.frombuffer(bytearray(h), dtype=torch.uint8))
            t.payload.copy_(torch.frombuffer(bytearray(pl), dtype=torch.uint8))
        assert ws.commit(targets[:1]) == [True]
        time.sleep(0.45)  # past 80% of the reservation, not yet reclaimed by the server
        assert ws.commit(targets[1:]) == [False]
        with MPClient(srv.address) as c:
            st = c.stats()
            assert st["aborted_objects"] == 1 and st["commit_fenced"] == 0 and st["objects"] == 1
    finally:
        ws.close()


def test_an_old_pool_is_unmapped_once_nothing_uses_it(server_factory):
    """After a restart the client maps the new pool and unmaps the old one as soon as no tensor
    view or memoryview of it is left (never under a live view: that would be a crash)."""
    srv = server_factory("--l1-bytes", "16MiB")
    with MPClient(srv.address) as c:
        t = c.pool_tensor()
        piece = t[4096:8192]
        mv = c.pool_view()
        unmapped = []
        c.before_unmap = lambda tensor: unmapped.append(tensor.numel())
        size = c.pool_size
        for _ in range(2):  # the second pool is used by nothing: unmapped at the next restart
            assert srv.stop() == 0
            srv.start()
            wait_for(lambda: _try(lambda: c.stats()))
        del t
        c.stats()
        assert c.mapped_pools == 2 and unmapped == []  # the slice and the memoryview use the first
        piece[:] = 7  # still mapped: writing is safe
        del piece
        c.stats()
        assert unmapped == [size] and c.mapped_pools == 2  # the tensor went; the memoryview holds
        mv.release()
        c.stats()
        assert c.mapped_pools == 1 and unmapped == [size]


def test_restart_under_a_connected_client(server_factory):
    """The client's socket reconnects by itself to a restarted server: the first call that meets
    the new instance fails (the caller drops its offsets), the pool is re-mapped, then all works."""
    srv = server_factory("--l1-bytes", "16MiB")
    keys = keys_for(71, 3)
    oids = oids_for(keys, 1, 1, 1)
    with MPClient(srv.address, retry_s=0.0) as c:
        old_pool = c.hello()["pool_path"]
        gen = c.pool_generation
        offs = c.reserve([(o, HEADER_SIZE + NB) for o in oids])
        assert srv.stop() == 0
        srv.start()
        errors = 0
        while True:
            try:
                c.lookup(keys)
                break
            except TierUnavailable:
                errors += 1
                assert errors < 50
                time.sleep(0.05)
        assert errors >= 1 and c.pool_generation == gen + 1
        assert c.hello()["pool_path"] != old_pool
        with pytest.raises(TierUnavailable):  # an offset of the old pool is refused
            c.write_object(offs[0], *make_object(oids[0], NB), generation=gen)
        assert c.commit(oids, offs) == [False, False, False]
        assert all(store(c, oids, NB))
        assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 3


def test_a_lookup_whose_wait_ran_out_says_how_many_objects_are_still_coming(server_factory, short_tmp):
    """``LookupRep.promoting``: a lookup answered before the objects it brings back from L2 are
    in L1 (no wait at all) says how many are still on their way, and its hit holds only what is
    ready; asked again with a wait, the hit is whole and nothing is on its way (that lookup waits
    for the reads the first one started: it used to end its hit before them at once); a lookup
    of what L1 holds says 0.  (A lone request's lookup on vLLM's thread relies on it: a hit
    still coming is asked again on the index's thread, with the client's wait.)"""
    l2 = os.path.join(short_tmp, "l2")
    srv = server_factory("--l1-bytes", "256MiB", "--l2-dir", l2)
    nb = 1 << 20  # 64 files of 1 MiB: their reads outlast a wait of 0 s
    keys = keys_for(21, 64)
    with MPClient(srv.address, timeout_s=5.0, client_name="engine") as c:
        assert all(store(c, oids_for(keys, 1, 1, 1), nb))
        wait_for(lambda: _l2_settled(c, 64))
        r = c.lookup_detail(keys, [(0, 0)], wait_s=0.0)
        assert (r.hits, r.promoting) == (64, 0)  # all in L1
        c.release(r.lease)
        srv.kill9()
        srv.start()
        wait_for(lambda: _try(lambda: c.stats()), timeout=10)
        assert c.stats()["objects"] == 0
        r = c.lookup_detail(keys, [(0, 0)], wait_s=0.0, resolve_rank=0)
        assert 0 < r.promoting <= 64 and r.hits < 64, r
        assert len(r.resolved) == r.hits  # the hit is what was ready, placed as ever
        if r.lease:
            c.release(r.lease)
        r = c.lookup_detail(keys, [(0, 0)], wait_s=5.0)
        assert (r.hits, r.promoting) == (64, 0), r
        c.release(r.lease)
