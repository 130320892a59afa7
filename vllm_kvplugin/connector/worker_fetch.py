"""The fetch half of the worker role: a hit's objects read, sent toward the device and verified.

:class:`FetchPath` is mixed into :class:`~vllm_kvplugin.connector.worker.WorkerSide` and uses what
its registration built (layouts, the local pool, the server store, the transfer engine).  A fetch
reads the objects of a hit the scheduler is holding back, checks header and size, sends them
toward the device and starts their checksums (on the device where the engine computes digests,
on the hashing threads otherwise); it is called from ``start_load`` with a step's metadata or, for
an engine of one rank running nothing else, from the scheduler's lookup (:meth:`FetchPath.fetch_now`).
:meth:`FetchPath._settle` gives the verdict once the hashes are in: how many leading objects
passed, into the scheduler half's box (``connector/verdicts.py``) or with the step's metadata;
views of the verified bytes are kept for the load (they stay put: pinned in the local tier, leased
on the server).  An object that fails verification is dropped from its tier at once.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvplugin import counters
from vllm_kvplugin.chunk.checksums import (
    MAX_THREADS,
    PARALLEL_MIN_BYTES,
    PendingChecksums,
    join_checksums,
    start_payload_checksums,
)
from vllm_kvplugin.chunk.format import ChunkError, check_chunk
from vllm_kvplugin.connector.metadata import IDLE_WAIT_S, FetchJob, FetchRequest, first_part
from vllm_kvplugin.tiers.local_cpu import bytes_of
from vllm_kvplugin.tiers.mp import TierTrouble

logger = logging.getLogger(__name__)

#: a lone fetch that copies at least this much (~5 ms of a PCIe gen5 link) collects Python's young
#: generations while it waits for the device (a collection takes up to ~1.5 ms on the H200's host;
#: otherwise the allocation counts trigger one later, on the claimed step's critical path)
GC_IN_FETCH_MIN_BYTES = 256 << 20
#: a lone fetch verified on the device rehearses its load's host path over no object, every
#: :data:`REHEARSE_EVERY_S` from when all but the last piece of its copy are in until its verdict
#: (``WorkerSide._rehearse_load``): the path's code and data go cold while the thread polls
#: through the copy, and the claimed load then runs several times slower than warm.  Off: on an
#: H100 (2026-12-07, ``results/gpu-ttft-h100-rehearse-5rounds.json``) it shortened that hook at
#: 8k-16k but moved the first token by less than the rounds' spread (bench mode ``kvplugin-rehearse``).
REHEARSE_LOADS = False
REHEARSE_EVERY_S = 0.0005


@dataclass(frozen=True)
class Sent:
    """Objects of one group that a prefetch sent toward the device: ``jobs`` the fetch's job
    indices in row order, ``rows`` chunk position -> row.  A fetch may have several per group
    (a lone request's hit is sent in two parts, :meth:`FetchPath.fetch_now`)."""

    group: int
    pre: Any
    jobs: list[int]
    rows: dict[int, int]


@dataclass
class _Verifying:
    """A fetch whose payload hashes may still be running (:meth:`FetchPath._settle` ends it):
    ``errors`` per job so far, ``checked`` job -> (header checksum, payload tensor) of the
    objects whose headers passed, ``order`` the jobs hashed by ``sums`` (None: not verified);
    ``on_device``: every one of ``sums`` is computed on the device (no host thread hashes)."""

    req: FetchRequest
    errors: list
    checked: dict[int, tuple[int, torch.Tensor]]
    order: list[int]
    sums: PendingChecksums | None
    on_device: bool = False


class FetchPath:
    """Fetches and their verdicts for the worker half (a mixin of ``WorkerSide``; see the
    module's docstring).  Its state, made by ``WorkerSide.__init__``: ``_verifying`` (fetches
    whose verdict is still due; ``_provisional``, ``_loaded_unverified`` and ``_refuted`` for those
    claimed before it), ``_staged`` (verified objects per request), ``_prefetched``
    (per request, what is on the device: :class:`Sent`) and ``_progress`` (set when hashes or a
    store are done)."""

    def fetch_now(self, req: FetchRequest, fingerprint: bytes, wait_s: float,
                  more: Callable[[], list[FetchJob]] | None = None, early: bool = False) -> bool | None:
        """Called by the scheduler half of an engine of one rank (through its box), on vLLM's
        thread between steps, while the engine runs no request: fetch and verify ``req`` now and
        wait, at most ``wait_s``, for its verdict, which goes into the box as any other (device
        digests are polled, host hashes waited for on the progress event; the GIL released
        either way; a long copy verified on the device is a moment to collect Python's young
        generations, see :data:`GC_IN_FETCH_MIN_BYTES`).  ``fingerprint``: the scheduler's
        (what ``WorkerSide.bind`` takes from every step's metadata; an engine's first request
        comes before any).

        ``more``: the scheduler's lookup of the hit's other objects, called once ``req``'s are on
        their way (so the link copies those while the rest are keyed, planned and pinned); what it
        returns is fetched after them, as one fetch whose verdict covers both parts in order.

        ``early`` (the scheduler half may claim before the verdict: ``scheduler_lone.py``'s
        :data:`~vllm_kvplugin.connector.scheduler_lone.CLAIM_BEFORE_VERDICT`): when every object
        whose header passed is being verified (on the device, or by the host's threads), a
        provisional verdict -- those objects -- goes into the box at once, and the real one
        settles at the end of the step that loads them (:meth:`_settle_unverified_loads`):
        objects it refutes are a failed load of that step.

        True: the verdict is in the box.  False: the fetch is under way and its verdict comes
        later, from a step's :meth:`take_meta`.  None: not started (no transfer engine yet);
        the fetch must go with the step's metadata."""
        if self.engine is None:
            return None
        self.fingerprint = fingerprint
        self._forget(req.req_id)  # an earlier fetch of the request given up this step
        try:
            with torch.inference_mode():  # as on vLLM's thread in a step, whose tensors these are
                self._fetch(req, more, split=more is None)  # (with ``more`` the scheduler split it)
            prefetched = sum(s.pre.nbytes for s in self._prefetched.get(req.req_id, ()))
        except Exception:  # never into vLLM's scheduler: the hit is computed, nothing known bad
            logger.exception("vllm-kvplugin: %s: fetching its hit failed", req.req_id)
            counters.WORKER.failure("error")
            self._forget(req.req_id)
            box = self._box()
            if box is None:
                return None
            box.post(req.req_id, req.serial, 0)
            return True
        if early and self._provisional_verdict(req.req_id):
            return True
        deadline = time.monotonic() + wait_s
        collect = prefetched >= GC_IN_FETCH_MIN_BYTES and gc.isenabled()  # (a process that turned it off meant it)
        rehearse, rehearsed = REHEARSE_LOADS and prefetched > 0, 0.0
        while (v := self._verifying.get(req.req_id)) is not None:
            self._progress.clear()  # before looking: a completion from now on sets it
            if v.sums is None or v.sums.done():
                with torch.inference_mode():
                    self._settle()
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if v.on_device:
                if collect:  # once, while the link is busy: a collection then does not fall in the claimed step
                    collect = False
                    gc.collect(1)
                if rehearse and time.monotonic() - rehearsed >= REHEARSE_EVERY_S and self._copy_nearly_in(req.req_id):
                    self._rehearse_load()
                    rehearsed = time.monotonic()
                v.sums.advance()  # the landed pieces' digests combined now: the verdict has the last ones' left
                time.sleep(0)  # polled: seen as soon as the device is done, not after a waiter thread's wake-up
            else:
                self._progress.wait(left)  # (host hashes: their threads need the cores)
        return True

    def _provisional_verdict(self, req_id: str) -> bool:
        """Post ``req_id``'s provisional verdict when every object of its fetch whose header
        passed is being verified (see :meth:`fetch_now`'s ``early``)."""
        v = self._verifying.get(req_id)
        box = self._box()
        if v is None or box is None or v.sums is None or v.sums.done() or set(v.checked) - set(v.order):
            return False
        good = next((n for n, e in enumerate(v.errors) if e is not None), len(v.req.jobs))
        if good == 0:
            return False
        self._staged[req_id] = {(j.position, j.group): v.checked[n][1] for n, j in enumerate(v.req.jobs[:good])}
        self._provisional.add(req_id)
        box.post(req_id, v.req.serial, good)
        counters.WORKER.add(early_claims=1)
        return True

    def _settle_unverified_loads(self) -> None:
        """Before a step's stores are issued and its results given to vLLM: wait for the verdict
        of every load that step made before it (with the GIL released; the last digest ends
        ~0.1 ms after the copy's last byte, and the step's forward waits on the device for the
        copy anyway), then settle them -- objects refuted are a failed load of that step."""
        for rid in list(self._loaded_unverified):
            v = self._verifying.get(rid)
            if v is not None and v.sums is not None:
                try:
                    v.sums.result()
                except Exception:  # (``_settle`` gives it its verdict: nothing verified)
                    pass
        if self._loaded_unverified:
            self._settle()

    def _refute(self, rid: str, jobs: list[FetchJob], good: int) -> None:
        """The verdict of a fetch claimed before it (``jobs``' leading ``good`` passed): a load
        already made over the others failed; one still to come fails whole."""
        loaded = self._loaded_unverified.pop(rid, None)
        if good >= len(jobs):
            return
        if loaded is None:
            self._refuted[rid] = jobs[good].position
            return
        req, epoch = loaded
        bad = {(j.position, j.group) for j in jobs[good:]}
        self._failed_load(rid, [j for j in req.jobs if (j.position, j.group) in bad], epoch)

    def _copy_nearly_in(self, req_id: str) -> bool:
        """Whether every piece of ``req_id``'s copy but the last has landed (its last prefetch's)."""
        sent = self._prefetched.get(req_id)
        if not sent:
            return True
        pieces = sent[-1].pre.pieces
        return len(pieces) < 2 or pieces[-2][2].query()

    def _fetch(self, req: FetchRequest, more: Callable[[], list[FetchJob]] | None = None,
               split: bool = False) -> None:
        """Read every object of a held-back hit, send it toward the device and start verifying
        it; the verdict is given by :meth:`_settle` once the hashes are in (the step does not
        wait for them: the engine goes on with its other requests meanwhile).  ``more``: see
        :meth:`fetch_now` (its jobs are read and sent after ``req``'s).  ``split`` (a lone
        request's fetch, whose lookup waits for the link): a long hit's first objects
        (``metadata.first_part``) are read and sent before the rest are resolved and read (a
        server's hit of 256 objects took ~5 ms before its first byte on the H200)."""
        jobs = list(req.jobs)
        errors: list[ChunkError | TierTrouble | None] = []
        # the objects' bytes, where their sizes are right.  Those sent toward the device are
        # verified there, over the bytes that landed (the engine's ``digest``); the host hashes
        # the rest (all of them on an engine without device digests) while the link moves them
        # and the headers are checked (unverified bytes go into staging only; a load scatters
        # verified objects alone).  The verdict waits for the last digest.  Without device
        # digests the host starts the first objects' hashes at once, so its threads work while
        # the rest are read and their copy is issued.
        found: dict[int, tuple[bytes, memoryview, torch.Tensor]] = {}
        parts: list[PendingChecksums] = []
        order: list[int] = []  # the jobs whose payloads are verified, in the order of ``parts``
        device_parts = 0  # of ``parts``, computed on the device
        verify = self.cfg.verify_checksums
        host_first = verify and not self.engine.digests
        sent: list[Sent] = []
        self._prefetched[req.req_id] = sent  # (released by _forget, whatever fails after this)

        def read_and_send(lo: int, hi: int) -> None:  # jobs[lo:hi]
            nonlocal order
            errors.extend([None] * (hi - lo))
            views: list[tuple[bytes, torch.Tensor] | None] = [None] * (hi - lo)
            # errors are kept without their tracebacks: a traceback holds this frame, whose views
            # would keep an old server pool mapped until the garbage collector ran
            try:
                self._resolve_remote(jobs[lo:hi], views)
            except TierTrouble as e:
                errors[lo:hi] = [e.with_traceback(None) if j.lease else None for j in jobs[lo:hi]]
            for n in range(lo, hi):
                if errors[n] is None:
                    try:
                        found[n] = self._object(jobs[n], views[n - lo])
                    except ChunkError as e:
                        errors[n] = e.with_traceback(None)
                if host_first and not order and len(found) == MAX_THREADS:
                    first = [data for _, data, _ in found.values()]
                    if sum(d.nbytes for d in first) >= PARALLEL_MIN_BYTES:  # enough for the threads
                        parts.append(start_payload_checksums(first))
                        order = list(found)
            # the copy goes first: the first hashes keep the threads busy while the rest are queued
            self._prefetch(jobs, {n: t for n, (_, _, t) in found.items() if n >= lo}, sent)

        first = first_part(len(jobs)) if split else 0
        if first:
            read_and_send(0, first)
        read_and_send(first, len(jobs))
        if more is not None:
            extra = more()
            if extra:
                jobs += extra
                read_and_send(len(jobs) - len(extra), len(jobs))
            req = FetchRequest(req.req_id, jobs, req.serial)
        if verify:
            unverifiable: list[int] = []
            for s in sent:
                try:
                    digests = self.engine.digest(s.pre)
                except Exception as e:  # no verdict for those rows: recomputed, nothing known bad
                    logger.exception("vllm-kvplugin: %s: device digests of %d objects could not be started",
                                     req.req_id, len(s.jobs))
                    trouble = TierTrouble("verify_error", f"device digests could not be started ({e})")
                    for n in s.jobs:
                        errors[n] = errors[n] or trouble
                    unverifiable += s.jobs
                    continue
                if digests is not None:
                    parts.append(digests)
                    order += s.jobs
                    device_parts += 1
            covered = set(order) | set(unverifiable)
            rest = [n for n in found if n not in covered]
            if rest:
                parts.append(start_payload_checksums([found[n][1] for n in rest]))
                order += rest
        sums = join_checksums(parts) if verify and parts else None
        checked: dict[int, tuple[int, torch.Tensor]] = {}
        for n, (header, data, tensor) in found.items():
            job = jobs[n]
            try:
                expect = self._expect(job.group, job.key, job.position)
                checked[n] = (check_chunk(header, data, expect, verify_checksum=False).checksum, tensor)
            except ChunkError as e:
                errors[n] = e.with_traceback(None)
        self._verifying[req.req_id] = _Verifying(req, errors, checked, order, sums,
                                                 on_device=bool(parts) and device_parts == len(parts))
        if sums is not None:
            sums.when_done(self._progress.set)
        self._settle()

    def _settle(self, wait: bool = False) -> None:
        """The verdict of every fetch whose hashes are in: how many leading objects passed (to
        the scheduler with this step's metadata); views of those are kept for the load.  Every
        object that failed is dropped from its tier at once (each would fail a later hit); the
        failure counts once, by the first one's reason.

        ``wait``: first :meth:`_wait_while_idle`."""
        if wait:
            self._wait_while_idle()
        for rid, v in list(self._verifying.items()):
            if v.sums is not None and not v.sums.done():
                continue
            del self._verifying[rid]
            errors, jobs = v.errors, v.req.jobs
            if v.sums is not None:
                try:
                    sums = v.sums.result()
                except Exception as e:  # the hashing itself failed: nothing verified, nothing known bad
                    logger.exception("vllm-kvplugin: %s: hashing its hit failed", rid)
                    trouble = TierTrouble("verify_error", f"payload checksums could not be computed ({e})")
                    sums = [None] * len(v.order)
                    for n in v.order:
                        errors[n] = errors[n] or trouble
                for n, got in zip(v.order, sums):
                    if got is not None and n in v.checked and got != v.checked[n][0]:
                        errors[n] = ChunkError("checksum", "payload bytes do not match the header checksum")
            good = next((n for n, e in enumerate(errors) if e is not None), len(jobs))
            if rid in self._provisional:  # claimed before this verdict (its views staged then)
                self._provisional.discard(rid)
                self._refute(rid, jobs, good)
            else:
                self._staged[rid] = {(j.position, j.group): v.checked[n][1] for n, j in enumerate(jobs[:good])}
            bad = self._failed_fetch(v.req, errors) if good < len(jobs) else {}
            box = self._box()
            if box is not None:  # the scheduler half is in this process: it takes it before its next match
                box.post(rid, v.req.serial, good, bad)
            else:
                self._meta.fetched[rid] = (1, good)
                self._meta.bad_slots.update(bad)

    def _wait_while_idle(self) -> None:
        """In a step that scheduled no tokens (nothing else to hold up): wait, up to
        :data:`~vllm_kvplugin.connector.metadata.IDLE_WAIT_S` with the GIL released, until a
        fetch's hashes or a store are done (what a held-back request waits on), rather than
        spin empty steps whose thread keeps the GIL from the threads doing that work.  A new
        request waits at most that."""
        self._progress.clear()  # before looking: a completion from now on sets it
        box = self._box()
        if (any(v.sums is None or v.sums.done() for v in self._verifying.values()) or self.finisher.has_results()
                or (box is not None and box.pending())):
            return
        if self._verifying or self.finisher.busy():
            self._progress.wait(IDLE_WAIT_S)

    def _object(self, job, view) -> tuple[bytes, memoryview, torch.Tensor]:
        """An object's header bytes, payload bytes and payload tensor (``[1, *shape]``), from
        the local pool or from its server lease view; a payload of the wrong size is an error."""
        if job.lease:
            header, payload = view
            data = bytes_of(payload)
        else:
            if self.pool is None or not 0 <= job.slot < self.pool.num_slots:
                raise ChunkError("missing", f"slot {job.slot} outside the pool")
            header = self.pool.header(job.group, job.slot)
            if header is None:
                raise ChunkError("missing", f"slot {job.slot} holds no object")
            data, payload = self.pool.views(job.group, job.slot)  # made once per slot
        shape, dtype = self._shape(job.group), self._dtype(job.group)
        want = math.prod(shape) * dtype.itemsize
        if data.nbytes != want:
            raise ChunkError("short_read", f"payload has {data.nbytes} of {want} bytes")
        if not job.lease:  # the pool's objects have the group's shape and dtype
            return header, data, payload
        return header, data, payload.view(dtype).view(1, *shape)

    def _prefetch(self, jobs: list[FetchJob], found: dict[int, torch.Tensor], sent: list[Sent]) -> None:
        """Per attention-like group, the objects ``found`` (job index -> payload), sent toward the
        device (a CUDA cache) while their headers and payloads are checked: each prefetch into
        ``sent`` as soon as it is issued (so that it is released should a later one raise)."""
        for g, spec in enumerate(self.groups):
            if spec.is_state:
                continue
            mine = [n for n in found if jobs[n].group == g]
            pre = self.engine.prefetch(self.layouts[g], [found[n] for n in mine]) if mine else None
            if pre is not None:
                mine = mine[:pre.rows]
                sent.append(Sent(g, pre, mine, {jobs[n].position: row for row, n in enumerate(mine)}))

    def _forget(self, req_id: str, keep_verdict: bool = False) -> None:
        """A fetch that will not load (or just did): its views and device staging go, and a
        verdict still due is never given (hashes still running are left to finish unread) --
        unless ``keep_verdict`` (a load made before it: :meth:`_settle_unverified_loads`)."""
        if not keep_verdict:
            self._verifying.pop(req_id, None)
            self._provisional.discard(req_id)
            self._loaded_unverified.pop(req_id, None)
        self._refuted.pop(req_id, None)
        self._staged.pop(req_id, None)
        for s in self._prefetched.pop(req_id, ()):
            self.engine.release(s.pre)

    def _resolve_remote(self, jobs, views) -> None:
        """Pool views (header bytes, payload tensor) of the leased jobs: where the scheduler's
        lookup placed them, else resolved here, per group."""
        by_group: dict[int, list[int]] = {}
        placed: list[int] = []
        now = time.monotonic()
        for n, job in enumerate(jobs):
            if job.lease and job.placed and now < job.placed.until:
                placed.append(n)
            elif job.lease:
                by_group.setdefault(job.group, []).append(n)
        if (by_group or placed) and self.server is None:
            raise TierTrouble("server_unavailable", "no server configured in this worker")
        if placed:
            for n, (header_t, payload_t) in zip(placed, self.server.placed_views([jobs[n].placed for n in placed])):
                views[n] = (bytes(header_t.numpy()), payload_t)
        for g, idx in by_group.items():
            offs = self.server.resolve(jobs[idx[0]].lease, [jobs[n].key for n in idx], g)
            for n, (off, size) in zip(idx, offs):
                header_t, payload_t = self.server.views(off, size)
                views[n] = (bytes(header_t.numpy()), payload_t)

    def _failed_fetch(self, req: FetchRequest, errors) -> dict[tuple[int, int], str]:
        """Count and log a fetch's first failure; drop its corrupt server objects; return its
        corrupt local slots (group, slot) -> reason, for the scheduler to drop with the verdict."""
        first = next(n for n, e in enumerate(errors) if e is not None)
        job, e = req.jobs[first], errors[first]
        counters.WORKER.failure(e.reason)
        logger.warning("vllm-kvplugin: %s: object of chunk %d (group %d) not served (%s); recomputing",
                       req.req_id, job.position, job.group, e)
        corrupt, bad = [], {}
        for job, e in zip(req.jobs, errors):
            if not isinstance(e, ChunkError):
                continue  # fine, or the tier could not answer: nothing known to be wrong with it
            if job.slot >= 0:
                bad[(job.group, job.slot)] = e.reason
            elif job.lease and self.server is not None and (job.placed is None or self.server.serves(job.placed)):
                corrupt.append(self.server.object_id(job.key, job.group))  # (not another server's object)
        if corrupt:
            self.server.drop(corrupt)
        return bad
