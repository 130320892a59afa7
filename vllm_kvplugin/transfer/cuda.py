"""Transfers between a CUDA KV cache and page-locked host buffers.

Placeholder until the staged DMA engine lands (issue 6): gathers on the device
into a staging buffer and copies it to the host on the current stream,
synchronously.  Correct, not fast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvplugin import ops
from vllm_kvplugin.layout.descriptor import KVLayout


class CudaTransfer:
    name = "cuda-sync"

    def __init__(self, device: torch.device):
        self.device = device

    def store(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
              bufs: Sequence[torch.Tensor]) -> None:
        staging = torch.empty((len(bufs), *layout.chunk_shape(slots.shape[1])), dtype=layout.dtype,
                              device=self.device)
        ops.gather(layers, slots.to(self.device), layout.strides, layout.block_size,
                   layout.kernel_block_size, layout.num_blocks, staging)
        for c, buf in enumerate(bufs):
            buf.copy_(staging[c:c + 1])
        return None

    def done(self, ticket: None) -> bool:
        return True

    def wait(self, ticket: None) -> None:
        return None

    def fence(self) -> None:
        return None

    def load(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
             bufs: Sequence[torch.Tensor]) -> None:
        staging = torch.cat([b.to(self.device) for b in bufs])
        ops.scatter(layers, slots.to(self.device), layout.strides, layout.block_size,
                    layout.kernel_block_size, layout.num_blocks, staging)
