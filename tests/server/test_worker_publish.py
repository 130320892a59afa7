"""The worker's publish step for server objects (``connector/worker_stores.py``), against a real
server process and its real shared pool: what a checksum written into the pool vouches for."""

from __future__ import annotations

import types

import pytest
import torch
from srvutil import keys_for, payload_for

from vllm_kvplugin import counters
from vllm_kvplugin.chunk.format import ChunkExpect, ChunkHeader, check_chunk, payload_checksum
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import StoreJob
from vllm_kvplugin.connector.worker_stores import StorePath
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE
from vllm_kvplugin.tiers.mp import ServerStore
from vllm_kvplugin.tiers.mp_client import MPClient

pytestmark = [pytest.mark.server, pytest.mark.newest_lane]

SHAPE = (2, 2, 16, 2, 16)  # L, KV, T, H, D of one bfloat16 object
NB = 2 * 2 * 16 * 2 * 16 * 2


def _expect(g: int, key: bytes, position: int) -> ChunkExpect:
    return ChunkExpect(b"F" * 32, key, 1, "bfloat16", SHAPE, 16 * position, 16 * (position + 1), 1, 0, g)


def test_objects_written_into_the_pool_are_vouched_for_by_the_device_digest_only(server_factory):
    """Three objects of one store: two the device copied straight into their pool room (their
    source is that room), one gathered into this process's own memory.  The first has the
    device's digest of the bytes it computed, and a foreign write lands in its room before the
    publish: its header carries the device's digest, not a hash of the pool, so a reader refuses
    the changed bytes.  The second has no device digest: it is aborted, never committed (the
    pool's bytes are never hashed).  The third is hashed in private memory and copied in."""
    srv = server_factory("--l1-bytes", "16MiB")
    cfg = KVPluginConfig.from_extra_config({"server": srv.address, "cpu_bytes": 0})
    ws = ServerStore(cfg, rank=0, world=1, name="worker", pin_for_cuda=False)
    try:
        keys = keys_for(64, 3)
        jobs = [StoreJob(k, i, 0, (i,), 16 * i, 16 * (i + 1), to_server=True) for i, k in enumerate(keys)]
        targets = ws.reserve(jobs, [(ws.object_id(k, 0), HEADER_SIZE + NB) for k in keys])
        assert len(targets) == 3
        computed = [payload_for(ws.object_id(k, 0), NB) for k in keys]
        for t, pl in zip(targets[:2], computed):  # the device's DMAs into the pool
            t.payload.copy_(torch.frombuffer(bytearray(pl), dtype=torch.uint8))
        private = torch.frombuffer(bytearray(computed[2]), dtype=torch.uint8)
        known = {targets[0].payload.data_ptr(): payload_checksum(computed[0])}
        targets[0].payload[100] ^= 0x5A  # a stalled writer's late copy lands in the room
        worker = types.SimpleNamespace(server=ws, _expect=_expect)
        errors = counters.WORKER.snapshot()["server_store_errors"]

        published = StorePath._publish(worker, targets, [targets[0].payload, targets[1].payload, private], known)

        assert published == 2 * NB
        assert counters.WORKER.snapshot()["server_store_errors"] == errors + 1
        first = ChunkHeader.unpack(bytes(targets[0].header))
        assert first.checksum == payload_checksum(computed[0])
        assert first.checksum != payload_checksum(bytes(targets[0].payload))
        with pytest.raises(Exception, match="checksum"):
            check_chunk(bytes(targets[0].header), bytes(targets[0].payload), _expect(0, keys[0], 0))
        assert bytes(targets[2].payload) == computed[2]
        check_chunk(bytes(targets[2].header), bytes(targets[2].payload), _expect(0, keys[2], 2))
        with MPClient(srv.address) as c:
            st = c.stats()
            assert st["objects"] == 2 and st["aborted_objects"] == 1, st
            hits, lease = c.lookup(keys, 1, 1, 1)
            assert hits == 1  # the second is not there, so the prefix ends before it
            c.release(lease)
    finally:
        ws.close()
