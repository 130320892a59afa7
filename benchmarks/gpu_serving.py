"""Throughput under a serving load on a GPU: many concurrent requests, 0% and 80% prefix reuse.

Run on the H200 with vLLM's GPU wheel (``bash compat/gpulane/bench.sh serving``).  The model is
``gpu_ttft``'s (Qwen3-8B's KV shape, random weights).  Modes, each an engine in its own process
(in-process engine core, eager), the same prompts:

* ``baseline`` - no connector;
* ``kvplugin`` - KVPluginConnector, in-process tier;
* ``kvplugin-server`` - KVPluginConnector through a ``vllm-kvplugin server`` process;
* ``vllm-offloading`` - vLLM's own ``OffloadingConnector`` (not in the default set: a fourth
  engine and its pinned memory are more than the H200 machine holds beside the others).

Side by side (``side_by_side.py``): every mode's engine is started first and runs one unmeasured
batch (first-use costs); then ``--rounds`` rounds, each with fresh prompts and the modes in a
rotated order, ask every engine for:

* ``reuse_0``:  ``--streams`` prompts of ``--prompt-tokens`` unique tokens, submitted together
  (one ``generate`` call: vLLM batches them), ``--max-tokens`` greedy tokens each.  Every chunk
  is new, so a connector can only cost here (lookups that miss, stores);
* ``reuse_80``: vLLM's GPU prefix cache reset, then prompts whose first 80% (rounded down to a
  whole chunk) are those of the round's ``reuse_0`` and whose rest is new: the shared part can
  only come from a connector.

With ``--timeline`` every engine has ``stage_timers.StageTimers`` installed from its start
(every mode alike), and after the rounds each runs one more ``reuse_0`` and ``reuse_80`` batch whose
stages and timeline (every step, forward, fetch, hash, copy) are kept in the results.

Each batch also records where the engine's main thread ran and how busy its core's other
logical CPUs were meanwhile (``host_cpus.MainThreadWatch``); with ``--pin-main`` each engine's
main thread has a physical core of its own.  Around each batch the engine's main thread runs
``host_cpus.speed_probe`` (a fixed piece of work, before and after): the same batch took ~3.5 or
~5.5 s of that thread's CPU from one round to the next, every mode alike, and the eager engine is
bound by that thread.  Besides the plain per-round ratio, each mode's ratio is also given with
each batch's time scaled by its probe's (``..._speed_normalized``; the batch counted in units
of the probe's work), and the probes' drift over the batch (after / before).  ``--cases
reuse_0`` runs the 0%-reuse batches alone: twice the rounds in the same time.

``--graphs``: how vLLM runs the model, every mode alike (``gpu_ttft.graph_kwargs``); ``eager``, the
default, as in every run before 2026-12-06.

Throughput = (prompt + generated tokens) / wall seconds of the batch.  A plugin engine's stores
still in flight when ``generate`` returns are then waited for, outside the batch's wall time
(``drain_s``), so that they never run into the next engine's batch.  A mode's ratio to the
baseline is taken per round (batches seconds apart) and the median over rounds is reported,
with every round's; each batch also records the engine process's CPU seconds, split by thread
name (and the cache server's, for the server mode).  Results: JSON with the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gpu_fit  # noqa: E402
import results_json  # noqa: E402
from gpu_ttft import GRAPHS, HOST_BYTES, KV_BYTES, SPEC, graph_kwargs, mode_knobs, transfer_config  # noqa: E402
from host_cpus import MainThreadWatch, pin_main_thread, reserve_cores, speed_probe  # noqa: E402
from side_by_side import running, serve  # noqa: E402
from ttft_common import built_gpu_model, environment, serve_loop, start_server, tokens  # noqa: E402

MODES = "baseline,kvplugin,kvplugin-server"
CASES = ("reuse_0", "reuse_80")
GPU_STAGING_BYTES = 8 << 30  # several engines share the GPU: the plugin's default is a quarter of it


def _batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": round(wall, 4), "tokens": n, "tokens_per_s": round(n / wall, 1),
            "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _threads_cpu_s() -> dict[str, float]:
    """user + system seconds so far of this process's live threads, by name: the Python thread's
    name where there is one (a pool's threads together: ``kvplugin-digest-wait_0`` counts as
    ``kvplugin-digest-wait``), the kernel's otherwise (torch's and CUDA's own threads)."""
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "main"
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        stat = _stat(task / "stat")
        if stat is None:
            continue  # the thread ended
        name = re.sub(r"_\d+$", "", names.get(int(task.name), stat[0]))
        out[name] = out.get(name, 0.0) + stat[1]
    return out


def _stat(path: Path) -> tuple[str, float] | None:
    """(command name, user + system seconds) from a Linux ``/proc/.../stat`` file; None if gone."""
    try:
        text = path.read_text()
        fields = text.rsplit(")", 1)[1].split()
        return text[text.index("(") + 1:text.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _by_thread(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per thread name between two :func:`_threads_cpu_s` (threads that ended meanwhile
    are missing), largest first, those under 10 ms left out."""
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def prompts_of(case: str, rnd: int, streams: int, prompt_tokens: int, chunk: int) -> list[list[int]]:
    """The prompts of one batch: the same in every mode; fresh in every round."""
    first = [tokens(prompt_tokens, 1000 * (rnd + 1) + i) for i in range(streams)]
    if case == "reuse_0":
        return first
    shared = (prompt_tokens * 8 // 10) // chunk * chunk
    return [p[:shared] + tokens(prompt_tokens - shared, 500_000 + 1000 * rnd + i) for i, p in enumerate(first)]


def run_resident(mode: str, args) -> None:
    """Child: one engine, its first-use batch, then a batch per command (``CASE ROUND``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM

    import vllm_kvplugin

    timers = None
    if args.timeline:
        from stage_timers import StageTimers
        timers = StageTimers().install()
    mode_knobs(mode)
    ktc = transfer_config(mode, args.chunk, args.host_bytes, args.server)
    if ktc is not None and mode.startswith("kvplugin"):
        ktc.kv_connector_extra_config["gpu_staging_bytes"] = args.gpu_staging_bytes
    llm = LLM(model=args.model, enable_prefix_caching=True, max_model_len=args.prompt_tokens + args.max_tokens + 16,
              kv_cache_memory_bytes=args.kv_bytes, gpu_memory_utilization=args.gpu_util,
              block_size=args.block, kv_transfer_config=ktc, seed=0, **graph_kwargs(args.graphs, args.streams))
    if args.serve_loop:
        serve_loop(llm)
    _batch(llm, [tokens(args.prompt_tokens, 900_000 + i) for i in range(args.streams)], args.max_tokens)
    if args.main_cpu is not None:
        pin_main_thread(args.main_cpu)

    def handle(command: str) -> dict:
        if command == "stats":
            return {"kvplugin_stats": vllm_kvplugin.stats() if mode.startswith("kvplugin") else None}
        *timed, case, rnd = command.split()  # [timeline] CASE ROUND
        llm.reset_prefix_cache()  # a reuse_80 hit can only come from the connector
        if timed:
            timers.reset()
        probe = speed_probe()
        c0, t0 = _cpu_s(), _threads_cpu_s()
        with MainThreadWatch(pinned=args.main_cpu) as watch:
            out = _batch(llm, prompts_of(case, int(rnd), args.streams, args.prompt_tokens, args.chunk),
                         args.max_tokens)
        out.update(watch.result())
        out["probe_s"] = [round(probe, 5), round(speed_probe(), 5)]  # (before the stores' drain)
        out["drain_s"] = _drain(mode)
        out["cpu_s"] = round(_cpu_s() - c0, 3)  # (the batch's stores finished included)
        out["cpu_s_by_thread"] = _by_thread(t0, _threads_cpu_s())
        if timed:
            out["stages"] = timers.collect()
        return out

    serve(handle)


def _drain(mode: str) -> float:
    """Seconds until the plugin's stores of the batch just done are finished (its store finisher
    drained, at most 60 s); 0 for an engine without the plugin."""
    if not mode.startswith("kvplugin"):
        return 0.0
    from vllm_kvplugin.connector.worker import registered

    worker = registered()
    t0 = time.perf_counter()
    if worker is not None and worker.finisher is not None and not worker.finisher.drain(60):
        print(f"{mode}: stores still in flight after 60 s", file=sys.stderr, flush=True)
    return round(time.perf_counter() - t0, 4)


def _proc_cpu_s(pid: int) -> float | None:
    """user + system seconds of a process so far (Linux ``/proc``)."""
    stat = _stat(Path(f"/proc/{pid}/stat"))
    return None if stat is None else stat[1]


def run_side_by_side(args, modes: list[str], model: str, log_dir: Path, partial: Path | None) -> dict:
    """Every mode's engine started, then ``args.rounds`` rounds of both cases, modes rotated."""
    gpu_fit.check(modes, model, args.kv_bytes, args.gpu_staging_bytes,
                  "Name fewer --modes or shrink --kv-bytes (an H100 fits --modes baseline,kvplugin).")
    server = address = None
    main_cpu = {m: core[0] for m, core in zip(modes, reserve_cores(len(modes)))} if args.pin_main else {}
    if main_cpu:
        print(f"main threads pinned: {main_cpu}", file=sys.stderr, flush=True)
    if "kvplugin-server" in modes:
        server, address = start_server(args.host_bytes)

    def args_for(mode: str) -> list[str]:
        a = ["--model", model, "--streams", str(args.streams), "--prompt-tokens", str(args.prompt_tokens),
             "--max-tokens", str(args.max_tokens), "--block", str(args.block), "--chunk", str(args.chunk),
             "--host-bytes", str(args.host_bytes), "--kv-bytes", str(args.kv_bytes),
             "--gpu-util", str(args.gpu_util), "--gpu-staging-bytes", str(args.gpu_staging_bytes)] \
            + ["--graphs", args.graphs] + (["--timeline"] if args.timeline else []) \
            + (["--serve-loop"] if args.serve_loop else []) \
            + (["--main-cpu", str(main_cpu[mode])] if mode in main_cpu else [])
        return a + (["--server", address] if mode == "kvplugin-server" else [])

    batches: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in args.cases} for m in modes}
    t0 = time.time()
    with running(__file__, modes, args_for, log_dir, server) as engines:
        started_s = round(time.time() - t0, 1)
        print(f"{len(modes)} engines ready in {started_s} s", file=sys.stderr, flush=True)
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            for case in args.cases:
                for mode in order:
                    watch = server is not None and mode == "kvplugin-server"
                    l0 = _server_lookups(address) if watch else 0  # (its stats call outside the CPU window)
                    s0 = _proc_cpu_s(server.pid) if watch else 0.0
                    b = engines[mode].ask(f"{case} {rnd}")
                    if watch:
                        b["server_cpu_s"] = round(_proc_cpu_s(server.pid) - s0, 3)
                        b["server_lookups"] = _server_lookups(address) - l0
                    batches[mode][case].append(b)
            print(f"round {rnd}: " + ", ".join(f"{m} " + "/".join(f"{batches[m][c][-1]['tokens_per_s']:.0f}"
                                                                   for c in args.cases) for m in modes),
                  file=sys.stderr, flush=True)
            if partial:
                partial.write_text(json.dumps({"partial": True, "batches": _without_outputs(batches)}))
        timelines = {m: {c: e.ask(f"timeline {c} {args.rounds}") for c in args.cases} for m, e in engines.items()} \
            if args.timeline else None
        stats = {m: e.ask("stats")["kvplugin_stats"] for m, e in engines.items()}
    return {"engines_started_s": started_s, "batches": batches, "kvplugin_stats": stats, "timelines": timelines}


def _server_lookups(address: str) -> int:
    """Lookups the cache server has answered so far (its own counter)."""
    from vllm_kvplugin.tiers.mp_client import MPClient

    client = MPClient(address, heartbeat=False)
    try:
        return int(client.stats()["lookups"])
    finally:
        client.close()


def _without_outputs(batches: dict) -> dict:
    return {m: {c: [{k: v for k, v in b.items() if k != "outputs"} for b in bs] for c, bs in cases.items()}
            for m, cases in batches.items()}


def _probe(batch: dict) -> float:
    """The batch's host-speed probe: the mean of the ones before and after it (seconds)."""
    return sum(batch["probe_s"]) / 2


def summarize(batches: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Per case: each mode's median throughput, its per-round ratios to the baseline and their
    median, the engine's CPU seconds per batch, whether its outputs equal the baseline's."""
    base = batches.get("baseline")
    summary = []
    for case in next(iter(batches.values())):
        row: dict = {"case": case}
        for mode, cases in batches.items():
            bs = cases[case]
            row[f"{mode}_tokens_per_s"] = round(statistics.median(b["tokens_per_s"] for b in bs), 1)
            row[f"{mode}_cached_tokens"] = bs[-1]["cached_tokens"]
            row[f"{mode}_cpu_s_per_batch"] = round(statistics.median(b["cpu_s"] for b in bs), 2)
            row[f"{mode}_main_thread_cpu_s_each_round"] = [b.get("cpu_s_by_thread", {}).get("main") for b in bs]
            row[f"{mode}_main_cpu_steal_each_round"] = [b.get("main_cpu_steal") for b in bs]
            row[f"{mode}_main_core_sibling_busy_each_round"] = [b.get("main_core_sibling_busy") for b in bs]
            if all("probe_s" in b for b in bs):
                row[f"{mode}_probe_ms_each_round"] = [round(_probe(b) * 1e3, 2) for b in bs]
                row[f"{mode}_probe_drift_each_round"] = [round(b["probe_s"][1] / b["probe_s"][0], 3) for b in bs]
            row[f"{mode}_drain_s_per_batch"] = round(statistics.median(b.get("drain_s", 0.0) for b in bs), 4)
            threads = {name for b in bs for name in b.get("cpu_s_by_thread", {})}
            if threads:
                per = {name: round(statistics.median(b.get("cpu_s_by_thread", {}).get(name, 0.0) for b in bs), 2)
                       for name in threads}
                row[f"{mode}_cpu_s_per_batch_by_thread"] = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                                                            if v >= 0.05}
            if any("server_cpu_s" in b for b in bs):
                row[f"{mode}_server_cpu_s_per_batch"] = round(statistics.median(b["server_cpu_s"] for b in bs), 2)
                row[f"{mode}_server_lookups_each_round"] = [b.get("server_lookups") for b in bs]
            if base is not None and mode != "baseline":
                ratios = [b["tokens_per_s"] / r["tokens_per_s"] for b, r in zip(bs, base[case])]
                row[f"{mode}_over_baseline"] = round(statistics.median(ratios), 3)
                row[f"{mode}_over_baseline_each_round"] = [round(x, 3) for x in ratios]
                if all("probe_s" in b for b in bs + base[case]):  # each batch in units of its probe's work
                    scaled = [x * _probe(b) / _probe(r) for x, b, r in zip(ratios, bs, base[case])]
                    row[f"{mode}_over_baseline_speed_normalized"] = round(statistics.median(scaled), 3)
                    row[f"{mode}_over_baseline_speed_normalized_each_round"] = [round(x, 3) for x in scaled]
                row[f"{mode}_outputs_match_baseline"] = all(
                    b["outputs"] == r["outputs"] for b, r in zip(bs, base[case]))
        if "kvplugin" in batches and "kvplugin-server" in batches:
            ratios = [a["tokens_per_s"] / b["tokens_per_s"]
                      for a, b in zip(batches["kvplugin-server"][case], batches["kvplugin"][case])]
            row["server_over_inprocess"] = round(statistics.median(ratios), 3)
        summary.append(row)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default=MODES)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu-serving-h200.json"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--resident", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--host-bytes", type=int, default=HOST_BYTES)
    ap.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    ap.add_argument("--gpu-util", type=float, default=0.1,
                    help="vLLM's gpu_memory_utilization: with kv_cache_memory_bytes set, only its start-up "
                         "check of free memory, which the engines started beside each other must pass")
    ap.add_argument("--gpu-staging-bytes", type=int, default=GPU_STAGING_BYTES)
    ap.add_argument("--cases", type=lambda v: tuple(v.split(",")), default=CASES,
                    help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every case (ratios per round, their median)")
    ap.add_argument("--timeline", action="store_true",
                    help="stage timers in every engine, and one more batch of each case with its timeline")
    ap.add_argument("--graphs", choices=GRAPHS, default="eager", help="how vLLM runs the model (gpu_ttft.graph_kwargs)")
    ap.add_argument("--serve-loop", action="store_true",
                    help="step as vllm serve's engine loop does (ttft_common.serve_loop)")
    ap.add_argument("--pin-main", action="store_true",
                    help="each engine's main thread on a physical core of its own (host_cpus.py)")
    ap.add_argument("--main-cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if set(args.cases) - set(CASES):
        ap.error(f"--cases: {','.join(args.cases)} is not a list of {','.join(CASES)}")
    if args.child:
        run_resident(args.child, args)
        return 0
    model = args.model or built_gpu_model(str(HERE / "gpu_ttft.py"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(str(out) + ".partial")
    res = run_side_by_side(args, args.modes.split(","), model, out.parent / "serving-logs", partial)
    summary = summarize(res["batches"])
    doc = {
        "benchmark": "gpu_serving", "method": "side_by_side", "date": time.strftime("%Y-%m-%d"), **environment(),
        "model": SPEC if args.model is None else args.model, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "block_size": args.block,
        "chunk_size": args.chunk, "rounds": args.rounds, "pin_main": args.pin_main, "graphs": args.graphs, "serve_loop": args.serve_loop,
        "engines_started_s": res["engines_started_s"],
        "summary": summary, "batches": _without_outputs(res["batches"]), "kvplugin_stats": res["kvplugin_stats"],
    }
    if res["timelines"]:
        doc["timelines"] = {m: {c: {k: v for k, v in b.items() if k != "outputs"} for c, b in cases.items()}
                            for m, cases in res["timelines"].items()}
    results_json.write(out, doc)
    partial.unlink(missing_ok=True)  # the whole run is in out
    for row in summary:
        print(" | ".join(f"{k}={v}" for k, v in row.items() if not k.endswith(("match_baseline", "each_round"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
