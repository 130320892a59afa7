#!/usr/bin/env python3
"""How long a hit's verification takes on the device, against the host's (one device call, no vLLM).

A warm hit is verified by payload digests (the chunk format's segmented xxh3).  With the CUDA
kernel, ``CudaTransfer.digest`` hashes the rows of a prefetch where they landed; before it, the
host hashed the page-locked objects on 16 threads while the link copied the same bytes.  For
hits of 8k, 16k, 32k and 64k tokens of Qwen3-8B's KV (36 layers x 8 KV heads x 128, bf16: 37.7 MB
per 256-token chunk), side by side in one run, median of 5:

* ``copy_s``: the prefetch alone (the link);
* ``device_s``: the prefetch with its digests, until the digests are on the host (the verdict's
  wait on the device path), and ``device_kernel_s`` the digests of bytes already on the device;
* ``host_s``: the prefetch while the host hashes the same objects (the verdict's wait on the
  host path: the later of the two).

    python3 benchmarks/gpu_digest.py --out results/gpu-digest-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import results_json  # noqa: E402
from ttft_common import environment  # noqa: E402

from vllm_kvplugin.chunk.checksums import start_payload_checksums  # noqa: E402
from vllm_kvplugin.chunk.format import SEGMENT_BYTES, payload_checksum  # noqa: E402
from vllm_kvplugin.tiers.local_cpu import bytes_of  # noqa: E402
from vllm_kvplugin.transfer.cuda import CudaTransfer  # noqa: E402

CHUNK_SHAPE = (36, 2, 256, 8, 128)  # L, KV, T, H, D of one chunk


class _Layout:
    """What a prefetch reads of a layout."""

    dtype = torch.bfloat16

    @staticmethod
    def chunk_shape(tokens: int) -> tuple[int, ...]:
        L, KV, _, H, D = CHUNK_SHAPE
        return (L, KV, tokens, H, D)


def _median(f, n: int = 5) -> float:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(lengths: list[int]) -> list[dict]:
    eng = CudaTransfer(torch.device("cuda", 0))
    assert eng.digests, "the CUDA digest kernel is not built"
    layout = _Layout()
    rows = []
    most = max(lengths) // 256
    pool = torch.empty((most, *CHUNK_SHAPE), dtype=torch.bfloat16, pin_memory=True)
    pool.view(torch.int16).random_()
    for n in lengths:
        C = n // 256
        bufs = [pool[i:i + 1] for i in range(C)]

        def copy(bufs=bufs):
            pre = eng.prefetch(layout, bufs)
            pre.event.synchronize()
            eng.release(pre)

        def device(bufs=bufs):
            pre = eng.prefetch(layout, bufs)
            eng.digest(pre).result()
            eng.release(pre)

        def host(bufs=bufs):
            pre = eng.prefetch(layout, bufs)
            start_payload_checksums([bytes_of(b) for b in bufs]).result()
            pre.event.synchronize()
            eng.release(pre)

        pre = eng.prefetch(layout, bufs)
        pre.event.synchronize()
        staged = pre.staging.tensor[:pre.nbytes].view(C, -1)

        def kernel(staged=staged):
            torch.ops.kvplugin.segment_digests(staged, SEGMENT_BYTES)
            torch.cuda.synchronize()
        got = eng.digest(pre).result()
        assert got[:2] == [payload_checksum(bytes_of(b)) for b in bufs[:2]]
        for f in (copy, device, host, kernel):  # warm every path
            f()
        row = {"tokens": n, "bytes": C * bufs[0].nbytes, "copy_s": _median(copy), "device_s": _median(device),
               "device_kernel_s": _median(kernel), "host_s": _median(host)}
        eng.release(pre)
        row["device_over_copy"] = row["device_s"] / row["copy_s"]
        row["host_over_copy"] = row["host_s"] / row["copy_s"]
        row["kernel_GBps"] = row["bytes"] / row["device_kernel_s"] / 1e9
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8192,16384,32768,65536")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = run([int(x) for x in a.lengths.split(",")])
    result = {"benchmark": "gpu_digest", "environment": environment(), "rows": rows}
    if a.out:
        results_json.write(a.out, result)


if __name__ == "__main__":
    main()
