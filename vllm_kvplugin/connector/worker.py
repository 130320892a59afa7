"""Worker role: layouts at registration, verified fetches, loads before attention, stores.

Runs in each vLLM worker process.  Call order per step (vLLM): metadata bound
-> ``start_load`` (before the forward when the step loads, which every claimed
hit does; after it otherwise) -> forward -> ``store`` (from ``wait_for_save``)
-> ``take_invalid_blocks`` / ``take_meta``.

``start_load`` first *fetches* every hit the scheduler is holding back
(:class:`~vllm_kvplugin.connector.worker_fetch.FetchPath`: objects read and
verified, the verdict to the scheduler, views of the verified bytes kept), then
*loads* claimed hits from those verified views only.  A load can thus only fail
on a copy error: its blocks are then reported to vLLM (by default vLLM ends the
request with an error and drops the blocks from its prefix cache:
``load_failure_policy``), and every store of the step and of later metadata up
to the scheduler's next epoch is dropped (computed over blocks the load never
wrote).  Nothing here may crash the engine or serve doubtful KV.  Stores are
:class:`~vllm_kvplugin.connector.worker_stores.StorePath`'s.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.checksums import (
    PARALLEL_MIN_BYTES,
    payload_checksums,
)
from vllm_kvplugin.chunk.format import (
    ChunkError,
    ChunkExpect,
    dtype_name,
)
from vllm_kvplugin.config import KVPluginConfig
from vllm_kvplugin.connector import bad_blocks, finisher
from vllm_kvplugin.connector.finisher import StoreFinisher
from vllm_kvplugin.connector.metadata import (
    KVPluginMetadata,
    KVPluginWorkerMeta,
    LoadJob,
    LoadRequest,
    StoreJob,
)
from vllm_kvplugin.connector.verdicts import find_box
from vllm_kvplugin.connector.worker_fetch import FetchPath, Sent, _Verifying
from vllm_kvplugin.connector.worker_stores import StorePath
from vllm_kvplugin.layout import KVLayout, LayoutError, build_layout, certify
from vllm_kvplugin.layout.state import (
    StateSource,
    certify_state,
    check_state,
    scatter_state,
)
from vllm_kvplugin.tiers.local_cpu import LocalPool, slots_for_budget
from vllm_kvplugin.tiers.mp import ServerStore
from vllm_kvplugin.transfer import TransferEngine, engine_for
from vllm_kvplugin.transfer.host_buffers import HostBuffers, default_capacity
from vllm_kvplugin.transfer.placement import PlacedObjects

logger = logging.getLogger(__name__)


#: the worker half registered last in this process (``vllm-kvplugin verify`` reads it)
_REGISTERED: weakref.ref | None = None


def registered() -> WorkerSide | None:
    """This process's registered worker half, if any (one per vLLM worker process)."""
    return _REGISTERED() if _REGISTERED is not None else None


class WorkerSide(FetchPath, StorePath):
    """The worker half of :class:`~vllm_kvplugin.connector.KVPluginConnector`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: KVPluginConfig,
                 adapter: Any, vllm_version: str):
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.adapter = adapter
        self.vllm_version = vllm_version
        self.groups = _common.group_specs(kv_cache_config, vllm_config)
        self.chunk_size = cfg.resolve_chunk_size([g.block_size for g in self.groups])
        self.fingerprint = b""  # the scheduler's, from the first metadata on (see bind)
        self.rank, self.world = 0, _common.model_parallel_world(vllm_config)
        self._engine_id = _common.engine_id(vllm_config)  # finds the scheduler half's verdict box
        self.server: ServerStore | None = None
        self.layouts: list[KVLayout | StateSource] = []  # per group (recurrent: its state views)
        self.layers: list[Any] = []  # per group: layer tensors (recurrent: per layer, its state views)
        self.pool: LocalPool | None = None
        self.device = torch.device("cpu")
        self.engine: TransferEngine | None = None
        self._invalid_blocks: set[int] = set()
        self._meta = KVPluginWorkerMeta()
        self.finisher: StoreFinisher | None = None  # made at registration (it needs the engine)
        self._private: HostBuffers | None = None  # where server objects are gathered and hashed
        self._staged: dict[str, dict[tuple[int, int], torch.Tensor]] = {}  # verified objects per request
        self._prefetched: dict[str, list[Sent]] = {}  # what each fetch sent toward the device
        self._verifying: dict[str, _Verifying] = {}  # fetches whose verdict is still due
        self._provisional: set[str] = set()  # fetches claimed before their verdict (worker_fetch.py)
        self._loaded_unverified: dict[str, tuple[LoadRequest, int]] = {}  # their loads, verdict still due
        self._refuted: dict[str, int] = {}  # such fetches refuted before their load: first bad chunk
        self._idle = False  # the bound step schedules no tokens (KVPluginMetadata.idle)
        self._progress = threading.Event()  # set when a fetch's hashes or a store are done
        self._failed_epoch = -1  # metadata up to this epoch was built before a failed load was known
        #: bad blocks the scheduler half reports in this step (``connector/bad_blocks.py``), and this
        #: worker's own failed ones until metadata built after the scheduler learned of them
        self._reported: frozenset[int] = frozenset()
        self._unacked: set[int] = set()
        self._tracks_bad = bad_blocks.tracked(cfg.load_failure_policy, self.groups)
        self._attached = False  # fetch_now is in the scheduler half's box

    # ------------------------------------------------------------- registration
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Build and certify one layout per group, then allocate the pool (start-up errors raise)."""
        self.rank, self.world = _common.model_parallel_rank(self.vllm_config)
        sources = self.adapter.describe_groups(self.vllm_config, self.kv_cache_config, kv_caches,
                                               self.vllm_version)
        for src, spec in zip(sources, self.groups):
            if spec.is_state:
                state = self.adapter.describe_state(self.vllm_config, self.kv_cache_config, spec, kv_caches,
                                                    self.vllm_version)
                check_state(spec, state)
                if self.cfg.certify:
                    certify_state(spec, state)
                logger.info("vllm-kvplugin worker %d/%d: %s", self.rank, self.world, spec.describe())
                self.layouts.append(state)
                self.layers.append(state.views)
                continue
            layout, layers = build_layout(*src, spec.kind)
            if layout.bytes_per_token != spec.bytes_per_token:
                raise LayoutError(
                    f"vllm-kvplugin: {layout.describe()} holds {layout.bytes_per_token} bytes per "
                    f"token but the KV cache spec implies {spec.bytes_per_token}")
            if self.cfg.certify:
                certify(layout, layers)
            logger.info("vllm-kvplugin worker %d/%d: %s", self.rank, self.world, layout.describe())
            self.layouts.append(layout)
            self.layers.append(layers)
        self.device = next(t.device for t in kv_caches.values() if isinstance(t, torch.Tensor))
        self.engine = engine_for(self.device, self.cfg.gpu_staging_bytes)
        self.finisher = StoreFinisher(self.engine, self._finish,
                                      asynchronous=self.device.type == "cuda" or finisher.ASYNC_ON_HOST,
                                      on_done=self._stores_finished)
        step_chunks = -(-_common.max_batched_tokens(self.vllm_config) // self.chunk_size) + 1
        for g, layout in enumerate(self.layouts):  # a first hit as fast as later ones
            if not self.groups[g].is_state:  # and a buffer for a full step's store, or a hit that size
                self.engine.warm_up(layout, self.layers[g], self.groups[g].stored_tokens(self.chunk_size),
                                    keep_bytes=step_chunks * self.groups[g].object_bytes(self.chunk_size))
        payload_checksums([memoryview(bytearray(PARALLEL_MIN_BYTES))] * 2)  # the hashing threads
        num_slots = slots_for_budget(self.cfg.cpu_bytes, [g.object_bytes(self.chunk_size) for g in self.groups])
        pin = self.device.type == "cuda"
        self.pool = LocalPool([self._shape(g) for g in range(len(self.groups))],
                              [self._dtype(g) for g in range(len(self.groups))], num_slots, pin_memory=pin)
        if self.cfg.server:
            self.server = ServerStore(self.cfg, self.rank, self.world, f"worker{self.rank}", pin_for_cuda=pin)
            nbytes = self._staging_bytes()
            try:
                self._private = HostBuffers(nbytes, pin=pin)
            except RuntimeError as e:
                raise RuntimeError(f"vllm-kvplugin: cannot allocate {nbytes} bytes of host memory for "
                                   f"server_staging_bytes ({e}); set server_staging_bytes lower") from e
        global _REGISTERED
        _REGISTERED = weakref.ref(self)
        self._attach()

    def _attach(self) -> None:
        """Offer :meth:`fetch_now` and :meth:`load_now` to the scheduler half's box (an engine of
        one rank whose scheduler half is in this process; it may be made after this one: tried
        every step until it is there)."""
        box = self._box()
        if box is not None:
            box.attach_worker(self.fetch_now, self.load_now)
            self._attached = True

    def _staging_bytes(self) -> int:
        """Room for the server objects of the stores in flight that pass through private memory
        (``server_staging_bytes``; unset: :func:`~vllm_kvplugin.transfer.host_buffers.default_capacity`
        of a full step, ``max_num_batched_tokens`` and a chunk)."""
        if self.cfg.server_staging_bytes is not None:
            return self.cfg.server_staging_bytes
        C = self.chunk_size
        chunks = -(-_common.max_batched_tokens(self.vllm_config) // C) + 1
        return default_capacity([(chunks * g.object_bytes(C), g.is_state) for g in self.groups],
                                self.engine.undigested_store_max())

    @property
    def _token_group(self) -> int:
        """The group whose stored tokens ``stored_tokens`` counts (the first with tokens)."""
        return next((g.index for g in self.groups if not g.is_state), -1)

    def _dtype(self, g: int) -> torch.dtype:
        return torch.uint8 if self.groups[g].is_state else self.layouts[g].dtype

    def _shape(self, g: int) -> tuple[int, ...]:
        """Payload shape of one object of group ``g`` (recurrent: ``[L, 1, 1, 1, state bytes]``)."""
        spec = self.groups[g]
        if spec.is_state:
            return (spec.num_layers, 1, 1, 1, spec.state_bytes // spec.num_layers)
        return self.layouts[g].chunk_shape(spec.stored_tokens(self.chunk_size))

    def placed(self, jobs: Sequence[LoadJob | StoreJob]) -> PlacedObjects:
        """Where the objects of ``jobs`` (one group) are in the paged cache: their blocks, and
        each job's ``[lo, hi)`` as the tokens moved."""
        g, spec = jobs[0].group, self.groups[jobs[0].group]
        tokens = spec.stored_tokens(self.chunk_size)
        where = np.fromiter(itertools.chain.from_iterable((j.position, j.lo, j.hi) for j in jobs),
                            dtype=np.int64, count=3 * len(jobs)).reshape(-1, 3)
        firsts = spec.object_starts(where[:, 0], self.chunk_size)
        return PlacedObjects.of([j.block_ids for j in jobs], self.layouts[g].block_size, tokens,
                                where[:, 1] - firsts, where[:, 2] - firsts)

    def object_slots(self, jobs: Sequence[LoadJob | StoreJob]) -> torch.Tensor:
        """``[C, T]`` paged slots of the objects of ``jobs`` (one group): tokens outside each
        job's ``[lo, hi)`` are -1."""
        return self.placed(jobs).slots()

    def _expect(self, g: int, key: bytes, position: int) -> ChunkExpect:
        spec = self.groups[g]
        start, end = spec.object_tokens(position, self.chunk_size)
        return ChunkExpect(self.fingerprint, key, int(spec.kind), dtype_name(self._dtype(g)), self._shape(g),
                           start, end, self.world, self.rank, g, spec.layers, spec.spec)

    # ------------------------------------------------------------ verification
    def start_load(self, meta: KVPluginMetadata) -> None:
        for rid in meta.forget:
            self._forget(rid)
        for fetch in meta.fetches:
            self._fetch(fetch)
        for req in meta.loads:
            self._load(req, meta.epoch)

    def _box(self):
        """The scheduler half's box when it is in this process and the engine has one rank (else
        verdicts and finished stores go with the step's metadata)."""
        return find_box(self._engine_id) if self.world == 1 else None

    def _stores_finished(self) -> None:
        """After each store the finisher completed (on its thread): in an engine of one rank whose
        scheduler half is in this process its results go straight into the scheduler's box (an
        idle engine would otherwise tell it only with the next step's output); then a waiting
        idle step wakes."""
        box = self._box()
        if box is not None:
            done = KVPluginWorkerMeta()
            self.finisher.take(done)
            box.post_stores(done.stored, done.store_failed, done.store_done)
        self._progress.set()

    # -------------------------------------------------------------------- loads
    def load_now(self, req: LoadRequest, epoch: int) -> None:
        """Called by the scheduler half of an engine of one rank (through its box), on vLLM's
        thread, in ``update_state_after_alloc``: vLLM has just allocated the blocks of a claimed
        hit, and this step's forward (whose inputs it prepares next) is the first to read them.
        The load is issued now instead of from the step's metadata, so its scatter runs on the
        device while vLLM prepares the step.  As from :meth:`start_load`: the compute stream waits
        for it, and what it did (done, or its blocks failed) goes with this step's output."""
        with torch.inference_mode():  # as on vLLM's thread in a step, whose tensors these are
            self._load(req, epoch)

    def _rehearse_load(self) -> None:
        """From :meth:`fetch_now` while a lone hit's copy ends (``worker_fetch.REHEARSE_LOADS``):
        the load's host path once over no object -- an empty placement per group and the
        transfer engine's :meth:`~vllm_kvplugin.transfer.TransferEngine.rehearse` -- so that its
        code and data are in the caches when the claimed load runs.  Moves nothing; never raises."""
        try:
            with torch.inference_mode():
                for g, spec in enumerate(self.groups):
                    if spec.is_state:
                        continue
                    layout, tokens = self.layouts[g], spec.stored_tokens(self.chunk_size)
                    placed = PlacedObjects.of([[0] * (tokens // layout.block_size)], layout.block_size, tokens, [0], [0])
                    placed.count()
                    self.engine.rehearse(layout, self.layers[g], placed)
        except Exception:  # a rehearsal is an optimization: the load itself reports its own trouble
            logger.debug("vllm-kvplugin: a load's rehearsal failed", exc_info=True)

    def _load(self, req: LoadRequest, epoch: int) -> None:
        """Copy a claimed hit's verified objects into the KV cache (before the forward that
        reads them: from the step's metadata or :meth:`load_now`)."""
        t0 = time.perf_counter()
        staged = self._staged.get(req.req_id, {})
        prefetched = self._prefetched.get(req.req_id, ())
        provisional = req.req_id in self._provisional  # claimed before its verdict (worker_fetch.py)
        try:
            if req.req_id in self._refuted:  # its digests came in before the load: it fails as a whole
                raise ChunkError("refuted", f"objects from chunk {self._refuted.pop(req.req_id)} failed their digests")
            work, states, moved = [], [], [0] * len(self.groups)
            for g, spec in enumerate(self.groups):
                jobs = [j for j in req.jobs if j.group == g]
                if not jobs:
                    continue
                srcs = []
                for j in jobs:
                    src = staged.get((j.position, g))
                    if src is None:
                        raise ChunkError("missing", f"chunk {j.position} of group {g} was not verified")
                    srcs.append(src)
                if spec.is_state:  # one state, into the hit's block and the step's
                    for j, src in zip(jobs, srcs):
                        if not j.block_ids or not all(j.block_ids):
                            raise ChunkError("plan", f"state of chunk {j.position} into blocks {j.block_ids}")
                        states += [(self.layers[g], b, src.view(spec.num_layers, -1)) for b in j.block_ids]
                        moved[g] += spec.state_bytes
                    continue
                layout = self.layouts[g]
                # on the device already (one prefetch or two): scattered by one call, in the
                # prefetches' order; the rest goes over the link
                from_prefetches, prefetched_jobs = [], []
                for s in prefetched:
                    part = [i for i, j in enumerate(jobs) if j.position in s.rows] if s.group == g else []
                    if part:
                        from_prefetches.append((s.pre, [s.rows[jobs[i].position] for i in part]))
                        prefetched_jobs += part
                linked = sorted(set(range(len(jobs))) - set(prefetched_jobs))
                for part, sources in ((prefetched_jobs, from_prefetches), (linked, None)):
                    if not part:
                        continue
                    where = self.placed([jobs[i] for i in part])
                    moved[g] += where.count() * layout.bytes_per_token
                    work.append((layout, self.layers[g], where, [srcs[i] for i in part], sources))
            if tuple(moved) != tuple(req.expected_bytes):  # checked before a byte is written
                raise ChunkError("byte_mismatch", f"would move {moved} bytes, planned {list(req.expected_bytes)}")
            for layout, layers, where, bufs, sources in work:
                self.engine.load(layout, layers, where, bufs, staged=sources)
            for views, block, src in states:
                scatter_state(views, block, src)
        except Exception as e:  # never crash the engine: the blocks go to vLLM as failed
            reason = e.reason if isinstance(e, ChunkError) else "error"
            if reason == "refuted":  # (counted by its digests' verdict)
                logger.warning("vllm-kvplugin: load of %s refused: %s", req.req_id, e)
            else:
                logger.exception("vllm-kvplugin: load of %s failed after its claim (%s); its blocks are "
                                 "reported to vLLM (load_failure_policy: %s)", req.req_id, reason,
                                 self.cfg.load_failure_policy)
                counters.WORKER.failure(reason)
            self._failed_load(req.req_id, req.jobs, epoch)
            provisional = False
        else:
            counters.WORKER.add(loaded_tokens=req.num_tokens, loaded_bytes=sum(moved),
                                load_seconds=time.perf_counter() - t0)
        finally:
            self._forget(req.req_id, keep_verdict=provisional)
        if provisional:
            self._loaded_unverified[req.req_id] = (req, epoch)
        self._meta.loads_done[req.req_id] = self._meta.loads_done.get(req.req_id, 0) + 1

    def _failed_load(self, req_id: str, jobs: Sequence[LoadJob], epoch: int) -> None:
        """``jobs`` of ``req_id``'s load (from metadata of ``epoch``) did not put the right KV into
        their blocks: the blocks go to vLLM as invalid in this step's output (and, under the
        ``recompute`` policy, in later ones until the scheduler half reports them), the scheduler
        half learns which, and the stores of metadata up to ``epoch`` are dropped."""
        blocks = {b for j in jobs for b in j.block_ids if b}
        self._invalid_blocks |= blocks
        self._meta.failed_blocks |= blocks
        if self._tracks_bad:
            self._unacked |= blocks
        first = min(j.position for j in jobs)
        self._meta.load_failed[req_id] = min(first, self._meta.load_failed.get(req_id, first))
        self._failed_epoch = max(self._failed_epoch, epoch)

    def bind(self, meta: KVPluginMetadata) -> None:
        """Every step, before the forward: take the scheduler's fingerprint; the compute stream
        must not overwrite blocks that stores still read."""
        self.fingerprint = meta.fingerprint
        self._idle = meta.idle
        self._reported = meta.bad_blocks
        if meta.epoch > self._failed_epoch:
            self._unacked.clear()  # the scheduler half's report holds them from now on
        if not self._attached and self.engine is not None:
            self._attach()
        self.engine.fence()
        self.pump()

    def pump(self) -> None:
        """From vLLM's thread, at every hook it passes (each attention layer, a step's start and
        end): the transfer engine issues more of its paced store DMAs.  Never raises: a DMA
        that cannot be issued fails its store (its ticket), not vLLM's forward."""
        if self.engine is None:
            return
        try:
            self.engine.pump()
        except Exception:
            logger.exception("vllm-kvplugin: issuing paced store DMAs failed")

    def close(self) -> None:
        """At vLLM's connector shutdown: the stores in flight finish (bounded), the finisher's
        thread ends, held device staging is released and the server connection closes; what
        this worker holds (KV cache views, tiers, staging) is then freed with it."""
        if self.finisher is not None and not self.finisher.close():
            logger.warning("vllm-kvplugin: stores still in flight at shutdown may not be kept")
        for req_id in list(self._prefetched):
            self._forget(req_id)
        if self.server is not None:
            self.server.close()

    # ------------------------------------------------------------------ results
    def take_invalid_blocks(self) -> set[int]:
        """The step's blocks for vLLM's ``get_block_ids_with_load_errors``: those of loads that
        failed in it (a load claimed before its verdict is settled first) and, under the
        ``recompute`` policy, every bad block not yet recomputed (vLLM truncates each request
        that read one; ``connector/bad_blocks.py``)."""
        self._settle_unverified_loads()
        out, self._invalid_blocks = self._invalid_blocks | self._reported | self._unacked, set()
        return out

    def take_meta(self) -> KVPluginWorkerMeta | None:
        """Every step, after it: what finished since the last one (verdicts, stores, loads)."""
        self.pump()
        self._settle_unverified_loads()
        self._settle(wait=self._idle)
        self.finisher.take(self._meta)
        if self._meta.is_empty():
            return None
        out, self._meta = self._meta, KVPluginWorkerMeta()
        return out
