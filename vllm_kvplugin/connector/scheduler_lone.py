"""A request alone in an engine of one rank: its hit fetched, verified and claimed in the step that
looks it up, its first chunks on the link while the rest are still being keyed, and loaded as soon
as vLLM has allocated its blocks.

:class:`LoneFetch` is mixed into :class:`~vllm_kvplugin.connector.scheduler.SchedulerSide`; it runs
in ``get_num_new_matched_tokens``, on vLLM's thread, where the worker half of such an engine runs
too (its ``fetch_now`` is in the verdict box, ``connector/verdicts.py``).

"Alone": one rank, both halves in this process, no request started and unfinished, and no other
request known to the connector (running or held back).  A wait then holds up nobody but requests
that arrived along with this one, which wait at most :data:`LONE_FETCH_WAIT_S`.  With other
requests running the hit goes with the step's metadata instead (a wait would stall their steps).

The load (:meth:`LoneFetch._load_here`): vLLM prepares the step's inputs between its allocation
and the step's ``start_load_kv`` (1.7-4 ms for an 8k-token hit on an H100's host); issued at the
allocation, the scatter's device time (~1.2 ms at 8k) runs under that preparation instead of ahead
of the forward.  The forward's stream waits for the whole scatter either way (the compute stream
waits on its event); that costs time where the hit's step replays a captured CUDA graph (vLLM's
default for one-token batches), whose one launch leaves the device nothing else to do: on an
H100, (warm - own hit) / link 1.14 / 1.09 / 1.05 at 8k / 16k / 32k against 1.18 / 1.11 / 1.08
from the step's metadata.  Eager, the host's kernel-by-kernel launches of the forward outlast the
scatter anyway (no difference measured).

The split (:meth:`LoneFetch._first_keys`, sized by ``metadata.first_part``; unsplit, the keys, plan
and reads of an 8k-token hit took ~0.5 ms before the first byte on the H200's host): a long
prompt's first chunks are keyed alone; when the local tier holds every one of them, the worker
reads them and starts their copy, then calls back for the rest (:meth:`LoneFetch._first_part`'s
``rest``: the other keys, the whole plan, its pins), which it fetches after them as one fetch.
The verdict covers both parts in order, and the claim waits for it as before: only the work
before the first byte moves under the copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm_kvplugin import counters
from vllm_kvplugin.adapters import _common
from vllm_kvplugin.chunk.keys import chunk_keys
from vllm_kvplugin.connector.metadata import FetchJob, FetchRequest, LoadRequest, first_part
from vllm_kvplugin.connector.tracker import Fetch, RequestTracker

#: how long the lookup of a request that arrives at an engine running nothing waits for its hit's
#: verdict; a 64k-token hit of an 8B model (9.7 GB) is copied and verified in ~0.18 s on an H200.
#: A longer one is held back and claimed in a later step, as with other requests running.  A
#: request arriving meanwhile waits at most this.
LONE_FETCH_WAIT_S = 0.25

#: how long such a request's lookup on the cache server is waited for (the step's grace for
#: other lookups is 2 ms).  On the H200 the lookup of a 64k-token prompt (256 chunks) outlasted
#: the grace, and its fetch came a step (~5 ms) later; at 8k-32k it was answered within 1.5-2.5
#: ms.  A stuck server costs the lone request this much, then it is held back and asked again.
LONE_LOOKUP_WAIT_S = 0.05

#: whether such a request's lookup on the cache server runs on vLLM's thread
#: (:meth:`LoneFetch._lookup_here`); off, it goes to the index's thread like any other
LOOKUP_HERE = True

#: whether such a request's lookup is announced to the cache server before its keys are computed
#: (:meth:`LoneFetch._wake_server`), so that the server is awake when it comes
WAKE_SERVER = True

#: how long the server may wait, for such a lookup, for objects it brings into L1 (from L2 or the
#: remote store; it answers at once when L1 holds them): a hit still on its way then is asked
#: again on the index's thread, with the client's own wait
LOOKUP_HERE_PROMOTION_WAIT_S = 0.02

#: whether a lone request's hit is claimed before its verdict, where a refuted load is safe:
#: vLLM's ``recompute`` policy (which needs its synchronous scheduling and V1 model runner) with
#: one KV cache group, whose bad blocks the connector reports until recomputed
#: (``connector/bad_blocks.py``).  vLLM then allocates the blocks and prepares the step while the
#: copy runs, the scatter waits on the device for each piece, and the step's end waits for the
#: digests (``FetchPath.fetch_now``'s ``early``): objects they refute are a failed load of that
#: step, whose outputs vLLM drops and recomputes.  Off: measured faster on an H100 (``benchmarks/NOTES.md``, twenty-eighth session),
#: but its refutation has not yet run right on a GPU (there only with the V2 runner, whose
#: recompute is wrong: vLLM issue #49250).
CLAIM_BEFORE_VERDICT = False

#: whether a lone request's claimed hit is loaded at its allocation (:meth:`LoneFetch._load_here`);
#: off, it is loaded from the step's metadata like any other (benchmarks compare the two)
LOAD_AT_ALLOCATION = True


class LoneFetch:
    """The lone request's fetch (a mixin of ``SchedulerSide``; see the module's docstring).  Uses
    its ``world_size``, ``chunk_size``, ``groups``, ``local``, ``server``, ``fingerprint``, ``_bad``,
    ``namespace``, ``drafter``, ``_started``, ``_reqs``, ``_storing``, ``_verdicts``, ``_forget``,
    ``_limit``, ``_local_plan``, ``_pinned_jobs`` and ``_release``."""

    def _alone(self, req_id: str) -> Callable[..., bool | None] | None:
        """The worker half's ``fetch_now`` when ``req_id`` is alone in an engine of one rank whose
        worker half is in this process, else None."""
        if self.world_size != 1 or self._started or any(rid != req_id for rid in self._reqs):
            return None  # (requests looked up and not finished: running, or waiting as this one)
        return self._verdicts.fetcher()

    def _fetch_here(self, req: FetchRequest, more: Callable[[], list[FetchJob]] | None = None) -> bool | None:
        """When ``req``'s request is alone (see the module's docstring): the worker half fetches
        and verifies ``req`` now, on this thread, and the verdict is waited for up to
        :data:`LONE_FETCH_WAIT_S` -- the hit is then claimed in this step instead of the next (a
        step boundary and the verdict's hand-off between threads saved).  ``more``: the rest of
        the hit, looked up once ``req``'s objects are on their way (``fetch_now``).

        True: the verdict is in the box.  False: the fetch is under way, its verdict comes
        later.  None: not done here (the workers fetch it with this step's metadata, as with
        other requests running: a wait here would stall their steps); ``more`` was not called."""
        fetch_now = self._alone(req.req_id)
        if fetch_now is None:
            return None
        t0 = time.monotonic()
        done = fetch_now(req, self.fingerprint, LONE_FETCH_WAIT_S, more,
                         early=CLAIM_BEFORE_VERDICT and self._bad is not None)
        if done is not None:
            counters.SCHEDULER.add(lone_fetches=1, lone_fetch_wait_s=time.monotonic() - t0)
            # an earlier fetch of the request, given up this step, was forgotten there first
            self._forget = [rid for rid in self._forget if rid != req.req_id]
        return done

    def _wake_server(self, req_id: str) -> None:
        """Before a new request's keys are computed, when it is alone and its lookup will run here:
        the server is told a lookup follows (``ServerIndex.wake``).  A server woken from sleep by
        the lookup itself answered 0.1-0.4 ms later than one woken before it
        (``results/server-wake-cpu.json``; at 8k on an H100 the lookup on this thread without the wake
        took 1.024x the time above an own hit: ``results/gpu-ttft-h100-graphs-wake-ab.json``)."""
        if WAKE_SERVER and LOOKUP_HERE and self.server is not None and self._alone(req_id) is not None:
            if self.server.wake():
                counters.SCHEDULER.add(server_wakes=1)

    def _lookup_here(self, req_id: str, keys, first: int) -> Future | None:
        """When ``req_id``'s request is alone (see the module's docstring): its lookup on the
        cache server on this thread, bounded by :data:`LONE_LOOKUP_WAIT_S` (``ServerIndex.lookup_now``:
        the hand-offs to the index's thread and back cost 0.3-1.1 ms on an H100's host at 8k);
        a done future.  None: not done here, and the index's thread asks -- also after a lookup
        here that met trouble (its own bound included) or found objects still on their way into
        the server's L1 (its lease released first), so that the hit is no shorter than there."""
        if not LOOKUP_HERE or self._alone(req_id) is None:
            return None
        done = self.server.lookup_now(keys, first, LONE_LOOKUP_WAIT_S, LOOKUP_HERE_PROMOTION_WAIT_S)
        if done is None or done.exception() is not None:
            return None
        found = done.result()
        if found.promoting:
            self._release(found.lease)
            return None
        counters.SCHEDULER.add(lone_server_lookups=1)
        return done

    def _load_here(self, load: LoadRequest) -> bool:
        """From ``update_state_after_alloc``, when ``load``'s request is alone (see the module's
        docstring) and every group restores a prefix (a state also goes into the step's own
        block, known only with the step's metadata: ``_running_state_blocks``): the worker half
        loads it now (``load_now``).  False: it goes with the step's metadata."""
        if not LOAD_AT_ALLOCATION or not all(g.restores_prefix for g in self.groups) or self._alone(load.req_id) is None:
            return False
        load_now = self._verdicts.loader()
        if load_now is None:
            return False
        load_now(load, self.epoch)
        return True

    def _first_keys(self, request: Any, ids) -> int:
        """How many leading chunks of a new request to key before its lookup (0: all of them):
        a split is for a lone request whose hit can only come from the local tier, with groups
        that restore every chunk of a prefix (attention, MLA), no store of this engine's still
        unacknowledged (a lookup would wait for those), and a hit long enough for two parts."""
        if (self.server is not None or self._storing
                or not all(g.restores_prefix for g in self.groups)
                or any(idx.num_slots == 0 for idx in self.local) or _common.skips_prefix_cache(request)
                or self._alone(request.request_id) is None):
            return 0
        return first_part(max(0, (len(ids) - 1) // self.chunk_size - self.drafter))

    def _finish_keys(self, tr: RequestTracker) -> None:
        """The keys of the chunks after the first (a split lookup's), once."""
        if tr.unkeyed is None:
            return
        (ids, extras), tr.unkeyed = tr.unkeyed, None
        tr.keys += chunk_keys(self.fingerprint, ids, self.chunk_size, extras, namespace=self.namespace,
                              start_key=tr.keys[-1], start_chunk=len(tr.keys))

    def _first_part(self, tr: RequestTracker, num_computed: int) -> tuple[Fetch | None, Callable[[], list[FetchJob]] | None]:
        """For a request keyed only up to its first chunks: when the local tier holds every one of
        them, their fetch (pinned) and ``rest``, which keys the other chunks, plans the whole hit,
        pins and returns its other objects and makes the fetch the whole hit's (once; later calls
        return nothing).  Otherwise the keys are finished here and (None, None): looked up as usual."""
        first = len(tr.keys)
        plan = self._local_plan(tr, num_computed, first)
        if plan is None or plan.end != first * self.chunk_size:
            self._finish_keys(tr)
            return None, None
        pins: list[tuple[int, int]] = []
        fetch = Fetch(plan, self._pinned_jobs(tr, plan.objects, pins), 0, pins, issued=time.monotonic())
        asked = False

        def rest() -> list[FetchJob]:
            nonlocal asked
            self._finish_keys(tr)
            if asked:
                return []
            asked = True
            whole = self._local_plan(tr, num_computed, self._limit(tr))
            n = len(fetch.plan.objects)
            if whole is None or whole.objects[:n] != fetch.plan.objects:  # (never, for these groups)
                return []
            more = self._pinned_jobs(tr, whole.objects[n:], fetch.pins)
            fetch.plan, fetch.jobs = whole, fetch.jobs + more
            if more:
                counters.SCHEDULER.add(split_fetches=1)
            return more

        return fetch, rest
