"""The connector's configuration: ``kv_connector_extra_config``, validated.

Every key the plugin accepts is a field of :class:`KVPluginConfig`; an unknown
key or a value of the wrong type is a start-up error that names the key and
what is accepted.  The README's configuration table is rendered from
:data:`FIELDS` (``vllm-kvplugin info --config-table``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """Bad ``kv_connector_extra_config``; raised when the connector is constructed."""


@dataclass(frozen=True)
class FieldDoc:
    key: str
    type: tuple[type, ...]
    default: Any
    meaning: str


#: every accepted key, its type(s), default and meaning (the README table)
FIELDS: tuple[FieldDoc, ...] = (
    FieldDoc("chunk_size", (int, type(None)), None,
             "Tokens per stored chunk: a multiple of every KV cache group's block size. Unset: "
             "the smallest such multiple >= 256 (hybrid models have blocks of 384, 528, ... "
             "tokens). Only whole chunks are stored and loaded."),
    FieldDoc("cpu_bytes", (int,), 4 << 30,
             "Byte budget of the in-process CPU tier, per worker (pinned memory on GPU "
             "machines). 0 disables the tier. Least recently used chunks are evicted."),
    FieldDoc("server", (str, type(None)), None,
             "Address of a `vllm-kvplugin server` (`unix:///path` or `tcp://127.0.0.1:PORT`). "
             "Unset: in-process tier only."),
    FieldDoc("server_token_file", (str, type(None)), None,
             "File (mode 0600) with the server's token, needed for a TCP server. Unset: "
             "`$VLLM_KVPLUGIN_TOKEN`. Both ends prove the token, neither sends it; the engine "
             "refuses a server that cannot prove it."),
    FieldDoc("server_uid", (int, type(None)), None,
             "The uid the server runs as, for a server of another user that shares itself with a "
             "group of this process (`--allow-gid`). Unset: this process's uid. The socket's "
             "directory and the pool must be that user's."),
    FieldDoc("server_timeout_s", (int, float), 5.0,
             "Upper bound on any single exchange with the server; on timeout the "
             "tokens are recomputed."),
    FieldDoc("server_step_timeout_s", (int, float), 0.05,
             "Upper bound on a server call inside an engine step (resolve, reserve, commit): a "
             "stopped or stuck server costs a miss or a skipped store, never more than this "
             "in a running request's inter-token gap. On a host so busy that the server is "
             "descheduled for longer, hits are missed (the demo, for a small shared box, sets 0.5)."),
    FieldDoc("server_staging_bytes", (int, type(None)), None,
             "Host memory of each worker (page-locked on GPU machines, allocated at start-up) where "
             "a step's server objects are gathered and hashed before they are copied into the "
             "server's shared pool (on a GPU that digests its stores, most objects skip it: they are "
             "copied straight into the pool, counted as `server_store_direct`). Objects of a step "
             "beyond what is free are not sent to the server (counted: `server_store_skipped`). "
             "Unset: four times the KV of one full step (`max_num_batched_tokens` plus a chunk) "
             "that passes through it, within 1 and 16 GiB; on a GPU that digests its stores only "
             "calls of at most 4 MiB a group and recurrent states pass, so at least 64 MiB."),
    FieldDoc("verify_checksums", (bool,), True,
             "Check the payload checksum (segmented xxh3) of every chunk before it reaches the KV cache; "
             "on a GPU it is computed there, over the bytes copied."),
    FieldDoc("gpu_staging_bytes", (int, type(None)), None,
             "CUDA: the most device memory the transfer engine's staging buffers hold (outside "
             "vLLM's memory budget). A hit is copied toward the GPU while it is verified only as "
             "far as it fits. Unset: a quarter of the GPU, and never more than what is free beyond "
             "2 GiB when a buffer grows. A claimed load that finds no device memory to stage in is "
             "scattered straight from the page-locked host buffers."),
    FieldDoc("certify", (bool,), True,
             "Compare the gather/scatter kernels with the independent layout reference at start-up."),
    FieldDoc("model_id", (str, type(None)), None,
             "Identity of the model in chunk keys and headers (default: vLLM's model path or "
             "name, revision and config). Set the same value on machines that load one "
             "model from different paths."),
    FieldDoc("state_interval", (int,), 1,
             "Recurrent (Mamba/GatedDeltaNet) groups: keep a state checkpoint at every n-th chunk "
             "boundary where vLLM materialised one, and always at the last one before a prompt's "
             "last token. A checkpoint can cost more than a chunk of attention KV."),
    FieldDoc("load_failure_policy", (str,), "fail",
             "What vLLM does with a request whose load failed after its hit was claimed (a failed "
             "copy; doubtful KV is found before the claim and only shortens the hit): `fail` "
             "(default, vLLM's own: the request ends with an error and vLLM drops the blocks from "
             "its prefix cache) or `recompute` (vLLM recomputes the request; vLLM keeps the blocks "
             "the load never wrote in its prefix cache meanwhile, so the connector reports them, "
             "and every block computed over them, to vLLM in every step until recomputed: a request "
             "that reads one is recomputed too and none of its chunks of that step is stored. Models "
             "with one KV cache group; with several, vLLM cannot take such reports and `recompute` "
             "leaves those blocks readable. `recompute` needs vLLM's synchronous scheduling "
             "(`async_scheduling=False`; asynchronous scheduling is vLLM's default on GPUs): under "
             "asynchronous scheduling vLLM keeps a recomputed request's output placeholders (vLLM "
             "issue #45138) and the request may never finish, so that combination is a start-up "
             "error; and vLLM's V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`; V2 is vLLM's default "
             "on GPUs): the V2 runner recomputes such a request from stale positions and gives "
             "wrong output (vLLM issue #49250), so that is a start-up error too). vLLM's "
             "`kv_load_failure_policy`."),
)
_BY_KEY = {f.key: f for f in FIELDS}


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


@dataclass(frozen=True)
class KVPluginConfig:
    """Validated connector configuration (see :data:`FIELDS` for the meaning of each key)."""

    chunk_size: int | None = None
    cpu_bytes: int = 4 << 30
    server: str | None = None
    server_token_file: str | None = None
    server_uid: int | None = None
    server_timeout_s: float = 5.0
    server_step_timeout_s: float = 0.05
    server_staging_bytes: int | None = None
    verify_checksums: bool = True
    gpu_staging_bytes: int | None = None
    certify: bool = True
    model_id: str | None = None
    state_interval: int = 1
    load_failure_policy: str = "fail"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KVPluginConfig:
        """Parse ``kv_connector_extra_config``; raises :class:`ConfigError`."""
        extra = dict(extra or {})
        values: dict[str, Any] = {}
        for key, value in extra.items():
            doc = _BY_KEY.get(key)
            if doc is None:
                raise ConfigError(
                    f"vllm-kvplugin: unknown kv_connector_extra_config key {key!r}; "
                    f"accepted keys: {', '.join(sorted(_BY_KEY))}")
            ok = isinstance(value, doc.type) and not (isinstance(value, bool) and bool not in doc.type)
            if float in doc.type and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok:
                raise ConfigError(
                    f"vllm-kvplugin: kv_connector_extra_config[{key!r}] must be "
                    f"{_type_names(doc.type)}, got {type(value).__name__} {value!r}")
            values[key] = value
        cfg = cls(**values)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ConfigError(f"vllm-kvplugin: chunk_size must be > 0, got {self.chunk_size}")
        if self.state_interval <= 0:
            raise ConfigError(f"vllm-kvplugin: state_interval must be > 0, got {self.state_interval}")
        if self.cpu_bytes < 0:
            raise ConfigError(f"vllm-kvplugin: cpu_bytes must be >= 0, got {self.cpu_bytes}")
        if self.server_staging_bytes is not None and self.server_staging_bytes < 0:
            raise ConfigError(f"vllm-kvplugin: server_staging_bytes must be >= 0, got {self.server_staging_bytes}")
        if self.gpu_staging_bytes is not None and self.gpu_staging_bytes < 0:
            raise ConfigError(f"vllm-kvplugin: gpu_staging_bytes must be >= 0, got {self.gpu_staging_bytes}")
        if self.server_timeout_s <= 0:
            raise ConfigError(f"vllm-kvplugin: server_timeout_s must be > 0, got {self.server_timeout_s}")
        if self.server_step_timeout_s <= 0:
            raise ConfigError("vllm-kvplugin: server_step_timeout_s must be > 0, got "
                              f"{self.server_step_timeout_s}")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(
                "vllm-kvplugin: load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.load_failure_policy!r}")
        if self.server is not None and not self.server.startswith(("unix://", "tcp://", "ipc://")):
            raise ConfigError(
                "vllm-kvplugin: server must be 'unix:///path' or 'tcp://HOST:PORT', "
                f"got {self.server!r}")

    def resolve_chunk_size(self, block_sizes: Sequence[int]) -> int:
        """The chunk size for KV cache groups of these block sizes (both connector roles agree):
        the configured one, which must be a multiple of every block size, or the smallest such
        multiple >= 256."""
        unit = math.lcm(*block_sizes) if block_sizes else 1
        if self.chunk_size is None:
            return unit * max(1, -(-256 // unit))
        if self.chunk_size % unit:
            valid = ", ".join(str(unit * k) for k in range(1, 5))
            raise ConfigError(
                f"vllm-kvplugin: chunk_size {self.chunk_size} must be a multiple of every KV cache "
                f"group's block size {sorted(set(block_sizes))}: {valid}, ...")
        return self.chunk_size


def config_table_markdown() -> str:
    """The README's configuration table."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in FIELDS:
        default = "unset" if f.default is None else f"`{f.default!r}`"
        if f.key == "chunk_size":
            default = "unset (auto)"
        if f.key == "cpu_bytes":
            default = f"`{f.default}` (4 GiB)"
        rows.append(f"| `{f.key}` | {_type_names(f.type)} | {default} | {f.meaning} |")
    return "\n".join(rows)
