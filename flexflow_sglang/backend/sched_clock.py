"""How long the backend holds SGLang's scheduler thread, per hook.

Every running request waits while a cache hook runs (the scheduler thread also decodes), so the
time spent there is the backend's cost to inter-token latency. `SchedClock` keeps per hook: calls,
total seconds, the longest call, and the calls longer than SLOW_S; the cache exports it under
`metrics()["sched"]` (and on /metrics as `flexflow_cache_sched_<hook>_<field>`). `timed(hook)`
wraps a cache method; nested hooks (evict -> poll) count in both, the outer one is what the
scheduler waited for.
"""

from __future__ import annotations

import functools
import time
from typing import Dict

#: a hook call longer than this is counted as slow (a decode step on a small GPU model is ~10-30 ms)
SLOW_S = 0.010


class SchedClock:
    __slots__ = ("hooks",)

    def __init__(self) -> None:
        self.hooks: Dict[str, list] = {}  # hook -> [calls, total_s, max_s, slow]

    def add(self, hook: str, seconds: float) -> None:
        h = self.hooks.get(hook)
        if h is None:
            h = self.hooks[hook] = [0, 0.0, 0.0, 0]
        h[0] += 1
        h[1] += seconds
        if seconds > h[2]:
            h[2] = seconds
        if seconds > SLOW_S:
            h[3] += 1

    def snapshot(self) -> Dict[str, Dict[str, float]]:
        return {k: {"calls": v[0], "total_ms": round(v[1] * 1e3, 3), "max_ms": round(v[2] * 1e3, 3), "slow": v[3]}
                for k, v in list(self.hooks.items())}


def timed(hook: str):
    """Decorator for a cache method: its wall time goes to `self._sched` (a SchedClock)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **kw)
            finally:
                self._sched.add(hook, time.perf_counter() - t0)
        return inner
    return wrap
