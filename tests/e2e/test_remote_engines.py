"""Engines on two "machines" sharing KV through one Redis (the seeds' method).

Cache server A and cache server B have their own pools (as on two machines) and one
remote store.  Engine A, in its own process, generates the prompts through server A:
their chunks go through to Redis.  Engine B, through server B, then runs each prompt
with every KV block overwritten with noise first: its hit comes from Redis (B never saw
the prompts), and its output must equal engine A's and a no-connector engine's.  With
the loads skipped on purpose the output changes (the hit matters).  Redis killed
afterwards: B goes on serving right outputs from its own pool.  With one Redis node and
with a 3-node Redis Cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Probe, engine, generate, prompt, shutdown
from test_server_tier import workdir  # noqa: F401  (fixture)

import vllm_kvplugin
from vllm_kvplugin.planner import max_loadable_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from redisutil import RedisCluster, RedisProc  # noqa: E402
from srvutil import ServerProc, wait_for  # noqa: E402

from vllm_kvplugin.tiers.mp_client import MPClient  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.redis, pytest.mark.newest_lane]

CHUNK = 64
BLOCK = 32
CHILD = Path(__file__).with_name("store_child.py")


def _engine_a(model: str, server: str, prompts: list[list[int]], workdir: str) -> dict:  # noqa: F811
    path = os.path.join(workdir, "prompts.json")
    Path(path).write_text(json.dumps(prompts))
    argv = [sys.executable, str(CHILD), "--model", model, "--chunk", str(CHUNK), "--block", str(BLOCK),
            "--server", server, "--prompts", path]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd="/",
                         env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])


@pytest.mark.parametrize("kind", ["node", "cluster"])
def test_engine_b_hits_what_engine_a_stored_through_redis(qwen3_model, workdir, kind):  # noqa: F811
    """One Redis node, and a 3-node Redis Cluster."""
    redis = (RedisProc(workdir) if kind == "node" else RedisCluster(workdir)).start()
    servers = [ServerProc(workdir, "--l1-bytes", "256MiB", "--remote", redis.url,
                          listen=f"unix://{workdir}/{name}.sock").start() for name in ("a", "b")]
    sa, sb = servers
    try:
        lengths = [4 * CHUNK, 4 * CHUNK + 1, 9 * CHUNK + 4]
        prompts = [prompt(n, seed=900 + n) for n in lengths]
        ref = engine(qwen3_model, BLOCK, None, budget=CHUNK)
        try:
            want = [generate(ref, [p])[0].token_ids for p in prompts]
        finally:
            shutdown(ref)
        a = _engine_a(qwen3_model, sa.address, prompts, workdir)
        assert a["outputs"] == want and a["cached"] == [0, 0, 0] and a["stored_tokens"] > 0
        with MPClient(sa.address) as c:
            wait_for(lambda: (s := c.stats())["remote_queued_puts"] == 0 and s["remote_puts"] > 0, timeout=30)
            assert c.stats()["remote_put_errors"] == 0
        with Probe().installed() as probe:
            llm = engine(qwen3_model, BLOCK, {"chunk_size": CHUNK, "cpu_bytes": 0, "server": sb.address},
                         budget=CHUNK)
            try:
                bpt = None
                for n, p, expect in zip(lengths, prompts, want):
                    probe.poison_all_blocks(seed=n)
                    before, loads_before = vllm_kvplugin.stats(), len(probe.loads)
                    warm = generate(llm, [p])[0]
                    after = vllm_kvplugin.stats()
                    bpt = bpt or sum(lay.bytes_per_token for lay in probe.worker.layouts)
                    hit = max_loadable_tokens(n, CHUNK)
                    assert warm.token_ids == expect, n
                    assert warm.num_cached_tokens == hit, (n, warm.num_cached_tokens)
                    assert after["server_hit_tokens"] - before["server_hit_tokens"] == hit
                    assert after["loaded_bytes"] - before["loaded_bytes"] == hit * bpt
                    # the load's target tokens were overwritten with noise right before it
                    assert [t for _, t in probe.loads[loads_before:]] == [hit], n
                assert not probe.kv_mismatches
                with MPClient(sb.address) as c:
                    s = c.stats()
                assert s["remote_hit_objects"] > 0 and s["remote_get_failures"] == 0
                # the hit matters: claimed but not written, the output differs
                probe.skip_loads = True
                bad = generate(llm, [prompts[2]])[0]  # B's pool holds it now: a hit, nothing written
                assert bad.num_cached_tokens == max_loadable_tokens(lengths[2], CHUNK)
                assert bad.token_ids != want[2]
                probe.skip_loads = False
                # the store dies: B still serves right outputs, and stores and hits in its own pool
                redis.kill9()
                q = prompt(5 * CHUNK + 3, seed=77)
                ref_q = generate(llm, [q])[0]
                probe.poison_all_blocks(seed=5)
                again = generate(llm, [q])[0]
                assert again.token_ids == ref_q.token_ids and again.num_cached_tokens == 5 * CHUNK
                probe.poison_all_blocks(seed=6)
                assert generate(llm, [prompts[0]])[0].token_ids == want[0]
            finally:
                shutdown(llm)
    finally:
        for s in servers:
            s.stop()
        redis.stop()
