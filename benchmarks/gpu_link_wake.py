#!/usr/bin/env python3
"""Does a host-to-device copy that starts after the link sat idle run slower at first, and does a
small copy issued a moment before wake it (one device call, no vLLM, no plugin build)?

In the TTFT runs a lone 8k hit's first part (4 objects, 151 MB) crossed at 49-51 GB/s and the
rest at 54-55 (``benchmarks/NOTES.md``).  This copies an 8k hit's bytes (32 objects of 37.7 MB,
pinned host to device, one DMA per object, an event after each) in these cases, median of
``--reps``:

* ``idle``: after ``--idle-ms`` with no copy (the GPU idle too), the DMAs queued behind a short
  spin kernel (the "gate") so that the host's issue is not in the time, timed from an event at
  the gate's end;
* ``idle_issued``: the same without the gate: timed from an event recorded just before the
  DMAs are issued, as the plugin's prefetch is (the host's issue in it);
* ``wake_<bytes>_<lead>``: ``idle``, with a small copy of ``bytes`` issued ``lead`` ms before the
  gate's end (its own stream);
* ``hot``: right behind another copy of the same bytes on the stream (the link busy);
* ``idle_issued_read`` / ``hot_read``: those two with the device reading each piece of
  ``--first`` objects where it landed, on a stream of its own after the piece's copy, as a
  prefetch's payload digests do (the plugin's ``kvplugin::segment_digests`` where its CUDA build is
  importable, else a sum): do the reads slow the link's writes?

Per case: the first object's rate, the first part's (``--first`` objects), the rest's and the
whole copy's, in GB/s (1e9 B/s).

    python3 benchmarks/gpu_link_wake.py --out benchmarks/results/gpu-link-wake-h100.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import results_json  # noqa: E402

OBJECT_BYTES = 256 * 147456  # one object of Qwen3-8B's KV: 256 tokens x 36 layers x 2 x 8 x 128 x bf16


def _spin_ms(ms: float, stream: torch.cuda.Stream) -> None:
    """A kernel that spins about ``ms`` on ``stream`` (the SM clock read at start-up)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 1e-3 * _CLOCK_HZ))


_CLOCK_HZ = 1.98e9
_DIGESTS = None  # the plugin's device digests, where its CUDA build loads (``main``)


def _digest_op():
    try:
        from vllm_kvplugin import ops
        if ops.load().cuda == "CUDA kernel":
            return torch.ops.kvplugin.segment_digests
    except Exception:  # no build here: a sum stands in for the digests
        pass
    return None


def _calibrate() -> float:
    """Cycles per second of ``torch.cuda._sleep`` on this GPU (a 20 ms spin timed by events)."""
    s = torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = int(2e7)
    torch.cuda._sleep(cycles)  # (its first launch)
    a.record(s)
    torch.cuda._sleep(cycles)
    b.record(s)
    b.synchronize()
    return cycles / (a.elapsed_time(b) / 1e3)


class Copy:
    """``objects`` objects' bytes: page-locked on the host, a device buffer for them."""

    def __init__(self, objects: int, wake_max: int):
        self.n = objects
        self.host = torch.empty(objects * OBJECT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host.fill_(7)
        self.dev = torch.empty_like(self.host, device="cuda")
        self.wake_host = torch.ones(max(wake_max, 1), dtype=torch.uint8, pin_memory=True)
        self.wake_dev = torch.empty_like(self.wake_host, device="cuda")
        self.stream, self.wake_stream, self.read_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        self.read_every = 0  # objects per read (0: none), set by ``run``

    def _read(self, a: int, b: int) -> None:
        """Read bytes ``[a, b)`` of the device buffer (on the read stream)."""
        rows = self.dev[a:b].view(-1, OBJECT_BYTES)
        if _DIGESTS is not None:
            _DIGESTS(rows, 256 << 10)
        else:
            rows.view(torch.int32).sum(dtype=torch.int64)

    def _issue(self) -> list[torch.cuda.Event]:
        evs = []
        for i in range(self.n):
            a = i * OBJECT_BYTES
            self.dev[a:a + OBJECT_BYTES].copy_(self.host[a:a + OBJECT_BYTES], non_blocking=True)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            evs.append(ev)
            k = self.read_every
            if k and ((i + 1) % k == 0 or i + 1 == self.n):
                self.read_stream.wait_event(ev)
                with torch.cuda.stream(self.read_stream):
                    self._read((i - i % k) * OBJECT_BYTES, a + OBJECT_BYTES)
        return evs

    def run(self, idle_ms: float, gate_ms: float | None, wake_bytes: int = 0, lead_ms: float = 0.0,
            hot: bool = False, read_every: int = 0) -> list[float]:
        """Milliseconds from the start event to each object's end."""
        self.read_every = read_every
        torch.cuda.synchronize()
        time.sleep(idle_ms / 1e3)
        with torch.cuda.stream(self.stream):
            if hot:
                self._issue()
            if gate_ms is not None:
                _spin_ms(gate_ms, self.stream)
            if wake_bytes:
                _spin_ms(max(0.0, gate_ms - lead_ms), self.wake_stream)
                with torch.cuda.stream(self.wake_stream):
                    self.wake_dev[:wake_bytes].copy_(self.wake_host[:wake_bytes], non_blocking=True)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            evs = self._issue()
        torch.cuda.synchronize()
        return [start.elapsed_time(e) for e in evs]


def rates(ends_ms: list[float], first: int) -> dict:
    gb = OBJECT_BYTES / 1e9
    return {"first_object_GBps": round(gb / (ends_ms[0] / 1e3), 2),
            "first_part_GBps": round(first * gb / (ends_ms[first - 1] / 1e3), 2),
            "rest_GBps": round((len(ends_ms) - first) * gb / ((ends_ms[-1] - ends_ms[first - 1]) / 1e3), 2),
            "whole_GBps": round(len(ends_ms) * gb / (ends_ms[-1] / 1e3), 2),
            "whole_ms": round(ends_ms[-1], 3)}


def main() -> int:
    global _CLOCK_HZ, _DIGESTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=32)
    ap.add_argument("--first", type=int, default=4)
    ap.add_argument("--idle-ms", type=float, default=50.0)
    ap.add_argument("--gate-ms", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _CLOCK_HZ = _calibrate()
    _DIGESTS = _digest_op()
    c = Copy(args.objects, 8 << 20)
    cases = {"hot": dict(gate_ms=None, hot=True), "idle": dict(gate_ms=args.gate_ms),
             "idle_issued": dict(gate_ms=None), "idle_issued_read": dict(gate_ms=None, read_every=args.first),
             "hot_read": dict(gate_ms=None, hot=True, read_every=args.first)}
    for nbytes in (4096, 1 << 20, 8 << 20):
        for lead in (0.2, 0.5, 1.0):
            cases[f"wake_{nbytes}_{lead}"] = dict(gate_ms=args.gate_ms, wake_bytes=nbytes, lead_ms=lead)
    for kw in cases.values():  # once each, unmeasured (first uses)
        c.run(1.0, **kw)
    ends: dict[str, list[list[float]]] = {k: [] for k in cases}
    for _ in range(args.reps):  # the cases in turn, each rep
        for name, kw in cases.items():
            ends[name].append(c.run(args.idle_ms, **kw))
    rows = {}
    for name, runs in ends.items():
        per = [rates(e, args.first) for e in runs]
        rows[name] = {k: statistics.median(p[k] for p in per) for k in per[0]}
        rows[name]["first_part_GBps_each"] = [p["first_part_GBps"] for p in per]
    doc = {"benchmark": "gpu_link_wake", "date": time.strftime("%Y-%m-%d"),
           "machine": {"gpu": torch.cuda.get_device_name(0), "cores": os.cpu_count(),
                       "python": platform.python_version()},
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "code": os.environ.get("KVPLUGIN_CODE", "")},
           "objects": args.objects, "object_bytes": OBJECT_BYTES, "first": args.first,
           "idle_ms": args.idle_ms, "gate_ms": args.gate_ms, "reps": args.reps,
           "spin_clock_GHz": round(_CLOCK_HZ / 1e9, 3),
           "reads": "kvplugin::segment_digests" if _DIGESTS is not None else "torch sum", "cases": rows}
    for name, r in rows.items():
        print(f"{name:>22}: first object {r['first_object_GBps']:6.2f}  first part {r['first_part_GBps']:6.2f}  "
              f"rest {r['rest_GBps']:6.2f}  whole {r['whole_GBps']:6.2f} GB/s ({r['whole_ms']} ms)")
    if args.out:
        results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
