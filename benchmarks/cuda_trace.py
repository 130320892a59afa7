"""One request's CUDA timeline under ``torch.profiler``, condensed to what a reader needs.

Called in a benchmark's engine process (in-process engine core, so the model's kernels run in
this process): :func:`traced` runs a callable under the profiler (CPU + CUDA activities) and
returns its device work and CUDA API calls as rows ``[kind, stream_or_thread, start_ms, dur_ms,
name]``, times from the first row, sorted by start.  ``kind`` is ``kernel``, ``memcpy``,
``memset``, ``sync`` (a device/stream/event wait on the host), ``wait`` (a stream made to wait
on an event) or ``api`` (other runtime calls over ``api_min_us``).  :func:`busy` merges a
stream's rows into busy spans.  Nothing here is asserted: the rows go into a benchmark's JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

KINDS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
SYNCS = ("Synchronize", "cudaEventQuery", "cudaStreamQuery")
WAITS = ("cudaStreamWaitEvent",)


def traced(fn: Callable[[], Any], api_min_us: float = 200.0) -> tuple[Any, list[list]]:
    """``fn()`` under the profiler: its result and the condensed rows (see the module doc)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    rows = []
    for e in events:
        cat, name, ts, dur = e.get("cat"), str(e.get("name", "")), e.get("ts"), e.get("dur")
        if ts is None or dur is None:
            continue
        args = e.get("args") or {}
        if cat in KINDS:
            rows.append([KINDS[cat], f"s{args.get('stream', '?')}", float(ts), float(dur), name[:90]])
        elif cat in ("cuda_runtime", "cuda_driver"):
            kind = "sync" if any(s in name for s in SYNCS) else "wait" if name in WAITS else "api"
            if kind == "api" and dur < api_min_us:
                continue
            if kind == "sync" and "Query" in name:
                continue
            rows.append([kind, f"t{e.get('tid', '?')}", float(ts), float(dur), name[:90]])
    if not rows:
        return out, []
    t0 = min(r[2] for r in rows)
    for r in rows:
        r[2], r[3] = round((r[2] - t0) / 1e3, 3), round(r[3] / 1e3, 3)
    rows.sort(key=lambda r: r[2])
    return out, rows


def busy(rows: list[list], gap_ms: float = 0.5) -> dict[str, list[list]]:
    """Per stream: [start_ms, end_ms, kernels+copies, longest name] spans, rows closer than ``gap_ms`` merged."""
    spans: dict[str, list[list]] = {}
    for kind, where, start, dur, name in rows:
        if kind not in ("kernel", "memcpy", "memset"):
            continue
        s = spans.setdefault(where, [])
        if s and start - s[-1][1] <= gap_ms:
            s[-1][1] = round(max(s[-1][1], start + dur), 3)
            s[-1][2] += 1
        else:
            s.append([start, round(start + dur, 3), 1, name[:40]])
    return spans
