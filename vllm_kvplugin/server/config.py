"""``vllm-kvplugin server`` flags -> :class:`ServerConfig` (typed, frozen, validated)."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from vllm_kvplugin.server.auth import AuthError, read_token
from vllm_kvplugin.server.protocol import Address, default_address, parse_address
from vllm_kvplugin.server.remote import (
    PASSWORD_ENV,
    RemoteConfig,
    RemoteConfigError,
    parse_remote_url,
    read_password,
)


class ServerConfigError(ValueError):
    """A bad flag; the message names the flag and the value."""


@dataclass(frozen=True)
class ServerConfig:
    listen: Address
    l1_bytes: int = 4 << 30
    l2_dir: str | None = None
    l2_bytes: int = 64 << 30
    token: str | None = None
    lease_s: float = 30.0
    heartbeat_s: float = 2.0
    reserve_s: float = 60.0
    quarantine_s: float = 10.0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    shm_dir: str = "/dev/shm"
    l2_readers: int = 2
    prefault: bool = False
    log_level: str = "INFO"
    remote: RemoteConfig | None = None
    allow_gid: int | None = None  # processes of other users in this group may use the server

    @property
    def reap_s(self) -> float:
        """A client silent for longer than this is reaped (3 heartbeat periods)."""
        return 3.0 * self.heartbeat_s


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``4294967296``, ``4GiB``, ``4G`` (= GiB), ``512MB``, ``1.5GiB``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 4GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-kvplugin server",
        description="The node-local KV cache server shared by every vLLM engine and rank on this machine.")
    p.add_argument("--listen", default=None,
                   help="unix socket path, unix:///path, or tcp://127.0.0.1:PORT "
                        f"(default {default_address()})")
    p.add_argument("--l1-bytes", default="4GiB",
                   help="size of the shared-memory pool (L1), allocated at start (default 4GiB)")
    p.add_argument("--l2-dir", default=None, help="directory of the L2 chunk files (default: no L2)")
    p.add_argument("--l2-bytes", default="64GiB", help="byte budget of L2 (default 64GiB)")
    p.add_argument("--token-file", default=None,
                   help="file holding the shared secret (>= 16 characters, mode 0600) every client must "
                        "prove it knows; required for any TCP address. Default: $VLLM_KVPLUGIN_TOKEN")
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: argv is public
    p.add_argument("--allow-gid", type=int, default=None,
                   help="also serve processes of other users in this group (Unix socket only): the socket's "
                        "directory, the socket and the pool are given to the group; this user must be in it")
    p.add_argument("--lease-s", type=float, default=30.0,
                   help="a lookup pins what it found for this long after its last use (default 30)")
    p.add_argument("--heartbeat-s", type=float, default=2.0,
                   help="client heartbeat period; silent for 3 periods = reaped (default 2)")
    p.add_argument("--reserve-s", type=float, default=60.0,
                   help="an uncommitted reservation is reclaimed after this long (default 60)")
    p.add_argument("--quarantine-s", type=float, default=10.0,
                   help="memory reclaimed from a reaped or timed-out writer is not reused for this long "
                        "(default 10)")
    p.add_argument("--high-watermark", type=float, default=0.95,
                   help="evict when L1 use exceeds this fraction of --l1-bytes (default 0.95)")
    p.add_argument("--low-watermark", type=float, default=0.85,
                   help="... down to this fraction (default 0.85)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the pool file is created (default /dev/shm)")
    p.add_argument("--prefault", action="store_true",
                   help="clients map the pool populated (no first-touch page faults in the engines); the "
                        "pool's pages are always allocated at start")
    p.add_argument("--l2-readers", type=int, default=2, help="threads reading L2 files (default 2)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    r = p.add_argument_group("remote tier (a Redis / Valkey store shared by servers on many machines)")
    r.add_argument("--remote", default=None,
                   help="redis://HOST:PORT[/DB], rediss://... (TLS) or redis+cluster://HOST:PORT[,HOST:PORT...] "
                        "(default: no remote tier)")
    r.add_argument("--remote-password-file", default=None,
                   help=f"file holding the store's password (mode 0600). Default: ${PASSWORD_ENV}")
    r.add_argument("--remote-bytes", default="16GiB",
                   help="the most bytes this prefix may hold in the store, every server's objects together "
                        "(default 16GiB)")
    r.add_argument("--remote-ttl-s", type=float, default=86400.0,
                   help="an object expires from the store this long after it was written (default 86400)")
    r.add_argument("--remote-timeout-s", type=float, default=2.0,
                   help="timeout of each call to the store (default 2)")
    r.add_argument("--remote-tls-ca-file", default=None, help="CA bundle for rediss:// (default: the system's)")
    r.add_argument("--remote-prefix", default="vllm-kvplugin",
                   help="the store's key prefix: servers share objects under the same prefix (default vllm-kvplugin)")
    return p


def _flag_error(flag: str, value, why: str) -> ServerConfigError:
    return ServerConfigError(f"{flag} {value!r}: {why}")


def config_from_args(argv: list[str] | None) -> ServerConfig:
    """Parse flags; raises :class:`ServerConfigError` (argparse's own errors exit with status 2)."""
    a = build_parser().parse_args(argv)
    try:
        listen = parse_address(a.listen or default_address())
    except ValueError as exc:
        raise _flag_error("--listen", a.listen, str(exc)) from None
    sizes = {}
    for flag, value in (("--l1-bytes", a.l1_bytes), ("--l2-bytes", a.l2_bytes)):
        try:
            sizes[flag] = parse_bytes(value)
        except ValueError as exc:
            raise _flag_error(flag, value, str(exc)) from None
    l1, l2 = sizes["--l1-bytes"], sizes["--l2-bytes"]
    if l1 < (1 << 20):
        raise _flag_error("--l1-bytes", a.l1_bytes, "must be at least 1MiB")
    if a.l2_dir is not None and l2 <= 0:
        raise _flag_error("--l2-bytes", a.l2_bytes, "must be > 0 with --l2-dir")
    if a.token is not None:
        raise _flag_error("--token", "***", "a secret on the command line is readable by every local user "
                          "(/proc/PID/cmdline): use --token-file FILE (mode 0600) or $VLLM_KVPLUGIN_TOKEN")
    try:
        token = read_token(a.token_file, "--token-file")
    except AuthError as exc:
        raise ServerConfigError(str(exc)) from None
    if listen.kind == "tcp" and not token:
        raise _flag_error("--listen", a.listen,
                          "every TCP address (loopback too: any local user reaches it) needs a token: "
                          "--token-file FILE (mode 0600) or $VLLM_KVPLUGIN_TOKEN; or use a Unix socket")
    for flag, value in (("--lease-s", a.lease_s), ("--heartbeat-s", a.heartbeat_s),
                        ("--reserve-s", a.reserve_s)):
        if not value > 0:
            raise _flag_error(flag, value, "must be > 0")
    if a.quarantine_s < 0:
        raise _flag_error("--quarantine-s", a.quarantine_s, "must be >= 0")
    if not 0 < a.high_watermark <= 1:
        raise _flag_error("--high-watermark", a.high_watermark, "must be in (0, 1]")
    if not 0 <= a.low_watermark <= a.high_watermark:
        raise _flag_error("--low-watermark", a.low_watermark,
                          f"must be in [0, --high-watermark={a.high_watermark}]")
    if not os.path.isdir(a.shm_dir):
        raise _flag_error("--shm-dir", a.shm_dir, "is not a directory")
    if a.l2_readers < 1:
        raise _flag_error("--l2-readers", a.l2_readers, "must be >= 1")
    remote = _remote_config(a)
    if a.allow_gid is not None:
        if listen.kind != "unix":
            raise _flag_error("--allow-gid", a.allow_gid, "applies to Unix sockets (a TCP server is shared "
                              "through its token)")
        if os.geteuid() != 0 and a.allow_gid not in {os.getgid(), *os.getgroups()}:
            raise _flag_error("--allow-gid", a.allow_gid, f"this user (uid {os.getuid()}) is not in the group")
    l2_dir = os.path.abspath(os.path.expanduser(a.l2_dir)) if a.l2_dir else None
    if l2_dir and os.path.exists(l2_dir) and not os.path.isdir(l2_dir):
        raise _flag_error("--l2-dir", a.l2_dir, "exists and is not a directory")
    return ServerConfig(listen=listen, l1_bytes=l1, l2_dir=l2_dir, l2_bytes=l2, token=token,
                        lease_s=a.lease_s, heartbeat_s=a.heartbeat_s, reserve_s=a.reserve_s,
                        quarantine_s=a.quarantine_s, high_watermark=a.high_watermark,
                        low_watermark=a.low_watermark, shm_dir=a.shm_dir, l2_readers=a.l2_readers, prefault=a.prefault,
                        log_level=a.log_level, remote=remote, allow_gid=a.allow_gid)


def _remote_config(a: argparse.Namespace) -> RemoteConfig | None:
    if a.remote is None:
        return None
    try:
        rc = parse_remote_url(a.remote, read_password(a.remote_password_file))
        budget = parse_bytes(a.remote_bytes)
    except (RemoteConfigError, ValueError) as exc:
        raise ServerConfigError(str(exc) if isinstance(exc, RemoteConfigError)
                                else f"--remote-bytes {a.remote_bytes!r}: {exc}") from None
    if budget < (1 << 20):
        raise _flag_error("--remote-bytes", a.remote_bytes, "must be at least 1MiB")
    for flag, value in (("--remote-ttl-s", a.remote_ttl_s), ("--remote-timeout-s", a.remote_timeout_s)):
        if not value > 0:
            raise _flag_error(flag, value, "must be > 0")
    if a.remote_ttl_s < 1:
        raise _flag_error("--remote-ttl-s", a.remote_ttl_s, "must be at least 1 (the store counts milliseconds)")
    if not a.remote_prefix or any(c in a.remote_prefix for c in "{}: "):
        raise _flag_error("--remote-prefix", a.remote_prefix, "must be non-empty without '{', '}', ':' or spaces")
    if a.remote_tls_ca_file and not rc.tls:
        raise _flag_error("--remote-tls-ca-file", a.remote_tls_ca_file, "needs a rediss:// address")
    import dataclasses

    return dataclasses.replace(rc, budget_bytes=budget, ttl_s=a.remote_ttl_s, timeout_s=a.remote_timeout_s,
                               tls_ca_file=a.remote_tls_ca_file, prefix=a.remote_prefix)
