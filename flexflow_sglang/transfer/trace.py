"""JobTrace: an opt-in timeline of the engine's finished jobs, one JSON line per job.

Why: counters say how long jobs took in total; a stall shows only on a timeline (which job ran
beside which, how long one sat in the queue, how much of its wall time was CPU). The multi-turn
fix of 3c1d01a was found this way: a 130 MB prefetch took 430-630 ms beside an idle scheduler
that held the GIL, and 55 ms right after it.

`transfer.trace_path: /some/dir/ff-jobs` writes `/some/dir/ff-jobs.<pid>.jsonl` (one file per
process: TP / DP ranks do not interleave), created owner-only (0600), never following a link,
appended to. At most `transfer.trace_max_jobs` lines; past that jobs are counted, not written
(`trace_dropped`). Written by the worker that ran the job, after it finished and released the
engine's lock, so the scheduler thread never touches the file. A write error turns the trace off
(logged once); it never fails a job.

Fields: kind, state, t_submit / t_start / t_end (wall clock, seconds since the epoch, so that they
line up with SGLang's request timestamps), queued_ms, wall_ms, cpu_ms (the worker thread's CPU while
the job ran), nbytes, thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_TRACE_MAX_JOBS = 100_000


class JobTrace:
    def __init__(self, path_prefix: str, max_jobs: int = DEFAULT_TRACE_MAX_JOBS):
        self.path = f"{path_prefix}.{os.getpid()}.jsonl"
        self.max_jobs = max(1, int(max_jobs))
        self.written = 0
        self.dropped = 0
        self._lock = threading.Lock()
        # wall clock = monotonic + offset (jobs carry monotonic times)
        self._offset = time.time() - time.monotonic()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            self._fd: Optional[int] = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise ValueError(f"transfer.trace_path: cannot open {self.path!r} for the job trace: {e}") from None
        os.fchmod(self._fd, 0o600)  # an existing file of ours keeps no wider mode

    def record(self, job) -> None:
        """Append one finished job (worker thread, engine lock not held)."""
        with self._lock:
            if self._fd is None:
                return
            if self.written >= self.max_jobs:
                self.dropped += 1
                return
            off = self._offset
            started = job.t_start > 0
            line = json.dumps({
                "kind": job.kind, "state": getattr(job.state, "value", str(job.state)),
                "t_submit": round(job.t_submit + off, 6),
                "t_start": round(job.t_start + off, 6) if started else None,
                "t_end": round(job.t_end + off, 6),
                "queued_ms": round((job.t_start - job.t_submit) * 1e3, 3) if started else None,
                "wall_ms": round((job.t_end - job.t_start) * 1e3, 3) if started else 0.0,
                "cpu_ms": round(job.cpu_s * 1e3, 3), "nbytes": int(job.nbytes),
                "thread": threading.current_thread().name,
            }, separators=(",", ":")) + "\n"
            try:
                os.write(self._fd, line.encode())
                self.written += 1
            except OSError as e:
                logger.warning("flexflow transfer: job trace %s stopped: %s", self.path, e)
                self._close_locked()

    def _close_locked(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def stats(self) -> dict:
        return {"trace_written": self.written, "trace_dropped": self.dropped}
