#!/usr/bin/env python3
"""What a warm hit's load costs after vLLM allocated its blocks (one device call, no vLLM).

A lone hit is loaded at its allocation (``update_state_after_alloc``): from the blocks' ids to the
scatter's launch everything runs on vLLM's thread, and the forward waits for the scatter.  For an
8k hit of Qwen3-8B's KV (36 layers x 8 KV heads x 128, bf16, blocks of 16 tokens: 32 objects of
256 tokens, 1.2 GB, staged on the device by a prefetch that has landed), median of ``--reps``:

* host seconds of each piece: the per-token slots from the block ids (``PlacedObjects.slots``), the
  engine's slot check, the staged load's whole call, and the scatter op's call alone;
* ``path_s``: the whole host path as the worker runs it (slots, then the staged load) and
  ``blocks_path_s`` the one that hands the op the blocks' ids (``PlacedObjects``);
* ``blocks_path_cold_s``: that path after its caches were swept and 20 ms of polling (as after a
  copy's wait), and ``blocks_path_cold_rehearsed_s`` the same with the path rehearsed over no
  object right before it (``CudaTransfer.rehearse``, ``worker_fetch.REHEARSE_LOADS``);
* device seconds of the scatter kernels (``scatter_multi``'s per-token one, ``scatter_blocks``'
  block-run one: this layout's blocks are dense runs), against a device-to-device copy of the
  same bytes (the memory's ceiling for moving them once).

    python3 benchmarks/gpu_load_host.py --out results/gpu-load-host-h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests" / "gpu"))

import _kvcases as K  # noqa: E402
import results_json  # noqa: E402
from ttft_common import environment  # noqa: E402

from vllm_kvplugin.layout.build import build_layout  # noqa: E402
from vllm_kvplugin.transfer.cuda import CudaTransfer  # noqa: E402
from vllm_kvplugin.transfer.placement import PlacedObjects  # noqa: E402

L, H, D, BS, T = 36, 8, 128, 16, 256


_SWEEP = np.ones(64 << 20, dtype=np.uint8)


def _chill() -> None:
    """As a lone hit's thread before its load: caches swept (here by reading 64 MB), then 20 ms
    of polling (``fetch_now``'s wait for the copy)."""
    _SWEEP.sum()
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        time.sleep(0)


def _median_host(fn, reps: int, before=None) -> float:
    out = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return round(statistics.median(out[3:]), 6)


def _median_device(fn, reps: int) -> float:
    out = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return round(statistics.median(out[3:]), 6)


def _measure(eng: CudaTransfer, layout, layers, num_blocks: int, tokens: int, reps: int) -> dict:
    C = tokens // T
    host = torch.zeros((C, *layout.chunk_shape(T)), dtype=layout.dtype, pin_memory=True)
    bufs = [host[i:i + 1] for i in range(C)]
    pre = eng.prefetch(layout, bufs)
    assert pre is not None and pre.rows == C, "the staging room must hold the hit"
    torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randperm(num_blocks, generator=gen)[:C * T // BS].view(C, T // BS).tolist()

    def placed() -> PlacedObjects:
        return PlacedObjects.of(ids, BS, T, [0] * C, [T] * C)

    slots = placed().slots()
    where = placed().tensors()
    staged = [(pre, list(range(C)))]
    multi = (list(layers), slots, list(layout.strides), layout.block_size, layout.kernel_block_size,
             layout.num_blocks, [pre.stage])
    row = {"prompt_tokens": tokens, "objects": C, "bytes": C * layout.chunk_nbytes(T)}
    row["host_s"] = {
        "placed_objects": _median_host(placed, reps),
        "token_slots": _median_host(lambda: placed().slots(), reps),
        "slot_check": _median_host(lambda: eng._check(layout, slots, bufs, read=False), reps),
        "staged_load_slots": _median_host(lambda: eng.load(layout, layers, slots, bufs, staged=staged), reps),
        "staged_load_blocks": _median_host(lambda: eng.load(layout, layers, placed(), bufs, staged=staged), reps),
        "scatter_multi_call": _median_host(lambda: torch.ops.kvplugin.scatter_multi(*multi, 0), reps),
        "scatter_blocks_call": _median_host(lambda: torch.ops.kvplugin.scatter_blocks(
            list(layers), *where, *multi[2:], 0), reps),
        "scatter_blocks_call_block_runs": _median_host(lambda: torch.ops.kvplugin.scatter_blocks(
            list(layers), *where, *multi[2:], 0, True), reps),
        "event_record": _median_host(lambda: CudaTransfer._event(torch.cuda.current_stream()), reps),
    }
    # the whole host path from the blocks' ids to the scatter's launch, either way
    row["path_s"] = _median_host(lambda: eng.load(layout, layers, placed().slots(), bufs, staged=staged), reps)
    row["blocks_path_s"] = _median_host(lambda: eng.load(layout, layers, placed(), bufs, staged=staged), reps)
    row["blocks_over_slots"] = round(row["blocks_path_s"] / row["path_s"], 3)

    def rehearsed() -> None:  # what WorkerSide._rehearse_load does, after the copy's wait
        _chill()
        empty = PlacedObjects.of([[0] * (T // BS)], BS, T, [0], [0])
        empty.count()
        eng.rehearse(layout, layers, empty)

    blocks_path = lambda: eng.load(layout, layers, placed(), bufs, staged=staged)  # noqa: E731
    row["blocks_path_cold_s"] = _median_host(blocks_path, reps, before=_chill)
    row["blocks_path_cold_rehearsed_s"] = _median_host(blocks_path, reps, before=rehearsed)
    dst = torch.empty_like(pre.stage)
    row["device_s"] = {"scatter_kernel": _median_device(lambda: torch.ops.kvplugin.scatter_multi(*multi, 0), reps),
                       "scatter_blocks_kernel": _median_device(lambda: torch.ops.kvplugin.scatter_blocks(
                           list(layers), *where, *multi[2:], 0, True), reps),
                       "d2d_copy": _median_device(lambda: dst.copy_(pre.stage), reps)}
    for ctas in (264, 528, 1056, 2112, 4224, 8448):
        row["device_s"][f"scatter_kernel_ctas_{ctas}"] = _median_device(
            lambda ctas=ctas: torch.ops.kvplugin.scatter_multi(*multi, ctas), reps)
    row["kernel_over_copy"] = round(row["device_s"]["scatter_kernel"] / row["device_s"]["d2d_copy"], 3)
    row["blocks_kernel_over_copy"] = round(row["device_s"]["scatter_blocks_kernel"] / row["device_s"]["d2d_copy"], 3)
    eng.release(pre)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    num_blocks = 4096
    case = K.v026_attention(layout="NHD", L=L, num_blocks=num_blocks, block_size=BS, H=H, D=D,
                            dtype=torch.bfloat16, device="cuda")
    layout, layers = build_layout(case.src, case.views)
    eng = CudaTransfer(torch.device("cuda", 0))
    rows = []
    for tokens in args.tokens:
        rows.append(_measure(eng, layout, layers, num_blocks, tokens, args.reps))
        torch.cuda.synchronize()
        print(rows[-1], flush=True)
    doc = {"benchmark": "gpu_load_host", "date": time.strftime("%Y-%m-%d"), **environment(),
           "geometry": {"layers": L, "kv_heads": H, "head_dim": D, "block_size": BS, "chunk_tokens": T,
                        "dtype": "bfloat16", "layout": "v026 FLASH_ATTN NHD"},
           "reps": args.reps, "rows": rows}
    results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
