"""Remote tier (Redis) benchmark: put/get GB/s, lookup latency at 1M tokens, warm TTFT.

    python benchmarks/remote_bench.py [--out benchmarks/results/remote-cpu.json] [--quick]

Starts a local ``redis-server`` (no persistence) and cache servers
(``python -m vllm_kvplugin.server --remote redis://...``), all on this machine, so the
"network" is loopback TCP: these are the costs of the store, the protocol and the copies,
not of a real network.

* **store put/get** (the server's remote worker path, :class:`RemoteStore`, one thread):
  put = ledger admission (Lua) + ``SET`` of the object from a memoryview; get = pipelined
  ``GET`` of a batch + copy into a buffer (the server's L1) + header/checksum verification.
  GB/s = object bytes / wall time, median of rounds; beside it the same bytes copied in
  memory (``memcpy``).
* **through two servers**: server A stores objects (the write-through drains in the
  background: A's commit-to-stored GB/s); server B, which never saw them, looks the
  prompt up: one probe, the reads into L1, verification, the lease (remote hit GB/s); the
  same lookup on A hits its L1.
* **lookup latency for a 1M-token prompt** (4,096 chunks of 256 tokens): B's probe when
  the store holds none of it (a miss: one pipelined round trip), when L1 holds all of it
  (no probe), and a 64-chunk prompt (16k tokens) missing everywhere.
* **warm TTFT** (the tiny Qwen3 on the CPU, one engine per server, in child processes):
  engine A computes prompts through server A; engine B through server B then asks for
  them (a hit through the store: probe + get + load), again (a hit in B's L1), and a
  prompt nobody has (recompute: probe included).  Side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import results_json  # noqa: E402
from server_bench import keys, machine_info, memcpy_gbps, pct, start_server, stop_server  # noqa: E402

from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, pack_header, payload_checksum  # noqa: E402
from vllm_kvplugin.server.protocol import object_id  # noqa: E402
from vllm_kvplugin.tiers.mp_client import MPClient  # noqa: E402

SIZES = {"tiny-qwen3 (512 KiB)": 512 << 10, "demo (8 MiB)": 8 << 20, "Qwen3-8B (37.7 MB)": 36 * 2 * 256 * 8 * 128 * 2}
FP = b"\0" * 32


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                          "--save", "", "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    for _ in range(200):
        if subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True).stdout.strip() == "PONG":
            return p, port
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def redis_version(port: int) -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "server"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("redis_version:")), "")


def objects(seed: int, n: int, nbytes: int) -> list[tuple[bytes, bytes]]:
    """(oid, [header | payload]) with a real checksum."""
    pl = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    ck = payload_checksum(pl)
    out = []
    for k in keys(seed, n):
        h = pack_header(key=k + b"\0" * 16, group=0, rank=0, world=1, payload_nbytes=nbytes, checksum=ck)
        out.append((object_id(k + b"\0" * 16, 0, 0, 1), h + pl))
    return out


def bench_store(port: int, nbytes: int, total: int, rounds: int) -> dict:
    from vllm_kvplugin.server.remote import (
        GET_BATCH_BYTES,
        RemoteStore,
        check_remote_object,
        parse_remote_url,
    )

    st = RemoteStore(parse_remote_url(f"redis://127.0.0.1:{port}", None))
    n = max(2, total // nbytes)
    puts, gets = [], []
    dest = bytearray(n * (HEADER_SIZE + nbytes))
    for rnd in range(rounds):
        objs = objects(1000 + rnd, n, nbytes)
        views = [memoryview(v) for _, v in objs]
        t0 = time.perf_counter()
        for (oid, _), v in zip(objs, views):
            assert st.put(st.key(FP, oid), v)[0] == "ok"
        puts.append(n * nbytes / (time.perf_counter() - t0) / 1e9)
        per = max(1, GET_BATCH_BYTES // (HEADER_SIZE + nbytes))
        t0 = time.perf_counter()
        off = 0
        for i in range(0, n, per):
            batch = objs[i:i + per]
            for (oid, _), value in zip(batch, st.get_many([st.key(FP, oid) for oid, _ in batch])):
                view = memoryview(dest)[off:off + len(value)]
                view[:] = value
                assert check_remote_object(oid, FP, view) is None
                off += len(value)
        gets.append(n * nbytes / (time.perf_counter() - t0) / 1e9)
        st.client.flushdb()
    st.close()
    return {"object_bytes": nbytes, "objects_per_round": n, "rounds": rounds,
            "put_gbps_median": round(statistics.median(puts), 3), "get_gbps_median": round(statistics.median(gets), 3),
            "put_gbps_all": [round(x, 3) for x in puts], "get_gbps_all": [round(x, 3) for x in gets],
            "memcpy_gbps_same_size": round(memcpy_gbps(nbytes, 20), 2)}


def _store_via(c: MPClient, objs) -> None:
    offs = c.reserve([(oid, len(v)) for oid, v in objs])
    assert all(o is not None for o in offs), "pool too small"
    for o, (_, v) in zip(offs, objs):
        c.pool_view()[o:o + len(v)] = v
    assert all(c.commit([oid for oid, _ in objs], offs))


def _wait(pred, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.002)


def bench_servers(a: MPClient, b: MPClient, nbytes: int, total: int, seed: int) -> dict:
    n = max(2, total // (HEADER_SIZE + nbytes))
    objs = objects(seed, n, nbytes)
    ks = [k + b"\0" * 16 for k in keys(seed, n)]
    before = a.stats()["remote_puts"]
    t0 = time.perf_counter()
    _store_via(a, objs)
    _wait(lambda: a.stats()["remote_puts"] - before >= n)
    write_through = n * nbytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    r = b.lookup_detail(ks, [(0, 0)], 1, 1, wait_s=30.0, fingerprint=FP)
    remote_s = time.perf_counter() - t0
    assert r.hits == n, (r.hits, n)
    b.release(r.lease)
    t0 = time.perf_counter()
    r = a.lookup_detail(ks, [(0, 0)], 1, 1, fingerprint=FP)
    l1_s = time.perf_counter() - t0
    a.release(r.lease)
    return {"object_bytes": nbytes, "objects": n, "write_through_gbps": round(write_through, 3),
            "remote_hit_lookup_s": round(remote_s, 4), "remote_hit_gbps": round(n * nbytes / remote_s / 1e9, 3),
            "l1_hit_lookup_s": round(l1_s, 5)}


def bench_lookup_1m(a: MPClient, b: MPClient, reps: int) -> dict:
    n = 4096
    miss = [k + b"\1" * 16 for k in keys(77, n)]
    lat_miss = []
    for _ in range(reps):
        t0 = time.perf_counter()
        assert b.lookup_detail(miss, [(0, 0)], 1, 1, fingerprint=FP).hits == 0
        lat_miss.append((time.perf_counter() - t0) * 1e3)
    small = objects(78, n, 512)
    ks = [k + b"\0" * 16 for k in keys(78, n)]
    _store_via(a, small)
    _wait(lambda: a.stats()["remote_queued_puts"] == 0)
    t0 = time.perf_counter()
    r = b.lookup_detail(ks, [(0, 0)], 1, 1, wait_s=30.0, fingerprint=FP)
    first_remote_ms = (time.perf_counter() - t0) * 1e3
    assert r.hits == n
    b.release(r.lease)
    lat_l1 = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = b.lookup_detail(ks, [(0, 0)], 1, 1, fingerprint=FP)
        lat_l1.append((time.perf_counter() - t0) * 1e3)
        b.release(r.lease)
    lat_64 = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.lookup_detail(miss[:64], [(0, 0)], 1, 1, fingerprint=FP)
        lat_64.append((time.perf_counter() - t0) * 1e3)
    return {"chunks": n, "miss_everywhere_probe_ms_p50": round(pct(lat_miss, 0.5), 2),
            "miss_everywhere_probe_ms_p99": round(pct(lat_miss, 0.99), 2),
            "all_in_store_first_lookup_ms (probe + 4096 gets of 512 B objects)": round(first_remote_ms, 2),
            "all_in_l1_ms_p50": round(pct(lat_l1, 0.5), 2),
            "miss_64_chunks_ms_p50": round(pct(lat_64, 0.5), 2)}


# ------------------------------------------------------------------ TTFT (child engines)
def child(server: str, lengths: list[int], role: str, chunk: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from ttft_common import tokens
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import vllm_kvplugin
    from vllm_kvplugin import tiny_model

    model = str(tiny_model.build(tiny_model.QWEN3))
    ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                           kv_connector_extra_config={"chunk_size": chunk, "cpu_bytes": 0, "server": server})
    max_len = max(lengths) + 64
    llm = LLM(model=model, enable_prefix_caching=False, max_model_len=max_len, enforce_eager=True,
              kv_cache_memory_bytes=2 << 30, block_size=32, kv_transfer_config=ktc, seed=0,
              max_num_batched_tokens=max_len)
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def once(p):
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, o

    once(tokens(300, 0))
    rows = []
    for n in lengths:
        p = tokens(n, n)
        if role == "a":
            once(p)
            continue
        remote, o1 = once(p)
        l1, o2 = once(p)
        cold, o3 = once(tokens(n, 10**6 + n))
        rows.append({"prompt_tokens": n, "recompute_s": round(cold, 4), "warm_remote_s": round(remote, 4),
                     "warm_l1_s": round(l1, 4), "remote_cached_tokens": int(o1.num_cached_tokens or 0),
                     "l1_cached_tokens": int(o2.num_cached_tokens or 0),
                     "same_first_token": o1.outputs[0].token_ids == o2.outputs[0].token_ids,
                     "recompute_cached_tokens": int(o3.num_cached_tokens or 0)})
    if role == "a":
        time.sleep(2.0)  # the write-through drains
    print("RESULT " + json.dumps({"rows": rows, "stats": vllm_kvplugin.stats()}), flush=True)


def bench_ttft(a_addr: str, b_addr: str, lengths: list[int], chunk: int) -> list[dict]:
    out = {}
    for role, addr in (("a", a_addr), ("b", b_addr)):
        r = subprocess.run([sys.executable, __file__, "--child", role, "--server", addr, "--lengths",
                            ",".join(map(str, lengths)), "--chunk", str(chunk)], capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            raise RuntimeError(f"engine {role} failed:\n{r.stderr[-3000:]}")
        out[role] = json.loads(line[0][7:])
    rows = out["b"]["rows"]
    for row in rows:
        row["remote_vs_recompute"] = round(row["recompute_s"] / row["warm_remote_s"], 2)
        row["remote_vs_l1"] = round(row["warm_remote_s"] / row["warm_l1_s"], 2)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "remote-cpu.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--lengths", default="2048,4097,8193,16385")
    ap.add_argument("--chunk", type=int, default=256)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.child:
        child(a.server, lengths, a.child, a.chunk)
        return 0
    total = (32 << 20) if a.quick else (256 << 20)
    rounds = 2 if a.quick else 5
    workdir = tempfile.mkdtemp(prefix="kvs-rb-", dir="/tmp")
    redis, port = start_redis(workdir)
    result: dict = {"benchmark": "remote_bench", "machine": machine_info(), "redis_version": redis_version(port),
                    "note": "redis-server, both cache servers and the client on one machine (loopback TCP)"}
    try:
        result["store"] = [bench_store(port, nb, max(total, 4 * nb), rounds) for nb in SIZES.values()]
        subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], capture_output=True)
        servers = []
        for name in ("a", "b"):
            d = os.path.join(workdir, name)
            os.makedirs(d)
            servers.append(start_server(d, "--l1-bytes", "2GiB", "--remote", f"redis://127.0.0.1:{port}",
                                        "--remote-bytes", "8GiB", "--remote-timeout-s", "10"))
        try:
            with MPClient(servers[0][1]) as ca, MPClient(servers[1][1]) as cb:
                result["through_servers"] = [bench_servers(ca, cb, nb, min(total, 512 << 20), 2000 + i)
                                             for i, nb in enumerate(list(SIZES.values())[:2])]
                result["lookup_1m_tokens"] = bench_lookup_1m(ca, cb, 10 if a.quick else 50)
            result["ttft"] = bench_ttft(servers[0][1], servers[1][1], lengths, a.chunk)
        finally:
            for p, _ in servers:
                stop_server(p)
    finally:
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    results_json.write(a.out, result)
    print(json.dumps({k: result[k] for k in ("store", "through_servers", "lookup_1m_tokens", "ttft")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
