"""Cold vs warm time-to-first-token of a GatedDeltaNet hybrid on the CPU, side by side in one run.

Modes, each in its own engine process (in-process engine, eager, prefix caching on:
the recurrent groups keep per-block states only then), the same prompts in order:

* ``baseline``        - no connector; vLLM's prefix cache emptied before every request
  (every request recomputes);
* ``vllm-apc``        - no connector; vLLM's own prefix cache hits the repeat (the floor:
  no copy at all);
* ``kvplugin``        - KVPluginConnector, in-process tier; vLLM's prefix cache emptied
  before every request, so every warm hit is the plugin's;
* ``kvplugin-server`` - the same through a `vllm-kvplugin server`.

Per length: the first request is cold, the second identical one warm (a 1-token
generate), then 8 greedy tokens compared with the baseline's.  Also reported: the bytes
of one state checkpoint (every recurrent layer) against the bytes of one chunk of
attention KV, which is what a checkpoint per chunk costs in a tier.

    python benchmarks/hybrid_ttft.py [--lengths 3072,3073,6144,6145,12288,12289] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_json  # noqa: E402
from ttft_common import measure, print_table, run_modes_with_server, summarize  # noqa: E402

BUDGET = 384  # one chunk per step: a state checkpoint at every chunk boundary


def run_mode(mode: str, model: str, lengths: list[int], server: str | None) -> dict:
    """One engine, all prompts; runs in a child process (``--child``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM
    from vllm.config import KVTransferConfig

    import vllm_kvplugin

    ktc = None
    if mode.startswith("kvplugin"):
        extra = {"cpu_bytes": 8 << 30 if mode == "kvplugin" else 0}
        if server:
            extra["server"] = server
        ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=max(lengths) + 64, enforce_eager=True,
              kv_cache_memory_bytes=4 << 30, kv_transfer_config=ktc, seed=0,
              max_num_batched_tokens=BUDGET, max_num_seqs=8)
    rows = measure(llm, lengths, reset_prefix_cache=mode != "vllm-apc")
    out = {"mode": mode, "rows": rows}
    if mode.startswith("kvplugin"):
        out["kvplugin_stats"] = vllm_kvplugin.stats()
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        ws = get_kv_transfer_group()._worker
        out["objects"] = [{"group": g.describe(), "bytes_per_chunk": g.object_bytes(ws.chunk_size)}
                          for g in ws.groups]
        out["chunk_size"] = ws.chunk_size
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="3072,3073,6144,6145,12288,12289")
    ap.add_argument("--modes", default="baseline,vllm-apc,kvplugin,kvplugin-server")
    ap.add_argument("--out", default=str(HERE / "results" / "hybrid-ttft-cpu.json"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args.model, lengths, args.server)))
        return 0

    from vllm_kvplugin import __version__, tiny_model

    spec = tiny_model.QWEN3NEXT_BENCH
    model = str(tiny_model.build(spec))

    def child_args(mode: str) -> list[str]:
        return ["--model", model, "--lengths", args.lengths]

    # the server's pool holds every prompt of the run (well under 1 GB of this model's objects)
    results, _ = run_modes_with_server(__file__, args.modes.split(","), child_args, keep_going=False,
                                       l1_bytes=2 << 30, address=args.server)
    import torch
    import vllm

    summary = summarize(results, lengths, {
        "kvplugin_vs_vllm_apc_warm_ratio": ("kvplugin", "vllm-apc"),
        "server_vs_inprocess_warm_ratio": ("kvplugin-server", "kvplugin"),
    })
    plugin = next(r for r in results if r["mode"] == "kvplugin")
    recurrent = [o["bytes_per_chunk"] for o in plugin["objects"] if "recurrent" in o["group"]]
    attention = [o["bytes_per_chunk"] for o in plugin["objects"] if "recurrent" not in o["group"]]
    doc = {
        "benchmark": "hybrid_ttft", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "vllm_kvplugin": __version__},
        "model": spec.__dict__, "chunk_size": plugin["chunk_size"], "max_num_batched_tokens": BUDGET,
        "objects": plugin["objects"],
        "checkpoint_bytes": sum(recurrent), "attention_chunk_bytes": sum(attention),
        "checkpoint_vs_chunk_ratio": round(sum(recurrent) / max(1, sum(attention)), 2),
        "summary": summary, "modes": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results_json.write(args.out, doc)
    print_table(summary, ("_cold_s", "_warm_s", "ratio"))
    print(f"one state checkpoint: {sum(recurrent)} bytes; one chunk of attention KV: {sum(attention)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
