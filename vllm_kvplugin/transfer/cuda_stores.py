"""The store half of :class:`~vllm_kvplugin.transfer.cuda.CudaTransfer` (the ``StorePath``
mixin): gathers out of the paged cache, their DMAs to the host paced through
``transfer/paced.py``, device digests of what is stored, and the fence that keeps the next forward
from overwriting blocks a gather has not read yet.  The ordering rules are the ones of
``transfer/cuda.py``'s module docstring; the state used (streams, staging pool, pending gathers,
host reads) is made by ``CudaTransfer.__init__``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_kvplugin.layout.descriptor import KVLayout
from vllm_kvplugin.transfer.cuda_handles import StoreTicket
from vllm_kvplugin.transfer.cuda_pieces import launch_groups
from vllm_kvplugin.transfer.paced import DmaJob, Piece


class StorePath:
    """Stores of a :class:`~vllm_kvplugin.transfer.cuda.CudaTransfer` (a mixin of it)."""

    def store(self, layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor,
              bufs: Sequence[torch.Tensor]) -> StoreTicket | None:
        if not bufs:
            return None
        slots = self._check(layout, slots, bufs)
        C, T = slots.shape
        nbytes = C * layout.chunk_nbytes(T)
        with torch.cuda.device(self.device):
            ready = self._event(torch.cuda.current_stream(self.device))
            self._kern.wait_event(ready)
            if nbytes <= self.store_zc_max:
                done = self._store_zero_copy(layout, layers, slots, bufs)
                return StoreTicket([done], nbytes, "zero-copy")
            # A staged DMA moves whole chunks; a chunk with skipped tokens (-1) must keep
            # the host bytes of those tokens, so the kernel writes it straight to the host.
            partial = (slots < 0).any(dim=1)
            events = []
            if self.kernel and bool(partial.any()):
                pidx = partial.nonzero().flatten().tolist()
                fidx = (~partial).nonzero().flatten().tolist()
                events.append(self._store_zero_copy(layout, layers, slots[pidx], [bufs[i] for i in pidx]))
                slots, bufs = slots[fidx], [bufs[i] for i in fidx]
            job = self._store_staged(layout, layers, slots, bufs) if bufs else None
            digests = None
            if job is not None and self.digests:
                # hashed after the gathers; the last DMA waits for it, so the staging buffer is
                # free for others only when the hash has read it too
                rows = job.staging.tensor[:len(bufs) * layout.chunk_nbytes(T)].view(len(bufs), -1)
                digests = self._digest(rows, [(0, len(bufs), job.pieces[-1].gathered)])
                job.pieces[-1].gathered = digests.event
                events.append(digests.event)
        if job is not None:
            self._paced.submit(job)
        return StoreTicket(events, nbytes, "staged", job, digests, bufs if digests is not None else ())

    def checksums(self, ticket: StoreTicket | None) -> dict[int, int]:
        """Payload digests a done store computed on the device: host buffer address -> digest
        (the buffers it wrote that are not here are the caller's to hash)."""
        if ticket is None or ticket.digests is None:
            return {}
        return {b.data_ptr(): d for b, d in zip(ticket.digested, ticket.digests.result())}

    def undigested_store_max(self) -> int | None:
        """A store of whole chunks (no skipped token) moving more bytes than this in one call is
        staged and digested: ``checksums`` of its ticket then covers every buffer it wrote (None:
        no store is digested; smaller calls go through the zero-copy kernel, undigested)."""
        return self.store_zc_max if self.digests else None

    def _store_zero_copy(self, layout, layers, slots, bufs) -> torch.cuda.Event:
        """One kernel writes the chunks into the host buffers (after ``ready``)."""
        with torch.cuda.stream(self._kern):
            self._wait_host_reads(self._kern, bufs)
            self._gather(layout, layers, slots, list(bufs), self.zc_max_ctas)
            done = self._event(self._kern)
        self._note_gather(done)
        return done

    def _store_staged(self, layout, layers, slots, bufs) -> DmaJob:
        """Gather into staging in groups (issued now: the blocks are read before the next forward);
        their DMAs queued as pieces for :meth:`pump`, each after its group's gather."""
        C, T = slots.shape
        nbytes = C * layout.chunk_nbytes(T)
        staging = self._acquire(nbytes)
        if staging.busy is not None:
            self._kern.wait_event(staging.busy)
        stage = staging.tensor[:nbytes].view(layout.dtype).view(C, *layout.chunk_shape(T))
        if not self.kernel:  # torch path: skipped tokens keep their host bytes through staging
            with torch.cuda.stream(self._kern):
                for i in (slots < 0).any(dim=1).nonzero().flatten().tolist():
                    stage[i:i + 1].copy_(bufs[i], non_blocking=True)
        job = DmaJob(staging)
        per_piece = max(1, self.dma_piece_bytes // layout.chunk_nbytes(T))
        gathered = None
        for a, b in launch_groups(C):
            with torch.cuda.stream(self._kern):
                self._gather(layout, layers, slots[a:b], [stage[a:b]], 0)
                gathered = self._event(self._kern)
            for i in range(a, b, per_piece):
                j = min(b, i + per_piece)
                reads = [ev for ev in (self._host_reads.get(t.data_ptr()) for t in bufs[i:j]) if ev is not None]
                job.pieces.append(Piece(gathered, reads, stage[i:j], list(bufs[i:j])))
        assert gathered is not None
        self._note_gather(gathered)
        staging.pacing = job
        return job

    def pump(self) -> None:
        """Issue more paced store DMAs (``transfer/paced.py``); any thread, returns at once."""
        self._paced.pump()

    def pumping(self) -> bool:
        """Store DMAs wait to be issued by :meth:`pump` (read without a lock; any thread)."""
        return not self._paced.idle()

    @staticmethod
    def _issued(job: DmaJob) -> None:
        """A store's last piece is issued: its staging buffer may be handed out again."""
        job.staging.busy = job.event
        job.staging.pacing = None

    def done(self, ticket: StoreTicket | None) -> bool:
        if ticket is None:
            return True
        self.pump()
        job = ticket.job
        return (job is None or (job.event is not None and job.event.query())) and all(e.query() for e in ticket.events)

    def wait(self, ticket: StoreTicket | None) -> None:
        """Until the ticket's bytes are in the host buffers; raises if its DMAs could not be issued."""
        if ticket is None:
            return
        job = ticket.job
        if job is not None:
            self._paced.drain(job)
            job.event.synchronize()
            if job.error is not None:
                raise RuntimeError(f"vllm-kvplugin transfer: a store's DMA failed: {job.error}") from job.error
        for e in ticket.events:
            e.synchronize()

    def settle(self) -> None:
        """Until every copy issued or queued so far is done (its paced DMAs issued first):
        after a store failed while it was issued, its memory may then be reused."""
        self._paced.drain_all()
        torch.cuda.synchronize(self.device)

    def fence(self) -> None:
        """The compute stream waits until every issued store has read its blocks."""
        if not self._pending_gathers:
            return
        with torch.cuda.device(self.device):
            compute = torch.cuda.current_stream(self.device)
            for ev in self._pending_gathers:
                compute.wait_event(ev)
        self._pending_gathers = []

    def _note_gather(self, ev: torch.cuda.Event) -> None:
        if len(self._pending_gathers) > 64:
            self._pending_gathers = [e for e in self._pending_gathers if not e.query()]
        self._pending_gathers.append(ev)
