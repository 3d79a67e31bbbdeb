"""The backend's time on SGLang's scheduler thread, per hook (backend/sched_clock.py)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from ffcache_env import serve  # noqa: E402

from flexflow_sglang.backend.sched_clock import SLOW_S, SchedClock  # noqa: E402


def test_clock_counts_calls_total_max_and_slow():
    c = SchedClock()
    c.add("evict", 0.001)
    c.add("evict", 2 * SLOW_S)
    c.add("tick", 0.0)
    snap = c.snapshot()
    assert snap["evict"] == {"calls": 2, "total_ms": pytest.approx(1e3 * (0.001 + 2 * SLOW_S)),
                             "max_ms": pytest.approx(2e3 * SLOW_S), "slow": 1}
    assert snap["tick"]["calls"] == 1 and snap["tick"]["slow"] == 0


def test_cache_hooks_report_their_scheduler_thread_time(envs):
    env = envs(page_size=1)
    ids = list(range(100, 140))
    serve(env, "a", ids)
    before = env.tree.metrics()["sched"]
    assert before["match_prefix"]["calls"] >= 1 and before["checkpoint"]["calls"] >= 1
    # a hook that stalls shows up as slow, with its wall time
    orig = env.tree.connector.poll

    def slow_poll():
        time.sleep(2 * SLOW_S)
        return orig()
    env.tree.connector.poll = slow_poll
    env.tree.tick()
    after = env.tree.metrics()["sched"]["tick"]
    assert after["slow"] >= 1 and after["max_ms"] >= 2e3 * SLOW_S
