"""Parallel payload checksums: the same values, in order, as the one-thread function; large
payloads hashed by the compiled op (the GIL released) with the library's values."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from vllm_kvplugin import ops
from vllm_kvplugin.chunk import checksums
from vllm_kvplugin.chunk.format import SEGMENT_BYTES, payload_checksum


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
    monkeypatch.setattr(checksums, "checksum",
                        lambda p: seen.add(threading.get_ident()) or payload_checksum(p))
    ps = _payloads(3, 1 << 10)
    assert checksums.payload_checksums(ps) == [payload_checksum(p) for p in ps]
    assert seen == {threading.get_ident()}


def test_large_inputs_hashed_on_the_pool_in_order(monkeypatch):
    seen = set()
    monkeypatch.setattr(checksums, "checksum",
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
        monkeypatch.setattr(checksums, "checksum",
                            lambda p, seen=seen: seen.add(threading.get_ident()) or payload_checksum(p))
        srcs = _payloads(n, nbytes)
        dsts = [memoryview(np.full(nbytes, 0x5A, dtype=np.uint8)) for _ in range(n)]
        want = [payload_checksum(s) for s in srcs]
        assert checksums.hash_then_copy(srcs, dsts) == want
        assert all(bytes(d) == bytes(s) for s, d in zip(srcs, dsts))
        assert (seen == {me}) if on_caller else (me not in seen)


def test_hash_then_copy_refuses_other_sizes():
    with pytest.raises(ValueError, match="destination sizes"):
        checksums.hash_then_copy(_payloads(2, 16), [memoryview(bytearray(16)), memoryview(bytearray(15))])


def test_started_checksums_run_while_the_caller_works(monkeypatch):
    """The hashes run on the pool from the start call on; the wait returns them in order."""
    go, started = threading.Event(), threading.Semaphore(0)

    def gated(p):
        started.release()
        assert go.wait(10)
        return payload_checksum(p)
    monkeypatch.setattr(checksums, "checksum", gated)
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
    monkeypatch.setattr(checksums, "checksum", lambda p: seen.append(threading.get_ident()) or payload_checksum(p))
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
    monkeypatch.setattr(checksums, "checksum", gated)
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
    monkeypatch.setattr(checksums, "checksum", lambda p: hashed.append(bytes(p[:8])) or payload_checksum(p))
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
    monkeypatch.setattr(checksums, "checksum", gated)
    a, b = _payloads(12, 1 << 20), _payloads(13, 1 << 20)
    joined = checksums.join_checksums([checksums.start_payload_checksums(a), checksums.start_payload_checksums(b)])
    calls = []
    joined.when_done(lambda: calls.append(joined.done()))
    assert calls == [] and not joined.done()
    go.set()
    assert joined.result() == [payload_checksum(p) for p in a + b]
    _eventually(lambda: calls)
    assert calls == [True]


@pytest.mark.skipif(not ops.load().cpu.startswith("C++"),
                    reason="the compiled CPU op is not built (pip install --no-build-isolation)")
def test_large_payloads_are_hashed_by_the_op_with_the_library_values(monkeypatch):
    """A large, writable payload goes through ``kvplugin::segment_digests`` (one call, the GIL
    released); small or read-only ones through the library; every value the library's."""
    real = checksums._segment_op()
    assert real is not None
    calls = []
    monkeypatch.setattr(checksums, "_op", lambda t, seg: calls.append(t.numel()) or real(t, seg))
    rng = np.random.default_rng(7)
    sizes = [checksums.OP_MIN_BYTES, checksums.OP_MIN_BYTES + 12_345, 5 * SEGMENT_BYTES - 64, 9 * SEGMENT_BYTES]
    for n in sizes:
        raw = rng.integers(0, 256, n, dtype=np.uint8)
        want = payload_checksum(raw.tobytes())
        assert checksums.checksum(memoryview(raw)) == want, n
    assert calls == sizes
    calls.clear()
    half = torch.from_numpy(rng.standard_normal((3, 700_001)).astype(np.float16))  # a 2-D float16 view
    assert checksums.checksum(memoryview(half.numpy())) == payload_checksum(half.numpy().tobytes())
    assert calls == [half.numel() * 2]
    calls.clear()
    raw = rng.integers(0, 256, 2 * checksums.OP_MIN_BYTES, dtype=np.uint8)
    frozen = memoryview(raw.tobytes())  # read-only: the library
    small = memoryview(raw[:checksums.OP_MIN_BYTES - 1])
    assert checksums.checksum(frozen) == payload_checksum(raw.tobytes())
    assert checksums.checksum(small) == payload_checksum(raw[:checksums.OP_MIN_BYTES - 1].tobytes())
    assert checksums.payload_checksums([memoryview(raw)] * 2) == [payload_checksum(raw.tobytes())] * 2
    assert calls == [raw.nbytes] * 2  # the pool's hashes too
