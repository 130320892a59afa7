"""The node-local multi-process KV cache server (``vllm-kvplugin server``).

One server per node, shared by every engine and rank on it.  Control over ZMQ
(Unix socket by default), msgpack messages (no pickle); data through a
shared-memory pool that clients map; an optional L2 directory behind it.
The protocol is documented in ``README.md`` beside this file; the client is
:class:`vllm_kvplugin.tiers.mp_client.MPClient`.  Needs no torch and no GPU.
"""

from __future__ import annotations

from vllm_kvplugin.server.config import ServerConfig, ServerConfigError, config_from_args
from vllm_kvplugin.server.protocol import PROTOCOL_VERSION, object_id, split_object_id


def main(argv: list[str] | None = None) -> int:
    """Run the server (the ``vllm-kvplugin server`` command); returns the exit status."""
    from vllm_kvplugin.server.app import main as _main

    return _main(argv)


__all__ = ["main", "ServerConfig", "ServerConfigError", "config_from_args", "object_id",
           "split_object_id", "PROTOCOL_VERSION"]
