"""Transfers between a CUDA KV cache and page-locked host buffers.

Two paths, chosen per call from the direction and the byte count (never
switched in the middle of a call, never a fallback after a failure):

* **staged** (copy engine): a gather kernel packs the chunks into a device
  staging buffer, then async DMAs (one per chunk, or one per run of chunks
  whose host buffers are adjacent) move staging -> host; loads do the reverse
  (H2D DMAs, then a scatter kernel).  The chunks are split in groups of 1, 1,
  2, 4, ... so the first DMA starts after one chunk's gather and the kernels
  overlap the DMAs of earlier groups.  A DMA moves whole chunks, so in a
  staged store the chunks with skipped tokens (slot -1: partial first/last
  chunks) are written by the zero-copy kernel instead, which leaves the host
  bytes of skipped tokens alone, as the contract says.
* **zero-copy**: one kernel reads/writes the page-locked host buffers
  directly through their device mapping (unified addressing), with a capped
  grid.  No staging and one launch.

Thresholds, measured on an H200 over PCIe gen5 x16 (pinned copy ceiling
55 GB/s; ``benchmarks/NOTES.md``, ``benchmarks/results/gpu-xfer-h200.json``):

* load: zero-copy was faster than (or equal to) staged at every measured size
  up to 32 MiB (131 kB chunks: 1.3 ms vs 1.9 ms for 32 MiB; 2.4 MB chunks: 0.89
  vs 0.90 ms for 36 MiB); staged won at one 37.7 MB chunk (815 vs 848 us) and
  above.  Threshold 32 MiB.
* store: zero-copy was faster in isolation up to one 37.7 MB chunk too, but a
  zero-copy store holds the next forward (:meth:`CudaTransfer.fence`) until its
  bytes crossed the link, while a staged store releases the blocks after a
  gather of a few microseconds.  Threshold 4 MiB (about 75 us of link time).

Ordering (the :class:`~vllm_kvplugin.transfer.TransferEngine` contract):

* ``store`` records an event on the caller's (compute) stream; the side stream
  waits on it before the gather reads the paged cache.  The gather's
  completion event is kept until :meth:`fence`, which makes the compute stream
  wait on it, so the next forward cannot overwrite a block before the gather
  read it.  A ``load`` issued before the fence also waits on it (its scatter
  may target a reused block).  The ticket is the event after the last DMA.
* ``load`` makes the compute stream wait on the "scatter done" event before
  returning: attention issued afterwards reads the loaded bytes.  No host sync.
  A staged load of a prefetch scatters on the compute stream itself (after the
  stores still gathering from the cache).
* A staging buffer is reused only after the DMA/kernel that last used it is
  done (device-side waits); a host buffer that a pending load still reads is
  not overwritten by a later store's DMA before that read.

Payload digests on the device (``kvplugin::segment_digests``, the chunk format's segmented
xxh3): :meth:`CudaTransfer.digest` hashes a prefetch's rows where they landed, on a stream of
their own, each piece's after it arrived, so a hit is verified over the very bytes a load
scatters and the host never reads them; a staged store hashes its staging rows after the
gathers (:meth:`CudaTransfer.checksums` gives the values once its ticket is done), so the
host does not hash what it stores either.  Only the digests (8 bytes per 256 KiB) cross the link.

Paced stores (``transfer/paced.py``): a store's DMAs wait in a queue that
:meth:`CudaTransfer.pump` feeds to the copy engine a piece at a time, because
vLLM's own small copies wait behind every DMA queued there.  A staging buffer
whose store has pieces left is not handed out again until they are issued.

Staging buffers are allocated outside vLLM's memory profile: a staged call
needs one device buffer of its own size (``max_staging_buffers`` of them at
most, ``staging_cap_bytes`` beyond the first).  By default the cap follows the
device: a quarter of its memory, and never more than the staging already held
plus what the device has free beyond a reserve (:data:`STAGING_RESERVE_BYTES`),
read when a buffer would grow.  So a long hit (64k tokens of an 8B model: 9.7
GB) is prefetched whole while it is verified, where the memory is there, and a
tighter device prefetches less (the load copies the rest itself).  A staging
allocation that fails anyway is no prefetch (the load copies), never an error.
Which buffer a call takes is ``staging_choice.choose_staging``: a prefetch, which
holds its buffer until its load, never keeps one much larger than it needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from vllm_kvplugin import ops
from vllm_kvplugin.chunk.format import SEGMENT_BYTES, segment_count
from vllm_kvplugin.layout.descriptor import KVLayout
from vllm_kvplugin.transfer.cuda_handles import DeviceDigests, Prefetch, Staging
from vllm_kvplugin.transfer.cuda_pieces import (
    host_runs,
    launch_groups,
    prefetch_pieces,
    staged_runs,
)
from vllm_kvplugin.transfer.cuda_stores import StorePath
from vllm_kvplugin.transfer.paced import PacedCopies
from vllm_kvplugin.transfer.placement import PlacedObjects
from vllm_kvplugin.transfer.staging_choice import StagingChoice, StagingState, choose_staging

logger = logging.getLogger(__name__)

#: at or below this many bytes a store uses the zero-copy kernel (see the module doc)
STORE_ZERO_COPY_MAX_BYTES = 4 << 20
#: at or below this many bytes a load uses the zero-copy kernel (measured crossover)
LOAD_ZERO_COPY_MAX_BYTES = 32 << 20
#: grid cap of the zero-copy kernel: it runs at link speed, it need not hold every SM
ZERO_COPY_MAX_CTAS = 64
#: a prefetch is copied in at most this many pieces, its last object alone (``prefetch_pieces``;
#: a scatter waits only for its rows' piece)
PREFETCH_PIECES = 8
#: a store's DMAs go in pieces of whole chunks of about this many bytes (at least one chunk)
DMA_PIECE_BYTES = 32 << 20
#: at most this many store pieces queued on the copy engine at once (see "Paced stores")
DMA_WINDOW = 1
#: the automatic staging cap leaves at least this much of the device free
STAGING_RESERVE_BYTES = 2 << 30
#: a staged load given block ids (:class:`~vllm_kvplugin.transfer.placement.PlacedObjects`) hands
#: them to ``kvplugin::scatter_blocks``, which places each token in C++ (False: the per-token slots
#: are built in numpy and checked, then ``scatter_multi``, as before; the A/B's other side)
SCATTER_BY_BLOCKS = True
#: ``scatter_blocks`` writes each block of a layout whose blocks are dense runs (vLLM's NHD, MLA)
#: with its block-run kernel, from the block's offset alone (no per-token table; on an H100 at 8k
#: 0.93 ms against the per-token kernel's 0.98, ``results/gpu-load-host-h100-block-runs.json``).
#: False: every layout takes the per-token kernel (bench mode ``kvplugin-per-token``).
BLOCK_RUNS = True


class CudaTransfer(StorePath):
    """Staged-DMA / zero-copy transfer engine for a KV cache on one CUDA device."""

    def __init__(self, device: torch.device | str | int, *,
                 store_zero_copy_max_bytes: int = STORE_ZERO_COPY_MAX_BYTES,
                 load_zero_copy_max_bytes: int = LOAD_ZERO_COPY_MAX_BYTES,
                 zero_copy_max_ctas: int = ZERO_COPY_MAX_CTAS,
                 max_staging_buffers: int = 4,
                 staging_cap_bytes: int | None = None,
                 dma_piece_bytes: int | None = None,
                 dma_window: int | None = None):
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        info = ops.load()
        # The choice of implementation happens here, once.
        # (a build of an older source lacks the later ops: the torch path then, never a missing op)
        self.kernel = info.cuda == "CUDA kernel" and all(
            hasattr(torch.ops.kvplugin, op) for op in ("dma_to_host", "scatter_blocks"))
        #: payload digests computed on the device (loads verified there, stores hashed there)
        self.digests = self.kernel and hasattr(torch.ops.kvplugin, "segment_digests")
        if self.kernel:
            self.name = "cuda"
            self.store_zc_max = store_zero_copy_max_bytes
            self.load_zc_max = load_zero_copy_max_bytes
        else:
            self.name = "cuda-torch"
            self.store_zc_max = self.load_zc_max = -1  # the torch path has no zero-copy
            logger.warning("vllm-kvplugin: CUDA gather/scatter kernel not built (%s); the GPU "
                           "transfer path uses the pure-torch ops (correct, slower)", info.describe())
        self.zc_max_ctas = zero_copy_max_ctas
        self.max_staging_buffers = max(1, max_staging_buffers)
        self.dma_piece_bytes = DMA_PIECE_BYTES if dma_piece_bytes is None else dma_piece_bytes
        self.dma_window = max(1, DMA_WINDOW if dma_window is None else dma_window)
        self._fixed_cap = staging_cap_bytes  # None: follows the device (see the module doc)
        with torch.cuda.device(device):
            self._kern = torch.cuda.Stream(device)  # gather / scatter kernels
            self._d2h = torch.cuda.Stream(device)  # staging -> host DMAs
            self._h2d = torch.cuda.Stream(device)  # host -> staging DMAs
            self._dig = torch.cuda.Stream(device)  # payload digests (and their copy to the host)
            self._joins = torch.cuda.Stream(device)  # events joining others (_join)
        self._pool: list[Staging] = []
        self._uses = 0
        self._pending_gathers: list[torch.cuda.Event] = []
        self._host_reads: dict[int, torch.cuda.Event] = {}
        self._paced = PacedCopies(device, self._d2h, self.dma_window, self._to_host, self._issued)

    def __del__(self):
        # staging buffers may still be read or written by queued copies: let the
        # caching allocator wait for those streams before it reuses the memory
        try:
            for e in self._pool:
                self._drop(e.tensor)
        except Exception:
            pass

    # ------------------------------------------------------------------ helpers
    def _check(self, layout: KVLayout, slots: torch.Tensor, bufs: Sequence[torch.Tensor],
               read: bool = True) -> torch.Tensor:
        """The slots as a host int64 tensor, each inside the cache; ``read``: the host buffers
        are copied too (their shapes and page-locking checked; a staged load reads none)."""
        if slots.dim() != 2 or slots.shape[0] != len(bufs):
            raise ValueError(f"slots must be [C={len(bufs)}, T], got {tuple(slots.shape)}")
        if read:
            self._check_host(layout, slots.shape[1], bufs)
        if slots.device.type != "cpu":
            slots = slots.cpu()  # synchronizes; the worker passes host slots
        slots = slots.to(torch.int64).contiguous()
        # every slot is checked before the first copy is issued (the ops check again)
        limit = layout.num_blocks * layout.block_size
        if slots.numel():  # numpy: torch's CPU reductions go to its thread pool (see PlacedObjects.slots)
            flat = slots.numpy()
            lo, hi = int(flat.min()), int(flat.max())
            if lo < -1 or hi >= limit:
                raise RuntimeError(
                    f"vllm-kvplugin transfer: slot {lo if lo < -1 else hi} is outside the cache "
                    f"({layout.num_blocks} blocks of {layout.block_size} tokens)")
        return slots

    @staticmethod
    def _check_host(layout: KVLayout, tokens: int, bufs: Sequence[torch.Tensor]) -> None:
        """Each host buffer one contiguous, page-locked chunk object of ``tokens`` tokens."""
        shape = (1, *layout.chunk_shape(tokens))
        pinned: set[int] = set()  # storages found page-locked (pool objects share a few)
        for i, b in enumerate(bufs):
            if tuple(b.shape) != shape or b.dtype != layout.dtype or not b.is_contiguous():
                raise ValueError(f"host buffer {i} is {b.dtype} {tuple(b.shape)}, expected contiguous "
                                 f"{layout.dtype} {shape}")
            base = b.untyped_storage().data_ptr()
            if b.device.type != "cpu" or (base not in pinned and not b.is_pinned()):
                raise ValueError(f"host buffer {i} must be a page-locked CPU tensor")
            pinned.add(base)

    @property
    def staging_cap_bytes(self) -> int:
        """The most device memory staging buffers may hold together (beyond the first one)."""
        if self._fixed_cap is not None:
            return self._fixed_cap
        free, total = torch.cuda.mem_get_info(self.device)
        held = sum(e.tensor.numel() for e in self._pool)
        return max(0, min(total // 4, held + free - STAGING_RESERVE_BYTES))

    def _acquire(self, nbytes: int, hold: bool = False) -> Staging:
        """A staging buffer of >= nbytes (``staging_choice.choose_staging`` picks it); the
        caller's stream must wait on ``busy``.  ``hold``: kept for a prefetch until released
        (never handed out meanwhile)."""
        self._uses += 1
        choice = self._choice(nbytes, hold)
        if choice.index is None:
            e = Staging(self._alloc(nbytes))
            self._pool.append(e)
        else:
            e = self._pool[choice.index]
            if e.pacing is not None:  # its store's last DMAs first (their event becomes ``busy``)
                self._paced.drain(e.pacing)
            if choice.resize:  # its memory goes back first (an allocation that fails leaves it empty)
                self._drop(e.tensor)
                e.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
                e.tensor = self._alloc(nbytes)
        e.last_use = self._uses
        e.held = hold
        return e

    def _choice(self, nbytes: int, hold: bool) -> StagingChoice:
        states = [StagingState(e.tensor.numel(), e.held, e.pacing is not None,
                               e.busy is None or e.busy.query(), e.last_use) for e in self._pool]
        return choose_staging(states, nbytes, hold, lambda: self.staging_cap_bytes, self.max_staging_buffers)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // (2 << 20)) * (2 << 20)  # 2 MiB granules
        with torch.cuda.stream(self._kern):
            return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _drop(self, t: torch.Tensor) -> None:
        """Before the last reference to ``t`` goes: the caching allocator hands its memory out
        again only after the work queued so far on every stream that may use it (digests too)."""
        for s in (self._kern, self._d2h, self._h2d, self._dig):
            t.record_stream(s)

    def _wait_host_reads(self, stream: torch.cuda.Stream, bufs: Sequence[torch.Tensor]) -> None:
        if not self._host_reads:
            return
        for b in bufs:
            ev = self._host_reads.get(b.data_ptr())
            if ev is not None:
                stream.wait_event(ev)

    def _note_host_reads(self, bufs: Sequence[torch.Tensor], ev: torch.cuda.Event) -> None:
        if len(self._host_reads) > 4096:
            self._host_reads = {p: e for p, e in self._host_reads.items() if not e.query()}
        for b in bufs:
            self._host_reads[b.data_ptr()] = ev

    def _gather(self, layout: KVLayout, layers, slots: torch.Tensor, outs: list[torch.Tensor],
                max_ctas: int) -> None:
        if self.kernel:
            torch.ops.kvplugin.gather_multi(list(layers), slots, list(layout.strides), layout.block_size,
                                            layout.kernel_block_size, layout.num_blocks, outs, max_ctas)
        else:
            (out,) = outs
            ops.gather(layers, slots.to(self.device), layout.strides, layout.block_size,
                       layout.kernel_block_size, layout.num_blocks, out)

    def _scatter(self, layout: KVLayout, layers, slots: torch.Tensor | PlacedObjects, srcs: list[torch.Tensor],
                 max_ctas: int) -> None:
        """``slots``: host slots, or placed objects (block ids: only with the kernel)."""
        if isinstance(slots, PlacedObjects):
            self._scatter_placed(layout, layers, slots, srcs, max_ctas)
        elif self.kernel:
            torch.ops.kvplugin.scatter_multi(list(layers), slots, list(layout.strides), layout.block_size,
                                             layout.kernel_block_size, layout.num_blocks, srcs, max_ctas)
        else:
            (src,) = srcs
            ops.scatter(layers, slots.to(self.device), layout.strides, layout.block_size,
                        layout.kernel_block_size, layout.num_blocks, src)

    def _to_host(self, stage: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
        """DMAs on the current stream: one per run of adjacent host buffers."""
        if self.kernel:
            torch.ops.kvplugin.dma_to_host(stage, list(bufs))
        else:
            for i, j, host in host_runs(bufs, 0, len(bufs)):
                host.copy_(stage[i:j], non_blocking=True)

    def _from_host(self, bufs: Sequence[torch.Tensor], stage: torch.Tensor) -> None:
        if self.kernel:
            torch.ops.kvplugin.dma_from_host(list(bufs), stage)
        else:
            for i, j, host in host_runs(bufs, 0, len(bufs)):
                stage[i:j].copy_(host, non_blocking=True)

    @staticmethod
    def _scatter_placed(layout: KVLayout, layers, placed: PlacedObjects, srcs: list[torch.Tensor],
                        max_ctas: int) -> None:
        blocks, spans = placed.tensors()
        torch.ops.kvplugin.scatter_blocks(list(layers), blocks, spans, list(layout.strides), layout.block_size,
                                          layout.kernel_block_size, layout.num_blocks, srcs, max_ctas, BLOCK_RUNS)

    def rehearse(self, layout: KVLayout, layers: Sequence[torch.Tensor], placed: PlacedObjects) -> None:
        """A staged load's host path over no object (``WorkerSide._rehearse_load``): the scatter
        op's argument conversion and checks on an empty chunk list, which return before any
        launch.  Nothing is written, queued or allocated (a 0-byte tensor holds no memory)."""
        if not (self.kernel and SCATTER_BY_BLOCKS):
            return
        with torch.cuda.device(self.device):
            empty = torch.empty((0, *layout.chunk_shape(placed.tokens)), dtype=layout.dtype, device=self.device)
            self._scatter_placed(layout, layers, placed[:0], [empty], 0)  # (not _scatter: no stage timer)

    def _load_staged(self, layout: KVLayout, layers, slots: torch.Tensor | PlacedObjects,
                     parts: Sequence[tuple[Prefetch, Sequence[int]]]) -> None:
        """Scatter prefetched rows into the paged cache: ``parts`` (prefetch, its rows), whose rows
        in order are ``slots``' objects.  Where every part's copy has landed (after a verdict of
        device digests, which waited for all of it) one launch scatters them all; otherwise each
        run of consecutive rows goes after its piece of the copy.  The scatter runs on the compute
        stream itself, after what is queued there (a forward that may still read a reused block)
        and after the stores still gathering from the cache: the forward that reads the loaded
        blocks comes after it, and no event or stream switch is spent on the host."""
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            for ev in self._pending_gathers:  # a pending store may still read a reused block
                compute.wait_event(ev)
            landed = all(pre.event.query() for pre, _ in parts)  # (one stream: its last piece in, all are)
            if landed:
                srcs = [pre.stage[rows[i]:rows[i] + (j - i)] for pre, rows in parts
                        for i, j, _ in staged_runs(rows, None)]
                self._scatter(layout, layers, slots, srcs, 0)
            else:
                at = 0  # the first slot row of this part
                for pre, rows in parts:
                    for i, j, k in staged_runs(rows, [(a, b) for a, b, _ in pre.pieces]):
                        if k is not None:
                            compute.wait_event(pre.pieces[k][2])
                        src = pre.stage[rows[i]:rows[i] + (j - i)]
                        self._scatter(layout, layers, slots[at + i:at + j], [src], 0)
                    at += len(rows)
            done = self._event(compute)
            for pre, _ in parts:
                # a load made before its verdict: the prefetch's digests may still read the rows
                digests = pre.staging.busy
                pre.staging.busy = done if digests is None or digests.query() else self._join(done, digests)
                pre.staging.tensor.record_stream(compute)  # (freed memory waits for the scatter too)

    def _join(self, *events: torch.cuda.Event) -> torch.cuda.Event:
        """An event that completes once all of ``events`` have (recorded on a stream of its own,
        so that no stream doing work waits for another's)."""
        for ev in events:
            self._joins.wait_event(ev)
        return self._event(self._joins)

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event recorded on ``stream`` now.  Blocking: a thread that waits for it (the store
        finisher, the digest waiter) sleeps instead of spinning a core for the length of a copy."""
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    def _digest(self, rows: torch.Tensor, after: Sequence[tuple[int, int, torch.cuda.Event]]) -> DeviceDigests:
        """The payload digests of ``rows`` (uint8 ``[R, N]`` on this device), on the digest
        stream: rows ``[a, b)`` after event ``ev`` for each ``(a, b, ev)`` of ``after`` (which
        covers them in order); each part's segments' values then copied to the host, an event
        after each (the result's marks)."""
        segments = torch.empty((rows.shape[0], segment_count(rows.shape[1])), dtype=torch.int64, pin_memory=True)
        marks = []
        with torch.cuda.stream(self._dig):
            for a, b, ev in after:
                self._dig.wait_event(ev)
                part = torch.ops.kvplugin.segment_digests(rows[a:b], SEGMENT_BYTES)
                segments[a:b].copy_(part, non_blocking=True)
                marks.append((a, b, self._event(self._dig)))
        return DeviceDigests(segments, marks, self.device)


    # ----------------------------------------------------------------- warm-up
    def warm_up(self, layout: KVLayout, layers: Sequence[torch.Tensor], tokens: int,
                keep_bytes: int = 0) -> None:
        """At registration: one store and one prefetched, digested load of the last block's own
        bytes (back where they came from), through every path a first hit takes: the kernels are loaded,
        the streams and a staging buffer exist, so the first hit costs what later ones do.
        ``keep_bytes``: then an idle staging buffer of that size is kept (:meth:`_keep_idle`)."""
        n = max(1, tokens // layout.block_size)
        blocks = torch.arange(layout.num_blocks - n, layout.num_blocks, dtype=torch.int64)
        t = torch.arange(n * layout.block_size, dtype=torch.int64)
        slots = (blocks[t // layout.block_size] * layout.block_size + t % layout.block_size).view(1, -1)
        buf = torch.empty((1, *layout.chunk_shape(slots.shape[1])), dtype=layout.dtype, pin_memory=True)
        ticket = self.store(layout, layers, slots, [buf])
        self.wait(ticket)
        self.checksums(ticket)
        pre = self.prefetch(layout, [buf])
        digests = self.digest(pre)
        if digests is not None:
            digests.result()
        self.load(layout, layers, slots, [buf], staged=[(pre, [0])] if pre is not None else None)
        self.release(pre)
        torch.cuda.synchronize(self.device)
        if keep_bytes > 0:
            self._keep_idle(keep_bytes)

    def _keep_idle(self, nbytes: int) -> None:
        """An idle staging buffer of ``nbytes`` made now where a store of that size would get a
        new one (``choose_staging``: none idle that large, within the cap and the count): a first
        hit (or store) of up to that size then finds its buffer.  Made later, on the hit's path,
        such an allocation can meet a full device, where PyTorch's allocator frees its cache and
        synchronizes the device first (50 ms of a first 8k hit on the H200, its copy stalled
        meanwhile).  Nothing kept where there is no room."""
        choice = self._choice(nbytes, hold=False)
        if choice.index is not None:  # one that large is there, or only a resize would make room
            if choice.resize:
                logger.info("vllm-kvplugin: no room for an idle %d-byte staging buffer at start-up; a "
                            "first hit allocates its own", nbytes)
            return
        try:
            with torch.cuda.device(self.device):
                self._pool.append(Staging(self._alloc(nbytes)))
        except torch.OutOfMemoryError:
            logger.info("vllm-kvplugin: no device memory for an idle %d-byte staging buffer at start-up",
                        nbytes)

    # ---------------------------------------------------------------- prefetch
    def prefetch(self, layout: KVLayout, bufs: Sequence[torch.Tensor]) -> Prefetch | None:
        """Start copying ``bufs`` (whole objects) into a device staging buffer, returning at once.

        Called while the bytes are still being verified on the host, so that the link is busy
        meanwhile: a load of verified objects then only scatters from the device.  Only the
        leading objects that fit the staging room are sent (``rows`` of the result; None when
        not one fits: the load then copies as usual).  :meth:`release` gives it back.
        """
        if not bufs or not self.kernel:
            return None
        room = self.staging_cap_bytes - sum(e.tensor.numel() for e in self._pool if e.held)
        fits = min(len(bufs), max(0, room) // bufs[0].nbytes)
        if fits == 0:
            return None
        bufs = bufs[:fits]  # the leading objects that fit; a load copies the rest itself
        nbytes = sum(b.nbytes for b in bufs)
        with torch.cuda.device(self.device):
            try:
                staging = self._acquire(nbytes, hold=True)
            except torch.OutOfMemoryError:
                logger.warning("vllm-kvplugin: no device memory for a %d-byte prefetch; the load copies", nbytes)
                return None
            if staging.busy is not None:
                self._h2d.wait_event(staging.busy)
            T = bufs[0].shape[3]
            stage = staging.tensor[:nbytes].view(layout.dtype).view(len(bufs), *layout.chunk_shape(T))
            pieces = []
            with torch.cuda.stream(self._h2d):
                for a, b in prefetch_pieces(len(bufs), PREFETCH_PIECES):
                    self._from_host(bufs[a:b], stage[a:b])
                    pieces.append((a, b, self._event(self._h2d)))
            done = pieces[-1][2]
            self._note_host_reads(bufs, done)
            staging.busy = done
        return Prefetch(staging, stage, pieces, nbytes)

    def release(self, pre: Prefetch | None) -> None:
        if pre is not None:
            pre.staging.held = False

    def digest(self, pre: Prefetch | None) -> DeviceDigests | None:
        """Start the payload digests of a prefetch's rows where they land (each piece's after its
        copy), returning at once; None without the kernel.  Who calls: the worker, right after
        :meth:`prefetch`, while the copy is in flight.  The staging buffer is not handed out
        again before the digests have read it."""
        if pre is None or not self.digests:
            return None
        with torch.cuda.device(self.device):
            rows = pre.staging.tensor[:pre.nbytes].view(pre.rows, -1)
            digests = self._digest(rows, pre.pieces)
        pre.staging.busy = digests.event  # after every piece's copy, on the digest stream
        return digests

    # -------------------------------------------------------------------- loads
    def load(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor | PlacedObjects,
             bufs: Sequence[torch.Tensor],
             staged: Sequence[tuple[Prefetch, Sequence[int]]] | None = None) -> None:
        """``slots``: host slots ``[C, T]`` or the objects' block ids.  ``staged``: the bytes of
        ``bufs`` are, in order, the rows ``rows`` of each ``(prefetch, rows)`` (no copy over the
        link); block ids then go to the scatter op as they are (:data:`SCATTER_BY_BLOCKS`),
        which checks each against the cache before anything moves."""
        if not bufs:
            return
        if staged and self.kernel:
            if sum(len(rows) for _, rows in staged) != len(bufs):
                raise ValueError(f"staged rows {[list(r) for _, r in staged]} do not cover the {len(bufs)} buffers")
            if isinstance(slots, PlacedObjects) and SCATTER_BY_BLOCKS:
                if len(slots) != len(bufs):
                    raise ValueError(f"{len(slots)} placed objects for {len(bufs)} buffers")
            else:
                slots = self._check(layout, _slots_of(slots), bufs, read=False)
            self._load_staged(layout, layers, slots, staged)
            return
        slots = self._check(layout, _slots_of(slots), bufs)
        C, T = slots.shape
        nbytes = C * layout.chunk_nbytes(T)
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            self._kern.wait_event(self._event(compute))
            for ev in self._pending_gathers:  # a pending store may still read a reused block
                self._kern.wait_event(ev)
            staging = None
            if nbytes > self.load_zc_max:
                try:
                    staging = self._acquire(nbytes)
                except torch.OutOfMemoryError:  # a claimed load must still land: read from the host
                    if not self.kernel:
                        raise
                    logger.warning("vllm-kvplugin: no device memory to stage a %d-byte load; "
                                   "it is scattered straight from the host (zero-copy)", nbytes)
            if staging is None:
                with torch.cuda.stream(self._kern):
                    self._scatter(layout, layers, slots, list(bufs), self.zc_max_ctas)
                    done = self._event(self._kern)
                self._note_host_reads(bufs, done)
            else:
                if staging.busy is not None:
                    self._h2d.wait_event(staging.busy)
                stage = staging.tensor[:nbytes].view(layout.dtype).view(C, *layout.chunk_shape(T))
                groups = launch_groups(C)
                copied = []
                with torch.cuda.stream(self._h2d):  # all DMAs first: the copy engine never waits
                    for a, b in groups:
                        self._from_host(bufs[a:b], stage[a:b])
                        copied.append(self._event(self._h2d))
                for (a, b), ev in zip(groups, copied):
                    self._note_host_reads(bufs[a:b], ev)
                    self._kern.wait_event(ev)
                    with torch.cuda.stream(self._kern):
                        self._scatter(layout, layers, slots[a:b], [stage[a:b]], 0)
                done = self._event(self._kern)
                staging.busy = done
            compute.wait_event(done)


def _slots_of(where: torch.Tensor | PlacedObjects) -> torch.Tensor:
    """Host slots ``[C, T]`` of a load's objects."""
    return where.slots() if isinstance(where, PlacedObjects) else where
