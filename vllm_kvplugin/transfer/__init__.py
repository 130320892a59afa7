"""Moving chunks between the paged KV cache and host chunk buffers.

A :class:`TransferEngine` is chosen once per worker from the KV cache's device
(:func:`engine_for`): :class:`~.cpu.CpuTransfer` when the cache lives in host
memory (vLLM's CPU platform), :class:`~.cuda.CudaTransfer` on CUDA devices.

Contract, for the worker (one thread, vLLM's worker thread):

* :meth:`TransferEngine.store` is called after the forward that wrote the
  blocks was *issued* (``wait_for_save``).  It must order its reads of the
  paged cache after that forward (device-side), and return a ticket; the
  host buffers hold the chunk bytes once :meth:`TransferEngine.done` is True.
* :meth:`TransferEngine.fence` is called before the next step's forward is
  issued: from then on the compute stream does not overwrite any block a store
  still has to read (a freed block may be reused by the next step).
* :meth:`TransferEngine.pump` may be called from any thread at any time, often
  (vLLM's thread at every attention layer): it issues more of the stores' queued
  copies and returns at once.  :meth:`TransferEngine.wait` pumps as well.
  :meth:`TransferEngine.pumping` (read before each attention layer, so it must cost no
  more than an attribute read) says whether a ``pump`` now would have anything to issue.
* :meth:`TransferEngine.settle` returns once every copy issued or queued so far is done (a
  store that failed while it was issued: its memory may be reused after that).
* :meth:`TransferEngine.load` returns when the chunk bytes are in the paged
  cache as far as the compute stream is concerned (attention issued after
  the call reads them).
* :meth:`TransferEngine.prefetch` starts moving whole host chunks toward the
  device while their bytes are verified on the host (returns at once; None when
  the engine has nothing to gain or no room); a later ``load`` given
  ``staged=[(prefetch, rows), ...]`` scatters those rows (of one prefetch or several, in
  that order) without using the link.
  :meth:`TransferEngine.release` gives a prefetch's room back.
* :meth:`TransferEngine.digest` starts the payload digests of a prefetch's rows on the device
  (a :class:`~vllm_kvplugin.chunk.checksums.PendingChecksums`; None: the host must verify them),
  and :meth:`TransferEngine.checksums` gives those a done store computed of the buffers it
  wrote (host buffer address -> digest; the rest are the host's to hash), and
  :meth:`TransferEngine.undigested_store_max` says beforehand which store calls get a digest
  of every buffer they write: those of whole chunks moving more bytes than it (None: none).
* :meth:`TransferEngine.warm_up` runs at registration, so that a first hit pays
  no first-use costs (kernel loading, streams, staging); :meth:`TransferEngine.rehearse`
  runs a staged load's host path over no object (nothing moves), so that its code is in the
  caches when a hit's load comes.

``slots`` are ``[C, T]`` int64 paged slots (``block_id * block_size + offset``,
-1 = leave the token alone), for a load also the objects' block ids
(:class:`~vllm_kvplugin.transfer.placement.PlacedObjects`); ``bufs`` are C host tensors
``[1, L, KV, T, H, D]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from vllm_kvplugin.layout.descriptor import KVLayout
from vllm_kvplugin.transfer.placement import PlacedObjects


class TransferEngine(Protocol):
    name: str
    digests: bool  # computes payload digests on the device (``digest``, ``checksums``)

    def store(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
              bufs: Sequence[torch.Tensor]) -> Any: ...

    def done(self, ticket: Any) -> bool: ...

    def wait(self, ticket: Any) -> None: ...

    def fence(self) -> None: ...

    def settle(self) -> None: ...

    def pump(self) -> None: ...

    def pumping(self) -> bool: ...

    def warm_up(self, layout: KVLayout, layers: Sequence[torch.Tensor], tokens: int,
                keep_bytes: int = 0) -> None: ...

    def prefetch(self, layout: KVLayout, bufs: Sequence[torch.Tensor]) -> Any: ...

    def release(self, pre: Any) -> None: ...

    def digest(self, pre: Any) -> Any: ...

    def checksums(self, ticket: Any) -> dict[int, int]: ...

    def undigested_store_max(self) -> int | None: ...

    def load(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor | PlacedObjects,
             bufs: Sequence[torch.Tensor], staged: Any = None) -> None: ...

    def rehearse(self, layout: KVLayout, layers: Sequence[torch.Tensor], placed: PlacedObjects) -> None: ...


def engine_for(device: torch.device, staging_bytes: int | None = None) -> TransferEngine:
    """The engine for a KV cache on ``device``; ``staging_bytes``: CUDA staging cap (None: auto)."""
    if device.type == "cuda":
        from vllm_kvplugin.transfer.cuda import CudaTransfer

        return CudaTransfer(device, staging_cap_bytes=staging_bytes)
    from vllm_kvplugin.transfer.cpu import CpuTransfer

    return CpuTransfer()
