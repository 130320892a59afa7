"""Cold vs warm time-to-first-token on the CPU lane, side by side in one run.

Modes, each in its own engine process (in-process engine, eager, prefix caching
off), the same prompts in the same order:

* ``baseline``  - no connector (every request recomputes);
* ``kvplugin``  - KVPluginConnector, in-process CPU tier;
* ``kvplugin-server`` - KVPluginConnector through a `vllm-kvplugin server` (when available);
* ``example``   - vLLM's ExampleConnector (disk), the only stock connector that runs on
  the CPU platform.

For every prompt length: the first request is cold, the second identical one
warm; TTFT is the latency of a 1-token generation.  Prompt lengths are block
multiples and one past a block multiple (ExampleConnector misses entirely
there).  Results: JSON with the machine and versions, and ratios.

    python benchmarks/cpu_ttft.py [--lengths 2048,4096,8192,16384] [--out benchmarks/results/cpu-ttft.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results_json  # noqa: E402
from ttft_common import measure, print_table, run_modes_with_server, summarize  # noqa: E402


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_mode(mode: str, model: str, lengths: list[int], block: int, chunk: int, server: str | None) -> dict:
    """One engine, all prompts; runs in a child process (``--child``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM
    from vllm.config import KVTransferConfig

    import vllm_kvplugin

    ktc = None
    if mode.startswith("kvplugin"):
        extra = {"chunk_size": chunk, "cpu_bytes": 8 << 30 if mode == "kvplugin" else 0}
        if server:
            extra["server"] = server
        ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    elif mode == "example":
        store = tempfile.mkdtemp(prefix="example-connector-")
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": store})
    max_len = max(lengths) + 64
    llm = LLM(model=model, enable_prefix_caching=False, max_model_len=max_len, enforce_eager=True,
              kv_cache_memory_bytes=4 << 30, block_size=block, kv_transfer_config=ktc, seed=0,
              max_num_batched_tokens=max_len)
    rows = measure(llm, lengths)
    stats = vllm_kvplugin.stats() if mode.startswith("kvplugin") else None
    return {"mode": mode, "rows": rows, "kvplugin_stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,2049,4096,4097,8192,8193,16384,16385")
    ap.add_argument("--modes", default="baseline,kvplugin,kvplugin-server,example")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--server", default=None, help="address of a running vllm-kvplugin server")
    ap.add_argument("--out", default=str(HERE / "results" / "cpu-ttft.json"))
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args.model, lengths, args.block, args.chunk, args.server)))
        return 0

    from vllm_kvplugin import __version__, tiny_model

    model = str(tiny_model.build(tiny_model.DEMO))

    def child_args(mode: str) -> list[str]:
        return ["--model", model, "--lengths", args.lengths, "--block", str(args.block), "--chunk", str(args.chunk)]

    # the server's pool holds every prompt of the run (about 4 GB of this model's KV)
    results, _ = run_modes_with_server(__file__, args.modes.split(","), child_args, keep_going=False,
                                       l1_bytes=6 << 30, address=args.server)
    import torch
    import vllm

    summary = summarize(results, lengths, {
        "kvplugin_vs_example_warm_ratio": ("example", "kvplugin"),
        "server_vs_inprocess_warm_ratio": ("kvplugin-server", "kvplugin"),
    })
    doc = {
        "benchmark": "cpu_ttft", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "vllm_kvplugin": __version__},
        "model": tiny_model.DEMO.__dict__, "block_size": args.block, "chunk_size": args.chunk,
        "summary": summary, "modes": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results_json.write(args.out, doc)
    print_table(summary, ("_cold_s", "_warm_s", "ratio"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
