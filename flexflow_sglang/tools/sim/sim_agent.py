"""The selector's view of the simulated network: the project's real NodeAgent, fed like a real one.

- sampling: every `sample_interval_ms` the agent reads per-link byte counters (`SimCounterSource`,
  a `LinkLoadSource`) through its own `sample_once()`: the rate over the last interval of the
  busier direction, which includes our own KV bytes; the agent subtracts what completed transfers
  reported (exactly the production code path). `mode="background"` instead hands the agent the
  background-only utilisation of the last interval (an idealised monitor) via the mock values.
- feedback: every completed KV sub-flow is reported with `report_transfer(links, nbytes, seconds)`.
  With `progress=True` the bytes each running sub-flow moved are also reported with
  `report_progress()` at every sampling tick (what a chunked executor does per chunk), so a
  transfer longer than the sampling interval is never counted as foreign load; the completion
  report then passes `progress_reported=True`.
- reservations: with `reserve=True` (default) the adaptive policy opens a `TransferEngine` ticket
  (select + `NodeAgent.reserve_decision`, one token per leg) and the leg's token is released when
  its last byte leaves (`on_drain` -> `Ticket.release_leg`), so a transfer arriving while an
  earlier one still fills its links sees them as partly busy; the agent also uses the reservations
  to estimate our in-flight bytes on the sampled counters. A completed leg is reported through
  `Ticket.leg_done`; the ticket is closed when its last leg has been reported.
- observed links: all, only those with a hardware counter attribute, or an explicit list of link
  ids (e.g. the two sysfs interfaces a NodeAgent inside one network namespace can read).
- staleness: decisions see the average of the last completed interval (plus `lag_intervals`
  whole intervals of extra reporting delay), never the simulator's instantaneous state.

The NodeAgent reads `time.monotonic()` for its sampling interval and feedback decay; while the
simulator calls into it, that module's clock is swapped for the simulated clock (single-threaded;
restored afterwards), so decay and rates are in simulated time.
"""

from __future__ import annotations

import contextlib
import time as _real_time
from collections import deque
from typing import Optional

import numpy as np

from flexflow_sglang.monitor import node_agent as _na
from flexflow_sglang.monitor.node_agent import NodeAgent
from flexflow_sglang.monitor.sources import LinkLoadSource

#: simulated t=0 maps to this monotonic value (the agent's feedback timestamps start at 0.0)
CLOCK_OFFSET_S = 1.0e4


class _TimeShim:
    """Stands in for the `time` module inside monitor.node_agent while the simulator calls it."""

    def __init__(self, sim):
        self._sim = sim

    def monotonic(self) -> float:
        return CLOCK_OFFSET_S + self._sim.t

    def __getattr__(self, name):
        return getattr(_real_time, name)


@contextlib.contextmanager
def sim_clock(sim):
    prev = _na.time
    _na.time = _TimeShim(sim)
    try:
        yield
    finally:
        _na.time = prev


class SimCounterSource(LinkLoadSource):
    """Per-link byte counters of the simulator, read as rates over the last sampling interval."""
    name = "sim-counters"

    def __init__(self, monitor: "SimMonitor", link_ids):
        self.monitor = monitor
        self.link_ids = np.asarray(sorted(link_ids), dtype=np.int64)

    def read_rates(self, dt):
        rates = self.monitor.window_rates(background_only=False)
        if rates is None:
            return ()
        return [(int(l), float(rates[l])) for l in self.link_ids]


class SimMonitor:
    """Wraps a NodeAgent; the simulator calls `on_sample` at each tick and `report` on completions."""

    def __init__(self, topo, sample_interval_ms: float = 100.0, mode: str = "counters", observe: str = "all",
                 feedback: bool = True, feedback_half_life_ms: float = 500.0, lag_intervals: int = 0,
                 phase_ms: float = 0.0, progress: bool = False, reserve: bool = True):
        if mode not in ("counters", "background"):
            raise ValueError(f"SimMonitor: mode must be 'counters' or 'background', got {mode!r}")
        if isinstance(observe, str) and observe not in ("all", "counters"):
            raise ValueError(f"SimMonitor: observe must be 'all', 'counters' or link ids, got {observe!r}")
        self.topo = topo
        self.interval_s = sample_interval_ms / 1000.0
        self.mode, self.observe, self.feedback = mode, observe, feedback
        self.progress = bool(progress)
        self.reserve_inflight = bool(reserve)
        self.lag = int(lag_intervals)
        # links with a hardware counter in the topology (NVML / sysfs); the rest: feedback only
        if observe == "all":
            self.observed = [l.id for l in topo.links]
        elif observe == "counters":
            self.observed = [l.id for l in topo.links if l.counter]
        else:
            self.observed = sorted({int(l) for l in observe})
            if any(not (0 <= l < len(topo.links)) for l in self.observed):
                raise ValueError(f"SimMonitor: observed link ids {self.observed} out of range")
        self._progress_bytes = {}  # (tid, sub) -> bytes already reported with report_progress
        self._source = SimCounterSource(self, self.observed)
        self.agent = NodeAgent(topo, sample_interval_ms=sample_interval_ms, source="mock",
                               feedback_half_life_ms=feedback_half_life_ms,
                               sources=[self._source] if mode == "counters" else [])
        self.next_tick = (phase_ms / 1000.0) % self.interval_s if phase_ms else 0.0
        self._hist: deque = deque(maxlen=self.lag + 2)  # (t, res_bytes, res_bg_bytes) snapshots
        self._sim = None
        self.samples = 0
        self.reports = 0

    # ------------------------------------------------------------------ simulator hooks
    def bind(self, sim) -> None:
        self._sim = sim

    def on_sample(self, sim) -> None:
        self._sim = sim
        self._hist.append((sim.t, sim.res_bytes.copy(), sim.res_bg_bytes.copy()))
        with sim_clock(sim):
            if self.progress:
                for f in sim.kv.values():
                    moved = f.nbytes - max(f.remaining, 0.0)
                    key = (f.tid, f.sub)
                    delta = moved - self._progress_bytes.get(key, 0.0)
                    if delta > 0.0:
                        self.agent.report_progress(f.links, delta)
                        self._progress_bytes[key] = moved
            if self.mode == "counters":
                self.agent.sample_once()
            else:
                rates = self.window_rates(background_only=True)
                if rates is not None:
                    for l in self.observed:
                        u = min(1.0, float(rates[l]) / (self.topo.links[l].capacity_gbps * 1e9))
                        self.agent.set_link_utilization(l, u)
        self.samples += 1
        self.next_tick = sim.t + self.interval_s

    def _ticket(self, key):
        """The engine ticket of transfer key[0] (the adaptive policy's plan.ticket), or None."""
        if key is None or self._sim is None:
            return None
        rec = self._sim.transfers.get(key[0])
        return getattr(rec.plan, "ticket", None) if rec is not None else None

    def _release(self, key) -> None:
        ticket = self._ticket(key)
        if ticket is not None:
            with sim_clock(self._sim):
                ticket.release_leg(key[1])

    def on_drain(self, flow) -> None:
        """A KV sub-flow's last byte left: its reservation is released (the links are free); with
        `progress`, its bytes not yet reported are reported now (its completion follows after the
        path latency and any relay pipeline fill)."""
        self._release((flow.tid, flow.sub))
        if self.progress:
            key = (flow.tid, flow.sub)
            delta = flow.nbytes - self._progress_bytes.get(key, 0.0)
            if delta > 0.0:
                self.agent.report_progress(flow.links, delta)
                self._progress_bytes[key] = float(flow.nbytes)

    def window_rates(self, background_only: bool) -> Optional[np.ndarray]:
        """Per-link bytes/s (busier direction) over the interval ending `lag` ticks ago."""
        if len(self._hist) < self.lag + 2:
            return None
        t1, b1, g1 = self._hist[-1 - self.lag]
        t0, b0, g0 = self._hist[-2 - self.lag]
        if t1 <= t0:
            return None
        d = (g1 - g0) if background_only else (b1 - b0)
        per_dir = d.reshape(-1, 2) / (t1 - t0)
        return per_dir.max(axis=1)

    def report(self, links, nbytes: int, seconds: float, relays: int = 0, key=None) -> None:
        if self._sim is None:
            return
        self._release(key)  # normally already released at drain; harmless twice
        ticket = self._ticket(key)
        with sim_clock(self._sim):
            if self.progress:  # own-byte accounting: the part not yet reported at a tick
                done = self._progress_bytes.pop(key, 0.0)
                if nbytes - done > 0.0:
                    self.agent.report_progress(links, nbytes - done)
            if ticket is not None:
                # the engine's leg end: feedback (when on) for the links the leg actually ran on
                ticket.leg_done(key[1], int(nbytes), float(seconds), report=self.feedback, links=links,
                                relays=int(relays), progress_reported=self.progress)
                # every leg with bytes reported: the move is done (0-byte legs never run)
                if len(ticket.stats.legs) >= sum(1 for sp in ticket.subpaths if sp.nbytes > 0):
                    ticket.close()
            elif self.feedback:  # a plan not routed by the engine (no ticket)
                self.agent.report_transfer(links, int(nbytes), float(seconds), relays=int(relays),
                                           progress_reported=self.progress)
        if self.feedback:
            self.reports += 1

    def before_decide(self, sim) -> None:
        """Apply feedback decay up to the decision time (the real agent refreshes every tick)."""
        self._sim = sim
        with sim_clock(sim):
            self.agent.refresh()

    @property
    def util(self) -> np.ndarray:
        return self.agent.util
