"""Tensor parallel (TP=2) engines (CPU, or two GPUs), the seeds' method, run as a script.

vLLM starts the TP workers as spawned processes, which re-import the main
module: an engine with TP > 1 cannot start inside a pytest(-xdist) worker, so
:mod:`test_tensor_parallel` runs this file as its own ``python`` process and
reads the one ``RESULT {json}`` line it prints.

Per prompt: a no-connector TP=2 engine's output is the reference; the plugin's
TP=2 engine runs it cold, every KV block of every rank is then overwritten with
finite noise (``collective_rpc``, in the worker processes), and it runs warm.
Recorded per prompt: outputs, ``num_cached_tokens`` and, per rank (read in
that rank's process), the rank, its bytes per token and its loaded
tokens/bytes and load failures during the warm run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _connector_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def poison_all_blocks(worker, seed: int) -> int:
    """In a worker process: finite noise into every KV block this rank holds (random
    bytes would put NaNs in unwritten slots, which vLLM's CPU attention turns into
    NaN logits even without a connector)."""
    import torch

    n = 0
    for layers in _connector_worker().layers:
        for i, t in enumerate(layers):
            gen = torch.Generator(device=t.device).manual_seed(seed * 1000 + i)
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))
            n += t.numel()
    return n


def rank_stats(worker) -> dict:
    """In a worker process: this rank's identity and its process-local counters."""
    import vllm_kvplugin

    ws = _connector_worker()
    s = vllm_kvplugin.stats()
    return {"rank": ws.rank, "world": ws.world,
            "bytes_per_token": sum(lay.bytes_per_token for lay in ws.layouts),
            "loaded_tokens": s["loaded_tokens"], "loaded_bytes": s["loaded_bytes"],
            "load_failures": s["load_failures"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--server", default="")
    args = ap.parse_args()

    from harness import engine, generate, shutdown

    import vllm_kvplugin

    tp = dict(tensor_parallel_size=2, distributed_executor_backend="mp", budget=args.chunk)
    prompts = [[random.Random(n).randrange(10, 4000) for _ in range(n)] for n in args.lengths]
    base = engine(args.model, args.block, None, **tp)
    try:
        want = [generate(base, [p])[0].token_ids for p in prompts]
    finally:
        shutdown(base)

    cfg = {"chunk_size": args.chunk, "cpu_bytes": 0 if args.server else 256 << 20}
    if args.server:
        cfg["server"] = args.server
    llm = engine(args.model, args.block, cfg, **tp)
    rows = []
    try:
        for p, expect in zip(prompts, want):
            cold = generate(llm, [p])[0]
            poisoned = llm.collective_rpc(poison_all_blocks, args=(len(p),))
            before = llm.collective_rpc(rank_stats)
            warm = generate(llm, [p])[0]
            after = llm.collective_rpc(rank_stats)
            rows.append({
                "length": len(p), "want": expect, "cold": cold.token_ids, "warm": warm.token_ids,
                "cold_cached": cold.num_cached_tokens, "warm_cached": warm.num_cached_tokens,
                "poisoned_elements": poisoned,
                "ranks": [{"rank": a["rank"], "world": a["world"], "bytes_per_token": a["bytes_per_token"],
                           "loaded_tokens": a["loaded_tokens"] - b["loaded_tokens"],
                           "loaded_bytes": a["loaded_bytes"] - b["loaded_bytes"],
                           "load_failures": a["load_failures"]}
                          for b, a in zip(before, after)],
            })
        sched = vllm_kvplugin.stats()
    finally:
        shutdown(llm)
    print("RESULT " + json.dumps({"rows": rows, "scheduler": sched}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
