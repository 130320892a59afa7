"""An engine on another "machine": generate prompts through its own cache server, print the outputs.

:mod:`test_remote_engines` runs this as its own ``python`` process (engine A, cache server A):
the prompts' chunks go to server A and through it to the shared remote store.  Prints one
``RESULT {json}`` line: per prompt the output tokens, and the plugin's counters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--prompts", required=True, help="a JSON file: a list of token id lists")
    args = ap.parse_args()

    from harness import engine, generate, shutdown

    import vllm_kvplugin

    prompts = json.loads(Path(args.prompts).read_text())
    llm = engine(args.model, args.block, {"chunk_size": args.chunk, "cpu_bytes": 0, "server": args.server},
                 budget=args.chunk)
    try:
        outs = [generate(llm, [p])[0] for p in prompts]
        stats = vllm_kvplugin.stats()
    finally:
        shutdown(llm)
    print("RESULT " + json.dumps({"outputs": [o.token_ids for o in outs],
                                  "cached": [o.num_cached_tokens for o in outs],
                                  "stored_tokens": stats["stored_tokens"]}), flush=True)


if __name__ == "__main__":
    main()
