"""The scheduler half's store decisions: which objects of the chunks a step completed go into
the local tier (a slot allocated per key while there is room) and to the cache server.

:class:`StoreDecisions` is mixed into :class:`~vllm_kvplugin.connector.scheduler.SchedulerSide`
and called from its ``build_connector_meta``, on vLLM's scheduler thread; the jobs go to the
workers with the step's metadata.  Every job is counted in ``_storing`` until every rank
acknowledged it (a lookup of those chunks waits for them, bounded)."""

from __future__ import annotations

from vllm_kvplugin import counters
from vllm_kvplugin.connector.metadata import StoreJob
from vllm_kvplugin.connector.tracker import RequestTracker
from vllm_kvplugin.planner import max_loadable_tokens


class StoreDecisions:
    """Store jobs of the scheduler half (a mixin of ``SchedulerSide``; see the module's
    docstring).  Uses its ``chunk_size``, ``groups``, ``state_groups``, ``local`` (one index
    per group), ``server``, ``world_size``, ``cfg``, ``_slot_chunk`` and ``_storing``."""

    def _store_jobs(self, tr: RequestTracker, done: int) -> list[StoreJob]:
        """Objects of the chunks completed by this step: into the local tier (once per key,
        while there is room, a prefix only) and to the server (past what its lookup found; it
        drops what it has).  A step that completes no new chunk (a decode step) costs nothing:
        the prefix was marked recently used when its last chunk was considered."""
        if done <= tr.stored_upto:
            return []
        jobs: list[StoreJob] = []
        C = self.chunk_size
        local_open = [idx.num_slots > 0 for idx in self.local]
        for ci in range(tr.stored_upto, done):
            key = tr.keys[ci]
            to_server = self.server is not None and ci >= tr.server_hits
            for g, spec in enumerate(self.groups):
                if spec.is_state:
                    continue  # _state_jobs
                idx, slot = self.local[g], -1
                if local_open[g] and not idx.contains(key):
                    got = idx.allocate(key)
                    if got is None:  # no room: a later chunk without this one is useless
                        counters.SCHEDULER.add(store_skipped_chunks=done - ci)
                        local_open[g] = False
                    else:
                        slot, evicted = got
                        if evicted:
                            counters.SCHEDULER.add(evicted_bytes=evicted)
                        self._slot_chunk[(g, slot)] = ci
                if slot >= 0 or to_server:
                    lo, hi = spec.object_tokens(ci, C)
                    jobs.append(StoreJob(key, ci, g, spec.object_blocks(tr.block_ids[g], ci, C), lo, hi,
                                         slot=slot, to_server=to_server))
                    self._storing[key] = self._storing.get(key, 0) + self.world_size
        tr.stored_upto = max(tr.stored_upto, done)
        for idx in self.local:
            idx.touch(tr.keys[:done])
        return jobs

    def _state_jobs(self, tr: RequestTracker, end: int) -> list[StoreJob]:
        """Recurrent checkpoints: vLLM ("align" mode) leaves the state after a step's last token
        in the block of column ``end / B - 1``; when the step ends on a chunk boundary inside the
        prompt, that is the checkpoint of the chunk ending there.  Kept every ``state_interval``
        chunks and always at the last boundary before the prompt's last token."""
        C = self.chunk_size
        if not self.state_groups or end % C or not C <= end <= tr.prompt_len:
            return []
        pos = end // C - 1
        if (pos + 1) % self.cfg.state_interval and end != max_loadable_tokens(tr.prompt_len, C):
            return []
        key, jobs = tr.keys[pos], []
        for spec in self.state_groups:
            ids = tr.block_ids[spec.index]
            col = end // spec.block_size - 1
            if col >= len(ids) or not ids[col]:
                continue  # no state there (a null block): nothing materialised
            idx, slot = self.local[spec.index], -1
            if idx.num_slots and not idx.contains(key):
                got = idx.allocate(key)
                if got is not None:
                    slot, evicted = got
                    counters.SCHEDULER.add(evicted_bytes=evicted)
                    self._slot_chunk[(spec.index, slot)] = pos
            if slot >= 0 or self.server is not None:
                jobs.append(StoreJob(key, pos, spec.index, (ids[col],), end, end, slot=slot,
                                     to_server=self.server is not None))
                self._storing[key] = self._storing.get(key, 0) + self.world_size
        return jobs
