"""Where a request's time goes, per stage, in a benchmark's engine process (GPU).

``StageTimers().install()`` wraps, in this process only and before the engine is made:

* ``step``      - each engine step (host wall time, ``EngineCore.step`` or, with async
  scheduling, ``step_with_batch_queue``);
* ``forward``   - the model runner's ``execute_model`` (CUDA events on the compute stream);
* ``fetch``     - the worker's fetch of a held-back hit: header checks, hashing, the prefetch
  issued (host wall time);
* ``verify``    - a fetch's payload hashes or device digests, from their start until the last
  is in (host wall time; they run on the hashing threads or the device while the engine goes on);
* ``h2d``       - the prefetch's copy over the link (CUDA events on the engine's H2D stream);
* ``digest``    - the prefetch's payload digests on the device, from their issue (they wait for
  the copy) until their values are on the host (CUDA events on the engine's digest stream);
* ``load``      - a claimed load, whole (CUDA events on the compute stream), of which
  ``scatter`` is the part from the device staging into the paged cache (from the entry of its
  call: the host's work up to the launch included) and ``scatter_kernel`` the scatter op's own
  kernels (``scatter_call``: that op's call on the host);
* ``store_issue`` - the worker's ``store`` call (host: gathers and DMAs issued);
* ``alloc``     - staging buffers allocated by the transfer engine (host wall time);
* ``server_lookup`` - a lookup on the cache server, on the index thread (host wall time: from the
  match's start to it, the hand-off to that thread; its end to the fetch, the hand-off back and
  the planning);
* host wall time of the scheduler (``schedule``, ``update``), the connector's scheduler hooks
  (``match``, ``build_meta``), the model runner's calls (``execute_host``, ``sample_host``) and
  the worker's (``start_load``, ``load_host``, ``bind``, ``take_meta``); ``sample`` on the device;
  between a lone hit's last byte and its scatter's launch, on the host: ``settle`` (the verdict),
  ``digest_result`` (the device digests read), ``take_verdicts`` and ``claim`` (the scheduler's),
  ``placed`` (the objects' block ids gathered), ``slot_check`` (per-token slots checked: only
  where the scatter is not given block ids) and ``staged_host`` (``_load_staged``'s call);
  of ``load_host``, ``load_issue`` is the transfer engine's part (the scatter's checks and launch:
  the rest is the worker's Python around it), and ``after_alloc`` is the scheduler hook that
  issues a lone hit's load (vLLM's own allocation of the hit's blocks is the gap between
  ``match``'s end and it).

``reset()`` before a request, ``collect()`` after it (synchronizes the device): seconds per
stage (summed), the count of each, and a ``timeline``: every interval as ``[stage, start_ms,
end_ms]`` from the reset, host and device on one clock (a CUDA event recorded at the reset, the
device idle, marks the host's time zero); a wrapped call's interval has a fourth value, the CPU
time its thread spent in it (ms: less than the interval when it waited -- the GIL, a lock, the device),
and Python's garbage collections of generations 1 and 2 appear as ``gc1``/``gc2`` (those of
generation 0 only in the sums, as ``gc0``).
Benchmark-only: the plugin itself is unchanged.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections import defaultdict


def _model_runners(v1) -> list[type]:
    """vLLM's model runner classes: V1's, and V2's where this vLLM has it (0.26 runs a dense
    model on V2 by default, so wrapping V1's alone timed no forward)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    except ImportError:
        return [v1]
    return [v1, V2]


class StageTimers:
    def __init__(self):
        self._host: dict[str, list[float]] = defaultdict(list)
        self._cuda: dict[str, list[tuple[object, object]]] = defaultdict(list)
        self._local = threading.local()
        self._t0 = time.perf_counter()
        self._ref = None  # CUDA event at the reset: the device's time zero
        self._spans: dict[str, list[tuple[float, ...]]] = defaultdict(list)
        self._gc_start: dict[int, float] = {}

    # ---------------------------------------------------------------- wrappers
    def _wrap_host(self, owner, name: str, stage: str, flag: str | None = None) -> None:
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def timed(*a, **k):
            if flag:
                setattr(self._local, flag, True)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                self._host[stage].append(t1 - t0)
                self._spans[stage].append((t0 - self._t0, t1 - self._t0, c1 - c0))
                if flag:
                    setattr(self._local, flag, False)
        setattr(owner, name, timed)

    def _wrap_cuda(self, owner, name: str, stage: str, stream_of) -> None:
        import torch

        orig = getattr(owner, name)

        @functools.wraps(orig)
        def timed(obj, *a, **k):
            stream = stream_of(obj)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out = orig(obj, *a, **k)
            end.record(stream)
            self._cuda[stage].append((start, end))
            return out
        setattr(owner, name, timed)

    def install(self) -> StageTimers:
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        from vllm_kvplugin.chunk.checksums import join_checksums
        from vllm_kvplugin.connector import worker as wmod
        from vllm_kvplugin.connector import worker_fetch as fmod
        from vllm_kvplugin.connector.scheduler import SchedulerSide
        from vllm_kvplugin.tiers.mp import ServerIndex
        from vllm_kvplugin.transfer.cuda import CudaTransfer

        self._wrap_host(EngineCore, "step", "step")
        self._wrap_host(EngineCore, "step_with_batch_queue", "step")
        for runner in _model_runners(GPUModelRunner):
            self._wrap_cuda(runner, "execute_model", "forward", lambda _: torch.cuda.current_stream())
            self._wrap_cuda(runner, "sample_tokens", "sample", lambda _: torch.cuda.current_stream())
            self._wrap_host(runner, "execute_model", "execute_host")
            self._wrap_host(runner, "sample_tokens", "sample_host")
        for owner, name, stage in ((Scheduler, "schedule", "schedule"), (Scheduler, "update_from_output", "update"),
                                   (SchedulerSide, "get_num_new_matched_tokens", "match"),
                                   (SchedulerSide, "build_connector_meta", "build_meta"),
                                   (SchedulerSide, "update_state_after_alloc", "after_alloc"),
                                   (wmod.WorkerSide, "start_load", "start_load"), (wmod.WorkerSide, "_load", "load_host"),
                                   (wmod.WorkerSide, "bind", "bind"), (wmod.WorkerSide, "take_meta", "take_meta")):
            self._wrap_host(owner, name, stage)
        self._wrap_host(wmod.WorkerSide, "_fetch", "fetch", flag="in_fetch")
        self._wrap_host(wmod.WorkerSide, "store", "store_issue")
        self._wrap_host(ServerIndex, "lookup", "server_lookup")
        orig_start, orig_digest, timed_fetch = fmod.start_payload_checksums, CudaTransfer.digest, wmod.WorkerSide._fetch

        def note(sums):  # a fetch's hashes or device digests (it may start them in parts)
            if sums is not None and getattr(self._local, "in_fetch", False):
                if not self._local.verify_parts:
                    self._local.verify_t0 = time.perf_counter()
                self._local.verify_parts.append(sums)
            return sums

        def start(payloads):
            return note(orig_start(payloads))

        def digest(engine, pre):
            return note(orig_digest(engine, pre))

        def fetch(worker, *a, **k):  # verify: from its first hash's start until its last is in
            self._local.verify_parts = []
            try:
                return timed_fetch(worker, *a, **k)
            finally:
                parts, t0 = self._local.verify_parts, getattr(self._local, "verify_t0", 0.0)
                self._local.verify_parts = []

                def done(t0=t0):
                    t1 = time.perf_counter()
                    self._host["verify"].append(t1 - t0)
                    self._spans["verify"].append((t0 - self._t0, t1 - self._t0))
                if parts:
                    join_checksums(parts).when_done(done)
        fmod.start_payload_checksums = start
        CudaTransfer.digest = digest
        wmod.WorkerSide._fetch = fetch
        gc.callbacks.append(self._on_gc)
        self._wrap_cuda(CudaTransfer, "prefetch", "h2d", lambda e: e._h2d)
        self._wrap_cuda(CudaTransfer, "digest", "digest", lambda e: e._dig)
        self._wrap_host(CudaTransfer, "_alloc", "alloc")
        self._wrap_cuda(CudaTransfer, "load", "load", lambda _: torch.cuda.current_stream())
        self._wrap_host(CudaTransfer, "load", "load_issue")
        self._wrap_cuda(CudaTransfer, "_load_staged", "scatter", lambda _: torch.cuda.current_stream())
        # the scatter op alone (``scatter`` starts at ``_load_staged``'s entry, on the compute stream,
        # idle before a lone hit's forward, so the host's work before the launch is in it): its
        # kernels, and its call on the host
        self._wrap_cuda(CudaTransfer, "_scatter", "scatter_kernel", lambda _: torch.cuda.current_stream())
        self._wrap_host(CudaTransfer, "_scatter", "scatter_call")
        # the pieces between the copy's last byte and the scatter's launch, each on the host
        from vllm_kvplugin.transfer.cuda_handles import DeviceDigests
        for owner, name, stage in ((fmod.FetchPath, "_settle", "settle"), (DeviceDigests, "result", "digest_result"),
                                   (SchedulerSide, "_take_verdicts", "take_verdicts"), (SchedulerSide, "_claim", "claim"),
                                   (wmod.WorkerSide, "placed", "placed"), (CudaTransfer, "_check", "slot_check"),
                                   (CudaTransfer, "_load_staged", "staged_host")):
            self._wrap_host(owner, name, stage)
        return self

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_start[threading.get_ident()] = now
            return
        t0 = self._gc_start.pop(threading.get_ident(), None)
        if t0 is not None:
            stage = f"gc{info.get('generation', '')}"
            self._host[stage].append(now - t0)
            if stage != "gc0":  # the youngest generation's are many and short: summed only
                self._spans[stage].append((t0 - self._t0, now - self._t0))

    # ------------------------------------------------------------------ results
    def reset(self) -> None:
        import torch

        self._host.clear()
        self._cuda.clear()
        self._spans.clear()
        torch.cuda.synchronize()
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record()
        self._t0 = time.perf_counter()

    def collect(self) -> dict:
        """Seconds per stage (summed over the request) and how many of each."""
        import torch

        torch.cuda.synchronize()
        out = {}
        for stage, times in self._host.items():
            out[stage] = {"s": round(sum(times), 5), "n": len(times)}
        for stage, pairs in self._cuda.items():
            out[stage] = {"s": round(sum(a.elapsed_time(b) for a, b in pairs) / 1e3, 5), "n": len(pairs)}
        if "step" in self._host:
            out["steps_s"] = [round(t, 5) for t in self._host["step"]]
        spans = [(stage, *(x * 1e3 for x in span)) for stage, ss in self._spans.items() for span in ss]
        if self._ref is not None:
            spans += [(stage, self._ref.elapsed_time(a), self._ref.elapsed_time(b))
                      for stage, pairs in self._cuda.items() for a, b in pairs]
        out["timeline"] = [[stage, *(round(x, 2) for x in span)] for stage, *span in sorted(spans, key=lambda x: x[1])]
        self.reset()
        return out
