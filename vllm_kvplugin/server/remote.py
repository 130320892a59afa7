"""The remote tier: one Redis / Valkey (or Redis Cluster) store shared by cache servers on many machines.

The cache server writes every committed object through to the store in the background
and reads from it on a miss (:mod:`.remote_ops` ties this into the server's state
machine); engines never talk to the store.  This module is the store's side: the
connection, the key namespace, the byte budget, and the worker threads.

**Keys.**  ``<prefix>:v<chunk format version>:<model fingerprint hex>:<object id hex>``:
one namespace per model identity and chunk format; a server only ever asks for keys of
the fingerprint a lookup names.  The value is the object exactly as it sits in L1,
``[chunk header | payload]``; a read is served only if its header parses (format
version), names this object, this fingerprint and this size, and its payload checksum
holds -- else the key is deleted and counted.  A value is written with one ``SET``, so
a write that did not complete is never visible.

**Budget and TTL.**  A ledger in the store (a sorted set of keys by admission time, their
sizes, the bytes admitted; all under one hash tag, so one Lua script updates it
atomically on a cluster too) admits each write: it forgets entries past the TTL, refuses a
key already admitted (another server wrote it), and evicts the oldest entries until the
new object fits the budget; the writer deletes those victims, then ``SET``s the value
with an absolute expiry equal to the ledger entry's (``PXAT``), so no value outlives its
entry.  The store never holds more than the budget of the servers' objects, except while
a victim's delete failed (counted; it expires with its TTL).

**Faults.**  Every call has a timeout; a connection error or timeout marks the store down
and later calls fail at once until a back-off (0.5 s doubling to 30 s) has passed; the
server keeps serving from L1/L2 meanwhile and counts what it skipped.

Threads: a writer (puts and deletes, in order) and readers (probes and gets); each
finished job goes on ``done`` and wakes the server's main loop through its pipe.  Only the
main thread touches the server's index.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vllm_kvplugin.chunk.format import FORMAT_VERSION
from vllm_kvplugin.server.auth import AuthError, read_secret_file
from vllm_kvplugin.server.chunkhdr import HEADER_SIZE, HeaderError, parse_header
from vllm_kvplugin.server.l2 import stop_threads, verify_object

logger = logging.getLogger(__name__)

PASSWORD_ENV = "VLLM_KVPLUGIN_REMOTE_PASSWORD"
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
#: a probe asks for at most this many keys per pipeline
PROBE_BATCH = 4096
#: a get job moves at most this many bytes
GET_BATCH_BYTES = 64 << 20

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl, 'LIMIT', 0, 256)
for _, m in ipairs(old) do
  local s = tonumber(redis.call('HGET', KEYS[2], m) or '0')
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
  redis.call('DECRBY', KEYS[3], s)
end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {0, now} end
local size = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
if size > budget then return {-1, now} end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local out = {1, now}
while used + size > budget do
  local v = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #v == 0 then break end
  used = used - tonumber(redis.call('HGET', KEYS[2], v[1]) or '0')
  redis.call('HDEL', KEYS[2], v[1])
  redis.call('ZREM', KEYS[1], v[1])
  table.insert(out, v[1])
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('SET', KEYS[3], used + size)
return out
"""

_FORGET = """
local s = redis.call('HGET', KEYS[2], ARGV[1])
if s then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('DECRBY', KEYS[3], tonumber(s))
end
return s and 1 or 0
"""


class RemoteConfigError(ValueError):
    """A bad ``--remote*`` flag; the message names the flag and the value."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where the shared store is and how the server uses it."""

    nodes: tuple[tuple[str, int], ...]   # one node, or a cluster's seed nodes
    cluster: bool
    tls: bool
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    budget_bytes: int = 16 << 30
    ttl_s: float = 86400.0
    timeout_s: float = 2.0
    tls_ca_file: str | None = None
    prefix: str = "vllm-kvplugin"

    @property
    def url(self) -> str:
        """The store's address for logs (never the password)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes) + ("" if self.cluster else f"/{self.db}")


def parse_remote_url(url: str, password: str | None) -> RemoteConfig:
    """``redis://HOST:PORT[/DB]``, ``rediss://...`` (TLS), ``redis+cluster://HOST:PORT[,HOST:PORT...]``.
    A password inside the URL is refused: argv is readable by every local user."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise RemoteConfigError(f"--remote {url!r}: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise RemoteConfigError(f"--remote {url!r}: the scheme must be one of {', '.join(SCHEMES)}")
    cluster, tls = parts.scheme.endswith("+cluster"), parts.scheme.startswith("rediss")
    netloc = parts.netloc
    username = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        if ":" in cred:
            raise RemoteConfigError(f"--remote {parts.scheme}://***@{netloc}: a password on the command line is "
                                    f"readable by every local user: use --remote-password-file or ${PASSWORD_ENV}")
        username = cred or None
    nodes = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RemoteConfigError(f"--remote {url!r}: {hp!r} is not HOST:PORT")
        nodes.append((host, int(port)))
    db = 0
    path = parts.path.strip("/")
    if path:
        if cluster or not path.isdigit():
            raise RemoteConfigError(f"--remote {url!r}: the path must be a database number (and a cluster has none)")
        db = int(path)
    if len(nodes) > 1 and not cluster:
        raise RemoteConfigError(f"--remote {url!r}: several nodes need redis+cluster://")
    return RemoteConfig(tuple(nodes), cluster, tls, db, username, password)


def read_password(path: str | None) -> str | None:
    """The store's password from a private file, else ``$VLLM_KVPLUGIN_REMOTE_PASSWORD``."""
    if path:
        try:
            return read_secret_file(path, "--remote-password-file") or None
        except AuthError as exc:
            raise RemoteConfigError(str(exc)) from None
    return os.environ.get(PASSWORD_ENV) or None


class RemoteDown(Exception):
    """The store is unreachable (now, or within the back-off after a failure)."""


class RemoteFull(Exception):
    """The store refused a write for lack of memory."""


def _redis():
    try:
        import redis
        import redis.cluster  # noqa: F401
    except ImportError:
        raise RemoteConfigError("--remote needs the redis client: pip install 'vllm-kvplugin[remote]'") from None
    return redis


class RemoteStore:
    """The store's operations (thread-safe: redis-py pools its connections), with the back-off."""

    BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0

    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        redis = _redis()
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ClusterError, redis.exceptions.RedisClusterException, OSError)
        self._full = redis.exceptions.OutOfMemoryError
        self._redis_error = redis.exceptions.RedisError
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside the client: a failure marks the store down and the back-off decides
        self._common = dict(password=cfg.password, username=cfg.username, socket_timeout=cfg.timeout_s,
                            socket_connect_timeout=cfg.timeout_s, retry=Retry(NoBackoff(), 0))
        if cfg.tls:
            self._common.update(ssl=True, ssl_ca_certs=cfg.tls_ca_file)
        tag = "{" + cfg.prefix + "}"
        self.ledger = [f"{tag}:ledger".encode(), f"{tag}:sizes".encode(), f"{tag}:used".encode()]
        self._client = None  # made by the first call (a cluster client connects when made)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self.connected = False  # the last call reached the store
        self.reconnects = 0
        self.failures = 0

    def _connected_client(self):
        """The client, made on first use (inside :meth:`_call`: a store down at start is a failure
        like any other, not a start-up error), with its two ledger scripts."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import redis.cluster

                    if self.cfg.cluster:
                        c = redis.cluster.RedisCluster(
                            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in self.cfg.nodes],
                            cluster_error_retry_attempts=1, **self._common)
                    else:
                        (host, port), = self.cfg.nodes
                        c = redis.Redis(host=host, port=port, db=self.cfg.db, **self._common)
                    self._admit, self._forget = c.register_script(_ADMIT), c.register_script(_FORGET)
                    self._client = c
        return self._client

    @property
    def client(self):
        """The Redis client (made now if needed; raises the client's errors)."""
        return self._connected_client()

    # ------------------------------------------------------------------ keys
    def key(self, fingerprint: bytes, oid: bytes) -> bytes:
        return f"{self.cfg.prefix}:v{FORMAT_VERSION}:{fingerprint.hex()}:{oid.hex()}".encode()

    # ------------------------------------------------------------------ health
    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn):
        """``fn(client)``, with the back-off: raises :class:`RemoteDown` or :class:`RemoteFull`."""
        if time.monotonic() < self._down_until:
            raise RemoteDown("in back-off after a failure")
        try:
            out = fn(self._connected_client())
        except self._full as exc:
            self.connected = True
            raise RemoteFull(str(exc)) from exc
        except self._errors as exc:
            with self._lock:
                self.connected = False
                self.failures += 1
                self._backoff = min(self.BACKOFF_MAX_S, max(self.BACKOFF_MIN_S, 2 * self._backoff))
                self._down_until = time.monotonic() + self._backoff
            logger.warning("remote store %s: %s: %s (next try in %.1f s)", self.cfg.url, type(exc).__name__,
                           exc, self._backoff)
            raise RemoteDown(f"{type(exc).__name__}: {exc}") from exc
        self.connected = True
        if self._backoff:
            with self._lock:
                if self._backoff:
                    self._backoff = 0.0
                    self.reconnects += 1
                    logger.info("remote store %s: reachable again", self.cfg.url)
        return out

    def ping(self) -> bool:
        try:
            return bool(self._call(lambda c: c.ping()))
        except (RemoteDown, RemoteFull, self._redis_error):
            return False

    # ------------------------------------------------------------------ operations
    def put(self, key: bytes, data: memoryview) -> tuple[str, int]:
        """Admit under the budget and write: (``"ok"``, ``"exists"`` (admitted before) or
        ``"too_large"``, older objects evicted for it).  Raises :class:`RemoteDown`,
        :class:`RemoteFull` or a Redis error."""
        got = self._call(lambda c: self._admit(keys=self.ledger, args=[
            key, data.nbytes, self.cfg.budget_bytes, int(self.cfg.ttl_s * 1000)]))
        status, now, victims = int(got[0]), int(got[1]), got[2:]
        if status <= 0:
            return ("exists" if status == 0 else "too_large"), 0
        if victims:
            self._delete_keys(victims)
        try:
            self._call(lambda c: c.set(key, data, pxat=now + int(self.cfg.ttl_s * 1000)))
        except BaseException:
            self._forget_quietly(key)
            raise
        return "ok", len(victims)

    def _delete_keys(self, keys: list[bytes]) -> None:
        if self.cfg.cluster:  # keys of other slots: one DEL each, batched per node by the pipeline
            self._pipelined("delete", keys)
        else:
            self._call(lambda c: c.delete(*keys))

    def _forget_quietly(self, key: bytes) -> None:
        try:
            self._call(lambda c: self._forget(keys=self.ledger, args=[key]))
        except Exception:
            pass  # the entry expires with its TTL

    def delete(self, key: bytes) -> None:
        """Delete a value and its ledger entry (a corrupt or foreign value)."""
        self._call(lambda c: c.delete(key))
        self._call(lambda c: self._forget(keys=self.ledger, args=[key]))

    def sizes(self, keys: list[bytes]) -> list[int]:
        """The byte size of each key's value (0: absent), one pipeline per batch (per node on a cluster)."""
        out: list[int] = []
        for i in range(0, len(keys), PROBE_BATCH):
            out += [int(x) for x in self._pipelined("strlen", keys[i:i + PROBE_BATCH])]
        return out

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self._pipelined("get", keys)

    def _pipelined(self, command: str, keys: list[bytes]) -> list:
        """One ``command key`` per key in one pipeline (on a cluster: one per node)."""
        def run(c):
            pipe = c.pipeline(transaction=False)
            for k in keys:
                getattr(pipe, command)(k)
            return pipe.execute()
        return self._call(run)

    def used_bytes(self) -> int:
        """The bytes the ledger counts as admitted (every server's objects under this prefix)."""
        return int(self._call(lambda c: c.get(self.ledger[2])) or 0)

    def close(self) -> None:
        try:
            if self._client is not None:
                self._client.close()
        except Exception:
            pass


# ---------------------------------------------------------------------- jobs
@dataclass
class PutJob:
    oid: bytes
    fingerprint: bytes
    offset: int
    nbytes: int
    token: object                 # the main thread's object entry (pinned while the job runs)
    result: str = ""              # ok | exists | too_large | down | full | error
    evicted: int = 0


@dataclass
class DeleteJob:
    oid: bytes
    fingerprint: bytes
    result: str = ""


@dataclass
class ProbeJob:
    """Which of ``oids`` the store holds, and their sizes (0: absent)."""

    fingerprint: bytes
    oids: list[bytes]
    token: object                 # the pending lookup
    sizes: list[int] = field(default_factory=list)
    result: str = ""


@dataclass
class GetJob:
    """Read objects into their L1 blocks and verify them; ``errors[i]`` None when object i is good."""

    fingerprint: bytes
    items: list                   # (oid, offset, nbytes, object entry)
    errors: list = field(default_factory=list)
    result: str = ""
    seconds: float = 0.0


def check_remote_object(oid: bytes, fingerprint: bytes, data: memoryview) -> str | None:
    """None if ``data`` is the intact object ``oid`` of model ``fingerprint``; else the reason."""
    err = verify_object(oid, data)
    if err is not None:
        return err
    try:
        h = parse_header(data[:HEADER_SIZE])
    except HeaderError as exc:  # pragma: no cover (verify_object parsed it)
        return exc.reason
    return None if h.fingerprint == fingerprint else "foreign_fingerprint"


class RemoteWorkers:
    """A writer thread (puts, deletes) and reader threads (probes, gets) on one :class:`RemoteStore`."""

    def __init__(self, store: RemoteStore, pool_view: memoryview, readers: int, wake_fd: int):
        self.store = store
        self.pool = pool_view
        self.wake_fd = wake_fd
        self.writes: queue.Queue = queue.Queue()
        self.reads: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, args=(self.writes,), name="remote-writer", daemon=True)]
        self._threads += [threading.Thread(target=self._loop, args=(self.reads,), name=f"remote-reader-{i}",
                                           daemon=True) for i in range(readers)]
        for t in self._threads:
            t.start()

    def _loop(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            try:
                self._run(job)
            except RemoteDown:
                job.result = "down"
            except RemoteFull:
                job.result = "full"
            except Exception as exc:  # a Redis error reply, a bad value: count it, keep going
                logger.warning("remote store: %s failed: %s: %s", type(job).__name__, type(exc).__name__, exc)
                job.result = "error"
            self.done.put(job)
            try:
                os.write(self.wake_fd, b"r")
            except (BlockingIOError, OSError):
                pass

    def _run(self, job) -> None:
        st = self.store
        if isinstance(job, PutJob):
            view = self.pool[job.offset:job.offset + job.nbytes]
            try:
                if verify_object(job.oid, view) is not None:  # never send what is not intact
                    job.result = "corrupt"
                    return
                job.result, job.evicted = st.put(st.key(job.fingerprint, job.oid), view)
            finally:
                view.release()
        elif isinstance(job, DeleteJob):
            st.delete(st.key(job.fingerprint, job.oid))
            job.result = "ok"
        elif isinstance(job, ProbeJob):
            job.sizes = st.sizes([st.key(job.fingerprint, oid) for oid in job.oids])
            job.result = "ok"
        elif isinstance(job, GetJob):
            t0 = time.perf_counter()
            values = st.get_many([st.key(job.fingerprint, oid) for oid, *_ in job.items])
            for (oid, offset, nbytes, _e), value in zip(job.items, values):
                if value is None:
                    job.errors.append("gone")
                    continue
                if len(value) != nbytes:
                    job.errors.append("size_changed")
                    continue
                view = self.pool[offset:offset + nbytes]
                try:
                    view[:] = value
                    job.errors.append(check_remote_object(oid, job.fingerprint, view))
                finally:
                    view.release()
            job.result = "ok"
            job.seconds = time.perf_counter() - t0

    @property
    def queued_puts(self) -> int:
        return self.writes.qsize()

    def stop(self, timeout: float) -> None:
        stop_threads(self._threads, self.writes, self.reads, timeout)
        self.store.close()
