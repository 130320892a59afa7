#!/usr/bin/env python3
"""How long a small copy of vLLM's waits behind the plugin's bulk store DMAs (one device call, no vLLM).

A store moves a step's KV to the host as DMAs on the plugin's own stream; vLLM then copies a
step's sampled tokens to the host on a stream of its own, after an event of its compute stream.
On the H200 in vLLM that copy ran only when every queued store DMA was done (the profile in
``benchmarks/NOTES.md``).  This reproduces it without vLLM: a "compute" kernel of
``--compute-ms`` on one stream, ``--bytes`` D2H queued on a second stream (all at once, or paced:
at most ``window`` pieces outstanding, the next issued when one is done), then a 4 KiB D2H on a
third stream that waits for the compute kernel's event.  Measured on the host's clock: from the
compute kernel's end (an event polled by the host) to the small copy's end, and the bulk's
time (its rate).  Median of 5; JSON.

An earlier version timed the small copy between two events of its own stream, which run only
when that stream runs: it measured the copy, not its wait, and showed none.
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


def _spin(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1.98e6))  # cycles at ~1.98 GHz (the H200's clock)


def small_copy_wait(nbytes: int, pieces: int, window: int | None, compute_ms: float, between: int = 0) -> dict:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s_dev = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    s_host = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    compute, bulk = torch.cuda.Stream(), torch.cuda.Stream()
    spacers = [torch.cuda.Stream() for _ in range(between)]  # torch hands out its pool's streams in turn
    out_stream = torch.cuda.Stream()
    step = -(-nbytes // pieces)
    waits, bulk_ms = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(compute):
            _spin(compute_ms)
            computed = torch.cuda.Event()
            computed.record(compute)
        outstanding: list[torch.cuda.Event] = []
        issued = 0

        def issue(out: list[torch.cuda.Event] = outstanding) -> None:
            nonlocal issued
            a = issued * step
            with torch.cuda.stream(bulk):
                host[a:a + step].copy_(dev[a:a + step], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(bulk)
            out.append(ev)
            issued += 1

        while issued < pieces and (window is None or len(outstanding) < window):
            issue()
        out_stream.wait_event(computed)  # vLLM: its output copy after the forward
        with torch.cuda.stream(out_stream):
            s_host.copy_(s_dev, non_blocking=True)
            small = torch.cuda.Event()
            small.record(out_stream)
        t_computed = t_small = None
        while t_small is None or issued < pieces or outstanding:
            now = time.perf_counter()
            if t_computed is None and computed.query():
                t_computed = now
            if t_small is None and small.query():
                t_small = now
            while outstanding and outstanding[0].query():
                outstanding.pop(0)
            while issued < pieces and (window is None or len(outstanding) < window):
                issue()
        bulk_done = time.perf_counter()
        waits.append((t_small - (t_computed or t_small)) * 1e3)
        bulk_ms.append((bulk_done - t0) * 1e3)
    del spacers
    return {"pieces": pieces, "window": "all" if window is None else window, "compute_ms": compute_ms,
            "streams_between": between, "small_copy_wait_ms": round(statistics.median(waits), 3),
            "bulk_ms": round(statistics.median(bulk_ms), 3),
            "bulk_GBps": round(nbytes / statistics.median(bulk_ms) * 1e3 / 1e9, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=2_415_919_104)  # a 16k-token store of the seeds' model
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--out", default="gpu-copy-queue.json")
    args = ap.parse_args()
    rows = []
    cases = [(7, None, 0), (64, None, 0), (64, 1, 0), (64, 2, 0), (64, 3, 0), (128, 2, 0), (128, 4, 0),
             (64, 2, 7), (7, None, 7)]
    for pieces, window, between in cases:
        rows.append(small_copy_wait(args.bytes, pieces, window, args.compute_ms, between))
        print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps({"benchmark": "gpu_copy_queue", "date": time.strftime("%Y-%m-%d"),
                                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                          "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                                          "bytes": args.bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
