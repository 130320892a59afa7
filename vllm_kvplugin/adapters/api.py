"""vLLM's KV-connector API classes, imported in one place.

These names are identical in every version of the compat matrix
(``compat/api_surface.toml`` lists them; the API lane checks them).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = [
    "KVConnectorBase_V1", "KVConnectorFactory", "KVConnectorMetadata",
    "KVConnectorPromMetrics", "KVConnectorRole", "KVConnectorStats",
    "KVConnectorWorkerMetadata", "SupportsHMA",
]
