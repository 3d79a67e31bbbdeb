"""TransferEngine: the one place where a KV move is selected, reserved, run leg by leg, released
and reported; and the worker threads that run deep-tier moves off SGLang's scheduler thread.

Routing a move (`open` / `move`):
  select   PathSelector.select(TransferRequest(src, dst, bytes))
  reserve  NodeAgent.reserve_decision(decision): concurrent moves see the links as partly busy
  legs     each subpath gets its byte share of the units (pages), cut into chunks of `chunk_bytes`;
           the caller's leg function moves one chunk (a wrong share costs only the chunks in flight)
  release  each leg's reservation as the leg ends, all that are left on failure
  report   NodeAgent.report_transfer(leg links, bytes, seconds) per leg; bytes/seconds per type
Executors with their own concurrency (CUDA streams, the remote tier's NIXL legs) use a `Ticket`
directly: `open()` does select + reserve, `leg_done()` releases and reports one leg, `close()`
releases the rest. Bookkeeping never fails a move: a failed select runs the move unrouted, a
failed reservation runs it unreserved.

Background jobs (`submit` / `poll`): a bounded priority queue (fetch, prefetch, spill,
write-through) served by `workers` daemon threads. Write-back jobs (spill, write-through) run on at
most `workers - 1` of them (with one worker they share it), so a fetch or prefetch (a request waits
on it) never queues behind a write-back backlog on a slow link: priority orders the queue, the
reserved worker orders the lanes. The bound is in bytes (`queue_bytes`, the staging and copies
queued and running jobs hold); a job that does not fit is refused (`submit`
returns False, counted as dropped) - never a wait. Finished jobs are collected by `poll()` on the
owner's thread. `mode="sync"` runs every job inline in `submit` (the ablation: today's
synchronous behaviour).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .jobs import PRIORITY, WRITE_BACK, Job, JobState, MoveStats
from .trace import JobTrace

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_QUEUE_BYTES = 256 << 20


class Ticket:
    """One routed move: its decision and the reservations still held (one per subpath)."""
    __slots__ = ("engine", "decision", "nbytes", "tokens", "t0", "stats", "closed")

    def __init__(self, engine: "TransferEngine", decision, nbytes: int):
        self.engine, self.decision, self.nbytes = engine, decision, nbytes
        self.tokens: Dict[int, int] = {}
        self.t0 = time.perf_counter()
        self.stats = MoveStats(path_type=decision.chosen_type.value if decision is not None else "unrouted")
        self.closed = False

    @property
    def subpaths(self) -> list:
        return list(self.decision.subpaths) if self.decision is not None else []

    def shares(self, units: int) -> List[tuple]:
        """[(subpath index, subpath, u0, u1)]: `units` cut in proportion to the subpaths' bytes
        (cumulative rounding, so the shares sum to `units`); empty shares are left out."""
        subs = self.subpaths
        if not subs:
            return [(0, None, 0, units)] if units else []
        bounds, acc, total = [0], 0, sum(s.nbytes for s in subs) or 1
        for s in subs:
            acc += s.nbytes
            bounds.append(round(acc * units / total))
        return [(i, s, bounds[i], bounds[i + 1]) for i, s in enumerate(subs) if bounds[i + 1] > bounds[i]]

    def leg_done(self, index: int, nbytes: int, seconds: float, *, report: bool = True,
                 links=None, relays: Optional[int] = None, progress_reported: bool = False) -> None:
        """Release subpath `index`'s reservation and report its bytes/seconds (never raises).
        `links` / `relays` override the subpath's (a leg that ran another route than planned)."""
        eng = self.engine
        self.release_leg(index)
        subs = self.subpaths
        sub = subs[index] if 0 <= index < len(subs) else None
        lk = links if links is not None else (sub.links if sub is not None else ())
        if report and nbytes > 0 and lk:
            rl = relays if relays is not None else (0 if sub is None or sub.type.value == "Direct" else 1)
            try:
                eng.agent.report_transfer(lk, nbytes, max(seconds, 1e-9), relays=rl,
                                          **({"progress_reported": True} if progress_reported else {}))
            except Exception as e:  # noqa: BLE001
                logger.debug("flexflow transfer: report failed: %r", e)
        self.stats.nbytes += nbytes
        self.stats.seconds += seconds
        self.stats.legs.append((sub.type.value if sub is not None else "unrouted", nbytes, seconds))

    def posted(self, index: int, nbytes: int, links=None) -> None:
        """`nbytes` of subpath `index` were just handed to the wire (a NIXL post, a chunk sent):
        the sampled link counters will see them before the leg ends, so they are ours, not foreign
        load (NodeAgent.report_progress). Pass `progress_reported=True` to the leg's leg_done."""
        subs = self.subpaths
        lk = links if links is not None else (subs[index].links if 0 <= index < len(subs) else ())
        if nbytes > 0 and lk:
            try:
                self.engine.agent.report_progress(lk, int(nbytes))
            except Exception as e:  # noqa: BLE001 - bookkeeping must never fail a move
                logger.debug("flexflow transfer: report_progress failed: %r", e)

    def release_leg(self, index: int) -> None:
        """End subpath `index`'s reservation without reporting (its bytes were reported elsewhere,
        e.g. per chunk, or the leg was never run); leg_done and reroute release through here."""
        tok = self.tokens.pop(index, 0)
        if tok:
            try:
                self.engine.agent.release([tok])
            except Exception as e:  # noqa: BLE001
                logger.debug("flexflow transfer: release failed: %r", e)

    def reroute(self, index: int, links, nbytes: int) -> None:
        """Subpath `index` runs over other links than planned (a relay that fell back to direct):
        move its reservation there, for the decision's estimated time."""
        eng = self.engine
        self.release_leg(index)
        try:
            if links and nbytes > 0:
                est = float(self.decision.estimated_time_us) * 1e-6 if self.decision is not None else None
                new = eng.agent.reserve(tuple(links), int(nbytes), est)
                if new:
                    self.tokens[index] = new
        except Exception as e:  # noqa: BLE001
            logger.debug("flexflow transfer: reroute failed: %r", e)

    def close(self, record: Optional[str] = None) -> MoveStats:
        """Release whatever is still reserved; record the move under `record` (e.g. "tier:")."""
        if self.closed:
            return self.stats
        self.closed = True
        toks, self.tokens = list(self.tokens.values()), {}
        if toks:
            try:
                self.engine.agent.release(toks)
            except Exception as e:  # noqa: BLE001
                logger.debug("flexflow transfer: release failed: %r", e)
        if self.decision is not None:
            self.engine._record((record or "") + self.stats.path_type, self.stats.nbytes, self.stats.seconds)
        return self.stats

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TransferEngine:
    def __init__(self, selector, agent, *, mode: str = "async", workers: int = 2,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 ttft_sensitive: bool = False, name: str = "ff-transfer", worker_nice: int = 0,
                 trace: Optional[JobTrace] = None):
        if mode not in ("async", "sync"):
            raise ValueError(f"transfer mode must be 'async' or 'sync', got {mode!r}")
        self.selector = selector
        self.agent = agent
        self.mode = mode
        self.n_workers = max(1, int(workers))
        self.queue_bytes = int(queue_bytes)
        self.chunk_bytes = max(4096, int(chunk_bytes))
        self.ttft_sensitive = ttft_sensitive
        self.name = name
        self.worker_nice = max(0, int(worker_nice))
        self.trace = trace  # opt-in timeline of finished background jobs (transfer/trace.py)
        # bytes and seconds per chosen path type (moves record "<type>", tier I/O "tier:<type>")
        self.by_type: Dict[str, Dict[str, float]] = {}
        self._cv = threading.Condition()
        self._cpu_tls = threading.local()  # per worker: CPU of jobs run inside the running job (run_urgent)
        self._select_lock = threading.Lock()
        self._heap: List[tuple] = []
        self._seq = itertools.count()
        self._held = 0            # bytes held by queued + running jobs
        self._running = 0
        self._running_wb = 0      # running write-back jobs (WRITE_BACK kinds)
        self._queued_fg = 0       # queued jobs that are not write-backs (a request may wait on them)
        # write-backs may occupy every worker but one: that one is kept for fetch / prefetch
        self.writeback_limit = max(1, self.n_workers - 1)
        self._finished: List[Job] = []
        self._threads: List[threading.Thread] = []
        self._closed = False
        self.c: Dict[str, int] = {k: 0 for k in ("submitted", "completed", "failed", "dropped", "dropped_bytes",
                                                 "cancelled", "inline", "writeback_yields", "writeback_yield_ms")}
        self.c_kind: Dict[str, Dict[str, int]] = {}

    # ================================================================= routing (the one place)
    def open(self, src: Optional[str], dst: Optional[str], nbytes: int, ttft_sensitive: Optional[bool] = None,
             *, reserve: bool = True) -> Ticket:
        """select + reserve for src -> dst. When there is no route (an endpoint outside the
        topology, src == dst, nothing to move, the selector fails) the ticket is unrouted."""
        decision = None
        topo = self.selector.topology
        if nbytes > 0 and src in topo.nodes and dst in topo.nodes and src != dst:
            from ..selector import TransferRequest
            try:
                with self._select_lock:  # the scoring core of a pair is not re-entrant (scheduler + workers)
                    decision = self.selector.select(TransferRequest(
                        src, dst, nbytes, self.ttft_sensitive if ttft_sensitive is None else ttft_sensitive))
            except Exception:  # noqa: BLE001 - no route known: still run the move
                logger.debug("flexflow transfer: no path %s -> %s", src, dst)
        t = Ticket(self, decision, nbytes)
        if decision is not None and reserve:
            try:
                toks = self.agent.reserve_decision(decision)
                t.tokens = {i: tok for i, tok in enumerate(toks) if tok}
            except Exception as e:  # noqa: BLE001
                logger.debug("flexflow transfer: reserve failed: %r", e)
        return t

    def unrouted(self, nbytes: int = 0) -> Ticket:
        """A ticket without a decision, for a move whose route is fixed by its caller (a pinned rail,
        an ablation's baseline): its legs still release and report here, with explicit links."""
        return Ticket(self, None, nbytes)

    def estimate_s(self, src: Optional[str], dst: Optional[str], nbytes: int) -> Optional[float]:
        """The selector's predicted seconds for src -> dst under the current load, without a
        reservation; None when there is no route (as in open())."""
        topo = self.selector.topology
        if nbytes <= 0 or src not in topo.nodes or dst not in topo.nodes or src == dst:
            return None
        from ..selector import TransferRequest
        try:
            with self._select_lock:
                d = self.selector.select(TransferRequest(src, dst, int(nbytes), self.ttft_sensitive))
        except Exception:  # noqa: BLE001 - no route known
            return None
        return d.estimated_time_us / 1e6

    def move(self, src: Optional[str], dst: Optional[str], units: int, unit_bytes: int,
             leg: Callable[[Any, int, int], Any], *, chunked: bool = True, record: str = "",
             ttft_sensitive: Optional[bool] = None, on_leg_end: Optional[Callable[[Any], None]] = None,
             chunk_bytes: Optional[int] = None) -> MoveStats:
        """Route `units` units of `unit_bytes` from src to dst and run them: `leg(subpath, u0, u1)`
        moves units [u0, u1) along the subpath (None when unrouted), in chunks of `chunk_bytes`
        when `chunked` (`chunk_bytes` overrides the engine's for this move: a leg whose every call
        has a high fixed cost asks for larger chunks). A chunk whose leg returns an int smaller
        than its size ends the move (short read: the leading units moved are what counts); the
        return value is then
        `MoveStats.nbytes` of what moved. Exceptions propagate after the reservations are released."""
        t = self.open(src, dst, units * unit_bytes, ttft_sensitive)
        try:
            cb = max(self.chunk_bytes, int(chunk_bytes)) if chunk_bytes else self.chunk_bytes
            per = max(1, cb // max(1, unit_bytes)) if chunked else max(1, units)
            for i, sub, u0, u1 in t.shares(units):
                t0 = time.perf_counter()
                moved, short = 0, False
                for c0 in range(u0, u1, per):
                    c1 = min(u1, c0 + per)
                    got = leg(sub, c0, c1)
                    n = (c1 - c0) if not isinstance(got, int) or isinstance(got, bool) else max(0, min(got, c1 - c0))
                    moved += n
                    if n < c1 - c0:
                        short = True
                        break
                if on_leg_end is not None:
                    on_leg_end(sub)
                t.leg_done(i, moved * unit_bytes, time.perf_counter() - t0, report=sub is not None)
                if short:
                    break
        finally:
            stats = t.close(record)
        return stats

    def _record(self, key: str, nbytes: int, seconds: float) -> None:
        rec = self.by_type.setdefault(key, {"moves": 0, "bytes": 0, "seconds": 0.0})
        rec["moves"] += 1
        rec["bytes"] += nbytes
        rec["seconds"] += seconds

    def bandwidth_by_type(self) -> Dict[str, Dict[str, float]]:
        return {k: {"moves": v["moves"], "bytes": v["bytes"], "seconds": round(v["seconds"], 6),
                    "gbps": round(v["bytes"] / v["seconds"] / 1e9, 3) if v["seconds"] > 0 else 0.0}
                for k, v in list(self.by_type.items())}

    # ================================================================= background jobs
    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    def fits(self, nbytes: int) -> bool:
        """Would a job holding `nbytes` be accepted now (check before copying anything for it)."""
        with self._cv:
            return self._held + nbytes <= self.queue_bytes or (self._held == 0 and not self._heap)

    def grant(self, job: Job, nbytes: int) -> int:
        """A running job asks for `nbytes` more (staging it learns it needs); returns what fits."""
        with self._cv:
            free = max(0, self.queue_bytes - self._held)
            got = min(nbytes, free)
            self._held += got
            job.nbytes += got
            return got

    def submit(self, job: Job) -> bool:
        """Queue `job` (async) or run it now (sync). False: refused (queue full or engine closed);
        the owner keeps (and undoes) whatever it prepared for it."""
        k = self.c_kind.setdefault(job.kind, {"submitted": 0, "dropped": 0, "done": 0, "failed": 0})
        if self._closed:
            return False
        if not self.is_async:
            self.c["inline"] += 1
            k["submitted"] += 1
            self._execute(job)
            with self._cv:
                self._finished.append(job)
            return True
        with self._cv:
            # one job larger than the whole bound still runs when nothing else is held
            if job.bounded and self._held + job.nbytes > self.queue_bytes and (self._held or self._heap):
                self.c["dropped"] += 1
                self.c["dropped_bytes"] += job.nbytes
                k["dropped"] += 1
                return False
            self._held += job.nbytes
            job.seq = next(self._seq)
            heapq.heappush(self._heap, (PRIORITY.get(job.kind, 9), job.seq, job))
            self._queued_fg += job.kind not in WRITE_BACK
            self.c["submitted"] += 1
            k["submitted"] += 1
            while len(self._threads) < self.n_workers:  # started on first use; idle ones wait on the condition
                self._start_worker()
            self._cv.notify_all()  # not notify(): a waiting write-back (yield_to_foreground) or drain could take it from an idle worker
        return True

    def _start_worker(self) -> None:
        th = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
        self._threads.append(th)
        th.start()

    def _lower_priority(self) -> None:
        """Raise this worker thread's niceness by worker_nice (Linux: per thread; raising needs no
        privilege). Background copies then yield the CPU to the scheduler and forward threads."""
        if not self.worker_nice or not hasattr(os, "setpriority"):
            return
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.worker_nice))
        except OSError as e:
            logger.debug("flexflow transfer: cannot lower worker priority: %r", e)

    def _runnable(self) -> bool:
        """The queue's first job may start now: a fetch / prefetch always (it sorts first), a
        write-back only while fewer than writeback_limit write-backs run."""
        return bool(self._heap) and (self._heap[0][2].kind not in WRITE_BACK
                                     or self._running_wb < self.writeback_limit)

    def _work(self) -> None:
        self._lower_priority()
        while True:
            with self._cv:
                while not self._runnable() and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                if not self._runnable():  # closing: the queue is cancelled by close(); nothing to run
                    return
                job = self._pop_locked()
            self._run_popped(job)

    def _pop_locked(self) -> Job:
        """Take the queue's first job and count it as running, under self._cv in one step: counted
        later, a second worker could see no write-back running and start one too, and the worker
        kept for fetches would be gone (seen as a prefetch waiting behind a write-back backlog)."""
        _, _, job = heapq.heappop(self._heap)
        self._queued_fg -= job.kind not in WRITE_BACK
        self._running += 1
        self._running_wb += job.kind in WRITE_BACK
        return job

    def _run_popped(self, job: Job) -> None:
        """Run a job _pop_locked took, then settle the counts and hand it to poll()."""
        wb = job.kind in WRITE_BACK
        try:
            self._execute(job)
        finally:
            with self._cv:
                self._running -= 1
                self._running_wb -= wb
                self._held -= job.nbytes
                self._finished.append(job)
                self._cv.notify_all()
            if self.trace is not None:  # after the lock: the file write holds up no other worker
                self.trace.record(job)

    def run_urgent(self, kind: str) -> int:
        """Called by a running job of `kind` between two of its steps (a prefetch between pieces):
        run, on this worker, the queued jobs that sort before `kind` (fetches, promotions), then
        return to it. With every worker in a long job (a prefetch reading piece after piece, a
        write-through on a slow link), a 10 ms promotion otherwise waits for one of them to end,
        and a request whose prefetch budget runs out finds none of the pieces that did arrive.
        Returns how many jobs it ran."""
        if not self.is_async:
            return 0
        rank, n = PRIORITY.get(kind, 9), 0
        while True:
            with self._cv:
                if self._closed or not self._heap or self._heap[0][0] >= rank:
                    return n
                job = self._pop_locked()
            self._run_popped(job)
            n += 1

    def _foreground_busy(self) -> bool:
        """A job a request waits on (not a write-back) is queued, or runs on another worker
        (under self._cv)."""
        return (self._running - self._running_wb) > 0 or self._queued_fg > 0

    def yield_to_foreground(self, max_s: float) -> float:
        """Called by a running write-back between two pieces: run the queued fetches and promotions
        here (run_urgent), then wait while a fetch, prefetch or promotion is queued or running on
        another worker, at most `max_s` (write-backs still progress a piece at a time under a
        steady stream of prefetches). On a machine whose cores the forward pass already holds, a
        write-back running beside a prefetch takes the CPU that the prefetch (which a queued request
        waits on) needs; paused, it costs only the write-back's own latency, which nobody waits on.
        Returns the seconds it waited."""
        if not self.is_async or max_s <= 0:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + max_s
        waited = False
        while True:
            self.run_urgent("prefetch")
            with self._cv:
                now = time.monotonic()
                if self._closed or now >= deadline or not self._foreground_busy():
                    break
                waited = True
                self._cv.wait(min(deadline - now, 0.05))  # woken when a job ends; re-checks queued fetches
        dt = time.monotonic() - t0
        if waited:
            with self._cv:
                self.c["writeback_yields"] += 1
                self.c["writeback_yield_ms"] += int(dt * 1e3)
        return dt

    def wait_for_progress(self, timeout_s: float) -> None:
        """Sleep until a job finishes or is submitted, at most `timeout_s` (the GIL released
        meanwhile). For an owner thread with nothing to do but wait for the engine: see
        FlexFlowRadixCache.idle_wait."""
        if not self.is_async or timeout_s <= 0:
            return
        with self._cv:
            if not self._closed and (self._heap or self._running):
                self._cv.wait(timeout_s)

    def _execute(self, job: Job) -> None:
        job.state = JobState.RUNNING
        job.t_start = time.monotonic()
        # this thread's CPU: what the job took from the forward's cores. Jobs it runs itself between
        # its steps (run_urgent: a write-back runs the queued promotions) count as their own kind,
        # not twice: their CPU is taken out of this job's.
        tls = self._cpu_tls
        outer_nested = getattr(tls, "nested", 0.0)
        tls.nested = 0.0
        cpu0 = time.thread_time()
        try:
            res = job.run(job)
        except Exception as e:  # noqa: BLE001 - a failed job is reported, never raised into a worker
            logger.warning("flexflow transfer: %s job failed: %r", job.kind, e)
            logger.debug("flexflow transfer: %s job traceback", job.kind, exc_info=True)
            self._settle_cpu(job, cpu0, outer_nested)
            job._finish(JobState.FAILED, None, repr(e))
        else:
            self._settle_cpu(job, cpu0, outer_nested)
            job._finish(JobState.DONE, res)

    def _settle_cpu(self, job: Job, cpu0: float, outer_nested: float) -> None:
        total = time.thread_time() - cpu0
        tls = self._cpu_tls
        job.cpu_s = max(0.0, total - tls.nested)
        tls.nested = outer_nested + total  # a job that ran inside another: its parent subtracts all of it

    def deliver(self, job: Job, result: Any) -> None:
        """A running job hands the owner a part of its work early: `job` (created for it, never
        queued) comes back DONE with `result` from the next poll(), before the job that made it."""
        job._finish(JobState.DONE, result)
        with self._cv:
            self._finished.append(job)

    def poll(self) -> List[Job]:
        """Finished jobs since the last poll, in completion order (owner's thread)."""
        with self._cv:
            if not self._finished:
                return []
            out, self._finished = self._finished, []
        for job in out:
            k = self.c_kind.setdefault(job.kind, {"submitted": 0, "dropped": 0, "done": 0, "failed": 0})
            if job.t_end and job.t_start:  # ran (a cancelled job did not): wall and CPU per kind
                k["wall_ms"] = k.get("wall_ms", 0) + int(1e3 * (job.t_end - job.t_start))
                k["cpu_ms"] = k.get("cpu_ms", 0) + int(1e3 * job.cpu_s)
                # time queued before a worker took it: what a request waiting on a prefetch loses
                # to other jobs (wall_ms is the run alone)
                k["queued_ms"] = k.get("queued_ms", 0) + int(1e3 * max(0.0, job.t_start - job.t_submit))
            if job.state == JobState.DONE:
                self.c["completed"] += 1
                k["done"] += 1
            elif job.state == JobState.FAILED:
                self.c["failed"] += 1
                k["failed"] += 1
            else:
                self.c["cancelled"] += 1
        return out

    def cancel_queued(self, kinds=None) -> int:
        """Take queued jobs (of `kinds`, default all) off the queue; they come back CANCELLED from
        poll() so their owner can undo what it prepared. Running jobs finish."""
        n = 0
        with self._cv:
            keep = []
            for item in self._heap:
                job = item[2]
                if kinds is None or job.kind in kinds:
                    self._held -= job.nbytes
                    job._finish(JobState.CANCELLED)
                    self._finished.append(job)
                    n += 1
                else:
                    keep.append(item)
            heapq.heapify(keep)
            self._heap = keep
            self._queued_fg = sum(item[2].kind not in WRITE_BACK for item in keep)
        return n

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until nothing is queued or running (True), or until `timeout` seconds (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._heap or self._running:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 0.5)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Cancel queued jobs, let running ones end (bounded by their own I/O timeouts), stop the
        workers. Idempotent."""
        if self._closed:
            return
        self.cancel_queued()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        end = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, end - time.monotonic()))
            if th.is_alive():
                logger.warning("flexflow transfer: worker %s still running at close", th.name)
        if self.trace is not None:
            self.trace.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> Dict[str, Any]:
        with self._cv:
            queued, held, running = len(self._heap), self._held, self._running
        trace = self.trace.stats() if self.trace is not None else {}
        return dict(self.c, **trace, mode=self.mode, workers=len(self._threads), writeback_limit=self.writeback_limit,
                    queued=queued, running=running,
                    held_bytes=held, queue_bytes=self.queue_bytes, by_kind={k: dict(v) for k, v in self.c_kind.items()})
