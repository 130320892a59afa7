"""Throughput under a serving load on a GPU: many concurrent requests, 0% and 80% prefix reuse.

Run on the H200 with vLLM's GPU wheel (``bash compat/gpulane/bench.sh serving``).  The model is
``gpu_ttft``'s (Qwen3-8B's KV shape, random weights).  Modes, each in its own engine process
(in-process engine core, eager), the same prompts in the same order:

* ``baseline`` - no connector;
* ``kvplugin`` - KVPluginConnector, in-process tier;
* ``kvplugin-server`` - KVPluginConnector through a ``vllm-kvplugin server`` process;
* ``vllm-offloading`` - vLLM's own ``OffloadingConnector``.

Per mode: one unmeasured batch (first-use costs), then ``--repeats`` times (fresh prompts each
time; the median is reported, every batch is kept):

* ``reuse_0``:  ``--streams`` prompts of ``--prompt-tokens`` unique tokens, submitted together
  (one ``generate`` call: vLLM batches them), ``--max-tokens`` greedy tokens each.  Every chunk
  is new, so a connector can only cost here (lookups that miss, stores);
* ``reuse_80``: vLLM's GPU prefix cache reset, then prompts whose first 80% (rounded down to a
  whole chunk) are those of ``reuse_0`` and whose rest is new: the shared part can only come from
  a connector.

Throughput = (prompt + generated tokens) / wall seconds of the batch (one batch moved by up to
15% between runs on the H200: hence the repeats).  The results are JSON with
the machine and versions, and each mode's throughput over the baseline's.
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

from gpu_ttft import HOST_BYTES, KV_BYTES, SPEC, transfer_config  # noqa: E402
from ttft_common import built_gpu_model, environment, run_modes_with_server, tokens  # noqa: E402

MODES = "baseline,kvplugin,kvplugin-server,vllm-offloading"


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


def run_mode(mode: str, model: str, streams: int, prompt_tokens: int, max_tokens: int, chunk: int,
             block: int, server: str | None, host_bytes: int = HOST_BYTES, kv_bytes: int = KV_BYTES,
             repeats: int = 3) -> dict:
    """One engine, the warm-up batch and the two measured batches; runs in a child process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM

    import vllm_kvplugin

    ktc = transfer_config(mode, chunk, host_bytes, server)
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=prompt_tokens + max_tokens + 16,
              enforce_eager=True, kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=0.5,
              block_size=block, kv_transfer_config=ktc, seed=0)
    shared = (prompt_tokens * 8 // 10) // chunk * chunk
    _batch(llm, [tokens(prompt_tokens, 900_000 + i) for i in range(streams)], max_tokens)  # first use
    runs: dict[str, list[dict]] = {"reuse_0": [], "reuse_80": []}
    for r in range(repeats):  # fresh prompts each repeat: every chunk of reuse_0 is new
        first = [tokens(prompt_tokens, 1000 * (r + 1) + i) for i in range(streams)]
        second = [p[:shared] + tokens(prompt_tokens - shared, 500_000 + 1000 * r + i) for i, p in enumerate(first)]
        llm.reset_prefix_cache()
        runs["reuse_0"].append(_batch(llm, first, max_tokens))
        time.sleep(0.5)  # asynchronous stores (vLLM's offloading) finish
        llm.reset_prefix_cache()
        runs["reuse_80"].append(_batch(llm, second, max_tokens))
    rows = {}
    for case, got in runs.items():
        tps = [g["tokens_per_s"] for g in got]
        rows[case] = {"tokens_per_s": round(statistics.median(tps), 1), "tokens_per_s_each": tps,
                      "wall_s_each": [g["wall_s"] for g in got], "cached_tokens": got[-1]["cached_tokens"],
                      "outputs": got[0]["outputs"]}
    rows["reuse_80"]["shared_tokens_per_prompt"] = shared
    stats = vllm_kvplugin.stats() if mode.startswith("kvplugin") else None
    return {"mode": mode, "rows": rows, "kvplugin_stats": stats}


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
    ap.add_argument("--model", default=None)
    ap.add_argument("--server", default=None)
    ap.add_argument("--host-bytes", type=int, default=HOST_BYTES)
    ap.add_argument("--kv-bytes", type=int, default=KV_BYTES)
    ap.add_argument("--repeats", type=int, default=3, help="batches per case (the median is reported)")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args.model, args.streams, args.prompt_tokens,
                                                 args.max_tokens, args.chunk, args.block, args.server,
                                                 args.host_bytes, args.kv_bytes, args.repeats)))
        return 0
    model = args.model
    if model is None:
        model = built_gpu_model(str(HERE / "gpu_ttft.py"))

    def child_args(mode: str) -> list[str]:
        return ["--model", model, "--streams", str(args.streams), "--prompt-tokens", str(args.prompt_tokens),
                "--max-tokens", str(args.max_tokens), "--block", str(args.block), "--chunk", str(args.chunk),
                "--host-bytes", str(args.host_bytes), "--kv-bytes", str(args.kv_bytes), "--repeats", str(args.repeats)]

    results, errors = run_modes_with_server(__file__, args.modes.split(","), child_args, keep_going=True,
                                            l1_bytes=args.host_bytes, partial=args.out + ".partial")
    by_mode = {r["mode"]: r["rows"] for r in results}
    base = by_mode.get("baseline")
    summary = []
    for case in ("reuse_0", "reuse_80"):
        row: dict = {"case": case}
        for mode, rows in by_mode.items():
            r = rows[case]
            row[f"{mode}_tokens_per_s"] = r["tokens_per_s"]
            row[f"{mode}_cached_tokens"] = r["cached_tokens"]
            if base is not None:
                row[f"{mode}_over_baseline"] = round(r["tokens_per_s"] / base[case]["tokens_per_s"], 3)
                row[f"{mode}_outputs_match_baseline"] = r["outputs"] == base[case]["outputs"]
        summary.append(row)
    for rows in by_mode.values():
        for r in rows.values():
            r.pop("outputs", None)
    doc = {
        "benchmark": "gpu_serving", "date": time.strftime("%Y-%m-%d"), **environment(),
        "model": SPEC, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "block_size": args.block, "chunk_size": args.chunk, "repeats": args.repeats,
        "summary": summary, "modes": results, "errors": errors,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    Path(args.out + ".partial").unlink(missing_ok=True)  # the whole run is in args.out
    for row in summary:
        print(" | ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("match_baseline")))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
