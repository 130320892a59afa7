"""``vllm-kvplugin verify --model M``: the seeds' proof, run by the user on their own deployment.

For each prompt length: the prompt runs cold (greedy, with logprobs), then once more on vLLM's
own prefix cache (the reference below), then vLLM's prefix cache is reset and every KV block
and recurrent state of every rank is overwritten with noise, then it runs warm.  A length
passes when the hit is the one the plugin's planner promises, every rank loaded exactly the
hit's tokens and the bytes the plan expected (so the hit really came from a load), and the
warm tokens equal the cold ones -- or, where they do not, equal vLLM's own prefix-cache hit
of the same length token for token and logprob for logprob.

The reference is vLLM's own prefix-cache hit of exactly the plugin's hit, over the KV bytes
the plugin then loads: it computes the same tokens over the same context with the same
kernels, from KV that vLLM computed and kept itself.  Where vLLM's hit on the cold run's
blocks covers exactly the plugin's hit (a prompt one token past a chunk multiple: the seed's
case), those blocks are it.  Elsewhere (vLLM's hit reaches further, to the last full block)
both caches are emptied and the hit's tokens plus one are computed once: vLLM keeps their
whole blocks and the plugin stores their chunks from that same prefill, so vLLM's hit on the
full prompt then covers exactly the plugin's.  On a GPU, a step over a cached prefix runs
other kernels than the cold prefill (and so may pick another token where two were within
rounding); the plugin is exact when its warm run equals vLLM's own hit.  Where no such
reference arises (vLLM's hit differs, e.g. for recurrent groups), a divergence where the cold
run's top two candidates were within ``--tie-margin`` is reported as a near tie, not a
failure.  Beside it: cold vs warm time to first token.  Exit status 0 only when every length
passed.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; tensor-parallel
workers are processes of their own): the scheduler's plan is read here, the workers' loads
through ``collective_rpc`` (:mod:`.worker_ops`).  ``--negative-control`` claims hits without
writing them: verify must then fail (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

#: prompts draw token ids below this (any real vocabulary is larger)
VOCAB = 1000


@dataclass
class Row:
    length: int
    expected_hit: int
    hit: int
    loads_proven: bool
    identical: bool
    verdict: str                 # identical | as vLLM's hit | near tie | DIFFERENT | NO LOAD | SHORT HIT
    first_divergence: int | None
    margin: float | None         # cold run's top-1 minus top-2 logprob at the divergence
    max_logprob_delta: float     # over the tokens both runs chose alike
    cold_ttft_s: float
    warm_ttft_s: float
    #: warm equals vLLM's own hit of the same length exactly (None: no such reference)
    as_vllm_hit: bool | None = None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict in PASSING


PASSING = ("identical", "as vLLM's hit", "near tie")


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_kwargs(rest: list[str]) -> dict:
    """vLLM engine arguments given after ours: ``--max-model-len 8192 --enforce-eager`` ->
    ``{"max_model_len": 8192, "enforce_eager": True}``."""
    out: dict = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--"):
            raise SystemExit(f"vllm-kvplugin verify: unexpected argument {arg!r} (engine arguments are --name value)")
        name, eq, val = arg[2:].partition("=")
        key = name.replace("-", "_")
        if eq:
            out[key] = _value(val)
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out[key] = _value(rest[i + 1])
            i += 1
        else:
            out[key] = True
        i += 1
    return out


def _size(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def lengths_for(chunk: int, given: list[int] | None, limit: int | None) -> list[int]:
    """Each base length rounded to a whole number of chunks m, then m - 1, m, m + 1; by
    default 1, 4, 16 and 64 chunks, as far as ``limit`` allows."""
    bases = given or [chunk, 4 * chunk, 16 * chunk, 64 * chunk]
    out = []
    for b in bases:
        m = max(chunk, round(b / chunk) * chunk)
        out += [n for n in (m - 1, m, m + 1) if n >= 2 and (limit is None or n <= limit) and n not in out]
    return out


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _bar(done: int, total: int) -> str:
    n = round(24 * done / max(1, total))
    return "[" + "#" * n + "." * (24 - n) + f"] {done}/{total}"


def compare(cold, warm, tie_margin: float) -> tuple[bool, int | None, float | None, float, str]:
    """(identical, first divergence, margin there, max |logprob delta| before it, verdict)."""
    first = next((i for i, (a, b) in enumerate(zip(cold.token_ids, warm.token_ids)) if a != b), None)
    if first is None and len(cold.token_ids) != len(warm.token_ids):
        first = min(len(cold.token_ids), len(warm.token_ids))
    upto = len(cold.token_ids) if first is None else first
    delta = 0.0
    for i in range(min(upto, len(cold.logprobs), len(warm.logprobs))):
        t = cold.token_ids[i]
        if t in cold.logprobs[i] and t in warm.logprobs[i]:
            delta = max(delta, abs(cold.logprobs[i][t] - warm.logprobs[i][t]))
    if first is None:
        return True, None, None, delta, "identical"
    margin = None
    if first < len(cold.logprobs) and len(cold.logprobs[first]) >= 2:
        top = sorted(cold.logprobs[first].values(), reverse=True)
        margin = top[0] - top[1]
    verdict = "near tie" if margin is not None and margin <= tie_margin else "DIFFERENT"
    return False, first, margin, delta, verdict


def same_run(a, b) -> bool:
    """Every token and every logprob alike."""
    return (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


def judge(cold, warm, reference, tie_margin: float) -> tuple[bool, int | None, float | None, float, str]:
    """:func:`compare`'s verdict, where a warm run that differs from the cold one is judged
    against ``reference`` (vLLM's own prefix-cache hit of the same length, or None): equal to
    it in every token and logprob -> "as vLLM's hit"."""
    identical, first, margin, delta, verdict = compare(cold, warm, tie_margin)
    if not identical and reference is not None and same_run(reference, warm):
        verdict = "as vLLM's hit"
    return identical, first, margin, delta, verdict


def _sum(rows: list[dict], key: str) -> list[int]:
    return [r[key] for r in rows]


def _loaded_tokens(llm) -> int:
    from vllm_kvplugin.adapters import offline
    from vllm_kvplugin.verify import worker_ops

    return sum(_sum(offline.on_workers(llm, worker_ops.load_counters), "loaded_tokens"))


def reference(llm, prompt: list[int], hit: int, max_tokens: int):
    """vLLM's own prefix-cache hit of ``prompt`` over its first ``hit`` tokens, where the
    caller's cold run left vLLM a longer one: both caches emptied, ``prompt[:hit + 1]``
    computed (vLLM keeps its ``hit`` tokens' blocks, the plugin stores their chunks from
    this prefill), then ``prompt`` on vLLM's hit.  Returns (the run, tokens the plugin loaded
    meanwhile: 0 for a reference that is vLLM's own)."""
    from vllm_kvplugin.adapters import offline

    offline.reset_prefix_cache(llm, connector=True)
    offline.generate(llm, prompt[:hit + 1], 1)
    before = _loaded_tokens(llm)
    ref = offline.generate(llm, prompt, max_tokens, logprobs=2)
    return ref, _loaded_tokens(llm) - before


def run(a: argparse.Namespace, rest: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler's plan is read here
    from vllm_kvplugin import counters
    from vllm_kvplugin.adapters import offline
    from vllm_kvplugin.planner import max_loadable_tokens
    from vllm_kvplugin.verify import worker_ops

    connector = json.loads(a.kv_transfer_config) if a.kv_transfer_config else {}
    connector = connector.get("kv_connector_extra_config", connector)
    if a.server:
        connector["server"] = a.server
    kw = engine_kwargs(rest)
    kw.setdefault("seed", 0)
    if a.tp > 1:
        kw["tensor_parallel_size"] = a.tp
    say = (lambda *x: None) if a.quiet else (lambda *x: print(*x, flush=True))
    say(f"vllm-kvplugin verify: starting {a.model} with KVPluginConnector {json.dumps(connector)}")
    llm = offline.build_llm(a.model, connector, **kw)
    try:
        ranks = offline.on_workers(llm, worker_ops.info)
        chunk, drafter = ranks[0]["chunk_size"], ranks[0]["drafter"]
        given = [_size(x) for x in a.lengths.split(",")] if a.lengths else None
        limit = kw.get("max_model_len")
        lengths = lengths_for(chunk, given, None if limit is None else int(limit) - a.max_tokens - 1)
        say(f"chunk {chunk} tokens; groups {ranks[0]['groups']}; {len(ranks)} rank(s) on {ranks[0]['device']}; "
            f"lengths {lengths}")
        if a.negative_control:
            offline.on_workers(llm, worker_ops.skip_loads, True)
            say("negative control: hits are claimed but not written (verify must fail)")
        offline.generate(llm, _tokens(min(lengths), 1), 1)  # warm-up, not measured
        rows: list[Row] = []
        for i, n in enumerate(lengths):
            say(f"{_bar(i, len(lengths))} {n} tokens")
            p = _tokens(n, 7 * n + 1)
            t0 = time.perf_counter()
            offline.generate(llm, _tokens(n, 7 * n + 2), 1)  # a cold first token: other tokens
            cold_ttft = time.perf_counter() - t0
            cold = offline.generate(llm, p, a.max_tokens, logprobs=2)
            expected = max(0, max_loadable_tokens(n, chunk) - (chunk if drafter else 0))
            before = _loaded_tokens(llm)
            ref = offline.generate(llm, p, a.max_tokens, logprobs=2)  # vLLM's hit on the blocks cold computed
            loaded = _loaded_tokens(llm) - before
            if expected and ref.num_cached_tokens != expected:
                ref, loaded = reference(llm, p, expected, a.max_tokens)
            offline.reset_prefix_cache(llm)
            offline.on_workers(llm, worker_ops.poison, n)
            before, plan0 = offline.on_workers(llm, worker_ops.load_counters), counters.SCHEDULER.snapshot()
            warm = offline.generate(llm, p, a.max_tokens, logprobs=2)
            after, plan1 = offline.on_workers(llm, worker_ops.load_counters), counters.SCHEDULER.snapshot()
            offline.reset_prefix_cache(llm)
            offline.on_workers(llm, worker_ops.poison, n + 1)
            t0 = time.perf_counter()
            offline.generate(llm, p, 1)  # a warm first token
            warm_ttft = time.perf_counter() - t0
            tokens = [y - x for x, y in zip(_sum(before, "loaded_tokens"), _sum(after, "loaded_tokens"))]
            moved = [y - x for x, y in zip(_sum(before, "loaded_bytes"), _sum(after, "loaded_bytes"))]
            failures = sum(_sum(after, "load_failures")) - sum(_sum(before, "load_failures"))
            planned = plan1["planned_load_bytes"] - plan0["planned_load_bytes"]
            hit = warm.num_cached_tokens
            proven = all(t == hit for t in tokens) and all(m == planned for m in moved) and not failures
            same = ref.num_cached_tokens == hit > 0 and not loaded  # the same compute, vLLM's own KV
            identical, first, margin, delta, verdict = judge(cold, warm, ref if same else None, a.tie_margin)
            detail = "" if proven else (f"loaded tokens per rank {tokens}, bytes {moved}, planned {planned}, "
                                        f"load failures {failures}")
            if hit and not proven:
                verdict = "NO LOAD" if verdict != "DIFFERENT" else verdict
            elif hit != expected:
                verdict = "SHORT HIT" if verdict != "DIFFERENT" else verdict
                detail = detail or f"hit {hit} tokens, the planner promises {expected}"
            as_hit = same_run(ref, warm) if same else None
            rows.append(Row(n, expected, hit, proven, identical, verdict, first, margin, delta,
                            round(cold_ttft, 4), round(warm_ttft, 4), as_hit, detail))
        say(f"{_bar(len(lengths), len(lengths))} done")
    finally:
        offline.shutdown(llm)
    ok = all(r.passed for r in rows)
    print(table(rows))
    print(f"\n{'PASS' if ok else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} lengths identical after "
          f"a load from the plugin ({a.model})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "connector": connector, "engine_args": kw, "chunk_size": chunk,
                       "ranks": ranks, "negative_control": a.negative_control, "passed": ok,
                       "rows": [asdict(r) for r in rows]}, f, indent=1, default=str)
    return 0 if ok else 1


def table(rows: list[Row]) -> str:
    head = ("length", "hit", "expected", "loads", "result", "divergence", "margin", "cold TTFT", "warm TTFT")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([
            str(r.length), str(r.hit), str(r.expected_hit), "proven" if r.loads_proven else "NOT PROVEN",
            r.verdict, "-" if r.first_divergence is None else f"token {r.first_divergence}",
            "-" if r.margin is None else f"{r.margin:.4f}", f"{r.cold_ttft_s:.3f} s", f"{r.warm_ttft_s:.3f} s"]))
    lines += [f"  {r.length}: {r.detail}" for r in rows if r.detail]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model (a local directory or a name vLLM can load)")
    p.add_argument("--kernels", action="store_true",
                   help="only certify the kernels against the layout reference on synthetic layouts (no model)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--server", default=None, help="a vllm-kvplugin server address (unix:///... or tcp://...)")
    p.add_argument("--lengths", default=None,
                   help="base prompt lengths, e.g. 4k,32k: each rounded to whole chunks m, then m-1, m, m+1 "
                        "(default: 1, 4, 16 and 64 chunks)")
    p.add_argument("--kv-transfer-config", default=None,
                   help="JSON: KVPluginConnector's kv_connector_extra_config, or a whole kv_transfer_config")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per run (default 16)")
    p.add_argument("--tie-margin", type=float, default=0.02,
                   help="a divergence where the cold run's top two logprobs were this close is a near tie "
                        "(default 0.02)")
    p.add_argument("--quiet", action="store_true", help="only the table and the verdict")
    p.add_argument("--negative-control", action="store_true", help=argparse.SUPPRESS)


def main(a: argparse.Namespace, rest: list[str]) -> int:
    if a.model is None:
        print("vllm-kvplugin verify: give --model M (any vLLM engine arguments may follow), or --kernels",
              file=sys.stderr)
        return 2
    return run(a, rest)
