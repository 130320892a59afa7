"""A lone request's lookup, from its start to the first prefetch call, split or not (CPU or GPU).

One engine (in-process, eager, vLLM's prefix cache off), KVPluginConnector with the in-process
tier (``--server``: a cache server's only).  Per prompt length and pair: a fresh prompt is stored
(cold), then repeated twice, once with ``metadata.FIRST_PART_CHUNKS`` as shipped (its first
chunks keyed, read and sent before the rest are keyed; through the server, looked up whole, then
the first objects resolved, read and sent before the rest are resolved and read) and once with it
0 (no split), the order alternating by pair.
Measured per repeat: from the start of vLLM's first ``get_num_new_matched_tokens`` call to the
worker's first ``_prefetch`` call (on a GPU, the copy's issue; the CPU engine's returns at once),
and that first lookup call whole.  Both repeats must hit in full.  The first two pairs of a length
are warm-up.  Results: medians per length, every sample, with the machine and versions.
``--compare placed`` (with ``--server``): the repeats differ instead in ``mp.LOOKUP_RESOLVES``: the
lookup answers where the objects are (``placed``), or the worker resolves them (``resolving``).
``--compare here`` (with ``--server``): in ``scheduler_lone.LOOKUP_HERE``: the lookup runs on vLLM's
thread (``here``) or on the index's (``threaded``).

    python benchmarks/lone_lookup.py [--lengths 8193,16385] [--pairs 20] [--server] [--compare split|placed|here] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_json  # noqa: E402
from ttft_common import environment, tokens  # noqa: E402

WARM_UP_PAIRS = 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8193,16385")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--server", action="store_true", help="hits from a cache server (in-process tier off)")
    ap.add_argument("--compare", choices=("split", "placed", "here"), default="split",
                    help="what the two repeats differ in (placed: the server's lookup resolving; here: it "
                         "running on vLLM's thread; both need --server)")
    ap.add_argument("--out", default=None, help="default: results/lone-lookup-cpu[-server].json")
    args = ap.parse_args()
    if args.compare != "split" and not args.server:
        ap.error(f"--compare {args.compare} needs --server")
    out = Path(args.out or HERE / "results" / f"lone-lookup-cpu{'-server' if args.server else ''}.json")
    server = None
    extra = {"chunk_size": args.chunk, "cpu_bytes": 6 << 30}
    if args.server:
        from ttft_common import start_server
        server, address = start_server(2 << 30)
        extra.update(cpu_bytes=0, server=address)
    try:
        return _run(args, [int(x) for x in args.lengths.split(",")], extra, out)
    finally:
        if server is not None:
            server.terminate()
            server.wait()


def _run(args, lengths: list[int], extra: dict, out: Path) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_kvplugin import tiny_model
    from vllm_kvplugin.connector import metadata
    from vllm_kvplugin.connector import scheduler_lone as lone
    from vllm_kvplugin.connector.scheduler import SchedulerSide
    from vllm_kvplugin.connector.worker import WorkerSide
    from vllm_kvplugin.tiers import mp

    marks: dict[str, float] = {}
    match, prefetch = SchedulerSide.get_num_new_matched_tokens, WorkerSide._prefetch

    def timed_match(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return match(self, *a, **k)
        finally:
            if "match" not in marks:
                marks["match"], marks["match_end"] = t0, time.perf_counter()

    def timed_prefetch(self, *a, **k):
        marks.setdefault("prefetch", time.perf_counter())
        return prefetch(self, *a, **k)
    SchedulerSide.get_num_new_matched_tokens, WorkerSide._prefetch = timed_match, timed_prefetch

    spec = tiny_model.TinySpec(arch="qwen3", layers=2, hidden=256, heads=8, kv_heads=8, head_dim=128)
    model = str(tiny_model.build(spec))
    ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                           kv_connector_extra_config=extra)
    top = max(lengths) + 64
    llm = LLM(model=model, enable_prefix_caching=False, max_model_len=top, enforce_eager=True,
              kv_cache_memory_bytes=3 << 30, block_size=args.block, kv_transfer_config=ktc, seed=0,
              max_num_batched_tokens=top)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    shipped = metadata.FIRST_PART_CHUNKS
    a, b = {"split": ("split", "unsplit"), "placed": ("placed", "resolving"), "here": ("here", "threaded")}[args.compare]
    rows = []
    for n in lengths:
        samples: dict[str, list[tuple[float, float]]] = {a: [], b: []}
        for pair in range(args.pairs + WARM_UP_PAIRS):
            p = tokens(n, 7000 * n + pair)
            llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
            for mode in (a, b) if pair % 2 else (b, a):
                if args.compare == "split":
                    metadata.FIRST_PART_CHUNKS = shipped if mode == "split" else 0
                elif args.compare == "placed":
                    mp.LOOKUP_RESOLVES = mode == "placed"
                else:
                    lone.LOOKUP_HERE = mode == "here"
                marks.clear()
                o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
                want = (n - 1) // args.chunk * args.chunk
                if o.num_cached_tokens != want:
                    raise RuntimeError(f"{mode} repeat of {n} tokens hit {o.num_cached_tokens}, not {want}")
                if pair >= WARM_UP_PAIRS:
                    samples[mode].append((marks["prefetch"] - marks["match"], marks["match_end"] - marks["match"]))
        metadata.FIRST_PART_CHUNKS, mp.LOOKUP_RESOLVES, lone.LOOKUP_HERE = shipped, True, True
        row = {"prompt_tokens": n}
        for mode, got in samples.items():
            row[f"{mode}_to_first_prefetch_ms"] = round(1e3 * statistics.median(a for a, _ in got), 3)
            row[f"{mode}_lookup_call_ms"] = round(1e3 * statistics.median(b for _, b in got), 3)
            row[f"{mode}_samples_ms"] = [[round(1e3 * a, 3), round(1e3 * b, 3)] for a, b in got]
        rows.append(row)
        print(f"{n}: to the first prefetch {row[f'{b}_to_first_prefetch_ms']} ms {b}, "
              f"{row[f'{a}_to_first_prefetch_ms']} ms {a}", flush=True)
    import vllm_kvplugin

    doc = {"benchmark": "lone_lookup", "date": time.strftime("%Y-%m-%d"), **environment(),
           "model": spec.__dict__, "tier": "server" if args.server else "local", "block_size": args.block,
           "chunk_size": args.chunk, "compare": [a, b],
           "first_part_chunks": shipped, "pairs": args.pairs, "rows": rows, "kvplugin_stats": vllm_kvplugin.stats()}
    out.parent.mkdir(parents=True, exist_ok=True)
    results_json.write(out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
