"""What a hit claimed asynchronously costs at vLLM's step boundary, against one claimed after its copy.

    python benchmarks/async_boundary.py [--lengths 8193] [--delays 0,20] [--pairs 20] [--out FILE]

A research probe for asynchronous loads (``compat/async_loads.md``; NOTES, sixteenth session,
Next 2), not the plugin: a bare connector (:class:`BoundaryConnector`, in this file) that moves
no bytes gives every fresh prompt a hit of its whole blocks, two ways, in one engine:

* ``sync`` -- as the plugin's lone hit today: ``get_num_new_matched_tokens`` waits ``delay`` ms
  (the copy and its verdict) and claims ``(N, False)``; vLLM then allocates the blocks and the
  forward runs in the same step;
* ``async`` -- ``(N, True)`` at once: vLLM allocates the blocks and parks the request in
  ``WAITING_FOR_REMOTE_KVS``; the worker reports it in ``get_finished`` once ``delay`` ms have
  passed since the lookup (the copy into the allocated blocks); vLLM promotes it in a later
  step and the forward runs.

* ``async-serve`` -- the same, with the engine loop of ``vllm serve`` (``EngineCoreProc``
  sleeps 1 ms after a step that ran no model while requests remain; the in-process ``LLM``
  used here does not, so it is added around its engine core's step);
* ``async-serve-wait`` -- the same, and ``get_finished`` waits for a load due within 2 ms (a
  worker that knows its copy's progress could wait for its last piece) instead of leaving it to
  the next step after the sleep.

TTFT is the wall time of a one-token ``generate`` (the KV is never written, so the token is not
meaningful).  ``async`` saves the allocation (and, on a GPU, the scatter) after the copy and pays
the steps between the report and the promotion.  Pairs alternate the order.  Medians per
(length, delay); every sample is kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: shared by the connector's two roles (one process): the mode, the delay, the loads in flight
STATE: dict[str, Any] = {"mode": "none", "delay_s": 0.0, "due": {}, "marks": {}}
_LOCK = threading.Lock()
#: ``async-serve-wait``: how long ``get_finished`` waits for a load about to land
WAIT_S = 0.002
#: vLLM's block size (the CPU attention backend takes multiples of 32)
BLOCK = 32


class _Meta(KVConnectorMetadata):
    pass

class BoundaryConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        mode = STATE["mode"]
        n = (len(request.prompt_token_ids) - 1) // BLOCK * BLOCK - num_computed_tokens
        if mode == "none" or n <= 0 or request.request_id in STATE["marks"]:
            return 0, False
        STATE["marks"][request.request_id] = {"lookup": time.perf_counter()}
        if mode == "sync":
            time.sleep(STATE["delay_s"])
            return n, False
        with _LOCK:
            STATE["due"][request.request_id] = time.perf_counter() + STATE["delay_s"]
        return n, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        m = STATE["marks"].get(request.request_id)
        if m is not None and "alloc" not in m:
            m["alloc"] = time.perf_counter()

    def build_connector_meta(self, scheduler_output):
        return _Meta()

    def request_finished(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        now = time.perf_counter()
        if STATE["mode"] == "async-serve-wait" and STATE["due"]:
            left = min(STATE["due"].values()) - now
            if 0 < left <= WAIT_S:  # a load about to land: seen in this step, not after a 1 ms sleep
                time.sleep(left)
                now = time.perf_counter()
        with _LOCK:
            done = {rid for rid, t in STATE["due"].items() if now >= t}
            for rid in done:
                del STATE["due"][rid]
                STATE["marks"][rid]["reported"] = now
        return None, (done or None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8193")
    ap.add_argument("--delays", default="0,20", help="ms of copy and verdict")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results" / "async-boundary-cpu.json"))
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import results_json
    from ttft_common import environment, serve_loop, tokens
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from vllm_kvplugin import tiny_model

    lengths = [int(x) for x in args.lengths.split(",")]
    spec = tiny_model.TinySpec(arch="qwen3", layers=2, hidden=256, heads=8, kv_heads=8, head_dim=128)
    ktc = KVTransferConfig(kv_connector="BoundaryConnector", kv_connector_module_path="async_boundary",
                           kv_role="kv_both")
    top = max(lengths) + 64
    llm = LLM(model=str(tiny_model.build(spec)), enable_prefix_caching=True, max_model_len=top,
              enforce_eager=True, kv_cache_memory_bytes=2 << 30, block_size=BLOCK, kv_transfer_config=ktc,
              seed=0, max_num_batched_tokens=top)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    mod = sys.modules["async_boundary"]  # vLLM's import of this file: its STATE is the connector's
    serve_loop(llm, lambda: mod.STATE["mode"].startswith("async-serve"))
    rows = []
    for n in lengths:
        for delay in (float(d) for d in args.delays.split(",")):
            mod.STATE["delay_s"] = delay / 1e3
            got: dict[str, list[dict]] = {"sync": [], "async": [], "async-serve": [], "async-serve-wait": [], "own_hit": []}
            for pair in range(args.pairs + 2):
                modes = ["sync", "async", "async-serve", "async-serve-wait"]
                for k, mode in enumerate(modes[pair % 4:] + modes[:pair % 4]):
                    mod.STATE["mode"], mod.STATE["marks"] = mode, {}
                    q = tokens(n, 9000 * n + 31 * pair + int(delay) + k + 1)  # fresh prompts
                    t0 = time.perf_counter()
                    o = llm.generate([{"prompt_token_ids": q}], sp, use_tqdm=False)[0]
                    t1 = time.perf_counter()
                    m = next(iter(mod.STATE["marks"].values()), {})
                    if o.num_cached_tokens != (n - 1) // BLOCK * BLOCK:
                        raise RuntimeError(f"{mode}: {o.num_cached_tokens} cached tokens of {n}")
                    if pair >= 2:
                        got[mode].append({"ttft_ms": 1e3 * (t1 - t0),
                                          **{f"{k}_ms": 1e3 * (v - t0) for k, v in m.items()}})
                    if mode == "sync":  # the same prompt again: vLLM's own prefix-cache hit
                        mod.STATE["mode"] = "none"
                        t0 = time.perf_counter()
                        llm.generate([{"prompt_token_ids": q}], sp, use_tqdm=False)
                        if pair >= 2:
                            got["own_hit"].append({"ttft_ms": 1e3 * (time.perf_counter() - t0)})
            row: dict[str, Any] = {"prompt_tokens": n, "delay_ms": delay}
            for mode, samples in got.items():
                for key in samples[0]:
                    row[f"{mode}_{key}"] = round(statistics.median(s[key] for s in samples), 3)
                row[f"{mode}_samples"] = [{k: round(v, 3) for k, v in s.items()} for s in samples]
            rows.append(row)
            print(f"{n} tokens, {delay:g} ms: sync {row['sync_ttft_ms']} ms, async {row['async_ttft_ms']} ms, "
                  f"async-serve {row['async-serve_ttft_ms']} ms, async-serve-wait {row['async-serve-wait_ttft_ms']} ms, "
                  f"own hit {row['own_hit_ttft_ms']} ms; sync allocated at {row.get('sync_alloc_ms')}, async at "
                  f"{row.get('async_alloc_ms')}, reported at {row.get('async_reported_ms')} ms", flush=True)
    doc = {"benchmark": "async_boundary", "date": time.strftime("%Y-%m-%d"), **environment(),
           "model": spec.__dict__, "pairs": args.pairs, "rows": rows}
    results_json.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
