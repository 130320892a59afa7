"""The plugin's counters in vLLM's connector stats and Prometheus.

Each connector role hands vLLM the delta of its own counters every step
(:meth:`vllm_kvplugin.counters.Counters.take_delta`); vLLM sums them over ranks
(:meth:`KVPluginStats.aggregate`) and passes the sum to the periodic log line
(:meth:`KVPluginStats.reduce`) and to :class:`KVPluginPromMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.adapters.api import KVConnectorPromMetrics, KVConnectorStats

PROM_PREFIX = "vllm:kvplugin_"


@dataclass
class KVPluginStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVPluginStats:
        return KVPluginStats(data=counters.merge(self.data, other.data or {}))

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, dict):
                for reason, n in v.items():
                    out[f"{k}.{reason}"] = n
            else:
                out[k] = round(v, 4) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPluginPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per plugin counter, labelled like vLLM's own metrics."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in counters.SCHEDULER_FIELDS + counters.WORKER_FIELDS:
            self._counters[name] = self._per_engine(
                self._counter_cls(name=PROM_PREFIX + name, documentation=f"vllm-kvplugin {name}",
                                  labelnames=labelnames))
        self._failures = self._counter_cls(
            name=PROM_PREFIX + "load_failures", documentation="vllm-kvplugin failed loads by reason",
            labelnames=[*labelnames, "reason"])

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*vals) for idx, vals in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k == counters.FAILURES:
                labels = self.per_engine_labelvalues.get(engine_idx, [])
                for reason, n in v.items():
                    self._failures.labels(*labels, reason).inc(n)
            elif k in self._counters and v:
                self._counters[k][engine_idx].inc(v)
