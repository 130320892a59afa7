"""Cold vs warm time-to-first-token on a GPU, side by side with vLLM's own CPU offloading.

Run on the H200 with vLLM's GPU wheel (``bash compat/gpulane/bench.sh ttft``).  The model
has Qwen3-8B's shape where KV and prefill are concerned (36 layers, hidden 4096, 32 query
heads, 8 KV heads of dim 128, bf16: 144 KiB of KV per token) with random weights, built
locally.  Modes, each in its own engine process (in-process engine core, eager), the same
prompts in the same order:

* ``baseline``   - no connector: every request recomputes;
* ``vllm-apc``   - no connector, vLLM's GPU prefix cache kept: the repeat is a GPU prefix-cache
  hit, no transfer at all (the floor any connector is measured against);
* ``kvplugin``   - KVPluginConnector, in-process tier (page-locked host memory);
* ``kvplugin-noverify`` - the same with ``verify_checksums: false`` (what the checksums cost);
* ``kvplugin-early`` - the same, a lone hit claimed before the device's verdict
  (``scheduler_lone.CLAIM_BEFORE_VERDICT``, with the ``recompute`` policy it needs, which needs
  vLLM's synchronous scheduling and V1 model runner: vLLM issues #45138, #49250), and
  ``kvplugin-sync``, ``kvplugin`` with both, to compare it with (neither in the default set);
* ``kvplugin-hash8`` - ``kvplugin`` hashing on at most 8 host threads (not in the default set:
  whether fewer hashing threads leave vLLM's host work of the claim step faster);
* ``kvplugin-wN`` - ``kvplugin`` with N paced store DMAs on the copy engine at once (not in the
  default set; ``transfer/paced.py``);
* ``kvplugin-held`` - ``kvplugin`` whose lone hits are held back a step for their verdict, as
  every hit was before ``SchedulerSide._fetch_here`` (not in the default set);
* ``kvplugin-gc-late`` - ``kvplugin`` whose lone fetches leave Python's collections where the
  allocation counts put them, as before ``worker_fetch.GC_IN_FETCH_MIN_BYTES`` (not in the
  default set);
* ``kvplugin-unsplit`` - ``kvplugin`` whose lone lookups key the whole prompt before the first
  read, as before ``metadata.FIRST_PART_CHUNKS`` (not in the default set);
* ``kvplugin-load-in-step`` - ``kvplugin`` whose lone hits are loaded from the step's metadata
  (``start_load_kv``), as before ``scheduler_lone.LOAD_AT_ALLOCATION`` (not in the default set);
* ``kvplugin-slots`` - ``kvplugin`` whose staged loads build and check per-token slots in numpy
  for ``scatter_multi``, as before ``cuda.SCATTER_BY_BLOCKS`` (not in the default set);
* ``kvplugin-per-token`` - ``kvplugin`` whose staged loads take ``scatter_blocks``' per-token
  kernel for every layout, as before ``cuda.BLOCK_RUNS`` (not in the default set);
* ``kvplugin-rehearse`` - ``kvplugin`` whose lone fetches rehearse their load's host path as
  their copy ends (``worker_fetch.REHEARSE_LOADS``; not in the default set);
* ``kvplugin-linkwake`` - ``kvplugin`` plus an experiment of this benchmark's, not the plugin's:
  a 1 MiB copy over the link when the scheduler half first sees a request, ~0.3 ms before a lone
  fetch's first bytes (does an idle link start a copy slowly? ``gpu_link_wake.py``; not in the
  default set);
* any mode with ``-untimed`` (e.g. ``kvplugin-untimed``): that mode's engine without the stage
  timers (no stages in its rows; what the timers on vLLM's thread add to its times);
* ``kvplugin-server`` - KVPluginConnector through a `vllm-kvplugin server` process;
* ``kvplugin-server-threaded`` - ``kvplugin-server`` whose lone requests' lookups go to the index's
  thread, as before ``scheduler_lone.LOOKUP_HERE`` (not in the default set);
* ``vllm-offloading`` - vLLM's own ``OffloadingConnector`` (CPU offloading, ``cpu_bytes_to_use``).

Prefix caching is on in every mode, and vLLM's GPU prefix cache is reset before each
measured request (but in ``vllm-apc``), so a warm request's hit can only come from the
connector.  The first hit after start-up is measured apart (``first_hit_warm_s``; side by side,
once every engine is up, one engine at a time: measured during the others' start-ups it read
0.92-2.06x a later hit through the server, one sample each, in runs of one day).  Per prompt
length: one unmeasured request of that length (kernel warm-up), the cold request, the same
prompt warm (the median of 5), then 8 greedy tokens compared with the baseline's.  TTFT is the
latency of a 1-token generation.

Side by side (the default, ``side_by_side.py``): every mode's engine is started first, all in
one GPU (``vllm-apc``'s cold request is the no-connector one), then in ``--rounds`` rounds with
fresh prompts each length is measured in every mode in turn (the order rotated), so a length's
modes ran seconds apart; the bars' ratios are taken per round and their median reported
(``*_each_round``: every round's).  The floor of a warm hit is the same engine's GPU
prefix-cache hit of the same prompt, measured right after each warm run (the bars take the
median of the pairs' differences); the link time of a hit is its bytes copied from pinned host
memory to the GPU in the same run, by the plugin's engine while every engine is idle, before the
rounds and after them (``link_seconds``, the fastest of 9 each time, then the faster of the two:
one run's copies after the rounds read 52.3 GB/s where its hits' own copies had crossed at 53-54;
every row reports it as ``link_s`` and ``link_GBps``, and both samples as ``link_samples_s``).
The own hit passes the plugin's lookup of the prompt (its keys, 0.5-1.8 ms at 8k-32k on an H100);
``*_warm_minus_own_apc_less_lookup_over_link`` takes that out of the floor.  One engine's times
moved by 10-30% between runs of the sequential method (``--sequential``: each mode's engine in
turn, e.g. for more modes than fit beside each other).  With ``--pin-main`` each engine's main
thread has a physical core of its own (``host_cpus.py``).  Results: JSON with the machine and
versions, and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gpu_fit  # noqa: E402
import results_json  # noqa: E402
from host_cpus import MainThreadWatch, pin_main_thread, reserve_cores  # noqa: E402
from side_by_side import running, serve  # noqa: E402
from ttft_common import (  # noqa: E402
    TTFTProbe,
    built_gpu_model,
    environment,
    measure,
    print_table,
    run_modes_with_server,
    serve_loop,
    start_server,
    summarize,
    tokens,
)

from vllm_kvplugin.planner import max_loadable_tokens  # noqa: E402

SPEC = dict(arch="qwen3", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128)
KV_PER_TOKEN = SPEC["layers"] * 2 * SPEC["kv_heads"] * SPEC["head_dim"] * 2  # bytes (bf16)
LINK_BYTES_PER_S = 55.3e9  # the ceiling of benchmarks/results/gpu-xfer-h200.json: where a run measured none
HOST_BYTES = 24 << 30  # every prompt of the run fits: no eviction in any mode
KV_BYTES = 16 << 30
SIDE_BY_SIDE_HOST_BYTES = 16 << 30  # the longest prompt and its primer fit
SEQUENTIAL_MODES = "baseline,vllm-apc,kvplugin,kvplugin-noverify,kvplugin-server,vllm-offloading"
SIDE_BY_SIDE_MODES = "vllm-apc,kvplugin,kvplugin-server,vllm-offloading"


def transfer_config(mode: str, chunk: int, host_bytes: int, server: str | None):
    """vLLM's ``KVTransferConfig`` of a mode (None: no connector)."""
    from vllm.config import KVTransferConfig

    if mode.startswith("kvplugin"):
        extra = {"chunk_size": chunk, "cpu_bytes": 0 if mode.startswith("kvplugin-server") else host_bytes}
        if mode == "kvplugin-noverify":  # what the payload checksums cost
            extra["verify_checksums"] = False
        if mode.startswith("kvplugin-early"):  # claimed before the verdict: needs the recompute policy
            extra["load_failure_policy"] = "recompute"
        if server:
            extra["server"] = server
        return KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    if mode == "vllm-offloading":
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": host_bytes})
    return None


#: ``--graphs``: how vLLM runs the model, every mode alike (:func:`graph_kwargs`)
GRAPHS = ("eager", "full-decode", "default")


def graph_kwargs(graphs: str, streams: int) -> dict:
    """``LLM`` arguments for ``--graphs``.  ``eager`` (the default, as in every run before
    2026-12-06): no torch.compile, no CUDA graphs, so every step is bound by the host's Python and
    launches, vLLM's per-layer connector plumbing included.  ``full-decode``: no torch.compile, and
    a batch of one-token requests (a decode step, the one-token step after a full hit) replays a
    whole captured CUDA graph (vLLM's ``FULL_DECODE_ONLY``: no Python runs per layer in it).
    ``default``: vLLM's own default, torch.compile and ``FULL_AND_PIECEWISE`` graphs (a minute or
    more of compilation per engine; two engines compile apart, and Inductor picks among kernel
    variants by timing them, so their outputs may differ in the last bits without any fault:
    ``tests/gpu``' graphs test compares with a recompute in the same engine).  Batches of up to
    ``streams`` requests are captured."""
    if graphs == "eager":
        return {"enforce_eager": True}
    sizes = sorted({1, 2, 4, 8, *range(16, streams + 1, 8), streams})
    if graphs == "full-decode":
        return {"enforce_eager": False, "compilation_config": {
            "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": sizes}}
    return {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": sizes}}


#: a mode's name with this suffix: the same engine without stage timers (``stage_timers``' wrappers
#: run on vLLM's thread, a dozen of them between a hit's last byte and its scatter, and record
#: CUDA events there; the engine's own hit passes few of them): what they add to the bars
UNTIMED = "-untimed"


def mode_knobs(mode: str) -> None:
    """In a mode's child, before its engine: the plugin's module constants that mode changes
    (each read when the engine registers)."""
    from vllm_kvplugin.chunk import checksums
    from vllm_kvplugin.transfer import cuda

    if mode == "kvplugin-hash8":  # a hit's hashes on at most 8 threads
        checksums.MAX_THREADS = 8
    if mode.startswith("kvplugin-w"):  # kvplugin-wN: N paced store DMAs on the copy engine at once
        cuda.DMA_WINDOW = int(mode[len("kvplugin-w"):])
    if mode == "kvplugin-held":  # every hit held back a step for its verdict, a lone one too
        from vllm_kvplugin.connector.scheduler import SchedulerSide
        SchedulerSide._fetch_here = lambda self, req, more=None: None
    if mode == "kvplugin-gc-late":  # no collection in a lone fetch's wait
        from vllm_kvplugin.connector import worker_fetch
        worker_fetch.GC_IN_FETCH_MIN_BYTES = 1 << 62
    if mode == "kvplugin-load-in-step":  # a lone hit loaded from the step's metadata, not at its allocation
        from vllm_kvplugin.connector import scheduler_lone
        scheduler_lone.LOAD_AT_ALLOCATION = False
    if mode == "kvplugin-rehearse":  # a lone fetch rehearses its load's host path as its copy ends
        from vllm_kvplugin.connector import worker_fetch
        worker_fetch.REHEARSE_LOADS = True
    if mode == "kvplugin-slots":  # staged loads scattered by per-token slots, not block ids
        cuda.SCATTER_BY_BLOCKS = False
    if mode == "kvplugin-per-token":  # scatter_blocks' per-token kernel, also where the blocks are dense runs
        cuda.BLOCK_RUNS = False
    if mode == "kvplugin-server-resolving":  # the worker resolves a hit's objects, as with several ranks
        from vllm_kvplugin.tiers import mp
        mp.LOOKUP_RESOLVES = False
    if mode == "kvplugin-server-threaded":  # a lone request's server lookup on the index's thread
        from vllm_kvplugin.connector import scheduler_lone
        scheduler_lone.LOOKUP_HERE = False
    if mode == "kvplugin-server-nowake":  # a lone request's lookup not announced to the server
        from vllm_kvplugin.connector import scheduler_lone
        scheduler_lone.WAKE_SERVER = False
    if mode.startswith("kvplugin-early"):  # a lone hit claimed before its verdict (scheduler_lone.py)
        from vllm_kvplugin.connector import scheduler_lone
        scheduler_lone.CLAIM_BEFORE_VERDICT = True
    if mode.startswith(("kvplugin-early", "kvplugin-sync")):  # what vLLM's recompute needs (bad_blocks.py)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if mode == "kvplugin-linkwake":
        _wake_link_at_lookup()
    if mode == "kvplugin-unsplit":  # a lone hit's keys all computed before its first read
        from vllm_kvplugin.connector import metadata
        metadata.FIRST_PART_CHUNKS = 0


def _wake_link_at_lookup(nbytes: int = 1 << 20) -> None:
    """``kvplugin-linkwake``: when the scheduler half first sees a request (``_tracker``, before
    its keys), ``nbytes`` copied from page-locked memory to the device on the worker's copy stream,
    returning at once.  In a TTFT run's timeline a lone hit's first part (151 MB at 8k) crossed at
    49-52 GB/s and the rest at 54-55; if a link idle before a copy starts it slowly, this shows it
    in the first token's time.  An experiment of this benchmark's only."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_kvplugin.connector.scheduler import SchedulerSide

    orig, bufs = SchedulerSide._tracker, []

    def tracker(self, request):
        if request.request_id not in self._reqs:
            engine = get_kv_transfer_group()._worker.engine
            if not bufs:  # (the warm-up requests pay for these)
                bufs[:] = [torch.ones(nbytes, dtype=torch.uint8, pin_memory=True),
                           torch.empty(nbytes, dtype=torch.uint8, device=engine.device)]
            with torch.cuda.stream(engine._h2d):
                bufs[1].copy_(bufs[0], non_blocking=True)
        return orig(self, request)

    SchedulerSide._tracker = tracker


def _engine(mode: str, args, lengths: list[int], server: str | None, side_by_side: bool):
    """A mode's engine and its stage timers (None without CUDA), in a child process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    from stage_timers import StageTimers
    from vllm import LLM

    timers = StageTimers().install() if torch.cuda.is_available() and not mode.endswith(UNTIMED) else None
    mode = mode.removesuffix(UNTIMED)
    mode_knobs(mode)
    ktc = transfer_config(mode, args.chunk, args.host_bytes, server)
    if ktc is not None and mode.startswith("kvplugin") and args.gpu_staging_bytes is not None:
        ktc.kv_connector_extra_config["gpu_staging_bytes"] = args.gpu_staging_bytes
    max_len = max(lengths) + 64
    kv_bytes = args.kv_bytes or (KV_BYTES if not side_by_side else _kv_bytes_for(max_len))
    sync = {"async_scheduling": False} if mode.startswith(("kvplugin-early", "kvplugin-sync")) else {}
    llm = LLM(model=args.model, enable_prefix_caching=True, max_model_len=max_len, **graph_kwargs(args.graphs, 1),
              kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=args.gpu_util, block_size=args.block,
              kv_transfer_config=ktc, seed=0, max_num_batched_tokens=args.max_batched or max_len, **sync)
    if args.serve_loop:
        serve_loop(llm)
    return llm, timers


def _kv_bytes_for(tokens: int) -> int:
    """KV cache room for one prompt of ``tokens`` tokens of SPEC's model and a fifth more, whole GiB."""
    return -(-int(tokens * KV_PER_TOKEN * 1.2) // (1 << 30)) << 30


def _probe(llm, mode: str, timers) -> TTFTProbe:
    # settle: asynchronous stores (vLLM's offloading) finish before the warm request
    return TTFTProbe(llm, reset_prefix_cache=mode.removesuffix(UNTIMED) != "vllm-apc", primer=True, settle_s=0.5,
                     timers=timers)


def run_mode(mode: str, args, lengths: list[int]) -> dict:
    """One engine, all prompts, in a child process (``--child``, the sequential method)."""
    import vllm_kvplugin

    llm, timers = _engine(mode, args, lengths, args.server, side_by_side=False)
    rows = measure(llm, lengths, reset_prefix_cache=mode.removesuffix(UNTIMED) != "vllm-apc", primer=True,
                   settle_s=0.5, timers=timers)
    stats = vllm_kvplugin.stats() if mode.startswith("kvplugin") else None
    return {"mode": mode, "rows": rows, "kvplugin_stats": stats}


def run_resident(mode: str, args, lengths: list[int]) -> None:
    """One engine in a child (``--child MODE --resident``): one length per command (``N SEED``),
    ``first`` (the warm-up and the first hit after start-up, measured when asked: the parent asks
    the engines in turn once all are up, so that no other engine's start-up -- weights, graph
    capture, its own first hit -- runs beside it) and ``stats``."""
    import vllm_kvplugin

    llm, timers = _engine(mode, args, lengths, args.server, side_by_side=True)
    probe = _probe(llm, mode, timers)
    if args.main_cpu is not None:
        pin_main_thread(args.main_cpu)
        MainThreadWatch(period_s=0.2, pinned=args.main_cpu, sample=False).__enter__()  # for the engine's life

    def handle(command: str) -> dict:
        if command == "first":
            first_s, first_stages = probe.first_hit(lengths[0])
            return {"first_hit_warm_s": round(first_s, 4), "first_hit_stages": first_stages}
        if command == "stats":
            return {"kvplugin_stats": vllm_kvplugin.stats() if mode.startswith("kvplugin") else None}
        if command.startswith("profile "):
            return profile(probe, *(int(x) for x in command.split()[1:]))
        if command.startswith("link "):
            return {"link_s": link_seconds(int(command.split()[1]) * KV_PER_TOKEN)}
        n, seed = (int(x) for x in command.split())
        return probe.length(n, seed)

    serve(handle)


def link_seconds(nbytes: int, repeats: int = 9, piece: int = 1 << 30) -> float:
    """The pinned-copy ceiling in this run: seconds to copy ``nbytes`` from page-locked host
    memory to the GPU (one stream, 1 GiB pieces back to back from one pinned buffer, so that a
    64k hit's 9.7 GB needs no second copy of it in memory), the fastest of ``repeats``.  (The
    median let one slow sample through: on the H100 of 2026-12-05 it gave 49.7 GB/s at 16k
    beside 54.4 and 54.8 at 8k and 32k, and with it a bar below 1.0.)"""
    import torch

    host = torch.empty(min(piece, nbytes), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    times = []
    for _ in range(repeats + 1):  # the first: warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for off in range(0, nbytes, host.numel()):
            k = min(host.numel(), nbytes - off)
            dev[:k].copy_(host[:k], non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del host, dev
    torch.cuda.empty_cache()
    return round(min(times[1:]), 5)


def profile(probe: TTFTProbe, n: int, seed: int) -> dict:
    """A cold and a warm request of ``n`` tokens (after a primer), each under the profiler: the
    device's streams and the host's CUDA waits, to see what a late step waited for."""
    from cuda_trace import busy, traced

    probe.once(tokens(n, 10**6 + seed))
    p = tokens(n, seed)
    out = {"prompt_tokens": n}
    for name in ("cold", "warm"):
        (t, _), rows = traced(lambda: probe.once(p))
        out[name] = {"s": round(t, 4), "busy": busy(rows), "rows": rows}
        time.sleep(probe.settle_s)
    return out


def build_model() -> str:
    """The model, its random weights made on the GPU (seconds instead of minutes on the CPU)."""
    import torch

    from vllm_kvplugin import tiny_model

    with torch.device("cuda"):
        return str(tiny_model.build(tiny_model.TinySpec(**SPEC)))


def _median_row(rows: list[dict]) -> dict:
    """A length's rows of every round as one: median cold and warm, the first round's stages."""
    out = dict(rows[0])
    for k in ("cold_s", "warm_s", "first_warm_s", "own_apc_s", "warm_minus_own_s"):
        if k in out:
            out[k] = round(statistics.median(r[k] for r in rows), 4)
    return out


def run_side_by_side(args, modes: list[str], lengths: list[int], model: str,
                     out: Path) -> tuple[list[dict], dict, dict[int, float], dict[int, list[float]]]:
    """Every mode's engine alive at once; per round and length, each asked in turn (rotated).
    Returns the modes' results, errors, and per length the link time of its hit (the faster of
    :func:`link_seconds` before the rounds and after them) and those samples."""
    gpu_fit.check(modes, model, args.kv_bytes or _kv_bytes_for(max(lengths) + 64), args.gpu_staging_bytes,
                  "Name fewer --modes or shrink --kv-bytes / --gpu-staging-bytes (an H100 fits --modes "
                  "vllm-apc,kvplugin,vllm-offloading --kv-bytes 6442450944 --gpu-staging-bytes 6442450944 "
                  "--lengths 8193,16385,32769).")
    proc = address = None
    main_cpu = {m: core[0] for m, core in zip(modes, reserve_cores(len(modes)))} if args.pin_main else {}
    if any(m.startswith("kvplugin-server") for m in modes):
        proc, address = start_server(args.host_bytes)

    def args_for(mode: str) -> list[str]:
        a = ["--model", model, "--lengths", args.lengths, "--block", str(args.block), "--chunk", str(args.chunk),
             "--host-bytes", str(args.host_bytes), "--gpu-util", str(args.gpu_util),
             "--max-batched", str(args.max_batched), "--graphs", args.graphs] \
            + (["--serve-loop"] if args.serve_loop else [])
        for flag, value in (("--kv-bytes", args.kv_bytes), ("--gpu-staging-bytes", args.gpu_staging_bytes)):
            if value is not None:
                a += [flag, str(value)]
        if mode in main_cpu:
            a += ["--main-cpu", str(main_cpu[mode])]
        return a + (["--server", address] if mode.startswith("kvplugin-server") else [])

    per: dict[str, list[dict]] = {m: [] for m in modes}
    profiles: dict[str, list[dict]] = {}
    t0 = time.time()
    with running(__file__, modes, args_for, out.parent / "ttft-logs", proc) as engines:
        print(f"{len(modes)} engines ready in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        firsts = {m: e.ask("first") for m, e in engines.items()}  # one engine at a time, the others idle
        meter = engines.get("kvplugin") or next(iter(engines.values()))  # engines idle: the link alone
        planned = {n: max_loadable_tokens(n, args.chunk) for n in lengths}  # the bytes a hit should move
        before = {n: meter.ask(f"link {planned[n]}")["link_s"] for n in lengths}
        for rnd in range(args.rounds):
            for i, n in enumerate(lengths):
                k = (rnd + i) % len(modes)
                for m in modes[k:] + modes[:k]:
                    row = engines[m].ask(f"{n} {n + rnd * 10**7}")  # a fresh prompt each round
                    per[m].append({**row, "round": rnd})
            print(f"round {rnd}: " + ", ".join(f"{m} {[r['warm_s'] for r in per[m] if r['round'] == rnd]}"
                                               for m in modes), file=sys.stderr, flush=True)
            Path(str(out) + ".partial").write_text(json.dumps({"partial": True, "rounds": per}))
        stats = {m: e.ask("stats")["kvplugin_stats"] for m, e in engines.items()}
        hits = {n: max(r["warm_cached_tokens"] for r in per[meter.mode] if r["prompt_tokens"] == n) or n
                for n in lengths}  # the bytes a hit moved
        samples = {n: ([before[n]] if hits[n] == planned[n] else []) + [meter.ask(f"link {hits[n]}")["link_s"]]
                   for n in lengths}
        links = {n: min(s) for n, s in samples.items()}
        for m, e in engines.items():  # after the rounds: one profiled cold and warm request per mode
            for n in args.profile:
                profiles.setdefault(m, []).append(e.ask(f"profile {n} {n + 99 * 10**6}"))
    results = []
    for m in modes:
        rows = [_median_row([r for r in per[m] if r["prompt_tokens"] == n]) for n in lengths]
        rows[0].update(firsts[m])
        results.append({"mode": m, "rows": rows, "rounds": per[m], "kvplugin_stats": stats[m],
                        **({"profiles": profiles[m]} if m in profiles else {})})
    return results, {}, links, samples


def per_round_ratios(results: list[dict], lengths: list[int], link_s: dict[int, float]) -> dict[int, dict]:
    """Per length, the bars' ratios of each round (batches seconds apart) and their medians.
    ``link_s``: per length, the seconds its hit's bytes take over the link."""
    by = {r["mode"]: r.get("rounds") for r in results}
    ref = "baseline" if by.get("baseline") else "vllm-apc"
    out: dict[int, dict] = {}
    for n in lengths:
        def col(mode, key, n=n):
            rows = by.get(mode)
            return [r[key] for r in rows if r["prompt_tokens"] == n] if rows else None
        ratios = {}
        kv_w, kv_c = col("kvplugin", "warm_s"), col("kvplugin", "cold_s")
        pairs = {"kvplugin_cold_over_baseline_cold": (kv_c, col(ref, "cold_s"), None),
                 "vllm_offloading_warm_over_kvplugin_warm": (col("vllm-offloading", "warm_s"), kv_w, None),
                 "server_vs_inprocess_warm_ratio": (col("kvplugin-server", "warm_s"), kv_w, None)}
        if kv_w and col("vllm-apc", "warm_s"):
            pairs["kvplugin_warm_minus_apc_over_link"] = (kv_w, col("vllm-apc", "warm_s"), link_s[n])
        above: dict[str, list[float]] = {}  # per mode, each round's warm time above its own hit
        for mode, rows in by.items():  # against the same engine's own GPU prefix-cache hit
            if rows and "warm_minus_own_s" in rows[0]:  # the median of (warm - own hit right after it)
                above[mode] = col(mode, "warm_minus_own_s")
                pairs[f"{mode.replace('-', '_')}_warm_minus_own_apc_over_link"] = (above[mode], None, link_s[n])
                # the same against a floor without the plugin's own lookup of the prompt, which the
                # own hit passes (its keys, for the step's store decisions): the median pair's ``match``
                lookups = [(r.get("own_apc_stages") or {}).get("match") for r in rows if r["prompt_tokens"] == n]
                if all(lookups):
                    pairs[f"{mode.replace('-', '_')}_warm_minus_own_apc_less_lookup_over_link"] = (
                        [x + s["s"] for x, s in zip(above[mode], lookups)], None, link_s[n])
        for name, (a, b, link) in pairs.items():
            if not a or (b is None and not link) or (b is not None and not b):
                continue
            each = [x / link for x in a] if b is None else [(x - y) / link if link else x / y for x, y in zip(a, b)]
            ratios[name] = round(statistics.median(each), 3)
            ratios[name + "_each_round"] = [round(x, 3) for x in each]
        # one mode's time above its engine's own hit over another's above its own:
        # the raw warm ratio also holds how fast each engine process launches (eager mode)
        for name, (a, b) in {"server_vs_inprocess_above_own_hit": ("kvplugin-server", "kvplugin"),
                             "server_resolving_over_server_above_own_hit": ("kvplugin-server-resolving",
                                                                            "kvplugin-server"),
                             "server_threaded_over_server_above_own_hit": ("kvplugin-server-threaded",
                                                                           "kvplugin-server"),
                             "server_nowake_over_server_above_own_hit": ("kvplugin-server-nowake",
                                                                         "kvplugin-server"),
                             "vllm_offloading_over_kvplugin_above_own_hit": ("vllm-offloading", "kvplugin")}.items():
            if a in above and b in above:
                each = [x / y for x, y in zip(above[a], above[b])]
                ratios[name] = round(statistics.median(each), 3)
                ratios[name + "_each_round"] = [round(x, 3) for x in each]
        out[n] = ratios
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8193,16385,32769,65537")
    ap.add_argument("--modes", default=None, help=f"default: {SIDE_BY_SIDE_MODES} (side by side), "
                                                  f"{SEQUENTIAL_MODES} (--sequential)")
    ap.add_argument("--sequential", action="store_true",
                    help="each mode's engine in turn, one after another (the method before side by side)")
    ap.add_argument("--rounds", type=int, default=3, help="side by side: rounds of every length (fresh prompts)")
    ap.add_argument("--profile", default="",
                    help="side by side, after the rounds: these lengths (comma-separated) once more per mode, "
                         "cold and warm under torch.profiler (benchmarks/cuda_trace.py), kept in the JSON")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu-ttft-h200.json"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--resident", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--build", action="store_true", help="build the model, print its path")
    ap.add_argument("--host-bytes", type=int, default=None,
                    help=f"host tier of each connector (default {HOST_BYTES >> 30} GiB, side by side "
                         f"{SIDE_BY_SIDE_HOST_BYTES >> 30} GiB: three of them share the host)")
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help=f"vLLM's KV cache (default {KV_BYTES >> 30} GiB, side by side: the longest prompt's and a fifth)")
    ap.add_argument("--gpu-util", type=float, default=None,
                    help="vLLM's start-up check of free memory (default 0.5, side by side 0.1: the engines share the GPU)")
    ap.add_argument("--gpu-staging-bytes", type=int, default=None,
                    help="the plugin's gpu_staging_bytes (side by side default: 12 GiB, the longest hit whole)")
    ap.add_argument("--max-batched", type=int, default=None,
                    help="max_num_batched_tokens (default the longest prompt; side by side 16384: activations of "
                         "four engines fit beside each other)")
    ap.add_argument("--graphs", choices=GRAPHS, default="eager", help="how vLLM runs the model (graph_kwargs)")
    ap.add_argument("--serve-loop", action="store_true",
                    help="step as vllm serve's engine loop does: 1 ms of sleep after a step that ran no model "
                         "(ttft_common.serve_loop)")
    ap.add_argument("--pin-main", action="store_true",
                    help="side by side: each engine's main thread on a physical core of its own (host_cpus.py)")
    ap.add_argument("--main-cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    side = not args.sequential and not (args.child and not args.resident)
    if args.host_bytes is None:
        args.host_bytes = SIDE_BY_SIDE_HOST_BYTES if side else HOST_BYTES
    if args.gpu_util is None:
        args.gpu_util = 0.1 if side else 0.5
    if side and args.gpu_staging_bytes is None:
        args.gpu_staging_bytes = 12 << 30
    if side and args.max_batched is None:
        args.max_batched = 16384
    lengths = [int(x) for x in args.lengths.split(",")]
    args.profile = [int(x) for x in args.profile.split(",") if x]
    if args.child:
        if args.resident:
            run_resident(args.child, args, lengths)
        else:
            print("RESULT " + json.dumps(run_mode(args.child, args, lengths)))
        return 0
    if args.build:
        print("MODEL " + build_model())
        return 0

    t_build = time.time()  # in a child: this process keeps no CUDA memory the engines need
    model, built = args.model, args.model is None
    if built:
        model = built_gpu_model(__file__)
    print(f"model built in {time.time() - t_build:.0f} s: {model}", file=sys.stderr, flush=True)
    modes = (args.modes or (SIDE_BY_SIDE_MODES if side else SEQUENTIAL_MODES)).split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if side:
        args.model = model
        results, errors, links, link_samples = run_side_by_side(args, modes, lengths, model, out)
    else:
        def child_args(mode: str) -> list[str]:
            a = ["--model", model, "--lengths", args.lengths, "--block", str(args.block), "--chunk", str(args.chunk),
                 "--host-bytes", str(args.host_bytes), "--gpu-util", str(args.gpu_util), "--sequential",
                 "--graphs", args.graphs] + (["--serve-loop"] if args.serve_loop else [])
            for flag, value in (("--kv-bytes", args.kv_bytes), ("--gpu-staging-bytes", args.gpu_staging_bytes),
                                ("--max-batched", args.max_batched)):
                if value is not None:
                    a += [flag, str(value)]
            return a

        results, errors = run_modes_with_server(__file__, modes, child_args, keep_going=True,
                                                l1_bytes=args.host_bytes, partial=str(out) + ".partial")
        links, link_samples = {}, {}
    summary = summarize(results, lengths,
                        {"vllm_offloading_warm_over_kvplugin_warm": ("vllm-offloading", "kvplugin"),
                         "server_vs_inprocess_warm_ratio": ("kvplugin-server", "kvplugin")})
    bpt = KV_PER_TOKEN
    ref = "baseline" if any(r["mode"] == "baseline" for r in results) else "vllm-apc"
    for row in summary:  # a hit's link time: measured in this run, else from the ceiling on record
        if "kvplugin_warm_cached_tokens" in row:
            n = row["prompt_tokens"]
            links[n] = links.get(n) or row["kvplugin_warm_cached_tokens"] * bpt / LINK_BYTES_PER_S
    rounds = per_round_ratios(results, lengths, links) if side else {}
    for row in summary:  # the bars: warm - (vLLM prefix-cache hit) <= 1.1 x link time; cold <= 1.03 x
        if "kvplugin_cold_s" in row and f"{ref}_cold_s" in row:
            row["kvplugin_cold_over_baseline_cold"] = round(row["kvplugin_cold_s"] / row[f"{ref}_cold_s"], 3)
        link_s = links.get(row["prompt_tokens"])
        if link_s:  # measured in this run (side by side), else the ceiling on record
            row["link_s"], row["link_measured"] = round(link_s, 4), side
            if row["prompt_tokens"] in link_samples:
                row["link_samples_s"] = link_samples[row["prompt_tokens"]]
            if "kvplugin_warm_cached_tokens" in row:
                row["link_GBps"] = round(row["kvplugin_warm_cached_tokens"] * bpt / link_s / 1e9, 1)
        if "kvplugin_warm_s" in row and "vllm-apc_warm_s" in row:
            row["kvplugin_warm_minus_apc_over_link"] = round((row["kvplugin_warm_s"] - row["vllm-apc_warm_s"]) / link_s, 2)
        row.update(rounds.get(row["prompt_tokens"], {}))  # side by side: medians of per-round ratios
        for res in results:  # the first hit after start-up against a later one (the bar: 1.0)
            if row.get(f"{res['mode']}_first_hit_warm_s") and row.get(f"{res['mode']}_warm_s"):
                row[f"{res['mode']}_first_hit_over_warm"] = round(
                    row[f"{res['mode']}_first_hit_warm_s"] / row[f"{res['mode']}_warm_s"], 2)
        for res in results:  # where the warm request's time went, per stage (seconds)
            r = next(x for x in res["rows"] if x["prompt_tokens"] == row["prompt_tokens"])
            if r.get("warm_stages"):
                row[f"{res['mode']}_warm_stages"] = {k: v.get("s", v) if isinstance(v, dict) else v
                                                     for k, v in r["warm_stages"].items() if k != "timeline"}
    doc = {
        "benchmark": "gpu_ttft", "method": "side_by_side" if side else "sequential",
        "date": time.strftime("%Y-%m-%d"), **environment(),
        "model": SPEC if built else model,
        "kv_bytes_per_token": bpt, "block_size": args.block, "chunk_size": args.chunk,
        "host_bytes": args.host_bytes, "max_num_batched_tokens": args.max_batched, "rounds": args.rounds if side else 1,
        "pin_main": args.pin_main, "graphs": args.graphs, "serve_loop": args.serve_loop,
        "summary": summary, "modes": results, "errors": errors,
    }
    results_json.write(out, doc)
    Path(str(out) + ".partial").unlink(missing_ok=True)  # the whole run is in out
    print_table(summary, ("_cold_s", "_warm_s", "_cached_tokens", "kvplugin_warm", "_ratio", "_link",
                          "_over_baseline_cold", "_over_kvplugin_warm"))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
