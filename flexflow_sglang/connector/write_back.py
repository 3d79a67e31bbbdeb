"""Write-back from the host tier to the deeper tiers, as transfer-engine jobs: write-through of
freshly stored pages, and spills of host-tier LRU victims. The connector owns the host tier and the
tiers; this part decides what each job reads (pinned host pages or a copy), queues it, and settles it.

Write-throughs pin at most `pin_budget` host pages at a time (a quarter of the tier): a backlog on a
slow link beyond that copies the rows past the budget into a second job, so stores always find pages
to take. A spill copies its victims out at once (the caller reuses the pages next) and skips the
victims the first deep tier already holds (`KVTier.holds_locally`). A full engine queue drops the
copy (a future miss, counted), never waits.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..transfer import Job, JobState
from ..transfer.legs import tier_put
from .host_tier import contiguous_runs

logger = logging.getLogger(__name__)

#: write-backs go to a tier in pieces of this many bytes; queued fetches and promotions run between two
WRITE_BACK_PIECE_BYTES = 16 << 20
#: before each piece a write-back waits at most this long for running / queued prefetches and fetches
WRITE_BACK_YIELD_S = 1.0


class WriteBack:
    def __init__(self, conn: Any, pin_budget: int):
        # conn is the owning FlexFlowConnector (host tier, tiers, engine, counters); not imported here,
        # even for typing, so the connector -> write_back layering stays a one-way edge
        self.conn = conn
        self.pin_budget = max(1, int(pin_budget))
        self.pinned = 0  # host pages pinned by queued / running write-through jobs

    def _rows(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of host-tier pages (word rows)."""
        return self.conn.host.words.index_select(0, torch.as_tensor(list(pages), dtype=torch.long))

    # ----------------------------------------------------------------- write-through
    def write_through(self, keys, pages) -> None:
        """Copy freshly stored pages to deeper tiers configured write-through (persistence across
        restarts, sharing with other instances): one engine job, or two when only its leading pages
        fit the pin budget."""
        c = self.conn
        tiers = [t for t in c.tiers if getattr(t, "write_through", False)]
        if not tiers:
            return
        keys, pages = list(keys), list(pages)
        tiers, lacking = self._lacking(tiers, keys)
        if not tiers:
            return
        if len(lacking) < len(keys):
            keys, pages = [keys[i] for i in lacking], [pages[i] for i in lacking]
        # zero copy for as many pages as the pin budget has room for: the job reads those host pages,
        # pinned (no eviction or reuse) until it is reaped. Past the budget (a backlog on a slow link
        # already pins its share of the host tier) pinning more would leave new stores no page to
        # take (their KV then stays device-only and is lost at eviction): the rest is copied out now,
        # on this (the scheduler's) thread, and those host pages stay evictable. Before, one page
        # over the budget made the whole store copy.
        room = max(0, min(len(pages), self.pin_budget - self.pinned))
        if room:
            self._submit_write_through(keys[:room], pages[:room], tiers, pinned=True)
        if room < len(pages):
            self._submit_write_through(keys[room:], pages[room:], tiers, pinned=False)

    def _submit_write_through(self, keys, pages, tiers, pinned: bool) -> None:
        c = self.conn
        nbytes = len(pages) * c.layout.page_nbytes
        if pinned:
            c.host.pin(pages)
            self.pinned += len(pages)
            job = Job("write_through", self._write_through_run, nbytes=nbytes, ctx=(keys, pages, tiers, None))
        else:
            if not c.engine.fits(nbytes):  # refused before the copy is made
                c._m["write_through_dropped"] += 1
                return
            rows = self._rows(pages)
            c._m["write_through_copied"] += 1
            job = Job("write_through", self._write_through_run, nbytes=nbytes, ctx=(keys, [], tiers, rows))
        if not c._submit(job):
            self._unpin(job)
            c._m["write_through_dropped"] += 1

    def _lacking(self, tiers, keys):
        """(tiers that lack a page, indices of the pages some tier lacks). A page a tier already
        holds (an earlier round of the same conversation wrote it, or it was prefetched from there
        and has just been stored again after a host-tier eviction) needs no second write: in a
        multi-turn workload every round resends the history the tier got before. Asked from the
        tiers' local state (`holds_locally`, no I/O); a tier that cannot tell gets every page."""
        need, lacking = [], set()
        for t in tiers:
            try:
                held = t.holds_locally(keys)
            except Exception:  # noqa: BLE001 - no answer: write them all
                held = None
            idx = range(len(keys)) if held is None else [i for i, h in enumerate(held) if not h]
            if idx:
                need.append(t)
                lacking.update(idx)
        skipped = len(keys) - len(lacking)
        if skipped:
            self.conn._m["write_through_skipped_held"] += skipped
        return need, sorted(lacking)

    def _write_through_run(self, job: Job):
        keys, pages, tiers, rows = job.ctx
        if rows is not None:  # copied out when it was queued
            return self._put_in_pieces(tiers, keys, lambda i0, i1: rows[i0:i1].view(torch.uint8))
        # the pinned host pages themselves, piece by piece: a run of consecutive pages is a view
        # (no copy), scattered ones are gathered into a reused staging buffer (no fresh mapping
        # to fault in); before, the whole write-back was copied into a new tensor first
        return self._put_in_pieces(tiers, keys, lambda i0, i1: self._piece_rows(pages[i0:i1]))

    def _piece_rows(self, pages: Sequence[int]) -> torch.Tensor:
        words = self.conn.host.words
        runs = contiguous_runs(pages)
        if len(runs) == 1:
            start = runs[0][2]
            return words[start:start + len(pages)].view(torch.uint8)
        buf = self.conn.staging.take(len(pages))
        torch.index_select(words, 0, torch.as_tensor(list(pages), dtype=torch.long), out=buf)
        return buf.view(torch.uint8)

    def _spill_run(self, keys, tier, rows_u8) -> int:
        got = self._put_in_pieces([tier], keys, lambda i0, i1: rows_u8[i0:i1])[tier.name]
        if got < 0:  # counted as a failed spill when it settles
            raise RuntimeError(f"spill of {len(keys)} pages to {tier.name} failed")
        return got

    def _put_in_pieces(self, tiers, keys, rows_of) -> dict:
        """Write the pages of `keys` (`rows_of(i0, i1)`: pages i0..i1-1 as uint8 rows) to each of
        `tiers` in pieces of WRITE_BACK_PIECE_BYTES and
        return {tier name: leading pages stored, -1 if it failed before storing any}. Before each
        piece the load-back fetches and promotions queued meanwhile run on this worker, and it waits
        while a prefetch runs (engine.yield_to_foreground): a write to a slow link takes seconds, and a load-back waiting for a
        worker behind it became a miss at its timeout. Queued prefetches are not taken here: on a
        CPU-bound machine two prefetches at once share the cores and both finish late, where in
        turn the first is done sooner at no cost to the second (tried on the kv128k multi-turn run:
        prefetch queueing and TTFT went up, not down)."""
        c = self.conn
        step = max(1, WRITE_BACK_PIECE_BYTES // max(1, c.layout.page_nbytes))
        out = {t.name: 0 for t in tiers}
        live = list(tiers)
        for i0 in range(0, len(keys), step):
            # fetches and promotions run here; then wait while a prefetch (a request waits on it) runs
            c.engine.yield_to_foreground(WRITE_BACK_YIELD_S)
            i1 = min(len(keys), i0 + step)
            rows = rows_of(i0, i1)
            for tier in list(live):
                try:
                    got = tier_put(c.engine, tier, c.host_node, keys[i0:i1], rows)
                except Exception:  # noqa: BLE001 - a failure only costs a future hit
                    logger.exception("flexflow: write of %d pages to %s failed", i1 - i0, tier.name)
                    got = -1
                if got < 0:
                    out[tier.name] = out[tier.name] or -1
                else:
                    out[tier.name] += got
                if got < i1 - i0:  # a short write ends this tier's leading run
                    live.remove(tier)
            if not live:
                break
        return out

    def _unpin(self, job: Job) -> None:
        pages = job.ctx[1]
        if pages:
            self.conn.host.unpin(pages)
            self.pinned -= len(pages)

    # ----------------------------------------------------------------- spill
    def spill(self, evicted) -> None:
        """Host-tier LRU victims [(key, page)] go to the first deeper tier: their bytes are copied
        out now (the caller reuses the pages next), the tier write is an engine job."""
        c = self.conn
        if not evicted or not c.tiers:
            return
        tier = c.tiers[0]
        try:
            held = tier.holds_locally([k for k, _ in evicted])
        except Exception:  # noqa: BLE001 - no answer: spill them all
            held = None
        if held is not None:  # already there (prefetched from it, written through, spilled before)
            kept = [e for e, h in zip(evicted, held) if not h]
            c._m["spills_skipped_held"] += len(evicted) - len(kept)
            evicted = kept
            if not evicted:
                return
        keys = [k for k, _ in evicted]
        nbytes = len(keys) * c.layout.page_nbytes
        if not c.engine.fits(nbytes):
            c._m["spills_dropped"] += 1
            c._m["pages_spill_dropped"] += len(keys)
            return
        rows = self._rows([p for _, p in evicted])
        job = Job("spill", lambda j: self._spill_run(keys, tier, rows.view(torch.uint8)), nbytes=nbytes,
                  ctx=(keys, tier))
        if not c._submit(job):
            c._m["spills_dropped"] += 1
            c._m["pages_spill_dropped"] += len(keys)

    # ----------------------------------------------------------------- settle (owner's thread)
    def settle(self, job: Job) -> None:
        """Unpin and count a finished write-through or spill job."""
        m, ok = self.conn._m, job.state == JobState.DONE
        if job.kind == "write_through":
            self._unpin(job)
            res = job.result if ok else None
            if not res:
                m["write_through_failures"] += 0 if job.state == JobState.CANCELLED else 1
                return
            m["pages_written_through"] += sum(max(0, v) for v in res.values())
            m["write_through_failures"] += sum(1 for v in res.values() if v < 0)
        elif job.kind == "spill":
            if ok:
                m["pages_spilled"] += int(job.result or 0)
            elif job.state == JobState.FAILED:
                m["spill_failures"] += 1
