"""The remote tier against real ``redis-server`` processes and real cache servers.

Two cache servers with their own L1 (as on two machines) share one Redis: what one
stores, the other serves, byte for byte; a corrupt value, a value of another model or
chunk format, the store down at start, killed and restarted, stopped (slow), full, and a
3-node cluster; the byte budget held over a long run.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from redisutil import RedisCluster, RedisProc
from srvutil import keys_for, load_and_check, oids_for, store, wait_for

from vllm_kvplugin.chunk.format import FORMAT_VERSION
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.protocol import object_id
from vllm_kvplugin.tiers.mp_client import MPClient

pytestmark = [pytest.mark.redis, pytest.mark.newest_lane]

FP = b"\0" * 32  # the fingerprint srvutil's objects carry in their headers
NBYTES = 64 << 10


@pytest.fixture
def redis_node(short_tmp):
    r = RedisProc(short_tmp).start()
    yield r
    r.stop()


def _pair(server_factory, short_tmp, url: str, *extra: str):
    """Two cache servers, separate pools, one remote store."""
    a = server_factory("--l1-bytes", "64MiB", "--remote", url, "--remote-timeout-s", "0.5", *extra,
                       listen=f"unix://{short_tmp}/a.sock")
    b = server_factory("--l1-bytes", "64MiB", "--remote", url, "--remote-timeout-s", "0.5", *extra,
                       listen=f"unix://{short_tmp}/b.sock")
    return a, b


def _lookup(c: MPClient, keys, fp=FP, wait_s=5.0):
    return c.lookup_detail(keys, [(0, 0)], 1, 1, wait_s=wait_s, fingerprint=fp)


def _remote_keys(r: RedisProc) -> list[str]:
    return [k for k in r.cli("--scan", "--pattern", "vllm-kvplugin:v*").split() if k]


def test_second_server_serves_what_the_first_stored(server_factory, short_tmp, redis_node):
    a, b = _pair(server_factory, short_tmp, redis_node.url)
    keys = keys_for(1, 12)
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 12)
        assert len(_remote_keys(redis_node)) == 12
        assert _lookup(cb, keys, fp=b"").hits == 0  # no fingerprint named: the store is not asked
        r = _lookup(cb, keys)
        assert r.hits == 12 and r.pinned_bytes == 12 * (HEADER_SIZE + NBYTES)
        cb.release(r.lease)
        load_and_check(cb, keys, 1, 1, 1, NBYTES)  # now from B's own L1, byte for byte
        s = cb.stats()
        assert s["remote_probes"] == 1 and s["remote_hit_objects"] == 12 and s["remote_get_failures"] == 0
        # B has them in L1 now and does not write them back; A's objects are not written twice
        assert s["remote_puts"] == 0 and ca.stats()["remote_put_exists"] == 0


def test_partial_prefix_extends_from_the_store(server_factory, short_tmp, redis_node):
    """B holds the first 4 chunks itself, the store all 10: B's hit is 10, only 6 read remotely."""
    a, b = _pair(server_factory, short_tmp, redis_node.url)
    keys = keys_for(2, 10)
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 10)
        assert all(store(cb, oids_for(keys[:4], 1, 1, 1), NBYTES))
        r = _lookup(cb, keys)
        assert r.hits == 10
        cb.release(r.lease)
        assert cb.stats()["remote_hit_objects"] == 6
        load_and_check(cb, keys, 1, 1, 1, NBYTES)


def test_per_group_rules_through_the_store(server_factory, short_tmp, redis_node):
    """Attention (a prefix of chunks) + a recurrent group (one state at the hit): the store
    holds states after chunks 3 and 5 only; B's hit is 5 chunks, and it reads exactly what
    that hit needs -- 5 attention chunks and one state -- byte for byte."""
    from srvutil import make_object

    a, b = _pair(server_factory, short_tmp, redis_node.url)
    keys = keys_for(20, 6)
    attn = [object_id(k, 0, 0, 1) for k in keys]
    states = [object_id(keys[i], 1, 0, 1) for i in (2, 4)]
    needs = [(0, 0), (2, 0)]  # chunk.rules.Need.PREFIX, Need.POINT
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, attn + states, NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 8)
        r = cb.lookup_detail(keys, needs, 1, 1, wait_s=5.0, fingerprint=FP)
        assert r.hits == 5 and r.pinned_bytes == 6 * (HEADER_SIZE + NBYTES)
        s = cb.stats()
        assert s["remote_gets_started"] == 6 and s["remote_hit_objects"] == 6
        for group, ks in ((0, keys[:5]), (1, keys[4:5])):
            for k, (off, n) in zip(ks, cb.resolve(r.lease, ks, group, 0, 1)):
                h, pl = make_object(object_id(k, group, 0, 1), NBYTES)
                assert bytes(cb.object_view(off, n)) == h + pl
        cb.release(r.lease)


def test_room_for_remote_reads_never_evicts_what_the_hit_needs(server_factory, short_tmp, redis_node):
    """Two groups; B's small L1 holds group 1 of a prompt whose group 0 only the store has:
    making room for the remote reads never evicts the group-1 objects the hit needs; the hit
    is as long as the room allows, every byte right, and the server keeps serving."""
    a = server_factory("--l1-bytes", "64MiB", "--remote", redis_node.url, listen=f"unix://{short_tmp}/a.sock")
    b = server_factory("--l1-bytes", "2MiB", "--remote", redis_node.url, listen=f"unix://{short_tmp}/b.sock")
    keys = keys_for(22, 20)
    g0 = [object_id(k, 0, 0, 1) for k in keys]
    g1 = [object_id(k, 1, 0, 1) for k in keys]
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, g0 + g1, NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 40)
        assert all(store(cb, g1, NBYTES))
        r = cb.lookup_detail(keys, [(0, 0), (0, 0)], 1, 1, wait_s=5.0, fingerprint=FP)
        assert 0 < r.hits < 20, r.hits  # 2 MiB cannot hold 40 objects of 64 KiB
        cb.release(r.lease)
        load_and_check(cb, keys[:r.hits], 2, 1, 1, NBYTES)
        assert cb.stats()["remote_get_failures"] == 0


def test_corrupt_and_foreign_values_are_never_served(server_factory, short_tmp, redis_node):
    """A flipped payload byte, a value copied under another object's key, a value of another
    model fingerprint and one of another chunk format version: none is served; the bad ones
    found are deleted and counted; the hit ends before the first bad chunk."""
    a, b = _pair(server_factory, short_tmp, redis_node.url)
    keys = keys_for(3, 8)
    oids = oids_for(keys, 1, 1, 1)
    rc = redis_node.client()

    def rkey(oid, fp=FP, version=FORMAT_VERSION):
        return f"vllm-kvplugin:v{version}:{fp.hex()}:{oid.hex()}".encode()

    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, oids, NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 8)
        v = bytearray(rc.get(rkey(oids[5])))
        v[HEADER_SIZE + 100] ^= 0x01
        rc.set(rkey(oids[5]), bytes(v))
        r = _lookup(cb, keys)
        assert r.hits == 5
        cb.release(r.lease)
        wait_for(lambda: cb.stats()["remote_deletes"] == 1)
        s = cb.stats()
        assert s["remote_corrupt_objects"] == 1 and rc.exists(rkey(oids[5])) == 0
        # another object's value under this key, chunk 2 (B holds 0..4 now: ask a fresh prompt)
        keys2 = keys_for(4, 4)
        oids2 = oids_for(keys2, 1, 1, 1)
        assert all(store(ca, oids2, NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 12)
        rc.set(rkey(oids2[2]), rc.get(rkey(oids2[1])))
        r = _lookup(cb, keys2)
        assert r.hits == 2
        cb.release(r.lease)
        wait_for(lambda: cb.stats()["remote_corrupt_objects"] == 2)
        # a model of another fingerprint: its namespace is never asked; a value that claims
        # this namespace but names another fingerprint in its header is refused
        other = b"\1" * 32
        keys3 = keys_for(5, 3)
        oids3 = oids_for(keys3, 1, 1, 1)
        assert all(store(ca, oids3, NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 15)
        assert _lookup(cb, keys3, fp=other).hits == 0
        for oid in oids3:  # move them into the other namespace, headers unchanged (fingerprint 0)
            rc.set(rkey(oid, fp=other), rc.get(rkey(oid)))
            rc.delete(rkey(oid))
        assert _lookup(cb, keys3, fp=other).hits == 0
        wait_for(lambda: cb.stats()["remote_corrupt_objects"] == 5)  # all three read, refused, deleted
        s = cb.stats()
        assert s["remote_get_failures"] == 5
        # another chunk format version: its keys are another namespace, never asked
        keys4 = keys_for(6, 2)
        for oid in oids_for(keys4, 1, 1, 1):
            ca_obj = rc.get(rkey(oids[0]))
            rc.set(rkey(oid, version=FORMAT_VERSION + 1), ca_obj)
        assert _lookup(cb, keys4).hits == 0
        assert cb.stats()["remote_probe_found_objects"] == s["remote_probe_found_objects"]


def test_only_committed_objects_reach_the_store(server_factory, short_tmp, redis_node):
    """What a writer aborted (a failed step's stores), committed too late (its reservation
    reclaimed: fenced) or committed under a header that does not name it never reaches the
    store; a client's report of a corrupt object deletes it there too."""
    from srvutil import make_object

    a, b = _pair(server_factory, short_tmp, redis_node.url, "--reserve-s", "0.5", "--quarantine-s", "0")
    keys = keys_for(17, 4)
    oids = oids_for(keys, 1, 1, 1)
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        res = ca.reserve([(o, HEADER_SIZE + NBYTES) for o in oids])
        for o, off in zip(oids, res):
            h, pl = make_object(o, NBYTES)
            ca.write_object(off, h if o != oids[2] else make_object(oids[3], NBYTES)[0], pl)
        assert ca.abort([oids[0]]) == 1
        time.sleep(1.2)  # past --reserve-s: oids[1]'s reservation is reclaimed
        assert ca.commit([oids[1]], [res[1]]) == [False]  # fenced
        assert ca.commit([oids[2]], [res[2]]) == [False]  # its header names another object
        assert all(store(ca, [oids[3]], NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 1)
        assert len(_remote_keys(redis_node)) == 1
        r = _lookup(cb, keys)
        assert r.hits == 0  # chunk 0 is nowhere: the prefix cannot start
        assert cb.stats()["remote_hit_objects"] == 0
        # a client reports the stored one corrupt: gone from the store as well
        assert ca.drop([oids[3]]) == 1
        wait_for(lambda: ca.stats()["remote_deletes"] == 1)
        assert _remote_keys(redis_node) == []


def test_store_down_at_start_then_up(server_factory, short_tmp):
    """No store at start: the server starts and serves from L1; once the store is up (and the
    back-off has passed), objects go out and a second server finds them."""
    r = RedisProc(short_tmp)
    a, b = _pair(server_factory, short_tmp, r.url)
    keys = keys_for(7, 4)
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
        load_and_check(ca, keys, 1, 1, 1, NBYTES)
        # skipped at once while the link is in its back-off, or queued and failed in a writer
        # once the back-off has passed (a slow machine): either way counted, never stored
        wait_for(lambda: (lambda s: s["remote_puts_skipped_down"] + s["remote_put_errors"])(ca.stats()) == 4)
        s = ca.stats()
        assert s["remote_up"] == 0 and s["remote_puts"] == 0
        r.start()
        try:
            time.sleep(1.2)  # past the back-off of the failed ping at start
            keys2 = keys_for(8, 4)
            assert _lookup(cb, keys2).hits == 0  # a probe (a miss) brings B's link up
            wait_for(lambda: cb.stats()["remote_up"] == 1)

            def stored_ok():
                store(ca, oids_for(keys2, 1, 1, 1), NBYTES)
                return ca.stats()["remote_puts"] >= 4
            wait_for(stored_ok, timeout=15, interval=0.5)
            got = _lookup(cb, keys2)
            assert got.hits == 4
            cb.release(got.lease)
            assert ca.stats()["remote_reconnects"] >= 1 or ca.stats()["remote_failures"] >= 1
        finally:
            r.stop()


def test_cluster_down_at_start(server_factory, short_tmp):
    """A cluster none of whose seed nodes answers: the server starts and serves from L1."""
    cl = RedisCluster(short_tmp)  # not started: its ports are free
    a = server_factory("--l1-bytes", "64MiB", "--remote", cl.url, listen=f"unix://{short_tmp}/a.sock")
    keys = keys_for(21, 3)
    with MPClient(a.address) as ca:
        assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
        load_and_check(ca, keys, 1, 1, 1, NBYTES)
        s = ca.stats()
        assert s["remote_enabled"] == 1 and s["remote_up"] == 0 and s["remote_failures"] >= 1


def test_store_killed_restarted_and_stopped(server_factory, short_tmp, redis_node):
    """Killed mid-run: the servers keep serving L1, count the failures, and use the store
    again once it is back.  Stopped (SIGSTOP, a slow store): a lookup is answered within its
    time budget from L1, never waits for the store."""
    a, b = _pair(server_factory, short_tmp, redis_node.url)
    keys = keys_for(9, 6)
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] == 6)
        redis_node.kill9()
        keys2 = keys_for(10, 3)
        assert all(store(ca, oids_for(keys2, 1, 1, 1), NBYTES))  # the puts fail: counted
        load_and_check(ca, keys2, 1, 1, 1, NBYTES)
        t0 = time.monotonic()
        assert _lookup(cb, keys).hits == 0
        assert time.monotonic() - t0 < 3.0
        wait_for(lambda: ca.stats()["remote_failures"] >= 1 and cb.stats()["remote_failures"] >= 1)
        redis_node.start()  # empty again (no persistence)
        attempt = iter(range(1000, 2000))

        def back():  # fresh objects each try: a put skipped in the back-off is not retried
            nonlocal keys3
            keys3 = keys_for(next(attempt), 3)
            store(ca, oids_for(keys3, 1, 1, 1), NBYTES)
            return wait_for(lambda: ca.stats()["remote_queued_puts"] == 0) and ca.stats()["remote_puts"] >= 9
        keys3 = []
        wait_for(back, timeout=40, interval=0.5)

        def b_hits():
            r = _lookup(cb, keys3)
            if r.hits:
                cb.release(r.lease)
            return r.hits == 3
        wait_for(b_hits, timeout=40, interval=0.5)
        # a slow store: stopped while B looks up a prompt only the store has
        keys4 = keys_for(12, 3)
        assert all(store(ca, oids_for(keys4, 1, 1, 1), NBYTES))
        wait_for(lambda: ca.stats()["remote_puts"] >= 12)
        redis_node.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = _lookup(cb, keys4, wait_s=1.0)
            took = time.monotonic() - t0
            assert r.hits == 0 and took < 2.5, took
            load_and_check(cb, keys3, 1, 1, 1, NBYTES)  # B's own L1 serves meanwhile
        finally:
            redis_node.signal(signal.SIGCONT)


def test_full_store_is_counted_and_served_around(server_factory, short_tmp):
    """Redis with maxmemory and noeviction refuses writes (OOM): counted as full; serving goes on."""
    r = RedisProc(short_tmp, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    try:
        a, _b = _pair(server_factory, short_tmp, r.url)
        keys = keys_for(13, 64)
        with MPClient(a.address) as ca:
            assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
            wait_for(lambda: (s := ca.stats())["remote_puts"] + s["remote_put_full"]
                     + s["remote_puts_skipped_backlog"] == 64)
            s = ca.stats()
            assert s["remote_put_full"] > 0 and s["remote_puts"] < 64
            load_and_check(ca, keys, 1, 1, 1, NBYTES)
            assert s["remote_up"] == 1  # full is not down
    finally:
        r.stop()


def test_byte_budget_holds_over_a_long_run(server_factory, short_tmp, redis_node):
    """Two servers write 10x the budget between them: what the prefix holds in the store never
    exceeds it (every value counted, measured in the store), the oldest objects went first, and
    the newest are still served."""
    budget = 2 << 20
    a, b = _pair(server_factory, short_tmp, redis_node.url, "--remote-bytes", str(budget))
    rc = redis_node.client()
    with MPClient(a.address) as ca, MPClient(b.address) as cb:
        for i in range(10):
            c = ca if i % 2 == 0 else cb
            keys = keys_for(100 + i, 5)
            assert all(store(c, oids_for(keys, 1, 1, 1), 80_000))
            wait_for(lambda want=5 * (i + 1): sum(x.stats()["remote_puts"] for x in (ca, cb)) == want)
            held = sum(rc.strlen(k) for k in rc.scan_iter(match="vllm-kvplugin:v*"))
            assert held <= budget, (i, held)
        ledger = int(rc.get(b"{vllm-kvplugin}:used"))
        held = sum(rc.strlen(k) for k in rc.scan_iter(match="vllm-kvplugin:v*"))
        assert held == ledger and held <= budget
        assert ca.stats()["remote_budget_evictions"] + cb.stats()["remote_budget_evictions"] > 0
        newest = keys_for(109, 5)  # stored by B last: A finds them in the store
        got = _lookup(ca, newest)
        assert got.hits == 5
        ca.release(got.lease)
        assert _lookup(cb, keys_for(100, 5)).hits == 0  # the oldest (A's, not in B's L1) were evicted


def test_cluster_of_three(server_factory, short_tmp):
    """A 3-node Redis Cluster: objects spread over the nodes; the second server hits them all,
    one probe per lookup; a corrupt value on one node is deleted and the hit ends before it."""
    cl = RedisCluster(short_tmp).start()
    try:
        a, b = _pair(server_factory, short_tmp, cl.url)
        keys = keys_for(14, 24)
        with MPClient(a.address) as ca, MPClient(b.address) as cb:
            assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
            wait_for(lambda: ca.stats()["remote_puts"] == 24, timeout=20)
            per_node = cl.keys_per_node("vllm-kvplugin:v*")
            assert sum(per_node) == 24 and all(per_node), per_node
            oid = object_id(keys[20], 0, 0, 1)
            import redis

            rc = redis.cluster.RedisCluster(host="127.0.0.1", port=cl.nodes[0].port)
            k = f"vllm-kvplugin:v{FORMAT_VERSION}:{FP.hex()}:{oid.hex()}".encode()
            v = bytearray(rc.get(k))
            v[-1] ^= 0xFF
            rc.set(k, bytes(v))
            r = _lookup(cb, keys)
            assert r.hits == 20
            cb.release(r.lease)
            load_and_check(cb, keys[:20], 1, 1, 1, NBYTES)
            wait_for(lambda: cb.stats()["remote_deletes"] == 1)
            assert rc.exists(k) == 0 and cb.stats()["remote_probes"] == 1
            rc.close()
    finally:
        cl.stop()


def test_cluster_master_failing_over(server_factory, short_tmp):
    """A master of a 3-master cluster with replicas is killed: while its replica takes over, the
    servers serve from L1 and count the failures; afterwards puts and remote hits work again,
    through the promoted replica."""
    cl = RedisCluster(short_tmp, replicas=1).start()
    try:
        a, b = _pair(server_factory, short_tmp, cl.url)
        keys = keys_for(16, 12)
        with MPClient(a.address) as ca, MPClient(b.address) as cb:
            assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
            wait_for(lambda: ca.stats()["remote_puts"] == 12, timeout=20)
            victim = cl.masters()[0]
            victim.kill9()
            load_and_check(ca, keys, 1, 1, 1, NBYTES)  # A's own L1 serves meanwhile
            wait_for(lambda: len(cl.masters()) == 3 and cl.healthy(), timeout=30, interval=0.2)  # promoted
            attempt = iter(range(3000, 4000))
            got = []

            def shared_again():  # fresh objects each try: puts skipped in the back-off are not retried
                ks = keys_for(next(attempt), 6)
                store(ca, oids_for(ks, 1, 1, 1), NBYTES)
                wait_for(lambda: ca.stats()["remote_queued_puts"] == 0)
                r = _lookup(cb, ks)
                if r.hits:
                    cb.release(r.lease)
                got.append(r.hits)
                return r.hits == 6
            wait_for(shared_again, timeout=60, interval=0.5)
            assert ca.stats()["remote_failures"] + cb.stats()["remote_failures"] >= 1 or got[0] == 6
    finally:
        cl.stop()


def test_tls_store(server_factory, short_tmp):
    """``rediss://`` with the store's CA: shared as over plain TCP.  Without it (the system's CAs
    do not know this one) the certificate is refused: the store stays down, counted, and the
    server serves from L1."""
    r = RedisProc(short_tmp, tls=True).start()
    try:
        a, b = _pair(server_factory, short_tmp, r.url, "--remote-tls-ca-file", r.ca_file)
        keys = keys_for(18, 5)
        with MPClient(a.address) as ca, MPClient(b.address) as cb:
            assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
            wait_for(lambda: ca.stats()["remote_puts"] == 5)
            got = _lookup(cb, keys)
            assert got.hits == 5
            cb.release(got.lease)
            load_and_check(cb, keys, 1, 1, 1, NBYTES)
        untrusting = server_factory("--l1-bytes", "64MiB", "--remote", r.url, listen=f"unix://{short_tmp}/c.sock")
        with MPClient(untrusting.address) as cc:
            assert _lookup(cc, keys).hits == 0
            assert all(store(cc, oids_for(keys_for(19, 2), 1, 1, 1), NBYTES))
            load_and_check(cc, keys_for(19, 2), 1, 1, 1, NBYTES)
            s = cc.stats()
            assert s["remote_up"] == 0 and s["remote_puts"] == 0 and s["remote_hit_objects"] == 0
    finally:
        r.stop()


def test_password_never_on_the_command_line(server_factory, short_tmp):
    """A password in the URL is refused (argv is public); from a private file it works."""
    r = RedisProc(short_tmp, password="s3cret-password-123").start()
    try:
        with pytest.raises(RuntimeError, match="password on the command line"):
            server_factory("--remote", f"redis://user:pw@127.0.0.1:{r.port}", listen=f"unix://{short_tmp}/x.sock")
        pw = os.path.join(short_tmp, "pw")
        fd = os.open(pw, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"s3cret-password-123\n")
        os.close(fd)
        a = server_factory("--l1-bytes", "64MiB", "--remote", r.url, "--remote-password-file", pw,
                           listen=f"unix://{short_tmp}/a.sock")
        keys = keys_for(15, 2)
        with MPClient(a.address) as ca:
            assert all(store(ca, oids_for(keys, 1, 1, 1), NBYTES))
            wait_for(lambda: ca.stats()["remote_puts"] == 2)
        assert "s3cret" not in a.read_log()
    finally:
        r.stop()
