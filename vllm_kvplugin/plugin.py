"""vLLM entry point (``vllm.general_plugins``): registers ``KVPluginConnector``.

vLLM calls :func:`register` in every process it starts (the front end, the
engine core, each worker, the model-inspection subprocess), before any
connector exists.  It must stay cheap and idempotent and must never break a
vLLM that does not use the connector: the name is registered lazily (vLLM
imports the module only when a config names it), and a vLLM outside the
compat matrix is refused when the connector is constructed, not here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVPluginConnector"
CONNECTOR_MODULE = "vllm_kvplugin.connector.connector"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_kvplugin import adapters
    from vllm_kvplugin.adapters.registration import register_connector

    try:
        register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except Exception as exc:  # a vLLM without the V1 connector factory
        logger.warning("vllm-kvplugin: cannot register %s: %s", CONNECTOR_NAME, exc)
        return
    _registered = True
    try:
        adapters.entry_for(adapters.vllm_version())
    except adapters.UnsupportedVLLMVersion as exc:
        logger.warning("%s (%s will refuse to start)", exc, CONNECTOR_NAME)
