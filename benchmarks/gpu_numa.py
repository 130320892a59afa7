#!/usr/bin/env python3
"""Host memory placement against the link: H2D / D2H GB/s of pinned memory on each NUMA node.

One device call (no vLLM needed; ``python3 benchmarks/gpu_numa.py --out $OUT/gpu-numa.json``).
Records the host's NUMA nodes (CPUs, memory), the GPU's PCI node and local CPUs, then for each
node that has CPUs this process may run on: pinned buffers allocated and first touched by a
thread bound to that node's CPUs (where Linux places their pages), and for each

* ``h2d`` / ``d2h``: one copy of the whole buffer, median of 5 (CUDA events);
* ``h2d_while_hashing``: the same H2D while the plugin's hashing threads xxh3 the same bytes
  (64 slices), as a hit's fetch does; and how long those hashes took.

Answers whether where the plugin's pools land (wherever the engine's thread happened to run)
costs link speed, and whether hashing beside the copy slows it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import results_json  # noqa: E402

from vllm_kvplugin.chunk.checksums import start_payload_checksums  # noqa: E402

GB = 1e9


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cpus(cpulist: str) -> set[int]:
    out: set[int] = set()
    for part in cpulist.split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def topology() -> dict:
    nodes = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        mem = _read(str(d / "meminfo")) or ""
        total = next((int(line.split()[-2]) for line in mem.splitlines() if "MemTotal" in line), None)
        nodes[d.name] = {"cpulist": _read(str(d / "cpulist")), "mem_kB": total}
    bus = torch.cuda.get_device_properties(0).pci_bus_id if hasattr(torch.cuda.get_device_properties(0), "pci_bus_id") \
        else None
    pci = None
    for cand in Path("/sys/bus/pci/devices").glob("*"):
        if _read(str(cand / "vendor")) == "0x10de" and _read(str(cand / "class")) in ("0x030200", "0x030000"):
            pci = cand
            break
    return {"nodes": nodes, "gpu_pci": pci.name if pci else bus,
            "gpu_numa_node": _read(str(pci / "numa_node")) if pci else None,
            "gpu_local_cpulist": _read(str(pci / "local_cpulist")) if pci else None,
            "allowed_cpus": sorted(os.sched_getaffinity(0)),
            "mems_allowed": next((line.split(":")[1].strip() for line in (_read("/proc/self/status") or "").splitlines()
                                  if line.startswith("Mems_allowed_list")), None)}


def _timed(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def measure(node: str, cpus: set[int], nbytes: int) -> dict:
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus & allowed)
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)  # first touch by a thread on this node
    finally:
        os.sched_setaffinity(0, allowed)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True))
    views = [memoryview(s.numpy()) for s in host.chunk(64)]
    hashed = []

    def copy_while_hashing():
        t0 = time.perf_counter()
        sums = start_payload_checksums(views)
        dev.copy_(host, non_blocking=True)
        sums.result()
        hashed.append(time.perf_counter() - t0)
    both = _timed(copy_while_hashing)
    return {"node": node, "cpus_used": len(cpus & allowed), "bytes": nbytes,
            "h2d_GBps": round(nbytes / h2d / GB, 1), "d2h_GBps": round(nbytes / d2h / GB, 1),
            "h2d_while_hashing_GBps": round(nbytes / both / GB, 1),
            "hash_s": round(statistics.median(hashed), 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=2 << 30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu-numa-h200.json"))
    args = ap.parse_args()
    topo = topology()
    allowed = set(os.sched_getaffinity(0))
    rows = []
    for node, info in topo["nodes"].items():
        cpus = _cpus(info["cpulist"] or "")
        if cpus & allowed:
            rows.append(measure(node, cpus, args.bytes))
            print(rows[-1], flush=True)
    doc = {"benchmark": "gpu_numa", "date": time.strftime("%Y-%m-%d"),
           "machine": {"gpu": torch.cuda.get_device_name(0), "cpu_count": os.cpu_count()},
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "topology": topo, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results_json.write(args.out, doc)
    print(json.dumps(topo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
