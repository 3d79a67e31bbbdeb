"""NodeAgent: background monitor of link load, plus feedback from the transfers themselves.

Two signals per link, combined as `util = max(sampled, mock, decayed feedback)`:
- sampled: counters read every `sample_interval_ms` by a daemon thread (NVML NVLink/PCIe, sysfs
  Ethernet / InfiniBand byte counters), minus the bytes our own transfers put on the link, so the
  selector does not flee from its own traffic;
- feedback: what completed transfers observed (achieved bandwidth -> implied utilisation of the
  bottleneck link, queueing delay), decayed with a half-life, because ~100 ms sampling misses bursts.

The selector reads `util` and `qdelay_us` (float64 arrays indexed by link id) directly. They are
updated in place, element by element, by whichever thread refreshes them; readers never lock and
at worst see a mix of two consecutive refreshes, which is harmless for scoring.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable, List, Optional, Sequence

import numpy as np

from ..errors import TopologyError
from ..topology.graph import Topology
from .sources import LinkLoadSource, make_sources

logger = logging.getLogger(__name__)

#: transfers smaller than this are latency-dominated: they say nothing reliable about bandwidth
MIN_FEEDBACK_BYTES = 256 << 10


class NodeAgent:
    def __init__(self, topology: Topology, sample_interval_ms: float = 100.0, source="auto",
                 sysfs_root: str = "/sys", feedback_half_life_ms: float = 500.0,
                 sources: Optional[Sequence[LinkLoadSource]] = None):
        if sample_interval_ms <= 0:
            raise ValueError(f"NodeAgent: sample_interval_ms must be > 0, got {sample_interval_ms!r}")
        if feedback_half_life_ms <= 0:
            raise ValueError(f"NodeAgent: feedback_half_life_ms must be > 0, got {feedback_half_life_ms!r}")
        self.topology = topology
        self.sample_interval_ms = float(sample_interval_ms)
        self.feedback_half_life_s = feedback_half_life_ms / 1000.0
        n = len(topology.links)
        self.util = np.zeros(n, dtype=np.float64)  # read by the selector core
        self.qdelay_us = np.zeros(n, dtype=np.float64)  # read by the selector core
        self._cap_bps = np.array([l.capacity_gbps * 1e9 for l in topology.links], dtype=np.float64)
        self._sampled = np.zeros(n)
        self._mock = np.zeros(n)
        self._fb_util = np.zeros(n)
        self._fb_q = np.zeros(n)
        self._fb_t = np.zeros(n)
        self._own_bytes = np.zeros(n)  # cumulative bytes our transfers moved per link
        self._own_prev = np.zeros(n)
        self._own_residual = np.zeros(n)
        self._lock = threading.Lock()  # serialises writers only; readers never take it
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.samples = 0
        self.feedback_count = 0
        self.source_mode = source if isinstance(source, str) else "custom"
        self.sources: List[LinkLoadSource] = list(sources) if sources is not None else \
            make_sources(topology, source, sysfs_root)
        self._last_sample_t: Optional[float] = None
        #: relay pipeline chunk used to discount relay fill from feedback; a PathSelector built on
        #: this agent sets it from its SelectorConfig.relay_chunk_bytes
        self.relay_chunk_bytes = 4 << 20

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> "NodeAgent":
        if self._thread is not None:
            return self
        if not self.sources:
            logger.debug("NodeAgent: no counter source for any link; feedback and mock values only")
        self._stop.clear()
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="flexflow-node-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        t = self._thread
        if t is None:
            return
        self._stop.set()
        t.join(timeout=5.0)
        self._thread = None
        for s in self.sources:
            s.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        period = self.sample_interval_ms / 1000.0
        while not self._stop.wait(period):
            try:
                self.sample_once()
            except Exception:  # a flaky counter must never kill the monitor
                logger.exception("NodeAgent: sampling failed; keeping previous values")

    # ----------------------------------------------------------------- sampling
    def sample_once(self) -> None:
        """Read every source once and refresh the effective arrays (also used by tests)."""
        now = time.monotonic()
        dt = None if self._last_sample_t is None else max(now - self._last_sample_t, 1e-6)
        self._last_sample_t = now
        sampled = np.full(len(self.util), -1.0)
        with self._lock:
            own_delta = self._own_bytes - self._own_prev
            self._own_prev = self._own_bytes.copy()
        # our bytes not yet matched against a counter: this interval's plus the previous interval's
        # residual (a chunk reported just after the counters were read). Older residue is dropped so
        # a transfer reported late cannot hide later foreign traffic.
        pending = own_delta + self._own_residual
        residual = np.zeros_like(pending)
        for src in self.sources:
            for link_id, rate_bps in src.read_rates(dt):
                if rate_bps is None:
                    continue
                if dt is not None:  # subtract what our own transfers moved over the link
                    seen = rate_bps * dt
                    mine = min(seen, pending[link_id])
                    residual[link_id] = min(pending[link_id] - mine, own_delta[link_id])
                    rate_bps = (seen - mine) / dt
                sampled[link_id] = max(sampled[link_id], rate_bps / self._cap_bps[link_id])
        self._own_residual = residual
        with self._lock:
            mask = sampled >= 0
            self._sampled[mask] = np.minimum(sampled[mask], 1.0)
            self._refresh_locked(now)
        self.samples += 1

    # ----------------------------------------------------------------- mock + feedback
    def set_utilization(self, a: str, b: str, value: float) -> None:
        """Mock load: set the utilisation (0..1) of every link between nodes a and b."""
        if not (0.0 <= float(value) <= 1.0):
            raise ValueError(f"set_utilization({a!r}, {b!r}): value must be in [0, 1], got {value!r}")
        links = self.topology.links_between(a, b)
        if not links:
            raise TopologyError(f"set_utilization: no link between {a!r} and {b!r}")
        with self._lock:
            for l in links:
                self._mock[l.id] = float(value)
            self._refresh_locked(time.monotonic())

    def set_link_utilization(self, link_id: int, value: float) -> None:
        with self._lock:
            self._mock[link_id] = float(value)
            self._refresh_locked(time.monotonic())

    def clear(self) -> None:
        """Forget mock values and feedback (sampled counters stay)."""
        with self._lock:
            self._mock[:] = 0.0
            self._fb_util[:] = 0.0
            self._fb_q[:] = 0.0
            self._refresh_locked(time.monotonic())

    def report_progress(self, links: Iterable[int], nbytes: int) -> None:
        """Bytes our transfer just put on `links` (call per chunk for transfers longer than the
        sampling interval, so sampled counters never count our own traffic as foreign load)."""
        with self._lock:
            for l in links:
                self._own_bytes[l] += nbytes

    def report_transfer(self, links: Iterable[int], nbytes: int, seconds: float,
                        queue_delay_us: float = 0.0, relays: int = 0,
                        progress_reported: bool = False) -> Optional[float]:
        """Feedback from a completed transfer over `links` (link ids of one path; `relays`
        store-and-forward hops on it). Returns the observed bandwidth in GB/s.

        Only the time beyond the path's fixed latency and relay pipeline fill counts as evidence
        of bandwidth (else a small transfer's latency would read as congestion), and the implied
        utilisation goes to the path's bottleneck link only: a 50 GB/s NVLink behind a 25 GB/s
        PCIe hop is not congested just because the transfer ran at 25 GB/s. Pass
        `progress_reported=True` when the bytes were already reported with report_progress()."""
        links = list(links)
        if not links or nbytes <= 0 or seconds <= 0:
            return None
        from ..selector.selector import RELAY_OVERHEAD_US
        now = time.monotonic()
        gbps = nbytes / seconds / 1e9
        with self._lock:
            if not progress_reported:
                for l in links:
                    self._own_bytes[l] += nbytes
            if queue_delay_us > 0:
                per = queue_delay_us / len(links)
                for l in links:
                    self._fb_q[l] = self._decayed(self._fb_q[l], self._fb_t[l], now) * 0.5 + per * 0.5
                    self._fb_t[l] = now
            avail = [max(self._cap_bps[l] * (1.0 - self.util[l]), self._cap_bps[l] * 0.01) for l in links]
            bott = links[int(np.argmin(avail))]
            fixed_s = sum(self.topology.links[l].latency_us for l in links) * 1e-6
            fixed_s += relays * (min(nbytes, self.relay_chunk_bytes) / min(avail) + RELAY_OVERHEAD_US * 1e-6)
            t_net = seconds - fixed_s
            # below ~256 KiB, or when the bandwidth term is not clearly above the fixed latency, the
            # measurement says nothing reliable about bandwidth
            if nbytes >= MIN_FEEDBACK_BYTES and t_net > fixed_s:
                implied = 1.0 - (nbytes / t_net) / self._cap_bps[bott]
                # a fresh observation replaces older feedback for this link (fast reaction both ways)
                self._fb_util[bott] = min(1.0, max(0.0, implied))
                self._fb_t[bott] = now
            self.feedback_count += 1
            self._refresh_locked(now)
        return gbps

    def report_decision(self, decision, seconds_per_subpath: Sequence[float], queue_delay_us: float = 0.0):
        """Feedback for every leg of a PathDecision (split legs report separately)."""
        for sub, secs in zip(decision.subpaths, seconds_per_subpath):
            relays = 0 if sub.type.value == "Direct" else 1
            self.report_transfer(sub.links, sub.nbytes, secs, queue_delay_us, relays=relays)

    # ----------------------------------------------------------------- internals
    def _decayed(self, value: float, t: float, now: float) -> float:
        if value == 0.0:
            return 0.0
        return value * 0.5 ** ((now - t) / self.feedback_half_life_s)

    def _refresh_locked(self, now: float) -> None:
        age = np.maximum(now - self._fb_t, 0.0)
        decay = np.power(0.5, age / self.feedback_half_life_s)
        eff = np.maximum(np.maximum(self._sampled, self._mock), self._fb_util * decay)
        self.util[:] = eff  # in place: the selector holds views of these arrays
        self.qdelay_us[:] = self._fb_q * decay

    def refresh(self) -> None:
        """Apply feedback decay now (the sampling thread does this every interval)."""
        with self._lock:
            self._refresh_locked(time.monotonic())

    def snapshot(self) -> dict:
        t = self.topology
        return {f"{l.a}-{l.b}#{l.id}": {"util": round(float(self.util[l.id]), 4),
                                         "queue_delay_us": round(float(self.qdelay_us[l.id]), 2)}
                for l in t.links}
