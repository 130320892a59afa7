"""Random operations against the server's state machine (no processes), invariants after each.

Invariants: live blocks never overlap and the allocator's count equals them plus
the quarantine; every committed object still holds exactly the bytes written;
an object's pin count equals the pins its leases hold; a lookup's hit is
exactly the largest one every group's need allows (recomputed independently, by
brute force), and its lease pins exactly the objects that hit needs.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from srvutil import keys_for, make_object

from vllm_kvplugin.chunk.rules import GroupNeed, Need
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.server.config import config_from_args
from vllm_kvplugin.server.leases import RequestError
from vllm_kvplugin.server.objects import READY, RESERVED
from vllm_kvplugin.server.protocol import LookupRep, object_id
from vllm_kvplugin.server.store import Store

PREFIX = [GroupNeed(Need.PREFIX)]
#: a hybrid model: attention, a sliding window of two chunks, a recurrent state
HYBRID = [GroupNeed(Need.PREFIX), GroupNeed(Need.WINDOW, 2), GroupNeed(Need.POINT)]

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]


def _live_blocks(st: Store) -> dict[int, int]:
    seen: dict[int, object] = {}
    for e in st.objs.values():
        seen[id(e)] = e
    for lease in st.leases.values():
        for e in lease.pinned.values():
            seen[id(e)] = e
    for p in st.pending:
        for e in p.pinned.values():
            seen[id(e)] = e
    blocks = {}
    for e in seen.values():
        if e.block >= 0:
            assert e.block not in blocks, "two objects share a block"
            blocks[e.block] = e.bsize
    return blocks


def _check(st: Store, written: dict[bytes, bytes]) -> None:
    blocks = _live_blocks(st)
    spans = sorted(blocks.items()) + sorted((off, size) for _, off, size in st.quarantine)
    spans.sort()
    for (a, asz), (b, _) in zip(spans, spans[1:]):
        assert a + asz <= b, "overlapping blocks"
    assert st.alloc.used == sum(size for _, size in spans)
    pins: dict[int, int] = {}
    for lease in st.leases.values():
        for e in lease.pinned.values():
            pins[id(e)] = pins.get(id(e), 0) + 1
    for e in st.objs.values():
        assert e.pins == pins.get(id(e), 0), "pin count differs from the leases' pins"
        if e.state == READY:
            data = bytes(st.pool[e.offset:e.offset + e.nbytes])
            assert data == written[e.oid], "a committed object's bytes changed"
            assert (e.oid in st.lru) == (e.pins == 0)


def _needed(need: GroupNeed, hit: int, first: int) -> list[int]:
    """Positions a group needs for a hit (written out again, not taken from chunk.rules)."""
    if need.need is Need.PREFIX:
        return list(range(first, hit))
    if need.need is Need.WINDOW:
        return [p for p in range(hit - need.window, hit) if p >= first]
    return [hit - 1]


def _expected_hit(st: Store, keys: list[bytes], needs, ranks: int, world: int, first: int) -> int:
    """Brute force: the largest hit whose every needed object of every rank is READY."""
    def ok(pos: int, g: int) -> bool:
        for r in range(ranks):
            e = st.objs.get(object_id(keys[pos], g, r, world))
            if e is None or e.state != READY or e.doomed:
                return False
        return True

    for hit in range(len(keys), first, -1):
        if all(ok(p, g) for g, need in enumerate(needs) for p in _needed(need, hit, first)):
            return hit
    return 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_store_random_operations(tmp_path, seed):
    rng = random.Random(seed)
    cfg = config_from_args(["--listen", str(tmp_path / "s"), "--l1-bytes", "2MiB", "--lease-s", "5",
                            "--heartbeat-s", "1", "--reserve-s", "4", "--quarantine-s", "1",
                            "--high-watermark", "0.9", "--low-watermark", "0.7"])
    pool = memoryview(bytearray(2 << 20))
    st = Store(cfg, pool, -1)
    now = 0.0
    st.now = now
    sessions = [st.hello(f"c{i}".encode(), f"c{i}", i, now) for i in range(3)]
    prompts = [keys_for(seed * 100 + i, rng.randint(1, 40)) for i in range(8)]
    geometry = (3, 2, 2)  # groups, ranks, world
    written: dict[bytes, bytes] = {}
    leases: list[int] = []
    for step in range(1500):
        op = rng.random()
        # a reaped client's requests never reach the store (the server answers hello_required)
        sessions = [x if st.sessions.get(x.ident) is x else st.hello(x.ident + b"'", "re", 0, now)
                    for x in sessions]
        s = rng.choice(sessions)
        g, r, w = geometry
        if op < 0.35:  # store a prompt's next chunks (some objects left out or aborted)
            keys = rng.choice(prompts)
            oids = [object_id(k, gg, rr, w) for k in keys[:rng.randint(1, len(keys))]
                    for gg in range(g) for rr in range(r) if gg == 0 or rng.random() < 0.7]
            nb = rng.choice([1000, 3000, 20000])
            sizes = [HEADER_SIZE + nb] * len(oids)
            offs, epochs = st.reserve(s, b"".join(oids), sizes, now)
            mine = [(o, off, ep) for o, off, ep in zip(oids, offs, epochs) if off >= 0]
            for o, off, _ep in mine:
                h, pl = make_object(o, nb)
                pool[off:off + HEADER_SIZE + nb] = h + pl
                written[o] = h + pl
            fate = rng.random()
            if fate < 0.8:
                picked = [(o, ep) for o, _off, ep in mine if rng.random() < 0.97]
                st.commit(s, b"".join(o for o, _ in picked), [ep for _, ep in picked])
            elif fate < 0.9:
                st.abort(s, b"".join(o for o, _off, _ep in mine))
            # else: left reserved (times out or is reaped)
        elif op < 0.6:  # lookup, checked against an independent count
            keys = rng.choice(prompts)
            keys = keys[:rng.randint(0, len(keys))]
            needs = rng.choice([PREFIX, HYBRID, HYBRID[1:]])
            first = rng.randint(0, max(0, len(keys) - 1))
            want = _expected_hit(st, keys, needs, r, w, first)
            rep = st.lookup(s, b"".join(keys), needs, r, w, first, 0.0, s.ident, 0, [], now)
            assert isinstance(rep, LookupRep) and rep.hits == want
            if rep.lease:
                leases.append(rep.lease)
                lease = st.leases[rep.lease]
                assert set(lease.pinned) == {object_id(keys[p], gg, rr, w) for gg, need in enumerate(needs)
                                             for p in _needed(need, rep.hits, first) for rr in range(r)}
                gg = len(needs) - 1
                pos = _needed(needs[gg], rep.hits, first)
                offsets, sizes = st.resolve(rep.lease, b"".join(keys[p] for p in pos), gg, 1, w, now)
                for p, off, n in zip(pos, offsets, sizes):
                    assert bytes(pool[off:off + n]) == written[object_id(keys[p], gg, 1, w)]
                with pytest.raises(RequestError):  # an object the lease does not pin
                    st.resolve(rep.lease, b"".join(keys[p] for p in pos) + os.urandom(32), gg, 0, w, now)
        elif op < 0.75 and leases:
            st.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.8:  # a client goes silent and is reaped; a new one appears
            victim = sessions.pop(rng.randrange(len(sessions)))
            st.reap(victim, "reaped")
            sessions.append(st.hello(f"c{step}".encode(), "new", step, now))
        else:
            now += rng.choice([0.01, 0.2, 1.5])
            for s2 in sessions:
                if rng.random() < 0.9:
                    s2.last_seen = now
            st.tick(now)
        leases = [lid for lid in leases if lid in st.leases]
        _check(st, written)
    for lid in list(st.leases):
        st.release(lid)
    for s in list(st.sessions.values()):
        st.reap(s, "reaped")
    st.tick(now + 100)
    assert all(e.state == READY and e.pins == 0 for e in st.objs.values()), [(e.state, e.pins, e.owner) for e in st.objs.values() if e.state != READY or e.pins]
    assert st.alloc.used == sum(e.bsize for e in st.objs.values())
    assert not [e for e in st.objs.values() if e.state == RESERVED]


def test_store_with_l2_random_operations(tmp_path):
    """The same with L2 on: writer and readers are real threads; eviction goes through L2."""
    rng = random.Random(7)
    cfg = config_from_args(["--listen", str(tmp_path / "s"), "--l1-bytes", "1MiB",
                            "--l2-dir", str(tmp_path / "l2"), "--l2-bytes", "3MiB"])
    pool = memoryview(bytearray(1 << 20))
    r_fd, w_fd = os.pipe()
    os.set_blocking(w_fd, False)
    st = Store(cfg, pool, w_fd)
    s = st.hello(b"c", "c", 1, 0.0)
    prompts = [keys_for(500 + i, rng.randint(5, 30)) for i in range(10)]
    written: dict[bytes, bytes] = {}
    for _step in range(300):
        keys = rng.choice(prompts)
        if rng.random() < 0.5:
            oids = [object_id(k, 0, 0, 1) for k in keys]
            offs, epochs = st.reserve(s, b"".join(oids), [HEADER_SIZE + 8000] * len(oids), 0.0)
            ok = []
            for o, off, ep in zip(oids, offs, epochs):
                if off >= 0:
                    h, pl = make_object(o, 8000)
                    pool[off:off + HEADER_SIZE + 8000] = h + pl
                    written[o] = h + pl
                    ok.append((o, ep))
            st.commit(s, b"".join(o for o, _ in ok), [ep for _, ep in ok])
        else:
            rep = st.lookup(s, b"".join(keys), PREFIX, 1, 1, 0, 5.0, b"c", 0, [], 0.0)
            deadline = time.monotonic() + 10
            while not isinstance(rep, LookupRep):
                assert time.monotonic() < deadline
                time.sleep(0.002)
                st.process_l2()
                done = st.poll_pending(0.0)
                if done:
                    rep = done[0][1]
            if rep.lease:
                offsets, sizes = st.resolve(rep.lease, b"".join(keys[:rep.hits]), 0, 0, 1, 0.0)
                for k, off, n in zip(keys, offsets, sizes):
                    assert bytes(pool[off:off + n]) == written[object_id(k, 0, 0, 1)]
                st.release(rep.lease)
        st.process_l2()
        st.tick(0.0)
        _check(st, written)
    assert st.stats["l1_evictions"] > 0 and st.stats["l2_promoted_objects"] > 0
    assert st.stats["l2_corrupt_files"] == 0 and st.stats["l1_corrupt_objects"] == 0
    st.workers.stop(5)
    os.close(r_fd)
    os.close(w_fd)


class _CountingDict(dict):
    """``objs`` that counts its lookups."""

    def __init__(self, *a):
        super().__init__(*a)
        self.gets = 0

    def get(self, key, default=None):
        self.gets += 1
        return super().get(key, default)


def test_a_tick_touches_only_what_is_due(tmp_path):
    """A client holding many reservations and leases must not slow every tick (each scanned all
    of them, every 50 ms, and another client's heartbeat waited seconds): a tick looks up only
    the reservations due, and reservations and leases still expire when due, an extended lease
    at its new deadline."""
    cfg = config_from_args(["--listen", str(tmp_path / "s"), "--l1-bytes", "64MiB", "--lease-s", "5",
                            "--reserve-s", "4", "--quarantine-s", "1"])
    st = Store(cfg, memoryview(bytearray(64 << 20)), -1)
    st.now = 0.0
    s = st.hello(b"c", "c", 1, 0.0)
    keys = keys_for(7, 2)
    for k in keys:
        oid = object_id(k, 0, 0, 1)
        (off,), (ep,) = st.reserve(s, oid, [HEADER_SIZE + 100], 0.0)
        h, pl = make_object(oid, 100)
        st.pool[off:off + HEADER_SIZE + 100] = h + pl
        st.commit(s, oid, [ep])
    rep = st.lookup(s, b"".join(keys), PREFIX, 1, 1, 0, 0.0, b"c", 0, [], 0.0)
    assert rep.lease and st.stats["leases_created"] == 1
    many = [object_id(k, 0, 0, 1) for k in keys_for(8, 20_000)]
    st.reserve(s, b"".join(many[:10_000]), [HEADER_SIZE + 1] * 10_000, 0.0)
    st.reserve(s, b"".join(many[10_000:]), [HEADER_SIZE + 1] * 10_000, 2.0)
    st.objs = counted = _CountingDict(st.objs)

    def tick(now: float) -> None:
        s.last_seen = now  # the client's heartbeats (a silent one is reaped)
        st.tick(now)

    for now in (0.5, 1.0, 1.5, 3.0, 3.9):
        tick(now)
    st.resolve(rep.lease, b"".join(keys), 0, 0, 1, 3.9)  # extends the lease to 8.9
    assert counted.gets == 0 and len(s.reserved) == 20_000
    tick(4.5)  # the first 10,000 are due, not the rest: looked up twice each (due, reclaimed)
    assert counted.gets <= 2 * 10_000 + 16 and len(s.reserved) == 10_000
    assert st.stats["reservations_timed_out"] == 10_000
    tick(6.5)
    assert len(s.reserved) == 0 and st.stats["leases_expired"] == 0  # extended at 3.9: due at 8.9
    tick(9.0)
    assert st.stats["leases_expired"] == 1 and not st.leases
    tick(10.0)
    assert not st.quarantine and st.alloc.used == sum(e.bsize for e in st.objs.values())
