"""The transfer engine: every KV move is selected, reserved, run in legs, released and reported
here (engine.TransferEngine), and deep-tier moves run as background jobs off SGLang's scheduler
thread (jobs.Job). See docs/architecture.md, "The transfer engine"."""

from .engine import DEFAULT_CHUNK_BYTES, DEFAULT_QUEUE_BYTES, Ticket, TransferEngine
from .jobs import PRIORITY, WRITE_BACK, Job, JobState, MoveStats
from .trace import JobTrace

__all__ = ["TransferEngine", "Ticket", "Job", "JobTrace", "JobState", "MoveStats", "PRIORITY", "WRITE_BACK", "DEFAULT_CHUNK_BYTES",
           "DEFAULT_QUEUE_BYTES", "engine_from_config"]


def engine_from_config(selector, agent, tc=None, *, ttft_sensitive: bool = False) -> TransferEngine:
    """A TransferEngine from a config.TransferConfig (None: the defaults)."""
    if tc is None:
        return TransferEngine(selector, agent, ttft_sensitive=ttft_sensitive)
    return TransferEngine(selector, agent, mode=tc.mode, workers=tc.workers, queue_bytes=tc.queue_bytes,
                          chunk_bytes=tc.chunk_bytes, ttft_sensitive=ttft_sensitive,
                          worker_nice=getattr(tc, "worker_nice", 0),
                          trace=JobTrace(tc.trace_path, tc.trace_max_jobs) if tc.trace_path else None)
