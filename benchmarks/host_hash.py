"""How fast the host verifies a hit's bytes, alone and while the link copies the same bytes.

A warm hit's verdict waits for the host's xxh3 of every loaded byte (``chunk/checksums.py``),
which runs while the prefetch copies the same page-locked bytes to the device.  This measures,
on one buffer of a 16k-token hit's size (64 objects), per thread count: the hashes alone, a
plain memory read of the same bytes on as many threads (numpy, the bandwidth ceiling for any
hash), and the hashes with the copy to the device running (CUDA only).  If the hashes run at
the read ceiling, a faster hash function cannot make the verdict earlier; if they do not, it
can.

    python3 benchmarks/host_hash.py --out results/host-hash.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ttft_common import environment  # noqa: E402


def _timed(pool: ThreadPoolExecutor, fn, parts) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, parts))
    return time.perf_counter() - t0


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
    for n in [int(x) for x in args.threads.split(",")]:
        with ThreadPoolExecutor(n) as pool:
            _timed(pool, xxhash.xxh3_64_intdigest, parts)  # the threads started, pages warm
            hash_s = min(_timed(pool, xxhash.xxh3_64_intdigest, parts) for _ in range(args.repeat))
            read_s = min(_timed(pool, np.bitwise_xor.reduce, arrays) for _ in range(args.repeat))
            row = {"threads": n, "hash_s": round(hash_s, 4), "hash_GBps": round(args.bytes / hash_s / 1e9, 1),
                   "read_s": round(read_s, 4), "read_GBps": round(args.bytes / read_s / 1e9, 1)}
            if cuda:
                both = []
                for _ in range(args.repeat):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ev = copy_all()
                    h = _timed(pool, xxhash.xxh3_64_intdigest, parts)
                    ev.synchronize()
                    both.append((h, time.perf_counter() - t0))
                h, c = min(both)
                row.update(hash_with_copy_s=round(h, 4), copy_with_hash_s=round(c, 4),
                           copy_alone_s=round(copy_alone, 4))
            rows.append(row)
            print(row, flush=True)
    doc = {"benchmark": "host_hash", "date": time.strftime("%Y-%m-%d"), **environment(),
           "bytes": args.bytes, "objects": args.objects, "xxhash": xxhash.VERSION, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
