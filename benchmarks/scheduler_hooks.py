"""The scheduler half's hooks on vLLM's thread under a serving load of new prompts (CPU or GPU).

At 0% reuse a connector can only cost, and an eager engine is bound by its one Python thread:
what the plugin's scheduler hooks take there comes straight off throughput.  One engine
(in-process, eager), KVPluginConnector with the in-process tier (``--server``: through a cache
server process instead, no in-process tier); per round ``--streams`` fresh
prompts of ``--prompt-tokens`` submitted together, ``--max-tokens`` greedy tokens each.  Measured
per call: ``build_connector_meta`` (every step; steps whose metadata carries stores apart from
the others, e.g. decode steps) and ``get_num_new_matched_tokens`` (each new request's lookup, and
every later call for a request vLLM still holds back: ``lookup_calls_per_request``; how many of
those calls held the request back, and how many lookups went to the server).  ``--miss-reuse``
runs each round twice, with the scheduler's ``MISS_REUSE_S`` and with 0.
The first batch is warm-up.  Results: per round the count, total and median of each, with the
machine and versions.

    python benchmarks/scheduler_hooks.py [--streams 32] [--rounds 3] [--out benchmarks/results/scheduler-hooks-cpu.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_json  # noqa: E402
from ttft_common import environment, start_server, tokens  # noqa: E402


def _summary(samples: list[float]) -> dict:
    return {"n": len(samples), "total_ms": round(1e3 * sum(samples), 3),
            "median_us": round(1e6 * statistics.median(samples), 1) if samples else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--server", action="store_true", help="through a cache server (no in-process tier)")
    ap.add_argument("--miss-reuse", action="store_true",
                    help="with --server: each round once with the scheduler's MISS_REUSE_S and once with 0 "
                         "(a server miss asked again each time vLLM asks), side by side in one engine")
    ap.add_argument("--out", default=str(HERE / "results" / "scheduler-hooks-cpu.json"))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_kvplugin import tiny_model
    from vllm_kvplugin.connector import scheduler as smod
    from vllm_kvplugin.connector.scheduler import SchedulerSide
    from vllm_kvplugin.tiers.mp import ServerIndex

    meta_store, meta_other, match, asked, held, sent = [], [], [], [], [], []
    build, lookup = SchedulerSide.build_connector_meta, SchedulerSide.get_num_new_matched_tokens
    server_lookup = ServerIndex.lookup

    def timed_build(self, so):
        t0 = time.perf_counter()
        meta = build(self, so)
        (meta_store if meta.stores else meta_other).append(time.perf_counter() - t0)
        return meta

    def timed_lookup(self, request, *a, **k):
        asked.append(request.request_id)
        t0 = time.perf_counter()
        try:
            got = lookup(self, request, *a, **k)
        finally:
            match.append(time.perf_counter() - t0)
        if got[0] is None:
            held.append(request.request_id)
        return got

    def counted_server_lookup(self, *a, **k):
        sent.append(1)
        return server_lookup(self, *a, **k)

    SchedulerSide.build_connector_meta, SchedulerSide.get_num_new_matched_tokens = timed_build, timed_lookup
    ServerIndex.lookup = counted_server_lookup
    extra = {"chunk_size": args.chunk, "cpu_bytes": 2 << 30}
    server = None
    if args.server:
        server, address = start_server(2 << 30)
        extra.update(cpu_bytes=0, server=address)
    ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=str(tiny_model.build(tiny_model.DEMO)), enable_prefix_caching=True, enforce_eager=True,
              block_size=args.block, max_model_len=args.prompt_tokens + args.max_tokens + 16,
              max_num_batched_tokens=8192, max_num_seqs=args.streams, kv_cache_memory_bytes=1 << 30,
              kv_transfer_config=ktc, seed=0)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    modes = {"miss_reuse": smod.MISS_REUSE_S, "no_miss_reuse": 0.0} if args.miss_reuse else {"": smod.MISS_REUSE_S}
    rounds = []
    for r in range(args.rounds + 1):
        row = {}
        for m, (mode, reuse_s) in enumerate(modes.items()):
            smod.MISS_REUSE_S = reuse_s
            for xs in (meta_store, meta_other, match, asked, held, sent):
                xs.clear()
            llm.generate([{"prompt_token_ids": tokens(args.prompt_tokens, 10_000 * r + 1_000 * m + i)}
                          for i in range(args.streams)], sp, use_tqdm=False)
            got = {"build_meta_with_stores": _summary(meta_store), "build_meta_other": _summary(meta_other),
                   "lookup": _summary(match),
                   "lookup_calls_per_request": round(len(asked) / max(1, len(set(asked))), 2),
                   "held_per_request": round(len(held) / max(1, len(set(asked))), 2),
                   "server_lookups_per_request": round(len(sent) / max(1, len(set(asked))), 2)}
            row.update({f"{mode}_{k}" if mode else k: v for k, v in got.items()})
        if r:  # the first batch is warm-up
            rounds.append(row)
            print(f"round {r}: {rounds[-1]}", flush=True)
    if server is not None:
        server.terminate()
    code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    doc = {"benchmark": "scheduler_hooks", "date": time.strftime("%Y-%m-%d"), **environment(),
           "code": code.strip() or None, "model": "tiny_model.DEMO", "server": args.server, "streams": args.streams,
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "block_size": args.block,
           "chunk_size": args.chunk, "miss_reuse_s": {m: v for m, v in modes.items() if m}, "rounds": rounds}
    results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
