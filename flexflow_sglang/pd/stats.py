"""Per-chunk accounting of PD KV transfers: counters for /metrics and an optional JSONL trace.

Every KV chunk the prefill side sends through FlexFlow's manager is recorded once all its legs
settled: bytes, wall time from the first post to the last completion, the plan's path type, and
each leg's rail / bytes / seconds. ``FLEXFLOW_PD_TRACE=/path.jsonl`` appends one JSON line per
chunk (file created 0600) - benchmarks read it for p50/p99 without scraping logs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

TRACE_ENV = "FLEXFLOW_PD_TRACE"


class ChunkStats:
    def __init__(self, n_rails: int, policy: str, trace_path: Optional[str] = None, exporter=None):
        self.policy = policy
        self.n_rails = n_rails
        self._lock = threading.Lock()
        self.chunks = 0
        self.failed_chunks = 0
        self.by_path = {"direct": 0, "split": 0, "fixed": 0, "sglang": 0}
        self.bytes_per_rail = [0] * n_rails
        self.bytes_sglang = 0
        self.seconds_total = 0.0
        self.bytes_total = 0
        self._exporter = exporter
        self._trace = None
        path = trace_path if trace_path is not None else os.environ.get(TRACE_ENV)
        if path:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._trace = os.fdopen(fd, "a", buffering=1)
            except OSError as e:
                logger.warning("flexflow PD: cannot open %s=%r: %s (no trace)", TRACE_ENV, path, e)

    def record(self, path_type: str, legs: Sequence[Tuple[int, int, float, float]], ok: bool,
               t_first_post: float) -> None:
        """legs: (rail (-1 = SGLang's agent), bytes, t_posted, t_done)."""
        t_end = max((l[3] for l in legs), default=t_first_post)
        seconds = max(0.0, t_end - t_first_post)
        nbytes = sum(l[1] for l in legs)
        with self._lock:
            self.chunks += 1
            if not ok:
                self.failed_chunks += 1
            else:
                self.by_path[path_type] = self.by_path.get(path_type, 0) + 1
                self.seconds_total += seconds
                self.bytes_total += nbytes
                for rail, b, _, _ in legs:
                    if rail < 0:
                        self.bytes_sglang += b
                    else:
                        self.bytes_per_rail[rail] += b
            snapshot = self._metrics_locked()
        if self._trace is not None:
            rec = {"t": time.time(), "ok": ok, "policy": self.policy, "path": path_type, "bytes": nbytes,
                   "seconds": seconds,
                   "legs": [{"rail": r, "bytes": b, "seconds": max(0.0, d - p)} for r, b, p, d in legs]}
            try:
                self._trace.write(json.dumps(rec) + "\n")
            except (OSError, ValueError):
                pass
        if self._exporter is not None:
            self._exporter.update(snapshot, force=True)

    def _metrics_locked(self) -> dict:
        return {"chunks": self.chunks, "failed_chunks": self.failed_chunks,
                "chunks_by_path": dict(self.by_path), "bytes": self.bytes_total,
                "seconds": self.seconds_total,
                "gbps": (self.bytes_total / self.seconds_total / 1e9) if self.seconds_total > 0 else 0.0,
                "bytes_per_rail": {f"rail{i}": b for i, b in enumerate(self.bytes_per_rail)},
                "bytes_sglang_agent": self.bytes_sglang}

    def metrics(self) -> dict:
        with self._lock:
            return self._metrics_locked()

    def close(self) -> None:
        if self._trace is not None:
            try:
                self._trace.close()
            except OSError:
                pass
            self._trace = None


def load_trace(path: str) -> List[dict]:
    out = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out
