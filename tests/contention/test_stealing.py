"""Work stealing between the legs of one split transfer (the contention lab's executor)."""

import pytest

from flexflow_sglang.tools.bench.contention.node import Leg, rebalance

MiB = 1 << 20


class _Leg(Leg):
    """A leg without NIXL: the test sets what it delivered and what it has in flight."""

    def __init__(self, off, nbytes, done=0, inflight=0):
        super().__init__("test", (0,), off, nbytes, MiB, 1)
        self.t_start = 0.0
        self.done_bytes = done
        self._inflight = inflight

    def inflight(self):
        return self._inflight

    def drain(self):
        """Post everything left (as if the link took it instantly)."""
        while self.todo:
            self._take()


def _ranges(*legs):
    return sorted((lo, hi) for l in legs for lo, hi in l.todo)


def test_idle_leg_takes_the_share_of_a_leg_that_delivered_nothing():
    fast, slow = _Leg(0, 8 * MiB, done=8 * MiB), _Leg(8 * MiB, 8 * MiB, inflight=2)
    fast.drain()
    slow._take(), slow._take()  # its two chunks in flight
    before = _ranges(fast, slow)
    assert rebalance([fast, slow], now=1.0) == 6 * MiB
    assert not slow.todo and fast.todo_bytes == 6 * MiB
    assert _ranges(fast, slow) == before, "no byte lost or duplicated"
    assert fast.stolen_bytes == 6 * MiB


def test_steal_in_proportion_to_delivered_rates():
    a, b = _Leg(0, 4 * MiB, done=12 * MiB), _Leg(4 * MiB, 16 * MiB, done=4 * MiB)
    a.drain()
    b._take()
    left = b.todo_bytes  # 15 MiB
    moved = rebalance([a, b], now=1.0)
    assert moved == pytest.approx(left * 12 / 16, abs=MiB)  # a is three times faster
    assert a.todo_bytes + b.todo_bytes == left


def test_no_steal_while_busy_or_when_nothing_is_left():
    a, b = _Leg(0, 4 * MiB, done=MiB, inflight=2), _Leg(4 * MiB, 4 * MiB, done=MiB)
    assert rebalance([a, b], now=1.0) == 0  # a still has its own bytes to post
    a.drain()
    assert rebalance([a, b], now=1.0) == 0  # ... and two chunks in flight
    a._inflight, b._inflight = 0, 0
    b.drain()
    assert rebalance([a, b], now=1.0) == 0  # nothing left to take
