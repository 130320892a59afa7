"""Where an engine's main thread runs during a batch, and a knob that gives it a core of its own.

On the H200's host the eager engine's one Python thread ran the same 0%-reuse batch in either
~3.5 s or ~5.7 s of CPU (2026-12-05, every mode alike, baseline included), and the batch's wall
time followed it: a 2% question cannot be settled through that.  One suspect is another thread
on the same physical core (an SMT sibling).  Two tools, for ``gpu_serving.py`` and ``gpu_ttft.py``:

* :class:`MainThreadWatch`, around a batch: every ``period_s`` a sampler thread reads which CPU the
  main thread is on and how busy the other logical CPUs of that core were since the last sample
  (``/proc/stat``).  Reported: the main thread's CPUs (share of samples), the mean busy share
  of its core's siblings, and the steal time of its CPU (the hypervisor running someone else
  on it: a neighbour no pinning inside the VM can move away from), so each batch's speed can be
  set against them.
* :func:`speed_probe`, before and after a batch: the time of a fixed piece of main-thread work
  (Python object work and small torch CPU calls, as an eager engine's thread does).  Pinning
  did not steady the host (the H100, 2026-12-05), so a CPU-bound batch's wall time can instead
  be set against how fast the same thread ran this probe around it.
* :func:`reserve_cores` / :func:`pin_main_thread` (``--pin-main``): the parent keeps one physical
  core per engine out of its own affinity (its children, the engines and a cache server, inherit
  that), and each engine, once built, moves its main thread onto the first CPU of its core.  A
  pinned watch also moves any thread started later by the main thread (it inherits the main's
  CPU) back to the shared CPUs; ``gpu_ttft.py`` keeps one running (``sample=False``) for the
  engine's life.

Linux only (``/proc``, ``/sys``, per-thread ``sched_setaffinity``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path


def physical_cores() -> list[tuple[int, ...]]:
    """The usable logical CPUs grouped by physical core (SMT siblings together), in CPU order."""
    allowed = os.sched_getaffinity(0)
    cores: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            sib = _cpu_list(path.read_text())
        except OSError:
            sib = [cpu]
        cores[tuple(c for c in sib if c in allowed)] = None
    return list(cores)


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def reserve_cores(n: int) -> list[tuple[int, ...]]:
    """Parent, before starting engines: the last ``n`` physical cores leave this process's
    affinity (every thread of it, so children inherit it); returns them, one per engine."""
    cores = physical_cores()
    if len(cores) < n + 2:
        raise RuntimeError(f"--pin-main: {len(cores)} physical cores cannot give {n} engines one each "
                           "and leave two for everything else")
    reserved = cores[-n:]
    rest = set(os.sched_getaffinity(0)) - {c for core in reserved for c in core}
    for tid in _tids():
        os.sched_setaffinity(tid, rest)
    return reserved


#: the CPUs every thread but the main one runs on, once :func:`pin_main_thread` ran
_shared: set[int] | None = None


def pin_main_thread(cpu: int) -> None:
    """Child, on its main thread once the engine is built: this thread runs on ``cpu`` only."""
    global _shared
    assert threading.current_thread() is threading.main_thread()
    _shared = set(os.sched_getaffinity(0)) - {cpu}
    os.sched_setaffinity(0, {cpu})  # 0: the calling thread


def speed_probe(repeats: int = 5) -> float:
    """Seconds of one fixed piece of work on the calling thread (20,000 dict stores of small
    tuples, 2,000 torch additions of 64 floats), the fastest of ``repeats``: the same work
    every call, so its time says how fast this host runs the thread now."""
    import torch

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        d: dict[int, tuple[int, str]] = {}
        for i in range(20_000):
            d[i & 1023] = (i, str(i))
        a = torch.ones(64)
        for _ in range(2_000):
            a = a + 1
        best = min(best, time.perf_counter() - t0)
    return best


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _busy_per_cpu() -> dict[int, tuple[int, int, int]]:
    """(busy, total, steal) jiffies per CPU from ``/proc/stat`` (steal: time the hypervisor gave
    this virtual CPU's turn to someone else; counted in busy too)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            name, *vals = line.split()
            v = [int(x) for x in vals[:8]]
            idle = v[3] + v[4]
            out[int(name[3:])] = (sum(v) - idle, sum(v), v[7])
    return out


class MainThreadWatch:
    """A sampler thread around one batch (``with MainThreadWatch() as w: ...; w.result()``)."""

    def __init__(self, period_s: float = 0.05, pinned: int | None = None, sample: bool = True):
        self.period_s = period_s
        self.sample = sample
        self.pinned = pinned  # the main thread's own CPU under --pin-main
        self._main = threading.main_thread().native_id
        self._siblings = {c: core for core in physical_cores() for c in core}
        self._cpus: Counter[int] = Counter()
        self._sibling_busy: list[float] = []
        self._steal: list[float] = []  # the main thread's CPU's share of steal time
        self._moved = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-main-watch", daemon=True)

    def __enter__(self) -> MainThreadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _main_cpu(self) -> int | None:
        try:
            text = Path(f"/proc/self/task/{self._main}/stat").read_text()
            return int(text.rsplit(")", 1)[1].split()[36])  # field 39: processor last run on
        except (OSError, IndexError, ValueError):
            return None

    def _run(self) -> None:
        if self.pinned is not None:  # started by the pinned main thread: off its CPU first
            os.sched_setaffinity(0, _shared)
        last = _busy_per_cpu() if self.sample else {}
        while not self._stop.wait(self.period_s):
            if self.pinned is not None:
                self._unpin_others()
            if not self.sample:
                continue
            now, cpu = _busy_per_cpu(), self._main_cpu()
            if cpu is not None:
                self._cpus[cpu] += 1
                if cpu in now and cpu in last:
                    self._steal.append((now[cpu][2] - last[cpu][2]) / max(1, now[cpu][1] - last[cpu][1]))
                sib = [c for c in self._siblings.get(cpu, (cpu,)) if c != cpu and c in now and c in last]
                if sib:
                    shares = [(now[c][0] - last[c][0]) / max(1, now[c][1] - last[c][1]) for c in sib]
                    self._sibling_busy.append(sum(shares) / len(shares))
            last = now

    def _unpin_others(self) -> None:
        """Threads started by the pinned main thread inherit its CPU: back to the shared ones."""
        for tid in _tids():
            try:
                if tid != self._main and self.pinned in os.sched_getaffinity(tid):
                    os.sched_setaffinity(tid, _shared)
                    self._moved += 1
            except OSError:
                pass  # the thread ended

    def result(self) -> dict:
        n = sum(self._cpus.values())
        return {"main_cpus": {str(c): round(k / n, 2) for c, k in self._cpus.most_common(4)} if n else {},
                "main_core_sibling_busy": round(sum(self._sibling_busy) / len(self._sibling_busy), 3)
                if self._sibling_busy else None,
                "main_cpu_steal": round(sum(self._steal) / len(self._steal), 3) if self._steal else None,
                "threads_moved_off_main_cpu": self._moved}
