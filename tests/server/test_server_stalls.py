"""Stalled peers, caused for real with SIGSTOP: a server stopped past a call's bound (a host
that deschedules it), answers that come after the client gave up, a client process stopped
past the server's reap time.  The client keeps what it should (its connection, its session)
and leaves nothing held on the server."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
from srvutil import PY, keys_for, load_and_check, oids_for, store, wait_for

from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.tiers.mp_client import MPClient, TierUnavailable

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]

NB = 4096


def test_hung_server_times_out_and_recovers(server):
    c = MPClient(server.address, timeout_s=1.0, retry_s=0.1)
    keys = keys_for(3, 4)
    assert all(store(c, oids_for(keys, 1, 1, 1), NB))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable):
            c.lookup(keys)
        assert time.monotonic() - t0 < 3.0  # the 1 s timeout, not a hang
    finally:
        os.kill(server.pid, signal.SIGCONT)
    time.sleep(0.2)
    assert load_and_check(c, keys, 1, 1, 1, NB)[0] == 4
    c.close()


def test_a_call_unanswered_within_a_step_keeps_the_session(server_factory):
    """A server descheduled past an engine step's bound (SIGSTOP for 0.3 s against a 50 ms
    resolve): the call fails naming that bound and calls back off, but the connection and its
    session stay -- heartbeats go on, so the server does not reap the client as silent (it did,
    6 s later, on an overloaded 2-core host: the demo's missed hits) -- and once the server
    answers a heartbeat the same session serves again, the late answer dropped."""
    srv = server_factory("--l1-bytes", "64MiB", "--heartbeat-s", "0.5")  # silent 1.5 s: reaped
    c = MPClient(srv.address, timeout_s=2.0, retry_s=5.0)
    keys = keys_for(9, 3)
    assert all(store(c, oids_for(keys, 1, 1, 1), NB))
    hits, lease = c.lookup(keys)
    assert hits == 3
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable, match=r"did not answer resolve within 0\.05 s"):
            c.resolve(lease, keys, 0, 0, 1, timeout_s=0.05)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(TierUnavailable, match="unavailable"):  # backing off: no socket work
            c.resolve(lease, keys, 0, 0, 1, timeout_s=0.05)
        time.sleep(0.3)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    # the heartbeats (every 0.5 s) reach the server again; the first answered ends the backoff
    # (retry_s is 5 s), long before the 1.5 s of silence that would reap the session

    def answered():
        try:
            return c.stats()
        except TierUnavailable:
            return None
    wait_for(answered, timeout=3.0)
    time.sleep(2.0)
    st = c.stats()
    assert st["clients_reaped"] == 0 and st["clients_connected"] == 1, st
    assert [n for _, n in c.resolve(lease, keys, 0, 0, 1)] == [HEADER_SIZE + NB] * 3
    c.close()


def test_calls_answered_after_the_client_gave_up_leave_nothing_held(server_factory):
    """A reserve and a lookup that a stopped server carries out only after the client gave up on
    them (SIGSTOP against a step's 50 ms bound, then SIGCONT): their reservations and lease
    belong to nobody.  Kept, every later reserve of those objects -- by this engine or any
    other -- was answered "exists" for the server's reserve_s (60 s) while nothing could read
    them: holes in the cache the engine that computed them could not fill (CI: a full hit lost
    after the server was stopped during a load).  The client reads the late answers before its
    next request and gives the reservations and the lease back first, so the next store lands."""
    srv = server_factory("--l1-bytes", "64MiB")
    c = MPClient(srv.address, timeout_s=2.0, retry_s=0.2, heartbeat=False)
    other = MPClient(srv.address, timeout_s=2.0, heartbeat=False)
    stored, fresh = keys_for(31, 3), keys_for(32, 4)
    assert all(store(c, oids_for(stored, 1, 1, 1), NB))
    oids = oids_for(fresh, 1, 1, 1)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TierUnavailable, match="did not answer reserve"):
            c.reserve([(o, HEADER_SIZE + NB) for o in oids], timeout_s=0.05)
        time.sleep(0.3)  # past the back-off
        with pytest.raises(TierUnavailable, match="did not answer lookup"):
            c.lookup_detail(stored, [(0, 0)], timeout_s=0.05)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    time.sleep(0.3)  # past the back-off
    # each call first reads the late answers already there and sends their give-backs (on a
    # loaded host they may come only while the first call waits: the next call sees them done)
    def given_back():
        st = c.stats()
        return st if st["aborted_objects"] and st["leases_released"] else None

    st = wait_for(given_back, timeout=5.0)
    assert st["reserved_objects"] == 4 + 3 and st["aborted_objects"] == 4, st
    assert st["leases_created"] == 1 and st["leases_released"] == 1 and st["leases_expired"] == 0, st
    assert all(store(other, oids, NB)), other.stats()  # another engine stores them
    assert load_and_check(c, fresh, 1, 1, 1, NB)[0] == 4
    assert load_and_check(other, stored, 1, 1, 1, NB)[0] == 3
    c.close()
    other.close()


STARVED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    from srvutil import keys_for
    from vllm_kvplugin.tiers.mp_client import MPClient, TierUnavailable
    c = MPClient({addr!r}, token={token!r}, client_name="starved", timeout_s=2.0)
    c.hello()
    print("up", flush=True)
    sys.stdin.readline()
    ready = c.ready
    try:  # bounded (an engine step's call has 50 ms; a loaded test host may need more for its answer,
        # and whether the call said hello is read from the server's count, not from its time)
        c.lookup_detail(keys_for(5, 2), [(0, 0)], timeout_s=1.0)
        print(ready, "answered", flush=True)
    except TierUnavailable as exc:
        print(ready, "unavailable:", exc, flush=True)
""")


def test_a_reaped_session_is_opened_again_by_the_heartbeat(server_factory, short_tmp):
    """A client process stopped past the server's reap time (SIGSTOP: a starved host) loses its
    session.  Its heartbeat thread, once it runs again, opens the session again on the same
    connection -- hello and the token's proof both ways -- so that the next call, an engine
    step's bounded by 50 ms, goes straight to the server (before, that call had to say hello
    and prove the token within its 50 ms, and on a loaded host backed off for a second)."""
    token = os.path.join(short_tmp, "token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("a-token-of-at-least-16-chars")
    srv = server_factory("--l1-bytes", "16MiB", "--heartbeat-s", "0.5", "--token-file", token)  # 1.5 s: reaped
    c = MPClient(srv.address, token="a-token-of-at-least-16-chars", client_name="observer")
    p = subprocess.Popen([PY, "-c", STARVED.format(here=os.path.dirname(__file__), addr=srv.address,
                                                          token="a-token-of-at-least-16-chars")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert c.stats()["clients"] == 2
        p.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: c.stats()["clients_reaped"] == 1, timeout=10.0)
            before = c.stats()
            assert before["clients"] == 1, before
        finally:
            p.send_signal(signal.SIGCONT)
        # the starved client makes no call: only its heartbeat thread can open the session again
        st = wait_for(lambda: (s := c.stats())["clients"] == 2 and s, timeout=5.0)
        assert st["op_hello"] == before["op_hello"] + 1 and st["op_auth"] == before["op_auth"] + 1, st
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline().strip()
        assert line == "True answered", line
        assert c.stats()["op_hello"] == st["op_hello"]  # the calls said no hello
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        c.close()
