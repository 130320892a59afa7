"""KV cache layouts: the descriptor, its builder, the independent reference, certification."""

from vllm_kvplugin.layout.build import GroupSource, LayoutError, build_layout
from vllm_kvplugin.layout.certify import CertificationError, certify
from vllm_kvplugin.layout.descriptor import ContentSemantics, GroupKind, KVLayout

__all__ = [
    "CertificationError", "ContentSemantics", "GroupKind", "GroupSource", "KVLayout",
    "LayoutError", "build_layout", "certify",
]
