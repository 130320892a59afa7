"""The vLLM connector. Importing this package imports vLLM."""

from vllm_kvplugin.connector.connector import KVPluginConnector

__all__ = ["KVPluginConnector"]
