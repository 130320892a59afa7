"""Parallel payload checksums: the same values, in order, as the one-thread function."""

from __future__ import annotations

import os
import threading

import numpy as np

from vllm_kvplugin.chunk import checksums
from vllm_kvplugin.chunk.format import payload_checksum


def _payloads(n: int, nbytes: int) -> list[memoryview]:
    rng = np.random.default_rng(n)
    return [memoryview(rng.integers(0, 256, nbytes, dtype=np.uint8)) for _ in range(n)]


def _eventually(ready, seconds: float = 1.0) -> None:
    """Until ``ready()`` (callbacks run on other threads), at most ``seconds``."""
    for _ in range(int(seconds / 0.01)):
        if ready():
            return
        threading.Event().wait(0.01)


def test_small_inputs_stay_on_the_calling_thread(monkeypatch):
    seen = set()
    monkeypatch.setattr(checksums, "payload_checksum",
                        lambda p: seen.add(threading.get_ident()) or payload_checksum(p))
    ps = _payloads(3, 1 << 10)
    assert checksums.payload_checksums(ps) == [payload_checksum(p) for p in ps]
    assert seen == {threading.get_ident()}


def test_large_inputs_hashed_on_the_pool_in_order(monkeypatch):
    seen = set()
    monkeypatch.setattr(checksums, "payload_checksum",
                        lambda p: seen.add(threading.get_ident()) or payload_checksum(p))
    ps = _payloads(12, 1 << 20)  # 12 MiB in all: above PARALLEL_MIN_BYTES
    want = [payload_checksum(p) for p in ps]
    assert len(set(want)) == len(want)
    assert checksums.payload_checksums(ps) == want
    assert threading.get_ident() not in seen


def test_a_forked_child_makes_its_own_pool():
    ps = _payloads(12, 1 << 20)
    want = [payload_checksum(p) for p in ps]
    assert checksums.payload_checksums(ps) == want
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the parent's worker threads do not exist here
        ok = checksums.payload_checksums(ps) == want
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)


def test_hash_then_copy_vouches_for_the_sources(monkeypatch):
    """The checksums are of the sources (a destination's old bytes enter none); each
    destination then holds its source's bytes; large inputs on the pool, in order."""
    me = threading.get_ident()
    for n, nbytes, on_caller in ((2, 1 << 10, True), (12, 1 << 20, False)):
        seen = set()
        monkeypatch.setattr(checksums, "payload_checksum",
                            lambda p, seen=seen: seen.add(threading.get_ident()) or payload_checksum(p))
        srcs = _payloads(n, nbytes)
        dsts = [memoryview(np.full(nbytes, 0x5A, dtype=np.uint8)) for _ in range(n)]
        want = [payload_checksum(s) for s in srcs]
        assert checksums.hash_then_copy(srcs, dsts) == want
        assert all(bytes(d) == bytes(s) for s, d in zip(srcs, dsts))
        assert (seen == {me}) if on_caller else (me not in seen)


def test_hash_then_copy_refuses_other_sizes():
    import pytest

    with pytest.raises(ValueError, match="destination sizes"):
        checksums.hash_then_copy(_payloads(2, 16), [memoryview(bytearray(16)), memoryview(bytearray(15))])


def test_started_checksums_run_while_the_caller_works(monkeypatch):
    """The hashes run on the pool from the start call on; the wait returns them in order."""
    go, started = threading.Event(), threading.Semaphore(0)

    def gated(p):
        started.release()
        assert go.wait(10)
        return payload_checksum(p)
    monkeypatch.setattr(checksums, "payload_checksum", gated)
    ps = _payloads(12, 1 << 20)
    want = [payload_checksum(p) for p in ps]
    started_sums = checksums.start_payload_checksums(ps)
    assert started.acquire(timeout=10)  # hashing already, before anybody waits
    assert not started_sums.done()
    go.set()
    assert started_sums.result() == want
    assert started_sums.done()


def test_started_checksums_of_small_inputs_wait_on_the_calling_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(checksums, "payload_checksum", lambda p: seen.append(threading.get_ident()) or payload_checksum(p))
    ps = _payloads(3, 1 << 10)
    started_sums = checksums.start_payload_checksums(ps)
    assert started_sums.done()  # nothing to wait for: hashed when asked
    assert seen == []
    assert started_sums.result() == [payload_checksum(p) for p in ps]
    assert set(seen) == {threading.get_ident()}


def test_when_done_calls_back_once_after_the_last_hash(monkeypatch):
    go = threading.Event()

    def gated(p):
        assert go.wait(10)
        return payload_checksum(p)
    monkeypatch.setattr(checksums, "payload_checksum", gated)
    calls = []
    started_sums = checksums.start_payload_checksums(_payloads(12, 1 << 20))
    started_sums.when_done(lambda: calls.append(started_sums.done()))
    assert calls == []  # every hash is held
    go.set()
    started_sums.result()
    _eventually(lambda: calls)  # the callback runs on the hashing thread after the future is done
    assert calls == [True]
    small = checksums.start_payload_checksums(_payloads(2, 16))
    small.when_done(lambda: calls.append("now"))
    assert calls == [True, "now"]


def test_hash_then_copy_takes_known_checksums_as_they_are(monkeypatch):
    """A source whose checksum the device computed is copied, not hashed again."""
    hashed = []
    monkeypatch.setattr(checksums, "payload_checksum", lambda p: hashed.append(bytes(p[:8])) or payload_checksum(p))
    for n, nbytes in ((3, 1 << 10), (12, 1 << 20)):
        hashed.clear()
        srcs = _payloads(n, nbytes)
        dsts = [memoryview(np.zeros(nbytes, dtype=np.uint8)) for _ in range(n)]
        known = [None if i % 2 else 1000 + i for i in range(n)]  # deliberately not the bytes' checksums
        got = checksums.hash_then_copy(srcs, dsts, known)
        assert got == [k if k is not None else payload_checksum(s) for k, s in zip(known, srcs)]
        assert sorted(hashed) == sorted(bytes(s[:8]) for k, s in zip(known, srcs) if k is None)
        assert all(bytes(d) == bytes(s) for s, d in zip(srcs, dsts))


def test_joined_checksums_in_order_and_called_back_once_after_the_last_part(monkeypatch):
    go = threading.Event()

    def gated(p):
        assert go.wait(10)
        return payload_checksum(p)
    monkeypatch.setattr(checksums, "payload_checksum", gated)
    a, b = _payloads(12, 1 << 20), _payloads(13, 1 << 20)
    joined = checksums.join_checksums([checksums.start_payload_checksums(a), checksums.start_payload_checksums(b)])
    calls = []
    joined.when_done(lambda: calls.append(joined.done()))
    assert calls == [] and not joined.done()
    go.set()
    assert joined.result() == [payload_checksum(p) for p in a + b]
    _eventually(lambda: calls)
    assert calls == [True]
