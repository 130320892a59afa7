"""Where the plugin's host time goes on vLLM's thread in a warm hit (a profile, not a benchmark).

Run on the H200 (``bash compat/gpulane/bench.sh profile``): one engine with the in-process
tier (``gpu_ttft``'s model and sizing), its first hit, then per prompt length a cold request and
``--repeats`` warm ones, each warm one with ``cProfile`` on only while vLLM's thread is inside
the connector's hooks that a warm hit passes (the lookup, the fetch, the claim, the load, the
metadata), then ``--repeats`` cold ones of new prompts the same way (the stores' issue: the
``store`` hook).  Per length and kind: the seconds in each hook and the functions that took the
most (own time and with callees), as JSON with the machine and versions.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gpu_ttft  # noqa: E402
import results_json  # noqa: E402
from ttft_common import TTFTProbe, built_gpu_model, environment, tokens  # noqa: E402

#: (module, class, method) of the hooks profiled
HOOKS = (("vllm_kvplugin.connector.scheduler", "SchedulerSide", "get_num_new_matched_tokens"),
         ("vllm_kvplugin.connector.scheduler", "SchedulerSide", "update_state_after_alloc"),
         ("vllm_kvplugin.connector.scheduler", "SchedulerSide", "build_connector_meta"),
         ("vllm_kvplugin.connector.scheduler", "SchedulerSide", "update_connector_output"),
         ("vllm_kvplugin.connector.worker", "WorkerSide", "_fetch"),
         ("vllm_kvplugin.connector.worker", "WorkerSide", "_load"),
         ("vllm_kvplugin.connector.worker", "WorkerSide", "take_meta"),
         ("vllm_kvplugin.connector.worker", "WorkerSide", "store"))


class HookProfile:
    """One profiler, on while the calling thread is inside a hook (not nested), and each hook's
    seconds."""

    def __init__(self):
        self.prof, self.inside, self.seconds = cProfile.Profile(), False, {}

    def install(self) -> None:
        import importlib

        for mod, cls, name in HOOKS:
            owner = getattr(importlib.import_module(mod), cls)
            setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, fn, name: str):
        @functools.wraps(fn)
        def profiled(*a, **k):
            if self.inside:
                return fn(*a, **k)
            self.inside, t0 = True, time.perf_counter()
            self.prof.enable()
            try:
                return fn(*a, **k)
            finally:
                self.prof.disable()
                self.inside = False
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return profiled

    def take(self, top: int) -> dict:
        """The hooks' seconds and the top functions since the last take; starts afresh."""
        st = pstats.Stats(self.prof)
        rows = [(f"{Path(f).name}:{line}:{fn}", nc, tt, ct) for (f, line, fn), (_, nc, tt, ct, _) in st.stats.items()]
        out = {"hook_s": {k: round(v, 5) for k, v in self.seconds.items()},
               "by_own_s": [[n, c, round(t, 5)] for n, c, t, _ in sorted(rows, key=lambda r: -r[2])[:top]],
               "by_cum_s": [[n, c, round(t, 5)] for n, c, _, t in sorted(rows, key=lambda r: -r[3])[:top]]}
        self.prof, self.seconds = cProfile.Profile(), {}
        return out


def child(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    lengths = [int(x) for x in args.lengths.split(",")]
    hp = HookProfile()
    hp.install()
    args.kv_bytes, args.gpu_util, args.host_bytes, args.max_batched = None, 0.5, gpu_ttft.SIDE_BY_SIDE_HOST_BYTES, 16384
    args.gpu_staging_bytes, args.block, args.chunk = 12 << 30, 16, 256  # as side by side
    llm, _ = gpu_ttft._engine("kvplugin", args, lengths, None, side_by_side=True)
    probe = TTFTProbe(llm, reset_prefix_cache=True, primer=True, settle_s=0.5)
    probe.first_hit(lengths[0])
    rows = []
    for n in lengths:
        p = tokens(n, 3 * 10**6 + n)
        probe.once(tokens(n, 4 * 10**6 + n))  # primer
        probe.once(p)  # cold: stores it
        time.sleep(probe.settle_s)
        probe.once(p)  # the first warm one (its stores' acknowledgements)
        hp.take(0)
        warm = [probe.once(p)[0] for _ in range(args.repeats)]
        rows.append({"prompt_tokens": n, "kind": "warm", "ttft_s": [round(w, 4) for w in warm],
                     "repeats": args.repeats, **hp.take(args.top)})
        cold = []
        for i in range(args.repeats):
            cold.append(probe.once(tokens(n, 5 * 10**6 + 1000 * n + i))[0])
            time.sleep(probe.settle_s)  # its stores finished before the next one
        rows.append({"prompt_tokens": n, "kind": "cold", "ttft_s": [round(w, 4) for w in cold],
                     "repeats": args.repeats, **hp.take(args.top)})
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8193,65537")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=str(HERE / "results" / "load-profile-h200.json"))
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--graphs", choices=gpu_ttft.GRAPHS, default="eager",
                    help="how vLLM runs the model (gpu_ttft.graph_kwargs)")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0
    import subprocess

    model = args.model or built_gpu_model(str(HERE / "gpu_ttft.py"))
    out = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--lengths", args.lengths,
                          "--repeats", str(args.repeats), "--top", str(args.top), "--graphs", args.graphs],
                         capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not line:
        print(out.stderr[-4000:], file=sys.stderr)
        return 1
    doc = {"benchmark": "load_profile", "date": time.strftime("%Y-%m-%d"), "graphs": args.graphs, **environment(),
           **json.loads(line[0][len("RESULT "):])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results_json.write(args.out, doc)
    for row in doc["rows"]:
        print(row["prompt_tokens"], row["kind"], row["ttft_s"], row["hook_s"])
        for name, calls, s in row["by_own_s"][:12]:
            print(f"   {s:9.5f} {calls:6d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
