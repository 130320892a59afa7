"""The in-process CPU tier: a scheduler-side index and a worker-side slot pool.

Each KV cache group has its own slots (one object of that group each) and its
own index: a chunk position may be present for one group and not another (a
recurrent group keeps state checkpoints only where vLLM materialised them).
The budget ``cpu_bytes`` gives every group the same number of slots
(:func:`slots_for_budget`).  The scheduler owns the indexes (key -> slot, LRU,
pins) and decides every store and eviction, so all ranks of an engine hold the
same slot numbering; each worker owns the bytes of its slots.  An object is
stored once however many requests share it.

Slot lifecycle (scheduler side)::

    free --allocate--> PENDING (pinned; invisible to lookups)
         --commit ok (all ranks stored)--> READY (evictable when unpinned)
         --commit failed / drop--> free
    READY --pin (load planned)--> pinned READY --unpin--> READY
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvplugin.chunk.format import HEADER_SIZE


class SlotState(enum.Enum):
    FREE = 0
    PENDING = 1
    READY = 2


@dataclass
class _Slot:
    key: bytes | None = None
    state: SlotState = SlotState.FREE
    pins: int = 0
    doomed: bool = False  # drop as soon as the last pin goes


class LocalIndex:
    """Scheduler-side index of the local CPU tier.  Not thread-safe (scheduler thread only)."""

    def __init__(self, num_slots: int, slot_bytes: int):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY slots, oldest first

    # --- lookups -----------------------------------------------------------
    def ready(self, key: bytes) -> bool:
        """The object is stored by every rank and not doomed."""
        s = self._by_key.get(key)
        return s is not None and self._slots[s].state is SlotState.READY and not self._slots[s].doomed

    def contains(self, key: bytes) -> bool:
        return key in self._by_key

    # --- loads -------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> list[int]:
        slots = []
        for k in keys:
            s = self._by_key[k]
            slot = self._slots[s]
            assert slot.state is SlotState.READY, f"pin of a {slot.state} slot"
            slot.pins += 1
            self._lru.move_to_end(s)
            slots.append(s)
        return slots

    def unpin(self, slot_id: int) -> None:
        slot = self._slots[slot_id]
        if slot.pins <= 0:
            return
        slot.pins -= 1
        if slot.pins == 0 and slot.doomed:
            self._release(slot_id)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark a prefix as recently used, its first chunk most recently: eviction then
        takes the tails of old prefixes first and keeps what remains reachable."""
        for k in reversed(keys):
            s = self._by_key.get(k)
            if s is not None and s in self._lru:
                self._lru.move_to_end(s)

    # --- stores ------------------------------------------------------------
    def allocate(self, key: bytes) -> tuple[int, int] | None:
        """A PENDING slot for ``key`` and the bytes evicted to make room; None if full or known."""
        if key in self._by_key:
            return None
        evicted = 0
        if not self._free:
            victim = next((s for s in self._lru if self._slots[s].pins == 0), None)
            if victim is None:
                return None
            self._release(victim)
            evicted = self.slot_bytes
        s = self._free.pop()
        self._slots[s] = _Slot(key=key, state=SlotState.PENDING, pins=1)
        self._by_key[key] = s
        return s, evicted

    def commit(self, slot_id: int, ok: bool) -> None:
        """A store finished on every rank (``ok``) or failed on at least one."""
        slot = self._slots[slot_id]
        if slot.state is not SlotState.PENDING:
            return
        slot.pins -= 1
        if ok and not slot.doomed:
            slot.state = SlotState.READY
            self._lru[slot_id] = None
        else:
            slot.doomed = True
            if slot.pins == 0:
                self._release(slot_id)

    def drop(self, slot_id: int) -> None:
        """Forget a chunk that failed a load; freed once nobody holds it."""
        slot = self._slots[slot_id]
        if slot.state is SlotState.FREE:
            return
        slot.doomed = True
        if slot.key is not None and self._by_key.get(slot.key) == slot_id:
            del self._by_key[slot.key]
        if slot.pins == 0:
            self._release(slot_id)

    def _release(self, slot_id: int) -> None:
        slot = self._slots[slot_id]
        if slot.key is not None and self._by_key.get(slot.key) == slot_id:
            del self._by_key[slot.key]
        self._lru.pop(slot_id, None)
        self._slots[slot_id] = _Slot()
        self._free.append(slot_id)

    def state(self, slot_id: int) -> SlotState:
        return self._slots[slot_id].state

    def clear(self) -> None:
        """Forget every object (``reset_cache``), also those pinned by a load or still being
        stored: they can never be found again, and their slots free when the last pin goes."""
        for s, slot in enumerate(self._slots):
            if slot.state is not SlotState.FREE:
                self.drop(s)


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class LocalPool:
    """Worker-side bytes of the local CPU tier: per group ``[slots, *object shape]`` plus headers.

    Pages are touched lazily (``torch.empty``); on CUDA machines the pool is
    page-locked so copies to and from the GPU run at DMA speed.
    """

    def __init__(self, chunk_shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                 num_slots: int, pin_memory: bool):
        self.num_slots = num_slots
        self.payloads = [
            torch.empty((num_slots, *shape), dtype=dt, pin_memory=pin_memory)
            for shape, dt in zip(chunk_shapes, dtypes)
        ]
        self.headers: list[list[bytes | None]] = [[None] * num_slots for _ in chunk_shapes]
        self._views: list[list[tuple[memoryview, torch.Tensor] | None]] = [[None] * num_slots for _ in chunk_shapes]

    def payload(self, group: int, slot: int) -> torch.Tensor:
        """The slot's object as ``[1, *object shape]`` (attention: ``[1, L, KV, T, H, D]``)."""
        return self.payloads[group][slot:slot + 1]

    def views(self, group: int, slot: int) -> tuple[memoryview, torch.Tensor]:
        """The slot's payload bytes and :meth:`payload`, made once per slot (the pool never
        moves): a fetch reads every object of a hit on vLLM's thread before its copy starts."""
        v = self._views[group][slot]
        if v is None:
            t = self.payload(group, slot)
            v = self._views[group][slot] = (bytes_of(t), t)
        return v

    def set_header(self, group: int, slot: int, header: bytes | None) -> None:
        assert header is None or len(header) == HEADER_SIZE
        self.headers[group][slot] = header

    def header(self, group: int, slot: int) -> bytes | None:
        return self.headers[group][slot]


def slots_for_budget(cpu_bytes: int, object_bytes: Sequence[int]) -> int:
    """Slots per group: every group gets as many as the budget holds objects of all groups."""
    total = sum(object_bytes)
    return 0 if total <= 0 else cpu_bytes // total
