"""NodeAgent: background monitor of link load, plus feedback from the transfers themselves.

Per link, `util = min(1, max(sampled, mock, decayed feedback) + reserved)`:
- sampled: counters read every `sample_interval_ms` by a daemon thread (NVML NVLink/PCIe, sysfs
  Ethernet / InfiniBand byte counters), minus the bytes our own transfers put on the link, so the
  selector does not flee from its own traffic;
- feedback: what completed transfers observed (achieved bandwidth -> implied utilisation of the
  bottleneck link, queueing delay), decayed with a half-life, because ~100 ms sampling misses bursts;
- elastic sharing (opt-in, `elastic_share` > 0): foreign load that has been seen to *yield* to our
  own traffic (greedy TCP bulk flows: when our leg joins the link, their rate drops by about what we
  get) counts only `1 - elastic_share` of its rate, so a link saturated by such a flow offers us a
  fair share instead of nothing. Non-yielding load (UDP-like inference traffic, anything not yet
  classified) stays fully protected. Evidence comes from intervals in which our own bytes crossed the
  link (see _elastic_observe). A busy link with no evidence, or only old evidence, is probed by the
  executor (probe_due()); a link found not to yield is re-probed after `elastic_probe_s`, doubling
  up to ELASTIC_PROBE_MAX_S while it keeps not yielding;
- reserved: our own transfers that were scheduled but have not finished (`reserve()` /
  `reserve_decision()` when a decision is executed, `release()` when a leg ends or fails). Each leg
  adds `leg bytes / predicted leg time / link capacity` on every link it crosses, scaled by the
  predicted fraction still to go (never below RESERVE_FLOOR while held), the sum per link capped at
  `reserve_cap` and never above the link's QoS threshold on its own, so a transfer that arrives while the previous one still fills its links sees them
  as partly busy. The same reservations estimate the bytes our in-flight transfers put on sampled
  counters, so those bytes are not also read as foreign load (no double counting).

The selector reads `util` and `qdelay_us` (float64 arrays indexed by link id) directly. They are
updated in place, element by element, by whichever thread refreshes them; readers never lock and
at worst see a mix of two consecutive refreshes, which is harmless for scoring.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import TopologyError
from ..selector.cost_model import MIN_AVAIL_FRAC, RELAY_CHUNK_BYTES, fixed_latency_s
from ..topology.graph import Topology
from .sources import LinkLoadSource, make_sources

logger = logging.getLogger(__name__)

#: transfers smaller than this are latency-dominated: they say nothing reliable about bandwidth
MIN_FEEDBACK_BYTES = 256 << 10
#: a held reservation past its predicted end still counts this fraction of its rate (it is late,
#: not gone: typically slowed down by sharing)
RESERVE_FLOOR = 0.25
#: a reservation never released is dropped after max(RESERVE_EXPIRY_FACTOR x its predicted time,
#: the agent's reserve_timeout_s) (a caller that died without release() cannot pin a link)
RESERVE_EXPIRY_FACTOR = 8.0
#: elastic sharing: our share of a link in an interval below this counts as "we were not on it",
#: and that interval's foreign rate becomes the link's quiet baseline
ELASTIC_QUIET_OWN = 0.02
#: our share must be at least this for the interval to say anything about yielding
ELASTIC_EVIDENCE_OWN = 0.04
#: a quiet baseline older than this is not compared against (the foreign load may have changed)
ELASTIC_BASELINE_MAX_AGE_S = 5.0
#: how much the quiet baseline may fall per quiet interval when the foreign load really drops
ELASTIC_BASELINE_DECAY = 0.05
#: measurement noise (fraction of capacity) not read as yielding: our bytes are reported per
#: completed chunk, so one interval's own rate is off by up to a chunk (1 MiB = 8 % of 1 Gbit/s x 100 ms)
ELASTIC_NOISE = 0.05
#: below this yield estimate a link counts as not yielding (probe back-off); above it, the estimate
#: scales the share we claim (one responsive flow: ~1; three: ~0.5, i.e. our 1/4 of the link)
ELASTIC_MIN_YIELD = 0.35
#: weight of one interval's observation in the yield estimate (the first one sets it). A leg starved
#: for CPU (not for the link) reads as "got nothing": with 0.5, two such intervals in a row take a
#: yielding link below ELASTIC_MIN_YIELD until the next evidence (seen only with other jobs
#: saturating both cores; the contention figures were measured with 0.5)
ELASTIC_ALPHA = 0.5
#: a link is probed only when its foreign load is at least this (fraction of capacity)
ELASTIC_PROBE_BUSY = 0.7
#: an elasticity estimate older than this is re-probed; the probe back-off never exceeds this either
ELASTIC_PROBE_MAX_S = 60.0


class _Reservation:
    __slots__ = ("links", "frac", "rate_bps", "t0", "dur", "expire")

    def __init__(self, links, frac, rate_bps, t0, dur, expire):
        self.links, self.frac, self.rate_bps = links, frac, rate_bps
        self.t0, self.dur, self.expire = t0, dur, expire


class NodeAgent:
    def __init__(self, topology: Topology, sample_interval_ms: float = 100.0, source="auto",
                 sysfs_root: str = "/sys", feedback_half_life_ms: float = 500.0,
                 sources: Optional[Sequence[LinkLoadSource]] = None, reserve_cap: float = 0.5,
                 reserve_timeout_s: float = 10.0, elastic_share: float = 0.0, elastic_probe_s: float = 5.0):
        if sample_interval_ms <= 0:
            raise ValueError(f"NodeAgent: sample_interval_ms must be > 0, got {sample_interval_ms!r}")
        if feedback_half_life_ms <= 0:
            raise ValueError(f"NodeAgent: feedback_half_life_ms must be > 0, got {feedback_half_life_ms!r}")
        if not (0.0 <= reserve_cap <= 1.0):
            raise ValueError(f"NodeAgent: reserve_cap must be in [0, 1], got {reserve_cap!r}")
        if not (0.0 <= elastic_share <= 1.0):
            raise ValueError(f"NodeAgent: elastic_share must be in [0, 1], got {elastic_share!r}")
        if elastic_probe_s <= 0:
            raise ValueError(f"NodeAgent: elastic_probe_s must be > 0, got {elastic_probe_s!r}")
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
        #: in-flight reservations of our own transfers (see reserve()); `reserved` is what they add
        #: to `util` now (after decay and cap); published for diagnostics, written under the lock
        self.reserve_cap = float(reserve_cap)
        self.reserve_timeout_s = float(reserve_timeout_s)
        self.reserved = np.zeros(n)
        self._base = np.zeros(n)  # max(sampled, mock, feedback): util without our reservations
        self._res: dict = {}  # token -> _Reservation
        self._res_tokens = itertools.count(1)
        self._res_rate = np.zeros(n)  # bytes/s our held reservations put on each link (undecayed)
        self._res_bytes = np.zeros(n)  # its integral over time: estimated own bytes per link
        self._res_prev = np.zeros(n)
        self._res_t: Optional[float] = None
        self._est_credit = np.zeros(n)  # own bytes subtracted on the estimate, not yet reported
        self.reservations_made = 0
        #: elastic sharing (see the module docstring). elastic_est: yield estimate per link in
        #: [0, 1], -1 = no evidence yet; `elastic` (published) is the fraction actually applied now
        self.elastic_share = float(elastic_share)
        self.elastic_probe_s = float(elastic_probe_s)
        self.elastic_est = np.full(n, -1.0)
        self.elastic = np.zeros(n)
        self.elastic_evidence = 0  # intervals that updated an estimate
        self._el_t = np.zeros(n)  # time of the last evidence
        self._quiet = np.full(n, -1.0)  # foreign utilisation in the last intervals we were off the link
        self._quiet_t = np.zeros(n)
        self._probe_after = np.zeros(n)  # monotonic time before which a non-yielding link is not re-probed
        self._probe_backoff = np.full(n, float(elastic_probe_s))
        self._held_prev = np.zeros(n, dtype=bool)
        #: per-link QoS thresholds (a PathSelector built on this agent sets them): our reservations
        #: never push a link over its threshold on their own (they are not inference traffic, so
        #: they lower the bandwidth the selector expects but never make it reject a path)
        self.qos_thresholds: Optional[np.ndarray] = None
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
        self.relay_chunk_bytes = RELAY_CHUNK_BYTES

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
            self._integrate_locked(now)
            est_delta = self._res_bytes - self._res_prev
            self._res_prev = self._res_bytes.copy()
            held = self._res_rate > 0.0
        # a reservation held at both ends of the interval: our transfer was trying to use the link
        held_throughout = held & self._held_prev
        self._held_prev = held
        # our bytes not yet matched against a counter: this interval's plus the previous interval's
        # residual (a chunk reported just after the counters were read). Older residue is dropped so
        # a transfer reported late cannot hide later foreign traffic.
        reported = own_delta + self._own_residual
        # reported bytes that the previous interval already subtracted on the reservations' estimate
        # (a transfer reported only at its end) are not subtracted twice
        cancel = np.minimum(reported, self._est_credit)
        reported = reported - cancel
        # reports and the reservations' estimate describe the same bytes: never their sum. Where a
        # link has reports this interval they are exact and win; the estimate stands in only for
        # in-flight transfers that report at their end (a transfer slower than predicted makes it
        # too large, hiding foreign load on that link until the reservation is released)
        pending = np.where(reported > 0.0, reported, est_delta)
        residual = np.zeros_like(pending)
        credit = np.zeros_like(pending)
        for src in self.sources:
            for link_id, rate_bps in src.read_rates(dt):
                if rate_bps is None:
                    continue
                if dt is not None:  # subtract what our own transfers moved over the link
                    seen = rate_bps * dt
                    mine = min(seen, pending[link_id])
                    residual[link_id] = min(pending[link_id] - mine, own_delta[link_id])
                    credit[link_id] = max(mine - reported[link_id], 0.0)
                    rate_bps = (seen - mine) / dt
                    if self.elastic_share > 0.0:
                        # evidence only from bytes our transfers reported, never from the
                        # reservations' estimate (a leg that moves nothing would look like load
                        # that made room for it)
                        cap = self._cap_bps[link_id]
                        rep = min(seen, max(reported[link_id], 0.0))
                        self._elastic_observe(link_id, rep / dt / cap, (seen - rep) / dt / cap,
                                              bool(held[link_id]), bool(held_throughout[link_id]), now)
                sampled[link_id] = max(sampled[link_id], rate_bps / self._cap_bps[link_id])
        self._own_residual = residual
        self._est_credit = credit
        with self._lock:
            mask = sampled >= 0
            self._sampled[mask] = np.minimum(sampled[mask], 1.0)
            self._refresh_locked(now)
        self.samples += 1

    def _elastic_observe(self, l: int, own: float, foreign: float, held: bool, held_throughout: bool,
                         now: float) -> None:
        """One sampling interval of link `l` (fractions of its capacity): the bytes our transfers
        reported on it, the rest, and whether one of our legs held the link (a reservation) at the
        end of / throughout the interval. Runs in the sampling thread only."""
        q = self._quiet[l]
        fresh = q >= 0.0 and now - self._quiet_t[l] < ELASTIC_BASELINE_MAX_AGE_S
        if own < ELASTIC_QUIET_OWN and not held:
            # we were off the link: what is on it now is what would have to yield to us. A slowly
            # decaying maximum, not an average: a responsive flow needs a few hundred ms to grow
            # back after our leg left, and those intervals must not lower the baseline
            self._quiet[l] = max(foreign, q - ELASTIC_BASELINE_DECAY) if fresh else foreign
            self._quiet_t[l] = now
            return
        if not fresh or q < 0.5:
            return  # no recent baseline, or too little foreign load for yielding to matter
        if not held_throughout:
            return  # our leg covered only part of the interval: its rate would read too low
        if own >= ELASTIC_EVIDENCE_OWN:
            if q + own < 0.9:
                return  # there was room for us: nobody had to yield
            # Two conditions, both needed: the foreign rate dropped by about what we got (else we
            # only used room it left), and we got about the share we would claim. The second
            # separates a responsive flow from a non-responsive one that saturates the link: a
            # full tbf/switch queue drops some of the latter's packets as we join (its delivered
            # rate drops too), but it keeps sending, and our congestion control backs off to a few %.
            dropped = (q - foreign - ELASTIC_NOISE) / own
            got = own / (self.elastic_share * q)
            obs = min(1.0, max(0.0, min(dropped, got)))
        else:
            obs = 0.0  # one of our legs tried for the whole interval and got almost nothing
        est = self.elastic_est[l]
        est = obs if est < 0.0 or now - self._el_t[l] >= ELASTIC_PROBE_MAX_S else (1.0 - ELASTIC_ALPHA) * est + ELASTIC_ALPHA * obs
        self.elastic_est[l] = est
        self._el_t[l] = now
        self.elastic_evidence += 1
        if est < ELASTIC_MIN_YIELD:
            # does not yield: protected. Look again later, less often while it stays so (once per
            # probe, not per interval of the same probe)
            if now >= self._probe_after[l]:
                self._probe_after[l] = now + self._probe_backoff[l]
                self._probe_backoff[l] = min(2.0 * self._probe_backoff[l], ELASTIC_PROBE_MAX_S)
        else:
            self._probe_backoff[l] = self.elastic_probe_s

    def _elastic_locked(self, now: float) -> np.ndarray:
        """Fraction of each link's sampled foreign load treated as yielding right now."""
        est = self.elastic_est
        known = (est >= ELASTIC_MIN_YIELD) & (now - self._el_t < ELASTIC_PROBE_MAX_S)
        return np.where(known, est, 0.0)

    def probe_due(self, link_id: int) -> bool:
        """Elastic sharing: should an executor probe `link_id` now? True when the link is busy
        with foreign load and it is not known whether that load yields (no evidence, evidence
        older than ELASTIC_PROBE_MAX_S, or a back-off after "does not yield" has run out).

        A probe is the executor's own traffic on the link, apart from any KV transfer (dummy bytes
        to a scratch buffer for a few sampling intervals), under a reservation (reserve()) and
        reported like any transfer: the sampling thread turns it into evidence. It is never a
        share of a transfer, because a probe on a link saturated by non-yielding traffic can
        stall for seconds (TCP retransmission back-off) and would hold that transfer."""
        if self.elastic_share <= 0.0 or self._sampled[link_id] < ELASTIC_PROBE_BUSY:
            return False  # off, or enough room left that whether the load yields matters little
        if self._res_rate[link_id] > 0.0:
            return False  # our own legs are on it: a probe would measure them, and slow them down
        now = time.monotonic()
        est = self.elastic_est[link_id]
        if est < 0.0 or now - self._el_t[link_id] >= ELASTIC_PROBE_MAX_S:
            return True
        return est < ELASTIC_MIN_YIELD and now >= self._probe_after[link_id]

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
        """Forget mock values, feedback and elasticity evidence (sampled counters stay)."""
        with self._lock:
            self._mock[:] = 0.0
            self._fb_util[:] = 0.0
            self._fb_q[:] = 0.0
            self.elastic_est[:] = -1.0
            self._quiet[:] = -1.0
            self._probe_after[:] = 0.0
            self._probe_backoff[:] = self.elastic_probe_s
            self._refresh_locked(time.monotonic())

    def report_progress(self, links: Iterable[int], nbytes: int, seconds: Optional[float] = None) -> None:
        """Bytes our transfer just put on `links` (call per chunk for transfers longer than the
        sampling interval, so sampled counters never count our own traffic as foreign load).
        `seconds`: how long they took to cross, ending now (a chunk reported at its completion);
        the part that crossed before the last sample is not subtracted again (see _own_now)."""
        with self._lock:
            nbytes = self._own_now(nbytes, seconds, time.monotonic())
            for l in links:
                self._own_bytes[l] += nbytes

    def _own_now(self, nbytes: float, seconds: Optional[float], now: float) -> float:
        """Of `nbytes` that crossed a link during the `seconds` before now (evenly), the part that
        crossed after the last sample: only that part is in the interval the next sample closes.

        The rest was already read from the counters as foreign load in the intervals before (too
        high, which is safe). Subtracting it now as well made the interval in which a slow chunk
        completed read the link as nearly free: a 1 MiB chunk that crawled for ~200 ms at 5 % of
        a link saturated by UDP at 95 % took ~0.7 of the link's capacity off that interval's
        foreign load, and the selector split the next transfers onto the link (issue 15 item 4:
        the elastic policy's first transfers under UDP at 95 %, which overlap its probe's tail).
        Without `seconds`, or before the first sample, everything counts as this interval's (as
        report_transfer does with the bytes it is given: a counter that lags the report, or a
        caller that reports a transfer before its bytes reach the counter, relies on that)."""
        t = self._last_sample_t
        if seconds is None or not seconds > 0.0 or t is None:
            return nbytes
        early = min(1.0, max(0.0, (t - (now - seconds)) / seconds))
        return nbytes * (1.0 - early)

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
            # our own reservations (this leg's included) are not foreign load: judge on the rest
            avail = [max(self._cap_bps[l] * (1.0 - self._base[l]), self._cap_bps[l] * MIN_AVAIL_FRAC) for l in links]
            bott = links[int(np.argmin(avail))]
            # the selector's model (selector/cost_model.py): link latencies + relay pipeline fill
            fixed_s = fixed_latency_s((self.topology.links[l].latency_us for l in links), relays, nbytes,
                                      min(avail), self.relay_chunk_bytes)
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

    def report_decision(self, decision, seconds_per_subpath: Sequence[float], queue_delay_us: float = 0.0,
                        tokens: Optional[Sequence[int]] = None):
        """Feedback for every leg of a PathDecision (split legs report separately); `tokens` (from
        reserve_decision) are released first."""
        if tokens:
            self.release(tokens)
        for sub, secs in zip(decision.subpaths, seconds_per_subpath):
            relays = 0 if sub.type.value == "Direct" else 1
            self.report_transfer(sub.links, sub.nbytes, secs, queue_delay_us, relays=relays)

    # ----------------------------------------------------------------- in-flight reservations
    def reserve(self, links: Iterable[int], nbytes: int, seconds: Optional[float] = None) -> int:
        """Count `nbytes` of our own transfer, about to run over `links` for about `seconds`
        (predicted), as in flight: until release(token), every link of the leg shows
        `nbytes / seconds / capacity` more utilisation (scaled by the predicted fraction still to
        go, at least RESERVE_FLOOR; all reservations of a link together capped at reserve_cap).
        Without `seconds` the leg is assumed to run at its narrowest link's line rate. Returns a
        token for release(); 0 (a no-op token) when there is nothing to reserve."""
        links = np.unique(np.asarray(list(links), dtype=np.int64))
        if nbytes <= 0 or len(links) == 0:
            return 0
        if len(links) and (links[0] < 0 or links[-1] >= len(self.util)):
            raise ValueError(f"NodeAgent.reserve: link ids {links.tolist()} out of range")
        cap = self._cap_bps[links]
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            seconds = nbytes / float(cap.min())
        rate = float(nbytes) / float(seconds)
        frac = np.minimum(rate / cap, 1.0)
        with self._lock:
            now = time.monotonic()
            self._integrate_locked(now)
            tok = next(self._res_tokens)
            expire = now + max(RESERVE_EXPIRY_FACTOR * seconds, self.reserve_timeout_s)
            self._res[tok] = _Reservation(links, frac, np.minimum(rate, cap), now, float(seconds), expire)
            self._res_rate[links] += np.minimum(rate, cap)
            self.reservations_made += 1
            self._refresh_locked(now)
        return tok

    def reserve_decision(self, decision) -> Tuple[int, ...]:
        """reserve() every leg of a PathDecision, each for the decision's estimated time (split
        legs are sized to finish together). One token per subpath, in order; a leg that cannot be
        reserved gets 0. Never raises: routing must not fail because of bookkeeping."""
        try:
            subs = decision.subpaths
            est = float(decision.estimated_time_us) * 1e-6
        except Exception:  # noqa: BLE001
            logger.debug("NodeAgent.reserve_decision: not a decision: %r", decision)
            return ()
        out = []
        for sub in subs:
            try:
                out.append(self.reserve(sub.links, int(sub.nbytes), est))
            except Exception as e:  # noqa: BLE001
                logger.debug("NodeAgent.reserve_decision: %r", e)
                out.append(0)
        return tuple(out)

    def release(self, tokens) -> None:
        """End reservations: a token, or an iterable of tokens (0, None and unknown or already
        released tokens are ignored, so releasing twice is harmless)."""
        if tokens is None:
            return
        toks = [tokens] if isinstance(tokens, (int, np.integer)) else list(tokens)
        with self._lock:
            now = time.monotonic()
            self._integrate_locked(now)
            changed = False
            for tok in toks:
                r = self._res.pop(tok, None) if tok else None
                if r is not None:
                    self._res_rate[r.links] -= r.rate_bps
                    changed = True
            if changed:
                if not self._res:
                    self._res_rate[:] = 0.0  # no float residue once nothing is held
                self._refresh_locked(now)

    @property
    def in_flight(self) -> int:
        """Reservations currently held."""
        return len(self._res)

    # ----------------------------------------------------------------- internals
    def _decayed(self, value: float, t: float, now: float) -> float:
        if value == 0.0:
            return 0.0
        return value * 0.5 ** ((now - t) / self.feedback_half_life_s)

    def _integrate_locked(self, now: float) -> None:
        """Advance the estimate of own bytes on each link (held reservations' rates x time)."""
        if self._res_t is not None and now > self._res_t and self._res:
            self._res_bytes += self._res_rate * (now - self._res_t)
        self._res_t = now

    def _reserved_locked(self, now: float) -> np.ndarray:
        res = np.zeros(len(self.util))
        if not self._res:
            return res
        expired = []
        for tok, r in self._res.items():
            if now >= r.expire:
                expired.append(tok)
                continue
            left = 1.0 - (now - r.t0) / r.dur
            res[r.links] += r.frac * min(1.0, max(left, RESERVE_FLOOR))
        for tok in expired:  # never released: a caller died or forgot; stop counting it
            r = self._res.pop(tok)
            self._res_rate[r.links] -= r.rate_bps
            logger.debug("NodeAgent: reservation %d expired unreleased", tok)
        if not self._res:
            self._res_rate[:] = 0.0
        return np.minimum(res, self.reserve_cap)

    def _refresh_locked(self, now: float) -> None:
        age = np.maximum(now - self._fb_t, 0.0)
        decay = np.power(0.5, age / self.feedback_half_life_s)
        sampled = self._sampled
        if self.elastic_share > 0.0:
            self.elastic[:] = self._elastic_locked(now)
            # while our own legs hold a link, part of the foreign load is displaced (a full queue
            # drops even non-responsive traffic) and the counters read low; it is back when we leave,
            # so a decision then must see the load from before we joined
            q = self._quiet
            held = (self._res_rate > 0.0) & (q >= 0.0) & (now - self._quiet_t < ELASTIC_BASELINE_MAX_AGE_S)
            sampled = np.where(held, np.maximum(sampled, np.minimum(q, 1.0)), sampled)
            sampled = sampled * (1.0 - self.elastic_share * self.elastic)
        eff = np.maximum(np.maximum(sampled, self._mock), self._fb_util * decay)
        self._base[:] = eff
        self._integrate_locked(now)
        if self._res:
            u = np.minimum(eff + self._reserved_locked(now), 1.0)
            thr = self.qos_thresholds
            if thr is not None and len(thr) == len(u):
                u = np.where(eff <= thr, np.minimum(u, thr), u)
        else:
            u = eff
        self.reserved[:] = u - eff
        self.util[:] = u  # in place: the selector holds views of these arrays
        self.qdelay_us[:] = self._fb_q * decay

    def refresh(self) -> None:
        """Apply feedback decay now (the sampling thread does this every interval)."""
        with self._lock:
            self._refresh_locked(time.monotonic())

    def snapshot(self) -> dict:
        t = self.topology
        return {f"{l.a}-{l.b}#{l.id}": {"util": round(float(self.util[l.id]), 4),
                                         "reserved": round(float(self.reserved[l.id]), 4),
                                         "elastic": round(float(self.elastic[l.id]), 4),
                                         "queue_delay_us": round(float(self.qdelay_us[l.id]), 2)}
                for l in t.links}
