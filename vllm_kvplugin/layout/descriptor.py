"""KVLayout: how one KV cache group sits in memory, as a frozen descriptor.

Built once per group at ``register_kv_caches`` (see :mod:`.build`); the same
object sizes the chunks, drives the gather/scatter ops and is checked against
every chunk header before a load.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ContentSemantics(enum.Enum):
    """What the bytes of one paged layer view mean (vllm_layouts.md §3.4)."""

    #: logical (B, H, N, 2D); each (token, head) row is [K(D) | V(D)]
    #: (FlashAttention, FlashInfer, Triton, FlexAttention from vLLM 0.26 on)
    GPU_FUSED = "gpu_fused"
    #: logical (B, H, N, 2D) but each (block, head) holds N K rows then N V rows
    #: (CPU_ATTN: ``kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``)
    CPU_FUSED = "cpu_fused"
    #: (2, B, N, H, D): K/V outermost (vLLM <= 0.22 GPU backends, ROCM_ATTN)
    SPLIT_KV_FIRST = "split_kv_first"
    #: (B, 2, N, H, D): blocks first (vLLM 0.23-0.25)
    SPLIT_BLOCK_FIRST = "split_block_first"
    #: (B, N, D_latent) [<= 0.28] or (B, 1, N, D_latent) [0.29+]: one latent row per token
    MLA_LATENT = "mla_latent"


class GroupKind(enum.IntEnum):
    """Kind of a KV cache group, as written in the chunk header (:mod:`.groups`)."""

    ATTENTION = 1
    MLA = 2
    RECURRENT = 3
    WINDOW = 4


@dataclass(frozen=True)
class KVLayout:
    """One KV cache group of one rank, as it sits in memory.

    ``strides`` are element strides of every layer view in the order
    ``[block, sub, tok, head, kv, dim]``: a manager block, a kernel block inside
    it (``block_size = r * kernel_block_size``), a token inside the kernel
    block, a KV head, K (0) or V (1), and the head dimension.  Every layer of
    the group shares them; each layer has its own base pointer (the worker
    keeps the tensors, this descriptor keeps only what is true of all).
    """

    group_index: int
    kind: GroupKind
    semantics: ContentSemantics
    source: str  # what vLLM said, for messages: version, backend, layout name
    layer_names: tuple[str, ...]
    num_blocks: int
    block_size: int
    kernel_block_size: int
    num_heads: int
    head_dim: int
    num_kv: int  # 2 (K and V) or 1 (MLA latent)
    dtype: torch.dtype
    strides: tuple[int, int, int, int, int, int]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in a chunk (all layers of the group)."""
        return self.num_layers * self.num_kv * self.num_heads * self.head_dim * self.element_size

    def chunk_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical chunk payload shape ``[L, KV, T, H, D]``."""
        return (self.num_layers, self.num_kv, tokens, self.num_heads, self.head_dim)

    def chunk_nbytes(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def describe(self) -> str:
        return (
            f"group {self.group_index} [{self.source}] {self.semantics.value}: "
            f"{self.num_layers} layers x {self.num_blocks} blocks of {self.block_size} tokens "
            f"(kernel blocks of {self.kernel_block_size}), H={self.num_heads} D={self.head_dim} "
            f"KV={self.num_kv} {self.dtype}, strides {list(self.strides)}"
        )
