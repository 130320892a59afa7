"""What the engine benchmarks (``cpu_ttft.py``, ``gpu_ttft.py``, ``gpu_serving.py``) share: a
cache server for the run, one engine process per mode (the script itself with ``--child MODE``,
printing one ``RESULT {json}`` line), the GPU model built in a child, the machine and versions
of a result, and the side-by-side summary of cold and warm TTFT per prompt length."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random token ids of the seed.  (Until 2026-12-02 a fresh generator per token made
    every prompt one token repeated, and prompts of different seeds collided now and then.)"""
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


class TTFTProbe:
    """In a child: the TTFT measurements of one engine.

    ``reset_prefix_cache``: vLLM's GPU prefix cache is emptied before each request (a hit
    can only come from the connector); ``primer``: one unmeasured request of that length on
    other tokens first (its kernels); ``settle_s``: a pause between cold and warm; ``timers``:
    a :class:`stage_timers.StageTimers` whose stages of the cold and warm requests are kept.
    """

    def __init__(self, llm, reset_prefix_cache: bool = False, primer: bool = False, settle_s: float = 0.0,
                 timers=None):
        from vllm import SamplingParams

        self.llm, self.reset, self.primer, self.settle_s, self.timers = llm, reset_prefix_cache, primer, settle_s, timers
        self.sp = SamplingParams(max_tokens=1, temperature=0.0)
        self.spx = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def once(self, p, params=None, reset: bool | None = None):
        if self.reset if reset is None else reset:
            self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        o = self.llm.generate([{"prompt_token_ids": p}], params or self.sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, o

    def timed(self, p, reset: bool | None = None):
        """``once``, with the stages it went through (None without timers) and the cgroup's CPU
        throttling during it."""
        if self.timers:
            self.timers.reset()
        before = cpu_throttling()
        t, o = self.once(p, reset=reset)
        stages = self.timers.collect() if self.timers else None
        if stages is not None and before:
            after = cpu_throttling()
            stages["cpu_throttled"] = {k: after[k] - before[k] for k in before if k in after}
        return t, o, stages

    def first_hit(self, n: int) -> tuple[float, dict | None]:
        """The warm-up and the first hit after start-up (seconds, stages).

        The warm-up decodes a few tokens, as every served request does: vLLM's first one-token
        step after start-up has first-use costs of its own (every mode, hit or not), which are
        not a first hit's.  The first hit is measured apart (its first-use costs), before the
        measured ones."""
        from vllm import SamplingParams

        self.once(tokens(300, 0), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        first = tokens(n, 7 * 10**6)
        self.once(first)
        time.sleep(self.settle_s)  # as before the measured ones: the first-use costs alone
        t, _, stages = self.timed(first)
        return t, stages

    def length(self, n: int, seed: int | None = None) -> dict:
        """Cold TTFT of one prompt of ``n`` tokens (a 1-token generate), the median of five warm
        ones (``warm_stages``: the median run's; ``first_warm_s``: the one right after the cold
        request), then 8 greedy tokens to compare with the baseline's; where vLLM's prefix cache is
        reset before each, each warm run is followed by a GPU prefix-cache hit of the same prompt
        (``own_apc_s``: their median; ``warm_minus_own_s``: the median of the pairs' differences;
        ``own_apc_stages``: the stages of the own hit in the pair of that median, to set beside
        the warm one's step by step).
        ``seed``: the prompt's (default ``n``; a fresh one per round when the same length is
        measured again)."""
        seed = n if seed is None else seed
        if self.primer:  # other tokens (Random(-n) would seed like Random(n))
            self.once(tokens(n, 10**6 + seed))
        p = tokens(n, seed)
        cold, oc, cold_stages = self.timed(p)
        time.sleep(self.settle_s)
        warms, owns = [], []
        for _ in range(5):  # 5 warm runs: their median, and its stages
            warms.append(self.timed(p))
            if self.reset:  # each paired with the same prompt as a GPU prefix-cache hit of this very
                # engine (the warm request left it cached): the floor, measured in the process of
                # the warm hits and right after each, so that both see the engine at the same speed
                owns.append(self.timed(p, reset=False))
        first_warm, ow = warms[0][0], warms[0][1]  # right after the cold one: its stores may still be landing
        warm, _, warm_stages = sorted(warms, key=lambda w: w[0])[len(warms) // 2]
        _, ox = self.once(p, self.spx)
        extra = {"cold_stages": cold_stages, "warm_stages": warm_stages} if self.timers else {}
        if owns:
            extra["own_apc_s"] = round(statistics.median(o[0] for o in owns), 4)
            pairs = sorted(zip(warms, owns), key=lambda wo: wo[0][0] - wo[1][0])
            extra["warm_minus_own_s"] = round(statistics.median(w[0] - o[0] for w, o in pairs), 4)
            if self.timers:
                extra["own_apc_stages"] = pairs[len(pairs) // 2][1][2]
        return {"prompt_tokens": n, "cold_s": round(cold, 4), "warm_s": round(warm, 4),
                "first_warm_s": round(first_warm, 4),
                "warm_cached_tokens": int(ow.num_cached_tokens or 0),
                "first_token_match": oc.outputs[0].token_ids == ow.outputs[0].token_ids,
                "continuation": list(ox.outputs[0].token_ids), **extra}


def serve_loop(llm, on: Callable[[], bool] | None = None) -> None:
    """Make an in-process ``LLM`` step as ``vllm serve``'s engine loop does: after a step that ran
    no model while requests remain (a request parked on a connector's load or held back for a
    verdict), ``EngineCoreProc._process_engine_step`` sleeps 1 ms; the in-process engine runs the
    next step at once (vLLM 0.26 and 0.32 alike).  ``on``: only while it says so.  Touches vLLM's
    engine core (``step_fn``, ``scheduler.has_requests``): a benchmark's knob, not the plugin's."""
    core = llm.llm_engine.engine_core.engine_core
    step = core.step_fn

    def step_fn():
        out, executed = step()
        if (on is None or on()) and not executed and core.scheduler.has_requests():
            time.sleep(0.001)
        return out, executed
    core.step_fn = step_fn


def measure(llm, lengths: Sequence[int], reset_prefix_cache: bool = False, primer: bool = False,
            settle_s: float = 0.0, timers=None) -> list[dict]:
    """In a child: :class:`TTFTProbe`'s first hit (at the first length), then each length in turn."""
    probe = TTFTProbe(llm, reset_prefix_cache, primer, settle_s, timers)
    first_hit_s, first_stages = probe.first_hit(lengths[0])
    rows = []
    for n in lengths:
        row = probe.length(n)
        row["first_hit_warm_s"] = round(first_hit_s, 4) if n == lengths[0] else None
        if timers and n == lengths[0]:
            row["first_hit_stages"] = first_stages
        rows.append(row)
    return rows


def start_server(l1_bytes: int) -> tuple[subprocess.Popen, str]:
    """A ``vllm-kvplugin server`` on a private Unix socket; (process, address)."""
    sockdir = tempfile.mkdtemp(prefix="kvs-bench-", dir="/tmp")
    server = subprocess.Popen([sys.executable, "-m", "vllm_kvplugin.server", "--listen",
                               f"unix://{sockdir}/s.sock", "--l1-bytes", str(l1_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout is not None
    banner = server.stdout.readline()
    return server, banner.split("listening on ", 1)[1].split(" ", 1)[0]


def run_modes(script: str, modes: Sequence[str], child_args: Callable[[str], list[str]],
              keep_going: bool, partial: str | None = None) -> tuple[list[dict], dict[str, str]]:
    """Each mode in its own ``python script --child MODE ...`` process, in order.

    A failed mode stops the run, or with ``keep_going`` is recorded (stderr tail) and skipped.
    ``partial``: a file rewritten after each mode with the results so far (a run cut off by a
    time limit keeps the modes it finished).
    """
    results, errors = [], {}
    for mode in modes:
        t0 = time.time()
        out = subprocess.run([sys.executable, script, "--child", mode, *child_args(mode)],
                             capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            print(f"{mode}: FAILED\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
            if not keep_going:
                raise SystemExit(f"mode {mode} failed")
            errors[mode] = out.stderr[-3000:]
            continue
        res = json.loads(line[0][len("RESULT "):])
        res["wall_s"] = round(time.time() - t0, 1)
        results.append(res)
        print(f"{mode}: done in {res['wall_s']} s", file=sys.stderr, flush=True)
        if partial:
            Path(partial).parent.mkdir(parents=True, exist_ok=True)
            Path(partial).write_text(json.dumps({"partial": True, "modes": results, "errors": errors}))
    return results, errors



def run_modes_with_server(script: str, modes: Sequence[str], child_args: Callable[[str], list[str]],
                          keep_going: bool, l1_bytes: int, address: str | None = None,
                          partial: str | None = None) -> tuple[list[dict], dict[str, str]]:
    """:func:`run_modes`, with a cache server for the ``kvplugin-server`` mode: the one at
    ``address``, else one started for the run (its pool of ``l1_bytes`` is allocated at start)
    and stopped after; that mode's child gets ``--server ADDRESS`` after ``child_args``."""
    proc = None
    if "kvplugin-server" in modes and not address:
        proc, address = start_server(l1_bytes)

    def args_for(mode: str) -> list[str]:
        return child_args(mode) + (["--server", address] if mode == "kvplugin-server" else [])

    try:
        return run_modes(script, modes, args_for, keep_going, partial)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

def summarize(results: Sequence[dict], lengths: Sequence[int],
              warm_ratios: dict[str, tuple[str, str]]) -> list[dict]:
    """Per prompt length: each mode's cold/warm seconds, warm hit and speedup, whether its
    continuation equals the baseline's, and ``name: (a, b)`` -> warm_s of a / warm_s of b."""
    by_mode = {r["mode"]: {row["prompt_tokens"]: row for row in r["rows"]} for r in results}
    base = by_mode.get("baseline", {})
    summary = []
    for n in lengths:
        row: dict = {"prompt_tokens": n}
        for mode, rows in by_mode.items():
            r = rows[n]
            row[f"{mode}_cold_s"] = r["cold_s"]
            row[f"{mode}_warm_s"] = r["warm_s"]
            row[f"{mode}_warm_cached_tokens"] = r["warm_cached_tokens"]
            row[f"{mode}_warm_speedup"] = round(r["cold_s"] / r["warm_s"], 2)
            if r.get("own_apc_s") is not None:
                row[f"{mode}_own_apc_s"] = r["own_apc_s"]
            if r.get("first_hit_warm_s") is not None:
                row[f"{mode}_first_hit_warm_s"] = r["first_hit_warm_s"]
            if base and mode != "baseline":
                row[f"{mode}_continuation_matches_baseline"] = r["continuation"] == base[n]["continuation"]
        for name, (a, b) in warm_ratios.items():
            if a in by_mode and b in by_mode:
                row[name] = round(by_mode[a][n]["warm_s"] / by_mode[b][n]["warm_s"], 2)
        summary.append(row)
    return summary


def print_table(summary: Sequence[dict], suffixes: tuple[str, ...]) -> None:
    cols = ["prompt_tokens"] + [k for k in summary[0] if k.endswith(suffixes)]
    print(" | ".join(cols))
    for row in summary:
        print(" | ".join(str(row.get(c, "")) for c in cols))


def built_gpu_model(script: str) -> str:
    """``python script --build`` (it prints ``MODEL path``) in a child: this process then keeps
    no CUDA memory that the engines need."""
    built = subprocess.run([sys.executable, script, "--build"], capture_output=True, text=True)
    if built.returncode != 0 or "MODEL " not in built.stdout:
        raise SystemExit(f"model build failed:\n{built.stderr[-3000:]}")
    return built.stdout.split("MODEL ", 1)[1].strip()


def cpu_throttling() -> dict[str, int]:
    """The cgroup's CPU-quota throttling counters so far (``nr_throttled``, ``throttled_usec``;
    empty where there is no such file): a quota spent by a burst of host threads stalls every
    thread of the container until the next period."""
    for path, keys in (("/sys/fs/cgroup/cpu.stat", ("nr_throttled", "throttled_usec")),
                       ("/sys/fs/cgroup/cpu/cpu.stat", ("nr_throttled", "throttled_time"))):
        try:
            with open(path) as f:
                fields = dict(line.split() for line in f if line.strip())
        except OSError:
            continue
        return {k: int(fields[k]) for k in keys if k in fields}
    return {}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def environment() -> dict:
    """``machine`` and ``versions`` of a result document.  ``versions["code"]``: the commit of the
    run's checkout, from ``KVPLUGIN_CODE`` (the device's copy of the tree has no git: its command
    names the commit, e.g. ``KVPLUGIN_CODE=5467f02 bash compat/gpulane/bench.sh ttft``)."""
    import torch
    import vllm

    from vllm_kvplugin import __version__

    gpu = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if gpu else None
    return {"machine": {"gpu": torch.cuda.get_device_name(0) if gpu else None,
                        "gpu_memory_GiB": round(props.total_memory / 2**30, 1) if props else None,
                        "cores": os.cpu_count(), "python": platform.python_version(),
                        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max"),
                        "cpufreq_governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                        "cpu_model": next((line.split(":", 1)[1].strip() for line in
                                           (_read("/proc/cpuinfo") or "").splitlines()
                                           if line.startswith("model name")), None)},
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                         "vllm_kvplugin": __version__, "code": os.environ.get("KVPLUGIN_CODE")}}
