#!/usr/bin/env python3
"""How long a small copy of vLLM's waits behind the plugin's bulk DMAs (one device call, no vLLM).

A store moves a step's KV to the host as a few large DMAs on the plugin's own stream; vLLM
then copies a step's few bytes (sampled tokens, inputs) on its streams.  This measures the
latency of a 4 KiB copy (D2H, and H2D) issued on another stream right after a bulk copy of
``--bytes`` in the same direction was queued, the bulk cut into 1, 8, 64 or 256 pieces, the
small copy's stream of default or high priority, all pieces queued at once or at most 2 at a time
(the next one issued when one is done), and as a control a small copy the other way.
Results (median of 5, ms) as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def small_copy_latency(direction: str, nbytes: int, pieces: int, priority: int, window: int | None,
                       small_direction: str | None = None) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s_dev = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    s_host = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    bulk = torch.cuda.Stream()
    other = torch.cuda.Stream(priority=priority)  # the small copy's (lower numbers: higher priority)
    src, dst = (dev, host) if direction == "d2h" else (host, dev)
    small_direction = small_direction or direction
    s_src, s_dst = (s_dev, s_host) if small_direction == "d2h" else (s_host, s_dev)
    lat, total = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step = -(-nbytes // pieces)
        done: list[torch.cuda.Event] = []
        with torch.cuda.stream(bulk):
            for a in range(0, nbytes, step):
                if window is not None and len(done) >= window:
                    break
                dst[a:a + step].copy_(src[a:a + step], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(bulk)
                done.append(ev)
        with torch.cuda.stream(other):  # its wait + copy, on the device's clock
            start, small = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(other)
            s_dst.copy_(s_src, non_blocking=True)
            small.record(other)
        issued = len(done)
        if window is not None:  # the pacer: the next piece once one is done
            k = 0
            while issued * step < nbytes:
                done[k].synchronize()
                k += 1
                with torch.cuda.stream(bulk):
                    a = issued * step
                    dst[a:a + step].copy_(src[a:a + step], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(bulk)
                    done.append(ev)
                issued += 1
        torch.cuda.synchronize()
        lat.append(start.elapsed_time(small))
        total.append((time.perf_counter() - t0) * 1e3)
    return {"direction": direction, "small_direction": small_direction, "pieces": pieces, "priority": priority,
            "queued_at_once": "all" if window is None else window,
            "small_copy_ms": round(statistics.median(lat), 3), "bulk_ms": round(statistics.median(total), 3),
            "bulk_GBps": round(nbytes / statistics.median(total) * 1e3 / 1e9, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=2_415_919_104)  # a 16k-token store of the seeds' model
    ap.add_argument("--out", default="gpu-copy-queue.json")
    args = ap.parse_args()
    # (least, greatest); the default stream priority is the least
    _, high = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    rows = []
    for direction in ("d2h", "h2d"):
        for pieces, prio, window in ((1, 0, None), (8, 0, None), (64, 0, None), (256, 0, None),
                                     (8, high, None), (64, high, None), (64, 0, 2), (256, 0, 2)):
            rows.append(small_copy_latency(direction, args.bytes, pieces, prio, window))
            print(rows[-1], flush=True)
        other = "h2d" if direction == "d2h" else "d2h"  # control: the other direction's engine
        rows.append(small_copy_latency(direction, args.bytes, 8, 0, None, small_direction=other))
        print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "gpu_copy_queue", "date": time.strftime("%Y-%m-%d"),
                                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                          "bytes": args.bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
