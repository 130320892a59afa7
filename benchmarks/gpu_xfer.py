#!/usr/bin/env python3
"""GPU <-> host KV transfer benchmark: the CUDA transfer engine against its ceilings.

One device call, built beforehand (``KVPLUGIN_BUILD_CUDA=1 python setup.py
build_ext --inplace``).  For the seeds' model shape (36 layers, 8 KV heads,
head dim 128, bf16, block 16, chunk 256) in the fused NHD layout, and for the
split (2, B, N, H, D) and MLA (36 x 576) layouts, over 1, 16 and 256 chunks:

* store / load GB/s of :class:`vllm_kvplugin.transfer.cuda.CudaTransfer`, both
  paths forced in turn (staged copy-engine DMAs, zero-copy kernel) and which
  one the default thresholds pick;
* (a) the pinned copy ceiling: ONE cudaMemcpyAsync D2H / H2D of the same bytes;
* (b) a naive per-block torch copy (per layer, per block ``.copy_`` of the
  page to pinned host, like ``swap_blocks``);
* (c) ``torch.index_select`` into a device buffer + one DMA (and the reverse);
* the gather / scatter kernels against a device-to-device copy of the same
  bytes (bytes read + bytes written).

Plus a sweep of small transfers, staged vs zero-copy, that sets the engine's
thresholds.  Every case records GB/s and ``ratio_to_ceiling``; the JSON goes
to ``--out`` (rewritten after each layout) and a short table is printed last.
Host wall time (synchronized) is what a store/load costs the caller, so the
engine numbers include its Python overhead.
"""

# The measurement closures below are defined and called within one loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import _kvcases as K  # noqa: E402
import results_json  # noqa: E402

from vllm_kvplugin import ops  # noqa: E402
from vllm_kvplugin.layout.build import build_layout  # noqa: E402
from vllm_kvplugin.transfer import cuda as xfer  # noqa: E402
from vllm_kvplugin.transfer.cuda import CudaTransfer  # noqa: E402

GB = 1e9
BS = 16
T = 256  # chunk tokens
SIZES = (1, 16, 256)
MAXC = max(SIZES)
ROTATE = 8  # slot sets rotated through for small kernel timings (L2 is 60 MB)


def wall(fn, reps: int, warmup: int = 1) -> list[float]:
    for i in range(warmup):
        fn(i)
        torch.cuda.synchronize()
    out = []
    for i in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def device_time(fn, reps: int, warmup: int = 2) -> list[float]:
    """Per-call time of ``reps`` back-to-back calls on the current stream (events)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    out = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(reps):
            fn(i)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / 1e3 / reps)
    return out


class Results:
    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"machine": machine(), "cases": [], "sweeps": {}, "errors": []}

    def add(self, **kw) -> dict:
        secs = kw.pop("secs")
        med = statistics.median(secs)
        nbytes = kw["bytes"]
        moved = nbytes * (2 if kw.get("count_rw") else 1)
        kw.pop("count_rw", None)
        row = dict(kw, seconds=med, seconds_all=secs, GBps=moved / med / GB)
        if kw.get("ceiling_GBps"):
            row["ratio_to_ceiling"] = row["GBps"] / kw["ceiling_GBps"]
        self.data["cases"].append(row)
        print(f"  {kw.get('layout', ''):10s} C={kw.get('chunks', ''):>4} {kw['direction']:7s} "
              f"{kw['method']:22s} {row['GBps']:8.1f} GB/s"
              + (f"  ratio {row['ratio_to_ceiling']:.3f}" if 'ratio_to_ceiling' in row else ""),
              flush=True)
        return row

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        results_json.write(self.out, self.data)


def machine() -> dict:
    props = torch.cuda.get_device_properties(0)
    smi = ""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
             "pcie.link.gen.max,pcie.link.width.current,clocks.max.sm,clocks.max.mem",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        smi = f"nvidia-smi failed: {e}"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "gpu_memory_GiB": round(props.total_memory / 2**30, 1),
        "nvidia_smi": smi,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "ops": ops.load().describe(),
        "engine_defaults": {
            "store_zero_copy_max_bytes": xfer.STORE_ZERO_COPY_MAX_BYTES,
            "load_zero_copy_max_bytes": xfer.LOAD_ZERO_COPY_MAX_BYTES,
            "zero_copy_max_ctas": xfer.ZERO_COPY_MAX_CTAS,
        },
    }


# ------------------------------------------------------------------ layouts

def make_layout(name: str, num_blocks: int, L: int = 36):
    """(case, layout, layers, segments): segments(l) are uint8 [num_blocks, bytes] views of
    layer l's pages (what a page copier moves per block)."""
    dev = "cuda"
    if name == "fused-nhd":
        case = K.v026_attention(layout="NHD", L=L, num_blocks=num_blocks, block_size=BS, H=8,
                                D=128, dtype=torch.bfloat16, device=dev)

        def segments(li):
            return [case.raws[li].view(torch.uint8).view(num_blocks, -1)]
    elif name == "split":
        case = K.split(kv_first=True, L=L, num_blocks=num_blocks, block_size=BS, H=8, D=128,
                       dtype=torch.bfloat16, device=dev)

        def segments(li):
            v = case.raws[li].view(torch.uint8).view(2, num_blocks, -1)
            return [v[0], v[1]]
    elif name == "mla":
        case = K.v032(layout="LBNHC", spec_kind="mla", backend="FLASHMLA", L=L,
                      num_blocks=num_blocks, block_size=BS, H=1, D=576, dtype=torch.bfloat16,
                      device=dev)

        def segments(li):
            return [case.raws[0].view(torch.uint8).view(L, num_blocks, -1)[li]]
    else:
        raise ValueError(name)
    for r in case.raws:
        r.random_()  # never time on zeros
    layout, layers = build_layout(case.src, case.views)
    return case, layout, layers, segments


def slot_sets(blocks: torch.Tensor, C: int, offsets, tokens: int = T) -> list[torch.Tensor]:
    out = []
    tok = torch.arange(tokens)
    per = tokens // BS
    for o in offsets:
        blk = blocks[o * per:(o + C) * per]
        s = blk.view(C, per).repeat_interleave(BS, dim=1) * BS + tok % BS
        out.append(s.to(torch.int64).contiguous())
    return out


def guarded(res: Results, what: str, fn) -> None:
    """Run one measurement group; a failure is recorded, the run goes on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        msg = f"{what}: {type(e).__name__}: {e}"
        print("  FAILED " + msg, flush=True)
        res.data["errors"].append(msg)
        torch.cuda.synchronize()


def default_path(res: Results, direction: str, nbytes: int) -> str:
    """The path the engine's default thresholds pick (the sweep's verdict is reported apart)."""
    limit = xfer.STORE_ZERO_COPY_MAX_BYTES if direction == "store" else xfer.LOAD_ZERO_COPY_MAX_BYTES
    return "zero-copy" if nbytes <= limit else "staged"


# ------------------------------------------------------------------ main

def run_layout(res: Results, name: str, host_u8: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor,
               engines: dict[str, CudaTransfer]) -> None:
    nb = MAXC * (T // BS) + 64
    case, layout, layers, segments = make_layout(name, nb)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(nb, generator=gen)[: MAXC * (T // BS)]
    chunk_bytes = layout.chunk_nbytes(T)
    nslots = MAXC + 1
    hv = host_u8[: nslots * chunk_bytes].view(layout.dtype).view(nslots, *layout.chunk_shape(T))
    print(f"\n== {name}: {layout.describe()}\n   chunk {chunk_bytes / 1e6:.1f} MB", flush=True)
    L = layout.num_layers
    segs = [segments(li) for li in range(L)]
    nseg, seg_bytes = len(segs[0]), segs[0][0].shape[1]
    args = (list(layout.strides), layout.block_size, layout.kernel_block_size, layout.num_blocks)
    for C in SIZES:
        nbytes = C * chunk_bytes
        big = C == MAXC
        reps = 3 if big else (5 if C >= 16 else 20)
        offsets = [0] if big else [(i * C) % (MAXC - C + 1) for i in range(ROTATE)]
        slots = slot_sets(blocks, C, offsets)
        bufs = [hv[nslots - 1 - c: nslots - c] for c in range(C)]  # reversed: no two adjacent
        common = dict(layout=name, chunks=C, bytes=nbytes)
        ceil: dict[str, float] = {}

        # kernels against a device-to-device copy of the same bytes (read + write counted)
        def kernels():
            krot = len(slots)
            span = max(1, d1.numel() - nbytes)
            offs = [(i * nbytes) % span // 256 * 256 for i in range(krot)]
            d2d = res.add(**common, direction="d2d", method="ceiling (D2D copy)", count_rw=True,
                          secs=device_time(lambda i: d2[offs[i % krot]:][:nbytes].copy_(
                              d1[offs[(i + 1) % krot]:][:nbytes]), max(3, reps)))
            stages = [d2[o:o + nbytes].view(layout.dtype).view(C, *layout.chunk_shape(T)) for o in offs]
            res.add(**common, direction="gather", method="gather kernel", count_rw=True,
                    ceiling_GBps=d2d["GBps"], secs=device_time(
                        lambda i: torch.ops.kvplugin.gather_multi(
                            layers, slots[i % krot], *args, [stages[i % krot]], 0), max(3, reps)))
            res.add(**common, direction="scatter", method="scatter kernel", count_rw=True,
                    ceiling_GBps=d2d["GBps"], secs=device_time(
                        lambda i: torch.ops.kvplugin.scatter_multi(
                            layers, slots[i % krot], *args, [stages[i % krot]], 0), max(3, reps)))
        guarded(res, f"{name} C={C} kernels", kernels)

        # (a) ceilings: one DMA of the same bytes
        def ceilings():
            hflat, dflat = host_u8[:nbytes], d1[:nbytes]
            ceil["store"] = res.add(**common, direction="store", method="ceiling (1 memcpy)", secs=wall(
                lambda i: hflat.copy_(dflat, non_blocking=True), reps))["GBps"]
            ceil["load"] = res.add(**common, direction="load", method="ceiling (1 memcpy)", secs=wall(
                lambda i: dflat.copy_(hflat, non_blocking=True), reps))["GBps"]
        guarded(res, f"{name} C={C} ceilings", ceilings)

        # the engine, both paths forced; the default is the one the thresholds pick
        def engine():
            for label, eng in engines.items():
                def store(i, eng=eng):
                    eng.wait(eng.store(layout, layers, slots[i % len(slots)], bufs))
                    eng.fence()

                def load(i, eng=eng):
                    eng.load(layout, layers, slots[i % len(slots)], bufs)

                for d, fn in (("store", store), ("load", load)):
                    row = res.add(**common, direction=d, method=f"engine {label}", path=label,
                                  ceiling_GBps=ceil.get(d), secs=wall(fn, reps))
                    if default_path(res, d, nbytes) == label:
                        res.data["cases"].append(dict(row, method="engine (default)"))
        guarded(res, f"{name} C={C} engine", engine)

        # (c) index_select into one device buffer + one DMA (and the reverse)
        idx = blocks[: C * (T // BS)].cuda()
        nblk = C * (T // BS)
        pages = host_u8[: L * nseg * nblk * seg_bytes].view(L, nseg, nblk, seg_bytes)
        stage = d1[: L * nseg * nblk * seg_bytes].view(L, nseg, nblk, seg_bytes)

        def isel():
            def isel_store(i):
                for li in range(L):
                    for sg, seg in enumerate(segs[li]):
                        torch.index_select(seg, 0, idx, out=stage[li, sg])
                pages.view(-1).copy_(stage.view(-1), non_blocking=True)

            def isel_load(i):
                stage.view(-1).copy_(pages.view(-1), non_blocking=True)
                for li in range(L):
                    for sg, seg in enumerate(segs[li]):
                        seg.index_copy_(0, idx, stage[li, sg])

            res.add(**common, direction="store", method="index_select + 1 DMA",
                    ceiling_GBps=ceil.get("store"), secs=wall(isel_store, reps))
            res.add(**common, direction="load", method="index_copy + 1 DMA",
                    ceiling_GBps=ceil.get("load"), secs=wall(isel_load, reps))
        guarded(res, f"{name} C={C} index_select", isel)

        # (b) naive per-block copies of each layer's pages (swap_blocks style)
        def naive():
            blk = blocks[:nblk].tolist()

            def naive_store(i):
                for li in range(L):
                    for sg, seg in enumerate(segs[li]):
                        dst = pages[li, sg]
                        for j, b in enumerate(blk):
                            dst[j].copy_(seg[b], non_blocking=True)

            def naive_load(i):
                for li in range(L):
                    for sg, seg in enumerate(segs[li]):
                        src = pages[li, sg]
                        for j, b in enumerate(blk):
                            seg[b].copy_(src[j], non_blocking=True)

            nreps, nwarm = (1, 0) if big else (3, 1)
            res.add(**common, direction="store", method="naive per-block copy_",
                    ceiling_GBps=ceil.get("store"), secs=wall(naive_store, nreps, nwarm))
            res.add(**common, direction="load", method="naive per-block copy_",
                    ceiling_GBps=ceil.get("load"), secs=wall(naive_load, nreps, nwarm))
        guarded(res, f"{name} C={C} naive", naive)

        # (d) vLLM's own block copies, where vLLM is on the machine (the GPU lane's payload):
        # swap_blocks (one cudaMemcpyAsync per page) and swap_blocks_batch (one driver call)
        def vllm_swaps():
            from vllm import _custom_ops as vops

            blk = blocks[:nblk].to(torch.int64)
            fwd = torch.stack([blk, torch.arange(nblk)], 1).contiguous()
            back = fwd[:, [1, 0]].contiguous()
            pairs = [(seg, pages[li, sg]) for li in range(L) for sg, seg in enumerate(segs[li])]
            dev_ptrs = torch.tensor([seg.data_ptr() + int(b) * seg.stride(0) for seg, _ in pairs for b in blk],
                                    dtype=torch.int64)
            host_ptrs = torch.tensor([dst.data_ptr() + j * dst.stride(0) for _, dst in pairs for j in range(nblk)],
                                     dtype=torch.int64)
            sizes = torch.full((len(dev_ptrs),), seg_bytes, dtype=torch.int64)
            for method, st, ld in (
                ("vLLM swap_blocks",
                 lambda i: [vops.swap_blocks(seg, dst, seg_bytes, fwd) for seg, dst in pairs],
                 lambda i: [vops.swap_blocks(dst, seg, seg_bytes, back) for seg, dst in pairs]),
                ("vLLM swap_blocks_batch",
                 lambda i: vops.swap_blocks_batch(dev_ptrs, host_ptrs, sizes),
                 lambda i: vops.swap_blocks_batch(host_ptrs, dev_ptrs, sizes)),
            ):
                nreps, nwarm = (1, 1) if big else (3, 1)
                res.add(**common, direction="store", method=method, ceiling_GBps=ceil.get("store"),
                        secs=wall(st, nreps, nwarm))
                res.add(**common, direction="load", method=method, ceiling_GBps=ceil.get("load"),
                        secs=wall(ld, nreps, nwarm))
        if importlib.util.find_spec("vllm") is not None:
            guarded(res, f"{name} C={C} vLLM swap_blocks", vllm_swaps)
        res.save()
    torch.cuda.empty_cache()


def sweep(res: Results, host_u8: torch.Tensor, engines: dict[str, CudaTransfer], *, L: int,
          tokens: int, counts, key: str) -> None:
    """Small transfers: staged vs zero-copy (capped and full grid), to set the thresholds."""
    nb = 4096 + 64 if L <= 4 else 320  # keep the cache small: ~0.5-0.8 GB
    case = K.v026_attention(layout="NHD", L=L, num_blocks=nb, block_size=BS, H=8, D=128,
                            dtype=torch.bfloat16, device="cuda")
    for r in case.raws:
        r.random_()
    layout, layers = build_layout(case.src, case.views)
    chunk_bytes = layout.chunk_nbytes(tokens)
    gen = torch.Generator().manual_seed(2)
    blocks = torch.randperm(nb, generator=gen)
    per = tokens // BS
    print(f"\n== sweep {key}: chunk of {tokens} tokens x {L} layers = {chunk_bytes / 1e3:.0f} kB",
          flush=True)
    rows = res.data.setdefault("sweeps", {}).setdefault(key, [])
    for C in counts:
        nslots = C + 1
        hv = host_u8[: nslots * chunk_bytes].view(layout.dtype).view(nslots, *layout.chunk_shape(tokens))
        bufs = [hv[nslots - 1 - c: nslots - c] for c in range(C)]
        offs = [(k * C) % max(1, (nb - 64) // per - C) for k in range(4)]
        slots = slot_sets(blocks, C, offs, tokens)
        row = {"chunks": C, "bytes": C * chunk_bytes}
        for label, eng in engines.items():
            def store(i, eng=eng):
                eng.wait(eng.store(layout, layers, slots[i % 4], bufs))
                eng.fence()

            def load(i, eng=eng):
                eng.load(layout, layers, slots[i % 4], bufs)

            row[f"store {label}"] = statistics.median(wall(store, 15, 3))
            row[f"load {label}"] = statistics.median(wall(load, 15, 3))
        rows.append(row)
        print("  " + "  ".join(f"{k}={v * 1e6:.0f}us" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
    res.save()


def thresholds(res: Results, key: str) -> None:
    """The largest size up to which zero-copy (capped grid) is never slower than staged."""
    out = {}
    for d in ("store", "load"):
        best = 0
        for row in res.data["sweeps"][key]:
            if row[f"{d} zero-copy"] < row[f"{d} staged"]:
                best = row["bytes"]
            else:
                break
        out[d] = best
    res.data["measured_thresholds"] = out
    res.data["measured_thresholds_from"] = key
    print(f"  measured thresholds (bytes): {out}", flush=True)


def table(res: Results) -> None:
    cases = res.data["cases"]

    def get(layout, C, direction, method):
        for r in cases:
            if (r["layout"], r["chunks"], r["direction"], r["method"]) == (layout, C, direction, method):
                return r
        return None

    print("\n" + "=" * 118)
    print(f"{res.data['machine']['gpu']}  torch {res.data['machine']['torch']}  CUDA {res.data['machine']['cuda']}"
          f"  {res.data['machine']['date']}")
    print("GB/s (ratio to the same-size ceiling)       store = GPU->host, load = host->GPU; kernels vs D2D copy")
    hdr = (f"{'layout':9s} {'C':>4s} {'MB':>7s} | {'ceil st':>7s} {'engine st':>15s} {'zc st':>6s} "
           f"{'naive':>6s} {'isel':>6s} | {'ceil ld':>7s} {'engine ld':>15s} {'zc ld':>6s} "
           f"{'naive':>6s} {'isel':>6s} | {'gather':>12s} {'scatter':>12s}")
    print(hdr)
    layouts = []
    for r in cases:
        if r["layout"] not in layouts:
            layouts.append(r["layout"])
    for lay in layouts:
        for C in SIZES:
            c_st = get(lay, C, "store", "ceiling (1 memcpy)")
            if c_st is None:
                continue
            c_ld = get(lay, C, "load", "ceiling (1 memcpy)") or c_st
            e_st = get(lay, C, "store", "engine (default)")
            e_ld = get(lay, C, "load", "engine (default)")

            def g(d, m):
                r = get(lay, C, d, m)
                return f"{r['GBps']:6.1f}" if r else "     -"

            def gr(r):
                if not r:
                    return "-"
                tag = {"staged": "s", "zero-copy": "z"}.get(r.get("path"), "")
                return f"{r['GBps']:5.1f} ({r.get('ratio_to_ceiling', float('nan')):.2f}){tag}"
            print(f"{lay:9s} {C:4d} {c_st['bytes'] / 1e6:7.0f} | {c_st['GBps']:7.1f} {gr(e_st):>15s} "
                  f"{g('store', 'engine zero-copy')} {g('store', 'naive per-block copy_')} "
                  f"{g('store', 'index_select + 1 DMA')} | {c_ld['GBps']:7.1f} {gr(e_ld):>15s} "
                  f"{g('load', 'engine zero-copy')} {g('load', 'naive per-block copy_')} "
                  f"{g('load', 'index_copy + 1 DMA')} | {gr(get(lay, C, 'gather', 'gather kernel')):>12s} "
                  f"{gr(get(lay, C, 'scatter', 'scatter kernel')):>12s}")
    d2d = [r["GBps"] for r in cases if r["method"] == "ceiling (D2D copy)" and r["chunks"] == MAXC]
    if d2d:
        print(f"D2D copy ceiling at {MAXC} chunks: {max(d2d):.0f} GB/s (read + write)")
    for e in res.data.get("errors", []):
        print("ERROR " + e[:200])
    if res.data.get("measured_thresholds"):
        print(f"zero-copy faster than staged up to (bytes): {res.data['measured_thresholds']}; "
              f"engine defaults: store <= {xfer.STORE_ZERO_COPY_MAX_BYTES}, load <= {xfer.LOAD_ZERO_COPY_MAX_BYTES}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-xfer.json")
    ap.add_argument("--layouts", default="fused-nhd,split,mla")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    info = ops.load()
    assert info.cuda == "CUDA kernel", f"build the CUDA kernel first ({info.describe()})"
    res = Results(args.out)
    print(json.dumps(res.data["machine"], indent=1), flush=True)
    t0 = time.perf_counter()
    max_chunk = 36 * 2 * T * 8 * 128 * 2
    total = (MAXC + 1) * max_chunk
    host_u8 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    print(f"pinned {total / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    d1 = torch.empty(total, dtype=torch.uint8, device="cuda")
    d2 = torch.empty(total, dtype=torch.uint8, device="cuda")
    d1.random_()
    d2.random_()
    dev = torch.device("cuda", 0)
    engines = {
        "staged": CudaTransfer(dev, store_zero_copy_max_bytes=-1, load_zero_copy_max_bytes=-1),
        "zero-copy": CudaTransfer(dev, store_zero_copy_max_bytes=1 << 62,
                                  load_zero_copy_max_bytes=1 << 62),
    }
    if not args.no_sweep:
        sweep_engines = dict(engines)
        sweep_engines["zero-copy-fullgrid"] = CudaTransfer(
            dev, store_zero_copy_max_bytes=1 << 62, load_zero_copy_max_bytes=1 << 62,
            zero_copy_max_ctas=0)
        guarded(res, "sweep small", lambda: sweep(res, host_u8, sweep_engines, L=2, tokens=BS,
                                                  counts=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                                                  key="L2-T16"))
        guarded(res, "sweep seeds", lambda: sweep(res, host_u8, sweep_engines, L=36, tokens=BS,
                                                  counts=(1, 2, 4, 8, 16), key="L36-T16"))
        guarded(res, "thresholds", lambda: thresholds(res, "L2-T16"))
    for name in args.layouts.split(","):
        guarded(res, name, lambda: run_layout(res, name, host_u8, d1, d2, engines))
        print(f"   ({time.perf_counter() - t0:.0f} s so far)", flush=True)
    res.data["wall_seconds"] = time.perf_counter() - t0
    res.save()
    table(res)


if __name__ == "__main__":
    main()
