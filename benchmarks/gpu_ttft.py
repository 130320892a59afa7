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
* ``kvplugin-hash8`` - ``kvplugin`` hashing on at most 8 host threads (not in the default set:
  whether fewer hashing threads leave vLLM's host work of the claim step faster);
* ``kvplugin-server`` - KVPluginConnector through a `vllm-kvplugin server` process;
* ``vllm-offloading`` - vLLM's own ``OffloadingConnector`` (CPU offloading, ``cpu_bytes_to_use``).

Prefix caching is on in every mode, and vLLM's GPU prefix cache is reset before each
measured request (but in ``vllm-apc``), so a warm request's hit can only come from the
connector.  The first hit after start-up is measured apart (``first_hit_warm_s``).  Per prompt
length: one unmeasured request of that length (kernel warm-up), the cold request, the same
prompt warm, then 8 greedy tokens compared with the baseline's.  TTFT is the latency of a
1-token generation.  Results: JSON with the machine and versions, and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from ttft_common import (  # noqa: E402
    built_gpu_model,
    environment,
    measure,
    print_table,
    run_modes_with_server,
    summarize,
)

SPEC = dict(arch="qwen3", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128)
HOST_BYTES = 24 << 30  # every prompt of the run fits: no eviction in any mode
KV_BYTES = 16 << 30


def transfer_config(mode: str, chunk: int, host_bytes: int, server: str | None):
    """vLLM's ``KVTransferConfig`` of a mode (None: no connector)."""
    from vllm.config import KVTransferConfig

    if mode.startswith("kvplugin"):
        extra = {"chunk_size": chunk, "cpu_bytes": 0 if mode == "kvplugin-server" else host_bytes}
        if mode == "kvplugin-noverify":  # what the payload checksums cost
            extra["verify_checksums"] = False
        if server:
            extra["server"] = server
        return KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    if mode == "vllm-offloading":
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": host_bytes})
    return None


def run_mode(mode: str, model: str, lengths: list[int], block: int, chunk: int, server: str | None,
             host_bytes: int = HOST_BYTES, kv_bytes: int = KV_BYTES) -> dict:
    """One engine, all prompts; runs in a child process (``--child``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from stage_timers import StageTimers
    from vllm import LLM

    import vllm_kvplugin

    timers = StageTimers().install()
    if mode == "kvplugin-hash8":
        from vllm_kvplugin.chunk import checksums

        checksums.MAX_THREADS = 8  # read when the hashing pool is made (at registration)
    ktc = transfer_config(mode, chunk, host_bytes, server)
    max_len = max(lengths) + 64
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=max_len, enforce_eager=True,
              kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=0.5, block_size=block, kv_transfer_config=ktc, seed=0,
              max_num_batched_tokens=max_len)
    rows = measure(llm, lengths, reset_prefix_cache=mode != "vllm-apc", primer=True,
                   settle_s=0.5, timers=timers)  # settle: asynchronous stores (vLLM's offloading) finish
    stats = vllm_kvplugin.stats() if mode.startswith("kvplugin") else None
    return {"mode": mode, "rows": rows, "kvplugin_stats": stats}


def build_model() -> str:
    """The model, its random weights made on the GPU (seconds instead of minutes on the CPU)."""
    import torch

    from vllm_kvplugin import tiny_model

    with torch.device("cuda"):
        return str(tiny_model.build(tiny_model.TinySpec(**SPEC)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8193,16385,32769,65537")
    ap.add_argument("--modes", default="baseline,vllm-apc,kvplugin,kvplugin-noverify,kvplugin-server,vllm-offloading")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu-ttft-h200.json"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--build", action="store_true", help="build the model, print its path")
    ap.add_argument("--host-bytes", type=int, default=HOST_BYTES)
    ap.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args.model, lengths, args.block, args.chunk, args.server,
                                                 args.host_bytes, args.kv_bytes)))
        return 0
    if args.build:
        print("MODEL " + build_model())
        return 0

    t_build = time.time()  # in a child: this process keeps no CUDA memory the engines need
    model = args.model
    if model is None:
        model = built_gpu_model(__file__)
    print(f"model built in {time.time() - t_build:.0f} s: {model}", file=sys.stderr, flush=True)

    def child_args(mode: str) -> list[str]:
        return ["--model", model, "--lengths", args.lengths, "--block", str(args.block), "--chunk", str(args.chunk),
                "--host-bytes", str(args.host_bytes), "--kv-bytes", str(args.kv_bytes)]

    results, errors = run_modes_with_server(__file__, args.modes.split(","), child_args, keep_going=True,
                                            l1_bytes=args.host_bytes, partial=args.out + ".partial")
    summary = summarize(results, lengths,
                        {"vllm_offloading_warm_over_kvplugin_warm": ("vllm-offloading", "kvplugin"),
                         "server_vs_inprocess_warm_ratio": ("kvplugin-server", "kvplugin")})
    link = 55.3e9  # the pinned-copy ceiling measured on the H200 (benchmarks/results/gpu-xfer-h200.json)
    bpt = SPEC["layers"] * 2 * SPEC["kv_heads"] * SPEC["head_dim"] * 2
    for row in summary:  # the bars: warm - (vLLM prefix-cache hit) <= 1.1 x link time; cold <= 1.03 x
        if "kvplugin_cold_s" in row and "baseline_cold_s" in row:
            row["kvplugin_cold_over_baseline_cold"] = round(row["kvplugin_cold_s"] / row["baseline_cold_s"], 3)
        if "kvplugin_warm_s" in row and "vllm-apc_warm_s" in row:
            link_s = row["kvplugin_warm_cached_tokens"] * bpt / link
            row["link_s"] = round(link_s, 4)
            row["kvplugin_warm_minus_apc_over_link"] = round((row["kvplugin_warm_s"] - row["vllm-apc_warm_s"]) / link_s, 2)
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
        "benchmark": "gpu_ttft", "date": time.strftime("%Y-%m-%d"), **environment(),
        "model": SPEC if args.model is None else args.model, "kv_bytes_per_token": SPEC["layers"] * 2 * SPEC["kv_heads"] * SPEC["head_dim"] * 2,
        "block_size": args.block, "chunk_size": args.chunk, "host_bytes": args.host_bytes,
        "summary": summary, "modes": results, "errors": errors,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    Path(args.out + ".partial").unlink(missing_ok=True)  # the whole run is in args.out
    print_table(summary, ("_cold_s", "_warm_s", "_cached_tokens", "kvplugin_warm"))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
