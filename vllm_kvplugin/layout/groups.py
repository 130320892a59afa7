"""What a KV cache group *is*: its kind and what one chunk of it holds.

An adapter turns each of vLLM's ``KVCacheGroupSpec`` into a :class:`GroupSpec`
(no tensors: both connector roles build it from the ``KVCacheConfig``).  The
kind decides everything downstream, in one place:

* ``ATTENTION`` / ``MLA``: a chunk object holds every token of its chunk; a hit
  restores every chunk from vLLM's own hit on (:data:`~vllm_kvplugin.chunk.rules.Need.PREFIX`).
* ``WINDOW`` (sliding window ``w``): the first token after a hit attends to the
  ``w - 1`` tokens before it (plus any extra tokens vLLM retains), i.e. to
  ``window_tail`` tokens rounded up to whole blocks.  A chunk object holds only
  that tail of its chunk (the rest is out of every later window, and vLLM frees
  those blocks while the chunk is still being computed); a hit restores the
  objects of the last ``ceil(tail / C)`` chunks before it (``Need.WINDOW``).
* ``RECURRENT`` (Mamba, GatedDeltaNet): a chunk object is the state checkpoint
  after the chunk's last token, every layer's state tensors as raw bytes; a hit
  restores exactly one, the checkpoint at the hit (``Need.POINT``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from vllm_kvplugin.chunk.format import layers_digest, state_spec
from vllm_kvplugin.chunk.rules import GroupNeed, Need
from vllm_kvplugin.layout.descriptor import GroupKind


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one recurrent layer for one block (e.g. conv or SSM state)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as the plugin stores it (both roles; no tensors)."""

    index: int
    kind: GroupKind
    spec_name: str  # vLLM's spec class, for messages
    block_size: int
    layer_names: tuple[str, ...]
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: torch.dtype = torch.uint8
    window: int = 0  # WINDOW: tokens before a token that its attention still sees
    state: tuple[StateTensor, ...] = ()  # RECURRENT: one layer's state tensors
    state_mode: str = ""  # RECURRENT: vLLM's mamba_cache_mode ("align" keeps per-block states)
    speculative_blocks: int = 0  # RECURRENT: blocks vLLM keeps for speculative tokens
    drafter: bool = False  # the KV of a speculative drafter (EAGLE): its last row saw the next token

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def is_state(self) -> bool:
        """A chunk object is one state checkpoint (recurrent), not tokens' KV: stored only at the
        chunk boundaries a step ends on, copied on the host into exactly the blocks a job names
        (:mod:`.state`), never through the transfer engine or its token slots."""
        return self.kind is GroupKind.RECURRENT

    @property
    def restores_prefix(self) -> bool:
        """A hit restores every chunk from the prompt's start (attention, MLA), so any shorter
        prefix of a hit is a hit too (vLLM may grant fewer tokens; a first part may be sent)."""
        return self.kind in (GroupKind.ATTENTION, GroupKind.MLA)

    @property
    def num_kv(self) -> int:
        return 1 if self.kind is GroupKind.MLA else 2

    @property
    def num_heads(self) -> int:
        return 1 if self.kind is GroupKind.MLA else self.num_kv_heads

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in a chunk object (0 for recurrent groups)."""
        if self.kind is GroupKind.RECURRENT:
            return 0
        return self.num_layers * self.num_kv * self.num_heads * self.head_size * self.dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of one state checkpoint (every layer of the group)."""
        return self.num_layers * sum(t.nbytes for t in self.state)

    @property
    def window_tail(self) -> int:
        """WINDOW: the tokens before a hit that its next token attends to, in whole blocks."""
        return -(-self.window // self.block_size) * self.block_size

    def stored_tokens(self, chunk_size: int) -> int:
        """Tokens one chunk object holds: its chunk's last ``stored_tokens`` (0: a state)."""
        if self.kind is GroupKind.RECURRENT:
            return 0
        if self.kind is GroupKind.WINDOW:
            return min(chunk_size, self.window_tail)
        return chunk_size

    def object_tokens(self, position: int, chunk_size: int) -> tuple[int, int]:
        """The tokens ``[start, end)`` object ``position`` covers, as its header names them: a
        state, the whole prefix up to its chunk's end; KV, its chunk's last ``stored_tokens``."""
        end = (position + 1) * chunk_size
        return (0, end) if self.is_state else (end - self.stored_tokens(chunk_size), end)

    def object_starts(self, positions: np.ndarray, chunk_size: int) -> np.ndarray:
        """The first token of each of the objects ``positions`` (KV groups: ``object_tokens``'
        start, for many objects at once)."""
        if self.is_state:
            raise ValueError(f"group {self.index} ({self.spec_name}) holds states, not tokens")
        return (positions + 1) * chunk_size - self.stored_tokens(chunk_size)

    def object_blocks(self, block_ids: list[int], position: int, chunk_size: int,
                      hit_end: int = 0) -> tuple[int, ...]:
        """The blocks of ``block_ids`` (this group's, of one request) that object ``position``
        is copied from or into (a state: the block at ``hit_end``, the tokens it follows)."""
        if self.is_state:
            return (block_ids[hit_end // self.block_size - 1],)
        lo, end = self.object_tokens(position, chunk_size)
        return tuple(block_ids[lo // self.block_size:end // self.block_size])

    def objects_blocks(self, block_ids: list[int], positions: Sequence[int], chunk_size: int,
                       hit_end: int = 0) -> list[tuple[int, ...]]:
        """:meth:`object_blocks` of each of ``positions`` (a load's objects, on vLLM's thread
        between its allocation of their blocks and the forward: one pass, no call per object)."""
        if self.is_state:
            return [self.object_blocks(block_ids, p, chunk_size, hit_end) for p in positions]
        B, C, tokens = self.block_size, chunk_size, self.stored_tokens(chunk_size)
        return [tuple(block_ids[((p + 1) * C - tokens) // B:(p + 1) * C // B]) for p in positions]

    def object_bytes(self, chunk_size: int) -> int:
        """Payload bytes of one chunk object of this group."""
        if self.kind is GroupKind.RECURRENT:
            return self.state_bytes
        return self.stored_tokens(chunk_size) * self.bytes_per_token

    def need(self, chunk_size: int) -> GroupNeed:
        if self.kind is GroupKind.RECURRENT:
            return GroupNeed(Need.POINT)
        if self.kind is GroupKind.WINDOW:
            return GroupNeed(Need.WINDOW, window=max(1, -(-self.window_tail // chunk_size)))
        return GroupNeed(Need.PREFIX)

    @cached_property
    def layers(self) -> bytes:
        """The chunk header's ``layers`` field (a digest: kept, every object's header names it)."""
        return layers_digest(self.layer_names)

    @cached_property
    def spec(self) -> str:
        """The chunk header's ``spec`` field (recurrent groups: the state tensors)."""
        if self.kind is not GroupKind.RECURRENT:
            return ""
        return state_spec((t.dtype, t.shape) for t in self.state)

    def unsupported(self) -> str | None:
        """Why the plugin cannot store this group (None: it can)."""
        if self.kind is GroupKind.RECURRENT:
            if self.state_mode != "align":
                return (f"mamba_cache_mode is {self.state_mode!r}: only 'align' keeps a state per block "
                        "(it is vLLM's mode with prefix caching on: enable_prefix_caching=True)")
            if self.speculative_blocks:
                return "speculative decoding with a recurrent group is not supported yet"
        return None

    def describe(self) -> str:
        what = {GroupKind.WINDOW: f", window {self.window}",
                GroupKind.RECURRENT: f", state {self.spec}"}.get(self.kind, "")
        return (f"group {self.index} ({self.spec_name}: {self.kind.name.lower()}, "
                f"{self.num_layers} layers, block {self.block_size}{what})")
