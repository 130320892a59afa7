"""vllm-kvplugin: KV cache offload for vLLM.

Importing this package is cheap: it does not import vLLM or torch.  vLLM loads
the plugin through the ``vllm.general_plugins`` entry point
(:func:`vllm_kvplugin.plugin.register`), which registers the connector name
``KVPluginConnector``.
"""

from __future__ import annotations

try:
    from vllm_kvplugin._version import version as __version__
except ImportError:  # running from a checkout without an install
    __version__ = "0.0.0+unknown"


def stats() -> dict:
    """This process's counters (see :mod:`vllm_kvplugin.counters`)."""
    from vllm_kvplugin.counters import STATS

    return STATS.snapshot()


__all__ = ["__version__", "stats"]
