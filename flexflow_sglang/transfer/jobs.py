"""Transfer jobs: one unit of background KV movement, and what a finished move reports.

A job is created and consumed on the scheduler thread; only `run` executes on an engine worker.
`run(job)` may only touch memory the job owns (its staging) or host pages its owner pinned for it,
and returns the job's result. Everything the owner must undo (unpin, free, commit) happens when
the owner polls the finished job back on its own thread, so the host tier is only ever mutated by
the thread that owns it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, List, Optional, Tuple

#: job kinds, in priority order (lower runs first): a fetch blocks a load-back; a promote (a finished
#: prefetch's copy into the host tier) is the last step before a queued request can run, a prefetch
#: the first; write-back copies only cost a future hit when late
PRIORITY = {"fetch": 0, "promote": 1, "prefetch": 2, "spill": 3, "write_through": 4}
#: background copies: they never take the engine's last free worker (engine.writeback_limit)
WRITE_BACK = frozenset({"spill", "write_through"})


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"          # run() returned (its result says how much it moved)
    FAILED = "failed"      # run() raised
    CANCELLED = "cancelled"  # taken off the queue before it ran (close, clear)


@dataclass(eq=False)
class Job:
    kind: str                          # "fetch" | "promote" | "prefetch" | "spill" | "write_through"
    run: Callable[["Job"], Any]        # worker body; returns the result
    nbytes: int = 0                    # bytes the job holds (staging, copies): counted against the queue bound
    ctx: Any = None                    # owner data (keys, pinned pages, ...), read back on poll
    #: False: counted against the queue bound but never refused by it (a job carrying memory that
    #: already exists, like a finished prefetch's staging: refusing it would free nothing)
    bounded: bool = True
    state: JobState = JobState.QUEUED
    result: Any = None
    error: Optional[str] = None
    abandoned: bool = False            # the owner stopped waiting: drop the result on poll
    t_submit: float = field(default_factory=time.monotonic)
    t_start: float = 0.0
    t_end: float = 0.0
    cpu_s: float = 0.0                 # CPU seconds of the worker thread while run() ran
    seq: int = 0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        return self.state == JobState.DONE

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def _finish(self, state: JobState, result: Any = None, error: Optional[str] = None) -> None:
        self.state, self.result, self.error = state, result, error
        self.t_end = time.monotonic()
        self._done.set()


@dataclass
class MoveStats:
    """What one routed move did: bytes, seconds, the decision's type and each leg's share."""
    nbytes: int = 0
    seconds: float = 0.0
    path_type: str = ""
    legs: List[Tuple[str, int, float]] = field(default_factory=list)  # (subpath type, bytes, seconds)
