"""Prefetch from the deeper tiers into the host tier, and promotion of deep pages, as transfer-engine
jobs. The connector owns the host tier, the tiers and the engine; this part decides what a prefetch
reads, hands its pieces over as they land, and settles them into host pages.

A prefetch (issue 13, "prefetch on arrival") reads the leading pages of a queued request's prefix
that a deeper tier holds, in pieces of PREFETCH_PIECE_BYTES: each landed piece reserves host pages on
the owner's thread and is copied into them, with its checksums, by a `promote` job on a worker. The
pages stay reserved (invisible, never evicted) until that job settles, so a reader never sees a
half-written page; a clear() meanwhile gives them back. A load that read deep pages itself promotes
them the same way (nobody waits on that).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..transfer import Job, JobState
from ..transfer.legs import deep_prefix
from .host_tier import contiguous_runs

logger = logging.getLogger(__name__)

#: a prefetch hands its pages over in pieces of this many bytes (promoted while the next is read)
PREFETCH_PIECE_BYTES = 32 << 20
#: the engine job kinds this part settles
JOB_KINDS = ("prefetch", "prefetch_piece", "promote")


@dataclass(eq=False)
class PrefetchHandle:
    """What `prefetch` returns: the engine fetches the leading `keys` the deeper tiers hold into
    the host tier in the background. `done` once the pages are committed (or it failed, was
    dropped or discarded); `pages` = leading pages of `keys` now in the host tier because of it."""
    keys: Optional[List[bytes]]        # None until the worker derived them from `chain`
    done: bool = False
    pages: int = 0
    failed: bool = False
    cancelled: bool = False
    job: Any = field(default=None, repr=False)
    refs: int = 1                      # requests waiting on it (a prefix shared by queued requests)
    pending: int = 0                   # landed pieces whose promotion into the host tier has not settled
    read_done: bool = False            # the fetch job itself has ended

    def share(self) -> "PrefetchHandle":
        """Another queued request waits on this fetch (its prefix starts with the same deep page)."""
        self.refs += 1
        return self

    def cancel(self) -> None:
        """A request waiting on it is gone (abort, flush, finished): when none is left, a queued
        fetch skips its I/O; what a running one brings back still lands in the host tier (valid KV
        for later requests)."""
        self.refs -= 1
        if self.refs <= 0:
            self.cancelled = True

    def settled(self) -> None:
        if self.read_done and self.pending <= 0:
            self.done = True


class Prefetcher:
    def __init__(self, conn: Any):
        # conn is the owning FlexFlowConnector (host tier, tiers, engine, counters); not imported here,
        # even for typing, so the connector -> prefetch layering stays a one-way edge
        self.conn = conn

    # ----------------------------------------------------------------- prefetch (owner's thread)
    def start(self, keys: Optional[Sequence[bytes]], chain) -> PrefetchHandle:
        """See FlexFlowConnector.prefetch."""
        c = self.conn
        h = PrefetchHandle(list(keys) if keys is not None else None)
        empty = not keys if chain is None else chain[2] <= 0
        if c.closed or empty or not c.tiers or c.prefetch_policy == "off":
            h.done = True
            return h
        c._m["prefetches"] += 1
        h.job = Job("prefetch", self._run, ctx=(h, c._gen, chain))
        if not c.engine.submit(h.job):
            c._m["prefetch_dropped"] += 1
            h.done, h.failed = True, True
        return h

    # ----------------------------------------------------------------- engine worker
    def _run(self, job: Job):
        c = self.conn
        h, gen, chain = job.ctx
        if h.cancelled:
            return None
        if chain is not None:
            h.keys = self._deep_chain(*chain)
            n = len(h.keys)
        else:
            n = deep_prefix(c.tiers, h.keys)
        if n <= 0:
            return 0, None, {}
        P = c.layout.page_nbytes
        granted = c.engine.grant(job, n * P) // P  # the queue bound covers prefetch staging too
        if granted < n:
            job.ctx = (h, gen, chain, n - granted)
        # In pieces, each handed to the owner as it lands (promoted while the next one is read), so
        # a request whose budget runs out (timeout policy) or that is admitted meanwhile finds the
        # leading pages that did arrive in the host tier, as HiCache's prefetch does.
        piece = max(1, PREFETCH_PIECE_BYTES // P)
        got = 0
        while got < granted:
            m = min(piece, granted - got)
            g, staging, _ = c._read_deep(h.keys[got:got + m], m)
            if g > 0:
                c.engine.deliver(Job("prefetch_piece", _never_run, ctx=(h, gen, got)), (g, staging[:g]))
            got += g
            if g < m:
                break
            # the earlier pieces' promotions (queued by the owner meanwhile) run here, before the
            # next read, so what arrived is usable even while every worker is in a long job
            c.engine.run_urgent("prefetch")
        return got, None, {}

    def _deep_chain(self, prev: bytes, tokens, pages: int, bigram: bool) -> List[bytes]:
        """Keys of the leading pages of `tokens` (chained after `prev`) that the deeper tiers hold:
        hashed and looked up in chunks growing 4x (worker thread; chain_keys is pure)."""
        c = self.conn
        ps, extra = c.page_size, 1 if bigram else 0
        out: List[bytes] = []
        j, chunk, cur = 0, 16, prev
        while j < pages:
            k = min(pages, j + chunk)
            ks = c.chain_keys(cur, tokens[j * ps:k * ps + extra], k - j, bigram)
            m = deep_prefix(c.tiers, ks)
            out.extend(ks[:m])
            if m < len(ks):
                break
            cur, j, chunk = ks[-1], k, chunk * 4
        return out

    # ----------------------------------------------------------------- promotion
    def promote(self, keys: Sequence[bytes], staging: torch.Tensor) -> int:
        """Copy pages a load read from a deeper tier into the host tier (best effort): on an engine
        worker when there is one (the staging is this call's own), else here."""
        c = self.conn
        pages, evicted = c.host.reserve(len(keys), protect=set(keys))
        c.write_back.spill(evicted)
        k = len(pages)
        if k and not self._promote_async(None, keys[:k], pages, staging[:k]):
            self._copy_in(keys[:k], pages, staging[:k])
        return k

    def _copy_in(self, keys: Sequence[bytes], pages: Sequence[int], staging: torch.Tensor) -> None:
        """Write staged pages into reserved host pages and make them visible (this thread)."""
        _copy_rows(self.conn.host.words, pages, staging)
        self.conn.host.commit(keys, pages)

    def _promote_async(self, h: Optional[PrefetchHandle], keys, pages, staging: torch.Tensor) -> bool:
        """Copy staged deep pages (a prefetch piece's, `h` its handle; or a load's, h None) into
        their reserved host pages on an engine worker, with the pages' checksums (commit takes
        them as they are): 128 MiB of copy and hash took 0.1-0.45 s, which on the scheduler thread
        every running request waited for. The pages stay reserved (invisible, never evicted) until
        the job settles. False: run it here (sync engine, or the engine is closed)."""
        c = self.conn
        if not c.engine.is_async:
            return False
        words = c.host.words  # the job keeps this buffer alive even if the tier closes meanwhile
        sums_of = c.host.page_sums if c.host.verify_checksums else None
        # Not counted against the queue bound: the staging exists already (granted to the prefetch
        # that filled it). Counted, it starved the next prefetches' grants (kv128k bench_serving:
        # cached tokens 91 % -> 67 %). Still bounded: a promote sorts before every prefetch, so while
        # it waits at most the prefetches already running (one per worker, each within the bound)
        # can finish and add theirs.
        job = Job("promote", lambda j: _promote_rows(words, pages, staging, sums_of), bounded=False,
                  ctx=(h, c._gen, keys, pages, staging))
        if not c.engine.submit(job):
            c._m["promote_inline"] += 1
            return False
        return True

    # ----------------------------------------------------------------- settle (owner's thread)
    def settle(self, job: Job) -> None:
        if job.kind == "prefetch":
            self._finish_prefetch(job)
        elif job.kind == "prefetch_piece":
            self._finish_piece(job)
        elif job.kind == "promote":
            self._finish_promote(job)

    def _finish_prefetch(self, job: Job) -> None:
        """The prefetch job ended: its pieces were handed over as they landed (_finish_piece); the
        handle is done once their promotions settled too."""
        m = self.conn._m
        h = job.ctx[0]
        if len(job.ctx) > 3:
            m["prefetch_capped"] += 1
        if job.state != JobState.DONE or job.result is None:
            h.failed = job.state != JobState.DONE and h.pages == 0 and h.pending == 0
            if job.state == JobState.FAILED:
                m["prefetch_failures"] += 1
        h.read_done = True
        h.settled()

    def _finish_piece(self, job: Job) -> None:
        """Pages [start, start + got) of a prefetch landed in its staging: reserve host pages and
        queue their promotion (the copy runs on a worker; the pages commit when it settles)."""
        c = self.conn
        h, gen, start = job.ctx
        got, staging = job.result
        if gen != c._gen or c.closed:
            c._m["prefetch_discarded"] += 1  # cleared meanwhile: the KV is stale
            return
        keys = h.keys[start:start + got]
        pages, evicted = c.host.reserve(got, protect=set(h.keys))
        c.write_back.spill(evicted)
        k = len(pages)
        if not k:
            return
        h.pending += 1
        if not self._promote_async(h, keys[:k], pages, staging[:k]):
            h.pending -= 1
            self._copy_in(keys[:k], pages, staging[:k])
            h.pages += k
            c._m["prefetch_pages"] += k

    def _finish_promote(self, job: Job) -> None:
        h = job.ctx[0]  # None: a load's promotion, nobody waits on it
        try:
            if self._commit_promoted(job) and h is not None:
                h.pages += len(job.ctx[3])
                self.conn._m["prefetch_pages"] += len(job.ctx[3])
        finally:
            if h is not None:
                h.pending -= 1
                h.settled()

    def _commit_promoted(self, job: Job) -> bool:
        """Make a promote job's pages visible (True), or give them back (stale, failed, closed)."""
        c = self.conn
        _, gen, keys, pages, staging = job.ctx
        if c.closed:
            return False
        if gen != c._gen:
            c.host.release(pages)
            c._m["prefetch_discarded"] += 1
            return False
        if job.state == JobState.FAILED:
            c._m["prefetch_failures"] += 1
            c.host.release(pages)
            return False
        if job.state != JobState.DONE:  # cancelled before it ran (close, clear): copy here
            self._copy_in(keys, pages, staging)
        else:
            c.host.commit(keys, pages, job.result)
        return True


def _never_run(job: Job):  # a job handed over finished (engine.deliver) is never queued
    raise AssertionError(f"{job.kind} job was queued")


def _copy_rows(words: torch.Tensor, pages: Sequence[int], staging: torch.Tensor) -> None:
    """staging's rows into words[pages]: one copy call, however scattered the pages are (a torch
    call per run was the scheduler thread's most frequent GIL hand-over while workers ran I/O)."""
    runs = contiguous_runs(pages)
    if len(runs) == 1:
        start = runs[0][2]
        words[start:start + len(pages)].copy_(staging)
    else:
        words.index_copy_(0, torch.as_tensor(list(pages), dtype=torch.long), staging)


def _promote_rows(words: torch.Tensor, pages: Sequence[int], staging: torch.Tensor, sums_of):
    """Engine worker: the promotion copy, then the host tier's checksums of the pages it wrote
    (`sums_of`: the tier's page_sums; its pages are reserved to this job, nobody else writes them)."""
    _copy_rows(words, pages, staging)
    return sums_of(pages) if sums_of is not None else None
