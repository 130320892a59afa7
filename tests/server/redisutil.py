"""Real ``redis-server`` processes for the remote-tier tests: one node, or a 3-node cluster."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time

from srvutil import _die_with_parent


def _below_ephemeral() -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 on most Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def free_port() -> int:
    """A free port whose +10000 is free too (a cluster node's bus port), both below the
    ephemeral range: a test may pick a port and start its server seconds later, and a port in
    that range can be taken meanwhile by any outgoing connection on the machine. Each xdist
    worker draws from a range of its own."""
    top = min(_below_ephemeral(), 60000) - 10000
    lo = 12000
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n_workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    idx = int(worker[2:]) if worker[2:].isdigit() else 0
    width = max(1, (top - lo) // n_workers)
    start = lo + (idx % n_workers) * width
    for _ in range(200):
        port = random.randrange(start, start + width)
        if port in _handed_out:  # not bound yet by the process it was handed to
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port pair")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:  # CI installs it (.ci/run): a missing binary is a broken machine, not a skip
        raise RuntimeError("the remote-tier tests need redis-server on PATH (apt-get install redis-server)")
    return path


class RedisProc:
    """One ``redis-server`` on 127.0.0.1, no persistence, its files under ``workdir``."""

    def __init__(self, workdir: str, *extra: str, port: int | None = None, cluster: bool = False,
                 password: str | None = None, tls: bool = False):
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.dir = os.path.join(workdir, f"redis-{self.port}")
        self.extra = list(extra)
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> str:
        return os.path.join(self.dir, "ca.crt")

    def _make_certs(self) -> list[str]:
        """A CA and a server certificate for 127.0.0.1 (openssl); the TLS flags."""
        d = self.dir

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=kvplugin-test-ca")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
        with open(os.path.join(d, "ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "srv.crt", "-days", "2", "-extfile", "ext")
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", "srv.crt", "--tls-key-file",
                "srv.key", "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"]

    def start(self, timeout: float = 10.0) -> RedisProc:
        os.makedirs(self.dir, exist_ok=True)
        port = self._make_certs() if self.tls else ["--port", str(self.port)]
        argv = [redis_binary(), *port, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no", *self.extra]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000", "--cluster-replica-validity-factor", "0"]
        self.log = open(os.path.join(self.dir, "redis.log"), "a")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cli("PING").strip() == "PONG":
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start: "
                           f"{open(os.path.join(self.dir, 'redis.log')).read()[-2000:]}")

    def cli(self, *args: str) -> str:
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        if self.tls:
            auth += ["--tls", "--cacert", self.ca_file]
        r = subprocess.run(["redis-cli", "-p", str(self.port), *auth, *args], capture_output=True, text=True,
                           timeout=10)
        return r.stdout

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()


class RedisCluster:
    """``n`` masters with ``replicas`` replicas each, slots spread by ``redis-cli --cluster create``."""

    def __init__(self, workdir: str, n: int = 3, replicas: int = 0):
        self.replicas = replicas
        self.nodes = [RedisProc(workdir, cluster=True) for _ in range(n * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for n in self.nodes:
            n.start()
        r = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout}\n{r.stderr}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy() and all("master_link_status:up" in n.cli("INFO", "replication")
                                      for n in self.nodes if n not in self.masters()):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def healthy(self) -> bool:
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        return all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in live)

    def masters(self) -> list[RedisProc]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None
                and "role:master" in n.cli("INFO", "replication")]

    def keys_per_node(self, pattern: str = "*") -> list[int]:
        return [len([k for k in n.cli("--scan", "--pattern", pattern).split() if k]) for n in self.nodes]

    def kill9(self) -> None:
        for n in self.nodes:
            n.kill9()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
