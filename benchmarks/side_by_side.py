"""Engines of several modes alive at once, asked in turn: a side-by-side comparison on a noisy host.

One batch of one engine moved by up to 25% between batches on the H200's host (a shared VM),
all engines alike, over minutes: modes run one after another in separate processes cannot be
ranked within a few percent.  Here every mode's engine is started first (each in its own
process, all at once) and then asked for one batch at a time, the modes in turn, so that
each round's batches ran within seconds of each other and their ratio is taken per round.

Parent side: :class:`Resident` (start, wait for ``READY``, ``ask``, ``close``).  Child side:
:func:`serve` reads one command per stdin line and answers one ``RESULT {json}`` line on stdout
(vLLM's own log lines may come in between; they are skipped).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

READY = "READY"
RESULT = "RESULT "


class Resident:
    """A child process ``python script --child MODE --resident ARGS...`` holding one engine.

    Its stdout is drained by a thread (a child blocked on a full pipe would stall), its stderr
    goes to ``log_dir/MODE.err``.
    """

    def __init__(self, script: str, mode: str, args: Sequence[str], log_dir: Path):
        self.mode = mode
        log_dir.mkdir(parents=True, exist_ok=True)
        self.err_path = log_dir / f"{mode}.err"
        self._err = open(self.err_path, "w")
        self.proc = subprocess.Popen([sys.executable, script, "--child", mode, "--resident", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith((READY, RESULT)):
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # the child exited

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.mode}: no answer within {timeout:.0f} s") from None
        if line is None:
            tail = self.err_path.read_text()[-3000:]
            raise RuntimeError(f"{self.mode}: engine process exited ({self.proc.wait()}):\n{tail}")
        return line

    def wait_ready(self, timeout: float = 600) -> None:
        line = self._next(timeout)
        if line != READY:
            raise RuntimeError(f"{self.mode}: expected {READY}, got {line[:200]}")

    def ask(self, command: str, timeout: float = 600) -> dict:
        """Send one command line; the child's answer (its ``RESULT`` JSON)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self._next(timeout)
        if not line.startswith(RESULT):
            raise RuntimeError(f"{self.mode}: expected a result, got {line[:200]}")
        return json.loads(line[len(RESULT):])

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.close()  # the child's loop ends at end of input
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._err.close()


def start_all(script: str, modes: Sequence[str], args_for: Callable[[str], list[str]], log_dir: Path,
              timeout: float = 900) -> dict[str, Resident]:
    """Every mode's engine started at once; returns when all are ready (raises, all stopped, if one fails)."""
    engines = {m: Resident(script, m, args_for(m), log_dir) for m in modes}
    try:
        for e in engines.values():
            e.wait_ready(timeout)
    except BaseException:
        for e in engines.values():
            e.proc.kill()
            e.close()
        raise
    return engines


@contextmanager
def running(script: str, modes: Sequence[str], args_for: Callable[[str], list[str]], log_dir: Path,
            server: subprocess.Popen | None = None) -> Iterator[dict[str, Resident]]:
    """:func:`start_all`; on exit, however it ends (an engine failing to start included), every
    engine closed and ``server`` (a cache server the engines use) stopped."""
    engines: dict[str, Resident] = {}
    try:
        engines = start_all(script, modes, args_for, log_dir)
        yield engines
    finally:
        for e in engines.values():
            e.close()
        if server is not None:
            server.terminate()
            server.wait(30)


def serve(handle: Callable[[str], dict]) -> None:
    """Child side, after the engine is built and warmed up: ``READY``, then one ``RESULT`` line
    per command line read from stdin, until end of input."""
    print(READY, flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line:
            print(RESULT + json.dumps(handle(line)), flush=True)
