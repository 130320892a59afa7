"""A lone request's hit in two parts (``connector/scheduler_lone.py``): its first chunks are keyed,
read and sent before the rest are keyed; one fetch, one verdict over both parts in order.  The
integrity issue's prompt P (8 chunks + 10 tokens, ``test_integrity``) on a real engine, every
output compared with an engine without the connector's, on poisoned KV."""

from __future__ import annotations

import contextlib
import functools

import pytest
from harness import Probe, engine, generate, server_stats, shutdown
from test_cache_hits import _baseline
from test_integrity import BLOCK, CHUNK, P, _local_flip

import vllm_kvplugin
from vllm_kvplugin import counters
from vllm_kvplugin.chunk.keys import chunk_keys

pytestmark = pytest.mark.engine


def _repeat(llm, probe, events: list, want: list[int], hit: int) -> None:
    """P again on poisoned KV: the right output from a hit of ``hit`` chunks, whose load's target
    blocks were poisoned first; ``events`` cleared before it; its stores finished after it."""
    probe.poison_all_blocks(seed=len(probe.loads))
    events.clear()
    r = generate(llm, [P])[0]
    assert r.token_ids == want and r.num_cached_tokens == hit * CHUNK
    assert probe.loads[-1][1] == hit * CHUNK
    assert probe.worker.finisher.drain(30)


@contextlib.contextmanager
def _served(model: str, address: str, events: list):
    """An engine whose only tier is the cache server at ``address`` (the counters reset first),
    which has computed P and stored it there: yields ``(probe, run)``, ``run(hit)`` being
    :func:`_repeat` against the output of an engine without the connector."""
    want = _baseline(model, BLOCK, [[P]], budget=CHUNK)[0]
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": address}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            assert probe.worker.finisher.drain(30)
            yield probe, functools.partial(_repeat, llm, probe, events, want)
        finally:
            shutdown(llm)


def test_a_lone_hits_first_chunks_are_read_before_the_rest_are_keyed(qwen3_model, monkeypatch):
    """P's repeat, alone in the engine: the scheduler keys its first 4 chunks
    (``FIRST_PART_CHUNKS``), the worker reads them (on a GPU: starts their copy), and only then
    are the other 4 keyed, planned, pinned and read; the hit is claimed whole in that step.  A
    byte flipped in chunk 6 (the second part), then in chunk 1 (the first): the verdict ends the
    hit before it (6, then 1 chunk), the object is dropped, the output is right and the next run
    hits in full.  ``FIRST_PART_CHUNKS = 0`` keys the prompt whole before the first read."""
    from vllm_kvplugin.connector import metadata as mmod
    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.connector import scheduler_lone as lmod
    from vllm_kvplugin.connector import worker as wmod

    want = _baseline(qwen3_model, BLOCK, [[P]], budget=CHUNK)[0]
    events: list[tuple[str, int]] = []
    for mod in (smod, lmod):
        def keys(*a, _orig=mod.chunk_keys, **k):
            out = _orig(*a, **k)
            events.append(("keys", len(out)))
            return out
        monkeypatch.setattr(mod, "chunk_keys", keys)
    read = wmod.WorkerSide._object
    monkeypatch.setattr(wmod.WorkerSide, "_object",
                        lambda ws, job, view: events.append(("read", job.position)) or read(ws, job, view))
    reads = [("read", n) for n in range(8)]
    counters.STATS.reset()
    with Probe().installed() as probe:
        llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK}, budget=CHUNK)
        try:
            assert generate(llm, [P])[0].token_ids == want
            assert probe.worker.finisher.drain(30)
            run = functools.partial(_repeat, llm, probe, events, want)

            run(8)
            assert events == [("keys", 4), *reads[:4], ("keys", 4), *reads[4:]], events
            s = vllm_kvplugin.stats()
            assert s["lone_fetches"] == 1 and s["split_fetches"] == 1 and s["load_failures"] == {}
            for bad, failures in ((6, 1), (1, 2)):
                flip, _ = _local_flip(probe, P, bad)
                flip()
                run(bad)
                assert events[:len(reads) + 2] == [("keys", 4), *reads[:4], ("keys", 4), *reads[4:]], events
                s = vllm_kvplugin.stats()
                assert s["load_failures"] == {"checksum": failures} and s["dropped_objects"] == failures
                run(8)  # stored again where it failed
            monkeypatch.setattr(mmod, "FIRST_PART_CHUNKS", 0)
            run(8)
            assert events == [("keys", 8), *reads], events
            s = vllm_kvplugin.stats()
            assert s["lone_fetches"] == 6 and s["split_fetches"] == 5, s
            assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
        finally:
            shutdown(llm)


@pytest.fixture
def server():
    import os
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from srvutil import ServerProc

    with tempfile.TemporaryDirectory(prefix="kvs-split-", dir="/tmp") as d:
        s = ServerProc(d, "--l1-bytes", "256MiB", "--l2-dir", os.path.join(d, "l2")).start()
        yield s
        s.stop()


def test_a_lone_server_hit_is_resolved_read_and_sent_in_two_parts(qwen3_model, server, monkeypatch):
    """P's repeat, alone in an engine whose only tier is the cache server: the server's answer
    covers all 8 chunks, and the worker resolves, reads and sends the first 4 (``first_part``)
    before it resolves and reads the other 4 -- one fetch, one verdict over both parts in order
    (resolved where the lookup placed them: the worker sends the server no resolve).
    A byte flipped in chunk 3 (the first part) on the server ends the hit before it, the object
    is dropped there, the output is right on poisoned KV and the next run hits in full.
    ``FIRST_PART_CHUNKS = 0``: one resolve of all 8 first."""
    from test_integrity import _server_flip

    from vllm_kvplugin.connector import metadata as mmod
    from vllm_kvplugin.connector import worker as wmod

    events: list[tuple[str, object]] = []
    resolve, read, send = wmod.WorkerSide._resolve_remote, wmod.WorkerSide._object, wmod.WorkerSide._prefetch
    monkeypatch.setattr(wmod.WorkerSide, "_resolve_remote", lambda ws, jobs, views: events.append(
        ("resolve", [j.position for j in jobs if j.lease])) or resolve(ws, jobs, views))
    monkeypatch.setattr(wmod.WorkerSide, "_object",
                        lambda ws, job, view: events.append(("read", job.position)) or read(ws, job, view))
    monkeypatch.setattr(wmod.WorkerSide, "_prefetch", lambda ws, jobs, found, sent: events.append(
        ("send", sorted(jobs[n].position for n in found))) or send(ws, jobs, found, sent))
    first = [("resolve", [0, 1, 2, 3]), *[("read", n) for n in range(4)], ("send", [0, 1, 2, 3])]
    second = [("resolve", [4, 5, 6, 7]), *[("read", n) for n in range(4, 8)], ("send", [4, 5, 6, 7])]
    with _served(qwen3_model, server.address, events) as (probe, run):
        run(8)
        assert events == first + second, events
        assert vllm_kvplugin.stats()["lone_fetches"] == 1
        flip, client = _server_flip(probe, P, server.address)  # (which resolves one object)
        try:
            st = client.stats()  # one rank: the lookup placed every object, the worker resolved none
            assert st["resolves"] == 1 and st["lookup_resolves"] >= 1, st
            flip()
            run(3)
            assert events[:len(first) + len(second)] == first + second, events
            s = vllm_kvplugin.stats()
            assert s["load_failures"] == {"checksum": 1}, s
        finally:
            client.close()
        run(8)  # stored again where it failed
        monkeypatch.setattr(mmod, "FIRST_PART_CHUNKS", 0)
        run(8)
        assert events == [("resolve", list(range(8))), *[("read", n) for n in range(8)],
                          ("send", list(range(8)))], events
        assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches


def test_placements_past_their_time_or_of_a_server_since_restarted(qwen3_model, server, monkeypatch):
    """The two guards on a lookup's placements (``Placement``), in an engine whose only tier is
    the cache server, P repeated alone, unsplit, on poisoned KV:

    * a placement past ``until`` (the lookup older than half a lease; made so here, a timing
      this test cannot wait for): the worker resolves the objects itself (one resolve on the
      server) and the hit is whole and right;
    * a byte of chunk 3 flipped in the pool, and the server killed and restarted (same L2
      directory) after the worker took its views and before the verdict: the hit ends before
      chunk 3, read from the killed server's pool, and the corrupt object is not dropped on the
      new server, whose own copy (from L2) is good; the next repeat hits in full."""
    import dataclasses
    import time

    from test_integrity import _server_flip

    from vllm_kvplugin.connector import metadata as mmod
    from vllm_kvplugin.connector import worker as wmod
    from vllm_kvplugin.tiers import mp
    from vllm_kvplugin.tiers.mp_client import MPClient, TierUnavailable

    monkeypatch.setattr(mmod, "FIRST_PART_CHUNKS", 0)
    events: list[tuple[str, object]] = []

    def server_hits() -> int:
        with MPClient(server.address, client_name="test-hits") as c:
            keys = chunk_keys(probe.worker.fingerprint, P, CHUNK)
            r = c.lookup_detail(keys, [(0, 0)])  # the prefix of the one group
            c.release(r.lease)
            return r.hits

    with _served(qwen3_model, server.address, events) as (probe, run):
        before = server_stats(server.address)["resolves"]
        run(8)  # placed: no resolve from the worker
        assert server_stats(server.address)["resolves"] == before

        lookup = mp.ServerIndex.lookup
        monkeypatch.setattr(mp.ServerIndex, "lookup", lambda ix, *a, **k: dataclasses.replace(
            lookup(ix, *a, **k), placed_until=time.monotonic() - 1.0))
        run(8)
        assert server_stats(server.address)["resolves"] == before + 1
        monkeypatch.setattr(mp.ServerIndex, "lookup", lookup)

        flip, client = _server_flip(probe, P, server.address)
        resolve = wmod.WorkerSide._resolve_remote

        def resolve_then_restart(ws, jobs, views):
            resolve(ws, jobs, views)
            assert all(j.placed is not None for j in jobs if j.lease)
            monkeypatch.setattr(wmod.WorkerSide, "_resolve_remote", resolve)
            server.kill9()
            server.start()
            with pytest.raises(TierUnavailable):  # the worker's client meets the new instance
                ws.server._client.stats()
            assert server_hits() == 8  # the new server's copies, from L2

        try:
            flip()
        finally:
            client.close()
        monkeypatch.setattr(wmod.WorkerSide, "_resolve_remote", resolve_then_restart)
        run(3)
        s = vllm_kvplugin.stats()
        assert s["load_failures"] == {"checksum": 1}, s
        assert server_stats(server.address)["dropped_reported_corrupt"] == 0  # not dropped on the new server
        run(8)
        assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches


def test_a_lone_lookup_here_that_finds_objects_still_coming_is_asked_again_on_the_index_thread(
        qwen3_model, server, monkeypatch):
    """A lone request's lookup runs on vLLM's thread (``LOOKUP_HERE``), its server wait short
    (``LOOKUP_HERE_PROMOTION_WAIT_S``).  An answer saying objects were still on their way into
    the server's L1 (``promoting``; made so here on a real answer, a timing this test cannot
    cause for sure) is not planned: its lease is released and the index's thread asks again with
    the client's wait -- the hit whole, the output right on poisoned KV.  Without it, the
    repeat's lookup is one of vLLM's thread (``lone_server_lookups``)."""
    import dataclasses
    from concurrent.futures import Future

    from vllm_kvplugin.tiers import mp

    with _served(qwen3_model, server.address, []) as (probe, run):
        run(8)
        assert vllm_kvplugin.stats()["lone_server_lookups"] == 1

        now = mp.ServerIndex.lookup_now

        def still_coming(ix, *a, **k):
            done = now(ix, *a, **k)
            if done is None or done.exception() is not None:
                return done
            said = Future()
            said.set_result(dataclasses.replace(done.result(), promoting=1))
            return said

        monkeypatch.setattr(mp.ServerIndex, "lookup_now", still_coming)
        before = server_stats(server.address)
        run(8)
        after = server_stats(server.address)
        assert vllm_kvplugin.stats()["lone_server_lookups"] == 1  # not planned from that answer
        assert after["lookups"] - before["lookups"] == 2  # asked again
        assert after["leases_created"] - before["leases_created"] == 2
        assert not probe.kv_mismatches and probe.kv_checked > 0, probe.kv_mismatches
