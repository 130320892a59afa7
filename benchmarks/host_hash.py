"""How fast the host verifies a hit's bytes, alone and while the link copies the same bytes,
and what the hashing costs the thread that runs vLLM.

A hit the device does not verify waits for the host's payload digests of every loaded byte
(``chunk/checksums.py``), which run while the prefetch copies the same page-locked bytes to the
device.  This measures, on one buffer of a 16k-token hit's size (64 objects), per thread count
and per implementation (``library``: the xxhash library, one call per 256 KiB segment; ``op``:
the compiled ``kvplugin::segment_digests``, one call per payload, what the plugin uses where it
is built): the hashes alone; vLLM's thread meanwhile (``main_loop_slowdown``: a loop of small
torch calls, each of which lets go of the GIL and takes it back, as vLLM's thread does, timed
while the pool hashes, over the same loop alone); a plain memory read of the same bytes on as
many threads (numpy, the bandwidth ceiling for any hash); and the hashes with the copy to the
device running (CUDA only).

    python3 benchmarks/host_hash.py --out results/host-hash.json
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from vllm_kvplugin.chunk import checksums
from vllm_kvplugin.chunk.format import payload_checksum

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_json  # noqa: E402
from ttft_common import environment  # noqa: E402

IMPLS = {"library": payload_checksum, "op": checksums.checksum}
MAIN_LOOP_CALLS = 2000


def _timed(pool: ThreadPoolExecutor, fn, parts) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, parts))
    return time.perf_counter() - t0


def _main_loop() -> float:
    """Seconds of ``MAIN_LOOP_CALLS`` small torch calls on this thread (each lets go of the GIL
    around its kernel and takes it back, as vLLM's thread does between its Python steps)."""
    x = torch.zeros(16)
    t0 = time.perf_counter()
    for _ in range(MAIN_LOOP_CALLS):
        x.add_(1)
    return time.perf_counter() - t0


def _main_loop_while_hashing(pool: ThreadPoolExecutor, fn, parts) -> tuple[float, bool]:
    """The main loop's seconds while the pool hashes ``parts``; whether the hashes outlasted it."""
    futures = [pool.submit(fn, p) for p in parts]
    time.sleep(0.002)  # the threads are hashing
    loop_s = _main_loop()
    outlasted = not all(f.done() for f in futures)
    for f in futures:
        f.result()
    return loop_s, outlasted


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=64 * 256 * 147456)  # 16k tokens of Qwen3-8B's KV
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--threads", default="1,2,4,8,12,16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "host-hash.json"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    buf = torch.empty(args.bytes, dtype=torch.uint8, pin_memory=cuda)
    buf.view(torch.int64)[:] = torch.arange(args.bytes // 8, dtype=torch.int64)  # every page touched
    size = args.bytes // args.objects
    parts = [memoryview(buf[i * size:(i + 1) * size].numpy()) for i in range(args.objects)]
    arrays = [np.frombuffer(p, dtype=np.uint64) for p in parts]
    dev = torch.empty(args.bytes, dtype=torch.uint8, device="cuda") if cuda else None
    stream = torch.cuda.Stream() if cuda else None

    def copy_all() -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            for i in range(8):  # as the prefetch: 8 pieces queued at once
                a, b = i * args.bytes // 8, (i + 1) * args.bytes // 8
                dev[a:b].copy_(buf[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    rows = []
    if cuda:  # the copy alone
        copy_all().synchronize()
        t0 = time.perf_counter()
        copy_all().synchronize()
        copy_alone = time.perf_counter() - t0
    assert checksums._segment_op() is not None, "the compiled op is not built: nothing to compare"
    assert len({fn(parts[0]) for fn in IMPLS.values()}) == 1
    for n in [int(x) for x in args.threads.split(",")]:
        with ThreadPoolExecutor(n) as pool:
            row = {"threads": n}
            for name, fn in IMPLS.items():
                _timed(pool, fn, parts)  # the threads started, pages warm
                hash_s = min(_timed(pool, fn, parts) for _ in range(args.repeat))
                alone = min(_main_loop() for _ in range(args.repeat))
                during = [_main_loop_while_hashing(pool, fn, parts) for _ in range(args.repeat)]
                row.update({f"{name}_hash_s": round(hash_s, 4),
                            f"{name}_hash_GBps": round(args.bytes / hash_s / 1e9, 1),
                            f"{name}_main_loop_slowdown": round(sorted(d for d, _ in during)[len(during) // 2] / alone, 2),
                            f"{name}_hashes_outlasted_main_loop": all(o for _, o in during)})
            read_s = min(_timed(pool, np.bitwise_xor.reduce, arrays) for _ in range(args.repeat))
            row.update(read_s=round(read_s, 4), read_GBps=round(args.bytes / read_s / 1e9, 1))
            if cuda:
                both = []
                for _ in range(args.repeat):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ev = copy_all()
                    h = _timed(pool, checksums.checksum, parts)
                    ev.synchronize()
                    both.append((h, time.perf_counter() - t0))
                h, c = min(both)
                row.update(hash_with_copy_s=round(h, 4), copy_with_hash_s=round(c, 4),
                           copy_alone_s=round(copy_alone, 4))
            rows.append(row)
            print(row, flush=True)
    doc = {"benchmark": "host_hash", "date": time.strftime("%Y-%m-%d"), **environment(),
           "bytes": args.bytes, "objects": args.objects, "xxhash": xxhash.VERSION,
           "main_loop_calls": MAIN_LOOP_CALLS, "rows": rows}
    results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
