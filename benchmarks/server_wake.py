"""A lookup on a cache server woken from sleep, with and without a ``wake`` sent before it.

    python benchmarks/server_wake.py [--gaps 0.3,0.6,1.0] [--repeats 150] [--out FILE]

Models a lone request's lookup in an engine that has been computing for a while (the server
idle 20 ms): the client sends ``wake`` (``MPClient.wake``), spends ``gap`` ms on the prompt's
keys, then makes a 32-chunk lookup with its resolve (a miss: the server's work is the same walk).
Pairs alternate wake / no wake.  The gap is spent two ways: ``sleep`` leaves the core to others
(a host with cores to spare, as a GPU host's while vLLM's thread keys a prompt) and ``busy``
keeps it (the 2-core host's case).  The lookup's median time and the median from the wake to the answer;
every sample is kept.  (A server that polled without sleeping after a wake was tried first: it
gained ~0.07 ms more with cores to spare and cost 1-2 ms on 2 busy cores; the wake alone stays.)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_json  # noqa: E402
from server_bench import start_server, stop_server  # noqa: E402

from vllm_kvplugin.server import protocol as P  # noqa: E402
from vllm_kvplugin.tiers.mp_client import MPClient  # noqa: E402

IDLE_S = 0.02
WARM_UP = 50


def _pairs(c: MPClient, gap_s: float, busy: bool, repeats: int) -> dict[bool, list[tuple[float, float]]]:
    keys = [os.urandom(P.KEY_SIZE) for _ in range(32)]

    def one(wake: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        if wake:
            c.wake()
        if busy:
            while time.perf_counter() - t0 < gap_s:
                pass
        else:
            time.sleep(gap_s)
        t1 = time.perf_counter()
        c.lookup_detail(keys, [(0, 0)], 1, 1, resolve_rank=0)
        t2 = time.perf_counter()
        return 1e3 * (t2 - t1), 1e3 * (t2 - t0)

    for _ in range(WARM_UP):
        one(False)
    got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(2 * repeats):
        time.sleep(IDLE_S)
        wake = bool(i % 2)
        got[wake].append(one(wake))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="0.3,0.6,1.0", help="ms between the wake and the lookup")
    ap.add_argument("--repeats", type=int, default=150)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "server-wake-cpu.json"))
    args = ap.parse_args()
    gaps = [float(g) for g in args.gaps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvwake-") as d:
        server, sock = start_server(d, "--l1-bytes", str(64 << 20))
        try:
            c = MPClient(sock, timeout_s=2.0)
            c.hello()
            for busy in (False, True):
                for gap in gaps:
                    got = _pairs(c, gap / 1e3, busy, args.repeats)
                    row = {"gap": "busy" if busy else "sleep", "gap_ms": gap}
                    for wake in (False, True):
                        tag = "wake" if wake else "no_wake"
                        row[f"{tag}_lookup_ms"] = round(statistics.median(a for a, _ in got[wake]), 3)
                        row[f"{tag}_from_start_ms"] = round(statistics.median(b for _, b in got[wake]), 3)
                        row[f"{tag}_samples_ms"] = [[round(a, 3), round(b, 3)] for a, b in got[wake]]
                    rows.append(row)
                    print(f"{row['gap']} {gap} ms: lookup {row['no_wake_lookup_ms']} ms -> "
                          f"{row['wake_lookup_ms']} ms with a wake; from the start {row['no_wake_from_start_ms']} "
                          f"-> {row['wake_from_start_ms']} ms", flush=True)
            stats = c.stats()
            c.close()
        finally:
            stop_server(server)
    doc = {"benchmark": "server_wake", "date": time.strftime("%Y-%m-%d"),
           "machine": {"cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
                       "python": platform.python_version()},
           "versions": {"code": os.environ.get("KVPLUGIN_CODE")},
           "server_wakes": stats.get("op_wake"), "idle_s": IDLE_S, "lookup_chunks": 32, "repeats": args.repeats, "rows": rows}
    results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
