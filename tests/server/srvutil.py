"""Helpers of the server tests: a server subprocess, deterministic chunk objects, store/load."""

from __future__ import annotations

import ctypes
import hashlib
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import xxhash

from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, pack_header, payload_checksum
from vllm_kvplugin.server.protocol import object_id, split_object_id
from vllm_kvplugin.tiers.mp_client import MPClient

PY = sys.executable


def _die_with_parent() -> None:
    """In the server's child, before exec: SIGKILL when the test process dies (a crashed or
    killed test worker must not leave a server, and its pool's memory, behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ServerProc:
    """``python -m vllm_kvplugin.server`` as a subprocess; stderr goes to a log file."""

    def __init__(self, workdir: str, *args: str, listen: str | None = None, env: dict | None = None):
        self.workdir = workdir
        self.listen = listen if listen is not None else f"unix://{workdir}/s.sock"
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.banner = ""
        self.starts = 0

    def start(self, timeout: float = 20.0) -> ServerProc:
        argv = [PY, "-m", "vllm_kvplugin.server"]
        if self.listen:
            argv += ["--listen", self.listen]
        argv += self.args
        self.starts += 1
        self.log = open(os.path.join(self.workdir, f"server-{self.starts}.log"), "w")
        env = dict(os.environ if self.env is None else self.env)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if r:
                self.banner = self.proc.stdout.readline()
                break
            if self.proc.poll() is not None:
                break
        if "listening on " not in self.banner:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"server did not start: {self.banner!r}\n{self.read_log()}")
        self.address = self.banner.split("listening on ", 1)[1].split(" ", 1)[0]
        self.pid = self.proc.pid
        return self

    def read_log(self) -> str:
        with open(os.path.join(self.workdir, f"server-{self.starts}.log")) as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


# ---------------------------------------------------------------------------- objects
def keys_for(prefix_seed: int, n: int) -> list[bytes]:
    """Rolling 32-byte keys (like chunk/keys.py: each names its whole prefix)."""
    prev = prefix_seed.to_bytes(8, "little") * 4
    out = []
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def payload_for(oid: bytes, nbytes: int) -> bytes:
    rng = np.random.default_rng(int.from_bytes(xxhash.xxh3_64_digest(oid), "little"))
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()


def make_object(oid: bytes, nbytes: int) -> tuple[bytes, bytes]:
    key, g, r, w = split_object_id(oid)
    pl = payload_for(oid, nbytes)
    return pack_header(key=key, group=g, rank=r, world=w, payload_nbytes=nbytes,
                       checksum=payload_checksum(pl)), pl


def oids_for(keys: list[bytes], groups: int, ranks: int, world: int) -> list[bytes]:
    return [object_id(k, g, r, world) for k in keys for g in range(groups) for r in range(ranks)]


def store(c: MPClient, oids: list[bytes], nbytes: int, batch: int = 512) -> list[bool]:
    """Reserve, write, commit; True per object committed by this call."""
    out: list[bool] = []
    for i in range(0, len(oids), batch):
        part = oids[i:i + batch]
        offs = c.reserve([(o, HEADER_SIZE + nbytes) for o in part])
        done, res = [], []
        for o, off in zip(part, offs):
            if off is None:
                continue
            h, pl = make_object(o, nbytes)
            c.write_object(off, h, pl)
            done.append(o)
            res.append(off)
        ok = dict(zip(done, c.commit(done, res)))
        out += [ok.get(o, False) for o in part]
    return out


def load_and_check(c: MPClient, keys: list[bytes], groups: int, ranks: int, world: int,
                   nbytes: int, release: bool = True) -> tuple[int, int]:
    """Lookup, resolve every (group, rank), compare bytes with what was stored; (hits, lease)."""
    hits, lease = c.lookup(keys, groups, ranks, world)
    total = 0
    for g in range(groups):
        for r in range(ranks):
            got = c.resolve(lease, keys[:hits], g, r, world) if hits else []
            assert len(got) == hits
            for k, (off, n) in zip(keys[:hits], got):
                oid = object_id(k, g, r, world)
                h, pl = make_object(oid, nbytes)
                assert n == HEADER_SIZE + nbytes
                view = c.object_view(off, n)
                assert bytes(view[:HEADER_SIZE]) == h, f"header of {oid.hex()} differs"
                assert bytes(view[HEADER_SIZE:]) == pl, f"payload of {oid.hex()} differs"
                total += n
    if release and hits:
        rep = c.release(lease)
        assert rep.found and rep.pinned_bytes == rep.resolved_bytes == total
    return hits, lease


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
