"""What the scheduler tells the workers each step, and what they report back.

Both travel through vLLM (pickled inside ``SchedulerOutput`` / aggregated over
ranks in ``KVConnectorOutput``), so they are plain dataclasses of builtins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kvplugin.adapters.api import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkJob:
    """Move one chunk between the paged cache and its tier locations.

    ``block_ids[g]`` are group ``g``'s blocks covering the chunk's tokens.
    Tokens ``[skip, take)`` of the chunk are moved; the rest is left alone
    (already computed by vLLM, or past the planned end).

    Where: ``slot`` is a local CPU tier slot (-1: none).  A load with a
    ``lease`` reads the chunk from the cache server under that lease; a store
    with ``to_server`` also writes it to the server.
    """

    key: bytes
    chunk_index: int
    slot: int
    block_ids: tuple[tuple[int, ...], ...]
    skip: int = 0
    take: int = -1  # -1: to the end of the chunk
    lease: int = 0
    to_server: bool = False


@dataclass
class LoadRequest:
    req_id: str
    jobs: list[ChunkJob]
    expected_bytes: tuple[int, ...]  # per group, from the planner


@dataclass
class StoreRequest:
    req_id: str
    jobs: list[ChunkJob]


@dataclass
class KVPluginMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    stores: list[StoreRequest] = field(default_factory=list)


@dataclass
class KVPluginWorkerMeta(KVConnectorWorkerMetadata):
    """One step's results of one or (after :meth:`aggregate`) all ranks."""

    stored: dict[int, int] = field(default_factory=dict)  # slot -> ranks that stored it
    store_failed: set[int] = field(default_factory=set)
    loads_done: dict[str, int] = field(default_factory=dict)  # req id -> ranks done
    load_failed: dict[int, str] = field(default_factory=dict)  # slot -> reason

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPluginWorkerMeta:
        assert isinstance(other, KVPluginWorkerMeta)
        out = KVPluginWorkerMeta(dict(self.stored), set(self.store_failed),
                                 dict(self.loads_done), dict(self.load_failed))
        for k, v in other.stored.items():
            out.stored[k] = out.stored.get(k, 0) + v
        out.store_failed |= other.store_failed
        for k, v in other.loads_done.items():
            out.loads_done[k] = out.loads_done.get(k, 0) + v
        for k, v in other.load_failed.items():
            out.load_failed.setdefault(k, v)
        return out

    def is_empty(self) -> bool:
        return not (self.stored or self.store_failed or self.loads_done or self.load_failed)
