"""Cache-server benchmark: put/get throughput through the shared memory, lookup latency.

    python benchmarks/server_bench.py [--out benchmarks/results/server-cpu.json] [--quick]

Starts ``python -m vllm_kvplugin.server`` as a subprocess (Unix socket in a temp
dir), then from one client process:

* put (steady state, ``--prefault`` pool that wraps around several times, the
  client maps it with MAP_POPULATE): reserve N objects, copy each payload into the pool (numpy copy from a
  private buffer), commit.  get: lookup + resolve + copy each object out of the
  pool into a private buffer, release.  GB/s = payload bytes / wall time of
  the whole sequence (control round trips included), median over rounds.
  ``memcpy_gbps_same_size`` is the same numpy copy between two private
  buffers of the object's size: the ceiling of this machine.
* first touch: the same on a fresh lazy pool (the default): every 4 KiB page
  is faulted in on its first touch by each process (page-locking the pool for
  a GPU, or ``--prefault``, pays this once at start instead).
* lookup: p50/p99 of one ``lookup`` round trip (client encode, ZMQ, server
  index walk, reply) against an index of 1k/10k/100k chunks, for a 64-chunk
  prompt (16k tokens at 256/chunk), a 1,000- and a 4,096-chunk prompt (1M
  tokens; the design's target is <= 5 ms) and a miss; plus the whole index as
  one prompt.

Chunk sizes: the tiny test model (qwen3 tiny: 4 layers x K/V x 256 tokens x 2
heads x 64 x bf16 = 512 KiB), the demo model (8 MiB) and Qwen3-8B (36 layers x
K/V x 256 x 8 x 128 x bf16 = 37.7 MB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, pack_header
from vllm_kvplugin.server.protocol import object_id
from vllm_kvplugin.tiers.mp_client import MPClient

SIZES = {
    "tiny-qwen3 (512 KiB)": 4 * 2 * 256 * 2 * 64 * 2,
    "demo (8 MiB)": 8 * 2 * 256 * 8 * 128 * 2,
    "Qwen3-8B (37.7 MB)": 36 * 2 * 256 * 8 * 128 * 2,
}


def start_server(workdir: str, *args: str) -> tuple[subprocess.Popen, str]:
    sock = f"unix://{workdir}/bench.sock"
    p = subprocess.Popen([sys.executable, "-m", "vllm_kvplugin.server", "--listen", sock,
                          "--log-level", "WARNING", *args], stdout=subprocess.PIPE, text=True)
    r, _, _ = select.select([p.stdout], [], [], 30)
    line = p.stdout.readline() if r else ""
    if "listening on" not in line:
        p.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return p, sock


def stop_server(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def keys(seed: int, n: int) -> list[bytes]:
    base = seed.to_bytes(8, "little")
    return [base + i.to_bytes(8, "little") for i in range(n)]


def memcpy_gbps(nbytes: int, reps: int) -> float:
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(b, a)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def bench_throughput(client: MPClient, nbytes: int, per_round: int, rounds: int, seed: int) -> dict:
    pool = np.frombuffer(client.pool_view(), dtype=np.uint8)
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    puts, gets = [], []
    for rnd in range(rounds):
        ks = keys(seed * 1000 + rnd, per_round)
        oids = [object_id(k, 0, 0, 1) for k in ks]
        hdrs = [pack_header(key=k, group=0, rank=0, world=1, payload_nbytes=nbytes, checksum=0)
                for k in ks]
        t0 = time.perf_counter()
        offs = client.reserve([(o, HEADER_SIZE + nbytes) for o in oids])
        assert all(o is not None for o in offs), "pool too small for one round"
        for off, h in zip(offs, hdrs):
            pool[off:off + HEADER_SIZE] = np.frombuffer(h, dtype=np.uint8)
            np.copyto(pool[off + HEADER_SIZE:off + HEADER_SIZE + nbytes], src)
        assert all(client.commit(oids, offs))
        puts.append(per_round * nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        hits, lease = client.lookup(ks)
        assert hits == per_round
        for off, n in client.resolve(lease, ks, 0, 0, 1):
            np.copyto(dst, pool[off + HEADER_SIZE:off + n])
        client.release(lease)
        gets.append(per_round * nbytes / (time.perf_counter() - t0) / 1e9)
    return {
        "object_bytes": nbytes, "objects_per_round": per_round, "rounds": rounds,
        "put_gbps_median": round(statistics.median(puts), 2), "put_gbps_max": round(max(puts), 2),
        "get_gbps_median": round(statistics.median(gets), 2), "get_gbps_max": round(max(gets), 2),
        "put_gbps_all": [round(x, 2) for x in puts], "get_gbps_all": [round(x, 2) for x in gets],
    }


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_lookup(client: MPClient, n_index: int, reps: int) -> dict:
    nb = 512
    ks = keys(7, n_index)
    payload = b"\0" * nb
    for i in range(0, n_index, 4096):
        part = ks[i:i + 4096]
        oids = [object_id(k, 0, 0, 1) for k in part]
        offs = client.reserve([(o, HEADER_SIZE + nb) for o in oids])
        view = client.pool_view()
        for k, off in zip(part, offs):
            view[off:off + HEADER_SIZE] = pack_header(key=k, group=0, rank=0, world=1,
                                                      payload_nbytes=nb, checksum=0)
            view[off + HEADER_SIZE:off + HEADER_SIZE + nb] = payload
        assert all(client.commit(oids, offs))
    out = {"index_chunks": n_index}
    cases = {"prompt_64_chunks": ks[:64], "prompt_1000_chunks": ks[:1000] if n_index >= 1000 else None,
             "prompt_4096_chunks (1M tokens)": ks[:4096] if n_index >= 4096 else None,
             "miss": keys(99, 64), "whole_index_prompt": ks}
    for name, q in cases.items():
        if q is None:
            continue
        r = reps if len(q) <= 4096 else max(5, reps // 20)
        lat = []
        for _ in range(r):
            t0 = time.perf_counter()
            hits, lease = client.lookup(q)
            lat.append((time.perf_counter() - t0) * 1e3)
            if lease:
                client.release(lease)
        out[name] = {"chunks": len(q), "hits": hits, "reps": r,
                     "p50_ms": round(pct(lat, 0.5), 3), "p99_ms": round(pct(lat, 0.99), 3)}
    return out


def bench_gpu(client: MPClient, reps: int) -> dict:
    """GPU <-> pool copies: the pool page-locked with cudaHostRegister (what the connector does),
    against the same copies from pageable pool memory and from a torch pinned buffer."""
    import torch

    pool = client.pool_tensor()
    cudart = torch.cuda.cudart()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res = {}
    for name, nb in SIZES.items():
        n = max(2, min(64, int(pool.numel() * 0.5) // nb))
        gpu = torch.empty((n, nb), dtype=torch.uint8, device="cuda")
        views = [pool[i * nb:(i + 1) * nb] for i in range(n)]  # n objects' worth of pool
        pinned = torch.empty((n, nb), dtype=torch.uint8, pin_memory=True)

        def run(h2d: bool, srcs, gpu=gpu, n=n, nb=nb) -> float:
            best = 0.0
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(n):
                    if h2d:
                        gpu[i].copy_(srcs[i], non_blocking=True)
                    else:
                        srcs[i].copy_(gpu[i], non_blocking=True)
                torch.cuda.synchronize()
                best = max(best, n * nb / (time.perf_counter() - t0) / 1e9)
            return round(best, 2)

        r = {"object_bytes": nb, "objects": n,
             "h2d_pageable_pool_gbps": run(True, views), "d2h_pageable_pool_gbps": run(False, views)}
        base, size = pool.data_ptr(), pool.numel()
        rc = cudart.cudaHostRegister(base, size, 0)
        r["cudaHostRegister"] = int(rc) if not isinstance(rc, int) else rc
        r["h2d_registered_pool_gbps"] = run(True, views)
        r["d2h_registered_pool_gbps"] = run(False, views)
        cudart.cudaHostUnregister(base)
        r["h2d_torch_pinned_gbps"] = run(True, list(pinned))
        r["d2h_torch_pinned_gbps"] = run(False, list(pinned))
        res[name] = r
        print(f"{name:>22}: H2D registered pool {r['h2d_registered_pool_gbps']} GB/s "
              f"(pageable {r['h2d_pageable_pool_gbps']}, torch pinned {r['h2d_torch_pinned_gbps']}); "
              f"D2H registered {r['d2h_registered_pool_gbps']} (pageable {r['d2h_pageable_pool_gbps']}, "
              f"pinned {r['d2h_torch_pinned_gbps']})", flush=True)
        del gpu, pinned
    out["copies"] = res
    return out


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    versions = {}
    for dist in ("vllm-kvplugin", "pyzmq", "msgspec", "numpy", "xxhash"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    import zmq

    versions["libzmq"] = zmq.zmq_version()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    return {"cpu_model": cpu, "cpu_cores": os.cpu_count(), "memory_bytes": mem,
            "load_avg_at_start": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(), "packages": versions, "git_commit": commit,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/server-cpu.json (server-gpu.json with --gpu)")
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (CI smoke)")
    ap.add_argument("--pool-bytes", type=int, default=1 << 30)
    ap.add_argument("--gpu", action="store_true",
                    help="GPU <-> pool copy speeds instead (results/server-gpu.json by default)")
    a = ap.parse_args(argv)
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    if a.gpu:
        return main_gpu(a, a.out or os.path.join(results, "server-gpu.json"))
    a.out = a.out or os.path.join(results, "server-cpu.json")
    res = {"machine": machine_info(), "throughput": {}, "lookup": [], "notes": []}
    workdir = tempfile.mkdtemp(prefix="kvbench-", dir="/tmp")
    try:
        res["memcpy_gbps_64MiB"] = round(memcpy_gbps(64 << 20, 10 if a.quick else 30), 2)
        # steady state: a prefaulted pool that wraps around several times
        p, addr = start_server(workdir, "--l1-bytes", str(a.pool_bytes), "--prefault",
                               "--high-watermark", "0.98", "--low-watermark", "0.9")
        try:
            with MPClient(addr, timeout_s=60.0, client_name="bench") as c:
                for seed, (name, nb) in enumerate(SIZES.items()):
                    per_round = max(2, min(256, int(a.pool_bytes * 0.3) // (nb + 4096)))
                    r = bench_throughput(c, nb, per_round, 3 if a.quick else 8, seed)
                    r["memcpy_gbps_same_size"] = round(memcpy_gbps(nb, max(3, (256 << 20) // nb)), 2)
                    res["throughput"][name] = r
                    print(f"{name:>22}: put {r['put_gbps_median']} GB/s median (max {r['put_gbps_max']}), "
                          f"get {r['get_gbps_median']} GB/s median (max {r['get_gbps_max']}); "
                          f"memcpy {r['memcpy_gbps_same_size']} GB/s", flush=True)
        finally:
            stop_server(p)
        # first touch: a fresh lazy pool (the default), one pass over new pages per process
        res["first_touch"] = {}
        for seed, (name, nb) in enumerate(SIZES.items()):
            p, addr = start_server(workdir, "--l1-bytes", str(a.pool_bytes))
            try:
                with MPClient(addr, timeout_s=60.0, client_name="bench") as c:
                    per_round = max(2, min(256, int(a.pool_bytes * 0.3) // (nb + 4096)))
                    r = bench_throughput(c, nb, per_round, 1, 10 + seed)
            finally:
                stop_server(p)
            res["first_touch"][name] = {"put_gbps": r["put_gbps_median"], "get_gbps": r["get_gbps_median"],
                                        "objects": per_round, "object_bytes": nb}
            print(f"{name:>22}: first touch (lazy pool): put {r['put_gbps_median']} GB/s, "
                  f"get {r['get_gbps_median']} GB/s", flush=True)
        for n in ([1000, 10000] if a.quick else [1000, 10000, 100000]):
            p, addr = start_server(workdir, "--l1-bytes", str(max(64 << 20, n * 2048)))
            try:
                with MPClient(addr, timeout_s=60.0, client_name="bench") as c:
                    r = bench_lookup(c, n, 50 if a.quick else 300)
            finally:
                stop_server(p)
            res["lookup"].append(r)
            print(f"index {n:>6}: " + ", ".join(
                f"{k} p50 {v['p50_ms']} ms p99 {v['p99_ms']} ms"
                for k, v in r.items() if isinstance(v, dict)), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["notes"].append("one client process, one server process, same machine; other jobs may have "
                        "been running (see load_avg_at_start)")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {a.out}")
    return 0


def main_gpu(a, out: str) -> int:
    res = {"machine": machine_info()}
    workdir = tempfile.mkdtemp(prefix="kvbench-", dir="/tmp")
    try:
        p, addr = start_server(workdir, "--l1-bytes", str(max(a.pool_bytes, 4 << 30)), "--prefault")
        try:
            with MPClient(addr, timeout_s=60.0, client_name="bench-gpu") as c:
                res["gpu"] = bench_gpu(c, 3 if a.quick else 10)
        finally:
            stop_server(p)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
