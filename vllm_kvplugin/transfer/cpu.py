"""Transfers when the KV cache is in host memory (vLLM's CPU platform): plain synchronous copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvplugin import ops
from vllm_kvplugin.layout.descriptor import KVLayout
from vllm_kvplugin.transfer.placement import PlacedObjects


class CpuTransfer:
    """gather/scatter straight between the paged cache and the host buffers."""

    name = "cpu"
    digests = False  # the host verifies and hashes every payload

    def store(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
              bufs: Sequence[torch.Tensor]) -> None:
        for c, buf in enumerate(bufs):
            ops.gather(layers, slots[c:c + 1], layout.strides, layout.block_size,
                       layout.kernel_block_size, layout.num_blocks, buf)
        return None

    def done(self, ticket: None) -> bool:
        return True

    def wait(self, ticket: None) -> None:
        return None

    def fence(self) -> None:
        return None

    def settle(self) -> None:
        return None  # copies are done when issued

    def pump(self) -> None:
        return None  # copies are done when issued

    def pumping(self) -> bool:
        return False  # nothing is ever left for pump

    def warm_up(self, layout: KVLayout, layers: Sequence[torch.Tensor], tokens: int,
                keep_bytes: int = 0) -> None:
        return None  # nothing costs more the first time, and there is no staging

    def prefetch(self, layout: KVLayout, bufs: Sequence[torch.Tensor]) -> None:
        return None  # the cache is in host memory: nothing to move ahead

    def release(self, pre: None) -> None:
        return None

    def digest(self, pre: None) -> None:
        return None  # no prefetch to hash: the host verifies

    def checksums(self, ticket: None) -> dict[int, int]:
        return {}  # the host hashes what it stored

    def undigested_store_max(self) -> int | None:
        return None  # the host hashes every store

    def rehearse(self, layout: KVLayout, layers: Sequence[torch.Tensor], placed: PlacedObjects) -> None:
        return None  # no staged loads here

    def load(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor | PlacedObjects,
             bufs: Sequence[torch.Tensor], staged=None) -> None:
        if isinstance(slots, PlacedObjects):
            slots = slots.slots()
        for c, buf in enumerate(bufs):
            ops.scatter(layers, slots[c:c + 1], layout.strides, layout.block_size,
                        layout.kernel_block_size, layout.num_blocks, buf)
