"""``KVPluginConnector``: the vLLM V1 KV connector (scheduler and worker roles).

vLLM constructs it twice per engine: with the SCHEDULER role in the engine
core and with the WORKER role in every worker.  Each role delegates to its
half (:mod:`.scheduler`, :mod:`.worker`); this class only maps vLLM's hooks.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvplugin import adapters, counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.adapters.api import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector.metadata import KVPluginMetadata
from vllm_kvplugin.connector.metrics import KVPluginPromMetrics, KVPluginStats

logger = logging.getLogger(__name__)


class KVPluginConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares vLLM's ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (sliding-window
    and Mamba/GatedDeltaNet groups next to attention) and passes per-group block ids.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        version = adapters.vllm_version()
        adapter = adapters.select(version)  # raises UnsupportedVLLMVersion outside the matrix
        self._cfg = KVPluginConfig.from_extra_config(_common.kv_transfer_extra_config(vllm_config))
        # vLLM reads this right after constructing the scheduler-side connector
        # (patches/README.md, "config overrides")
        vllm_config.kv_transfer_config.kv_load_failure_policy = self._cfg.load_failure_policy
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvplugin.connector.scheduler import SchedulerSide

            self._sched = SchedulerSide(vllm_config, kv_cache_config, self._cfg)
        else:
            from vllm_kvplugin.connector.worker import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config, self._cfg, adapter, version)

    # ----------------------------------------------------------------- class-level
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # an offload cache: a preempted request may simply recompute

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # every layout of the matrix is handled; let vLLM choose

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPluginStats:
        return KVPluginStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPluginPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> KVPluginStats | None:
        own = counters.SCHEDULER if self._sched is not None else counters.WORKER
        delta = own.take_delta()
        return KVPluginStats(data=delta) if delta else None

    # ----------------------------------------------------------------- worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # every step, before the forward is issued (both runners, every version)
        super().bind_connector_metadata(connector_metadata)
        meta = self._bound()
        if self._worker is not None and self._worker.engine is not None and meta is not None:
            self._worker.bind(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._bound()
        if meta is not None and (meta.fetches or meta.loads or meta.forget):
            self._worker.start_load(meta)

    def has_connector_metadata(self) -> bool:
        """vLLM's only caller outside connectors (0.26-0.33; ``tests/compat/test_layer_gate.py``)
        asks before each attention layer whether to call the two per-layer hooks below.  Their
        one job is to issue paced store DMAs, so they run only while some wait to be issued: a
        decode step without stores in flight skips two calls per layer.  (The connector's own
        use, :meth:`_bound`, asks vLLM's base.)"""
        worker = self._worker
        return (worker is not None and worker.engine is not None and worker.engine.pumping()
                and super().has_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads complete inside start_load_kv, before the forward (from verified bytes); vLLM's
        # thread passes here at every attention layer while store DMAs wait (has_connector_metadata)
        if self._worker is not None and self._worker.engine is not None:
            self._worker.pump()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # whole chunks are stored after the forward, in wait_for_save; here, as above
        if self._worker is not None and self._worker.engine is not None:
            self._worker.pump()

    def wait_for_save(self) -> None:
        meta = self._bound()
        if meta is not None and meta.stores:
            self._worker.store(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self):
        return self._worker.take_meta() if self._worker is not None else None

    def _bound(self) -> KVPluginMetadata | None:
        if not super().has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVPluginMetadata) else None

    # -------------------------------------------------------------- scheduler role
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPluginMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # what vLLM calls instead of request_finished for an SupportsHMA connector
        self._sched.request_finished(request)
        return False, None

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None

    def shutdown(self) -> None:
        # vLLM's scheduler and worker call it when the engine stops
        for side in (self._sched, self._worker):
            if side is not None:
                side.close()
