"""Registering the connector name with vLLM's KV connector factory (the same in every era)."""

from __future__ import annotations


def register_connector(name: str, module: str, class_name: str) -> bool:
    """Register ``name`` lazily (vLLM imports ``module`` only when a config names it).

    Idempotent: vLLM's factory raises on a second registration of a name, so an
    existing entry is left alone.  Returns True when the name is registered.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, class_name)
    return name in KVConnectorFactory._registry
