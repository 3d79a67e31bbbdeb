"""Flow-level, event-driven network simulator over a project `Topology`.

Model (see docs/simulation.md):
- every topology link is full duplex: two independent resources ("directed links"), each with the
  link's `capacity_gbps`; resource id = 2 * link_id + dir, dir 0 = link.a -> link.b;
- flows: background (inference) flows with a constant demand that switch on/off with their
  group's schedule, and KV sub-flows (elastic, finite bytes);
- bandwidth is shared max-min fairly among all active flows, recomputed at every event
  (flow start / data drained / burst toggle); background flows marked non-responsive (UDP-like)
  take their demand first and the remaining flows share what is left;
- a KV sub-flow completes `sum(link latency)` after its last byte left, plus, per store-and-forward
  relay, one pipeline chunk at the flow's average rate and a fixed hand-off overhead;
- QoS accounting while KV flows are active: an inference flow getting less than it would get
  without our transfers ("throttled"), or a directed link that carries inference traffic being
  driven above its QoS threshold by our traffic ("over threshold").
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from flexflow_sglang.selector.cost_model import RELAY_CHUNK_BYTES, RELAY_OVERHEAD_US, relay_fill_s
from flexflow_sglang.topology.graph import PathType, Topology
from .maxmin import max_min_csr

GB = 1e9  # bytes per GB (capacities are GB/s, bytes not bits)
TIME_EPS = 1e-12  # seconds: events closer than this are simultaneous
DRAIN_EPS_S = 1e-12  # a flow with less than 1 ps of data left at its rate has drained


# --------------------------------------------------------------------------- network
class Network:
    """Directed resources of a topology plus per-link QoS thresholds (fraction of capacity)."""

    def __init__(self, topo: Topology, thresholds: Optional[Sequence[float]] = None):
        self.topo = topo
        n = len(topo.links)
        self.n_links = n
        self.cap = np.repeat(np.array([l.capacity_gbps * GB for l in topo.links], dtype=np.float64), 2)
        thr = np.ones(n) if thresholds is None else np.asarray(thresholds, dtype=np.float64)
        if len(thr) != n:
            raise ValueError(f"Network: {len(thr)} thresholds for {n} links")
        self.thr = np.repeat(thr, 2)
        self.latency_s = np.array([l.latency_us * 1e-6 for l in topo.links], dtype=np.float64)

    def resources(self, nodes: Sequence[str], links: Sequence[int]) -> Tuple[int, ...]:
        """Directed resource ids of a route given as node sequence + link ids."""
        if len(nodes) != len(links) + 1:
            raise ValueError(f"route: {len(nodes)} nodes for {len(links)} links")
        out = []
        for i, lid in enumerate(links):
            link = self.topo.links[lid]
            if {nodes[i], nodes[i + 1]} != {link.a, link.b}:
                raise ValueError(f"route: link {lid} ({link.a}-{link.b}) does not join {nodes[i]}-{nodes[i + 1]}")
            out.append(2 * lid + (0 if link.a == nodes[i] else 1))
        return tuple(out)

    def route(self, *nodes: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """(links, resources) of a node sequence, taking the first link between consecutive nodes."""
        links = []
        for a, b in zip(nodes, nodes[1:]):
            ls = self.topo.links_between(a, b)
            if not ls:
                raise ValueError(f"route: no link between {a!r} and {b!r}")
            links.append(ls[0].id)
        return tuple(links), self.resources(nodes, links)

    def path_latency_s(self, links: Sequence[int]) -> float:
        return float(sum(self.latency_s[l] for l in links))


# --------------------------------------------------------------------------- background
@dataclass
class BgGroup:
    """Background flows that switch on and off together (a collective, a burst source).
    period_s None = always on. On for duty*period, then off, starting `phase_s` into a period."""
    name: str
    period_s: Optional[float] = None
    duty: float = 1.0
    phase_s: float = 0.0

    def state_at(self, t: float) -> Tuple[bool, float]:
        """(on?, time of the next toggle) at time t."""
        if self.period_s is None or self.duty >= 1.0:
            return True, math.inf
        if self.duty <= 0.0:
            return False, math.inf
        p = self.period_s
        x = (t + self.phase_s) % p
        on_len = self.duty * p
        if x < on_len:
            return True, t + (on_len - x)
        return False, t + (p - x)


@dataclass
class BgFlow:
    name: str
    links: Tuple[int, ...]
    res: Tuple[int, ...]
    demand_bps: float  # bytes/s (inf: a greedy elastic flow, e.g. a bulk TCP stream)
    group: int  # index into the simulator's groups
    #: False: a non-responsive flow (UDP at a fixed rate) that gets its demand first; the other
    #: flows (responsive background and our KV flows) share what it leaves max-min fairly
    responsive: bool = True


# --------------------------------------------------------------------------- transfers
@dataclass
class SubPlan:
    """One leg of a planned transfer: a route and its bytes."""
    ptype: PathType
    nodes: Tuple[str, ...]
    links: Tuple[int, ...]
    nbytes: int
    n_relays: int = 0


@dataclass
class Plan:
    label: str  # chosen path type as reported (Direct, NVLinkRelay, SplitPath, ...)
    subs: List[SubPlan]
    est_us: float = float("nan")
    reason: str = ""
    #: per sub-plan, the NodeAgent reservation token of the adaptive policy (released by the
    #: monitor when that leg drains); empty for other policies
    tokens: Tuple[int, ...] = ()


@dataclass
class TransferRecord:
    tid: int
    src: str
    dst: str
    nbytes: int
    arrival: float
    plan: Plan
    sub_done: List[Optional[float]] = field(default_factory=list)
    finish: Optional[float] = None
    throttled: bool = False  # an inference flow got less than its no-KV rate while we ran
    over_thr: bool = False  # our traffic drove a link with inference traffic above its threshold

    @property
    def fct(self) -> float:
        return (self.finish - self.arrival) if self.finish is not None else math.nan

    @property
    def qos_violation(self) -> bool:
        return self.throttled or self.over_thr


class _KVFlow:
    __slots__ = ("tid", "sub", "res", "links", "remaining", "nbytes", "start", "lat_s", "n_relays")

    def __init__(self, tid, sub, res, links, nbytes, start, lat_s, n_relays):
        self.tid, self.sub, self.res, self.links = tid, sub, res, links
        self.remaining = float(nbytes)
        self.nbytes = nbytes
        self.start = start
        self.lat_s = lat_s
        self.n_relays = n_relays

    def copy(self) -> "_KVFlow":
        f = _KVFlow(self.tid, self.sub, self.res, self.links, self.nbytes, self.start, self.lat_s, self.n_relays)
        f.remaining = self.remaining
        return f


@dataclass
class SimParams:
    relay_chunk_bytes: int = RELAY_CHUNK_BYTES  # store-and-forward pipeline chunk
    relay_overhead_us: float = RELAY_OVERHEAD_US  # per relay hand-off (buffer swap, notification)


# --------------------------------------------------------------------------- simulator
class Simulator:
    """Event loop. `policy(sim, request) -> Plan` decides each arriving KV transfer; `monitor`
    (optional) is sampled at its ticks and fed back completed sub-flows."""

    def __init__(self, net: Network, bg_flows: Sequence[BgFlow] = (), groups: Sequence[BgGroup] = (),
                 params: Optional[SimParams] = None, policy: Optional[Callable] = None, monitor=None):
        self.net = net
        self.params = params or SimParams()
        self.bg: List[BgFlow] = list(bg_flows)
        self.groups: List[BgGroup] = list(groups) or [BgGroup("const")]
        for f in self.bg:
            if not (0 <= f.group < len(self.groups)):
                raise ValueError(f"background flow {f.name}: unknown group {f.group}")
        self.bg_demand = np.array([f.demand_bps for f in self.bg], dtype=np.float64)
        self.bg_group = np.array([f.group for f in self.bg], dtype=np.int64)
        self.bg_nonresp = np.array([not f.responsive for f in self.bg], dtype=bool)
        self._bg_lens = np.array([len(f.res) for f in self.bg], dtype=np.int64)
        self._bg_idx_flat = (np.concatenate([np.asarray(f.res, dtype=np.int64) for f in self.bg])
                             if self.bg else np.zeros(0, dtype=np.int64))
        self._bg_owner = np.repeat(np.arange(len(self.bg)), self._bg_lens)
        self.policy = policy
        self.monitor = monitor
        if monitor is not None:
            monitor.bind(self)
        n_res = len(net.cap)
        self.t = 0.0
        self.group_on = np.zeros(len(self.groups), dtype=bool)
        self.next_toggle = np.full(len(self.groups), math.inf)
        for g, grp in enumerate(self.groups):
            self.group_on[g], self.next_toggle[g] = grp.state_at(0.0)
        self.kv: Dict[Tuple[int, int], _KVFlow] = {}
        self.transfers: Dict[int, TransferRecord] = {}
        self.arrivals: List[Tuple[float, object]] = []
        self._arr_i = 0
        self._heap: List[Tuple[float, int, tuple]] = []
        self._seq = itertools.count()
        self._tid = itertools.count()
        # cumulative bytes per directed resource (all traffic / background only): the "counters"
        self.res_bytes = np.zeros(n_res)
        self.res_bg_bytes = np.zeros(n_res)
        self.shortfall_bytes = 0.0  # inference bytes not delivered because of our transfers
        self.events = 0
        self._base_cache: Dict[bytes, np.ndarray] = {}
        self._dirty = True
        self._alloc()

    # ------------------------------------------------------------------ set-up
    def add_arrivals(self, arrivals: Sequence[Tuple[float, object]]) -> None:
        """(time_s, TransferRequest) pairs, decided by the policy when they arrive."""
        self.arrivals = sorted(self.arrivals[self._arr_i:] + list(arrivals), key=lambda x: x[0])
        self._arr_i = 0

    def fork(self) -> "Simulator":
        """A copy of the current state without policy, monitor, pending arrivals or other
        transfers' records (their flows keep running): the oracle's what-if sandbox."""
        s = Simulator.__new__(Simulator)
        s.net, s.params, s.bg, s.groups = self.net, self.params, self.bg, self.groups
        s.bg_demand, s.bg_group, s.bg_nonresp = self.bg_demand, self.bg_group, self.bg_nonresp
        s._bg_lens, s._bg_idx_flat, s._bg_owner = self._bg_lens, self._bg_idx_flat, self._bg_owner
        s.policy, s.monitor = None, None
        s.t = self.t
        s.group_on, s.next_toggle = self.group_on.copy(), self.next_toggle.copy()
        s.kv = {k: f.copy() for k, f in self.kv.items()}
        s.transfers = {}
        s.arrivals, s._arr_i = [], 0
        s._heap = []
        s._seq = itertools.count()
        s._tid = itertools.count(10 ** 9)
        s.res_bytes, s.res_bg_bytes = self.res_bytes.copy(), self.res_bg_bytes.copy()
        s.shortfall_bytes = 0.0
        s.events = 0
        s._base_cache = self._base_cache  # same background, same baselines
        s._dirty = True
        s._alloc()
        return s

    # ------------------------------------------------------------------ transfers
    def start_transfer(self, request, plan: Plan) -> TransferRecord:
        tid = next(self._tid)
        rec = TransferRecord(tid, request.src, request.dst, request.data_bytes, self.t, plan,
                             [None] * len(plan.subs))
        self.transfers[tid] = rec
        for i, sp in enumerate(plan.subs):
            lat = self.net.path_latency_s(sp.links)
            if sp.nbytes <= 0:
                self._push(self.t + lat, ("sub", tid, i, tuple(sp.links), 0, self.t, 0))
                continue
            res = np.array(self.net.resources(sp.nodes, sp.links), dtype=np.int64)
            self.kv[(tid, i)] = _KVFlow(tid, i, res, tuple(sp.links), int(sp.nbytes), self.t, lat, sp.n_relays)
        self._dirty = True
        return rec

    def _push(self, t: float, ev: tuple) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), ev))

    # ------------------------------------------------------------------ allocation
    def _share(self, active_bg: np.ndarray, idx_bg: np.ndarray, lens_bg: np.ndarray,
               kv_idx: Sequence[np.ndarray] = ()) -> Tuple[np.ndarray, np.ndarray]:
        """(active background rates, KV rates): non-responsive background first, then max-min."""
        demand_bg = self.bg_demand[active_bg]
        nr = self.bg_nonresp[active_bg]
        n_kv = len(kv_idx)
        kv_lens = np.fromiter((len(r) for r in kv_idx), dtype=np.int64, count=n_kv)
        if not nr.any():
            idx = np.concatenate([idx_bg] + list(kv_idx)) if n_kv else idx_bg
            lens = np.concatenate([lens_bg, kv_lens]) if n_kv else lens_bg
            demand = np.concatenate([demand_bg, np.full(n_kv, np.inf)]) if n_kv else demand_bg
            rates = max_min_csr(idx, lens, demand, self.net.cap)
            return rates[:len(lens_bg)], rates[len(lens_bg):]
        ent_nr = np.repeat(nr, lens_bg)
        r_nr = max_min_csr(idx_bg[ent_nr], lens_bg[nr], demand_bg[nr], self.net.cap)
        used = np.bincount(idx_bg[ent_nr], weights=np.repeat(r_nr, lens_bg[nr]), minlength=len(self.net.cap))
        cap2 = np.maximum(self.net.cap - used, 0.0)
        idx = np.concatenate([idx_bg[~ent_nr]] + list(kv_idx))
        lens = np.concatenate([lens_bg[~nr], kv_lens])
        demand = np.concatenate([demand_bg[~nr], np.full(n_kv, np.inf)])
        r2 = max_min_csr(idx, lens, demand, cap2) if len(lens) else np.zeros(0)
        bg_rates = np.empty(len(lens_bg))
        bg_rates[nr] = r_nr
        bg_rates[~nr] = r2[:int((~nr).sum())]
        return bg_rates, r2[int((~nr).sum()):]

    def _baseline(self, active_bg: np.ndarray, idx_bg: np.ndarray, lens_bg: np.ndarray) -> np.ndarray:
        key = active_bg.tobytes()
        base = self._base_cache.get(key)
        if base is None:
            base = self._share(active_bg, idx_bg, lens_bg)[0]
            self._base_cache[key] = base
        return base

    def _alloc(self) -> None:
        n_res = len(self.net.cap)
        active_bg = self.group_on[self.bg_group] if len(self.bg) else np.zeros(0, dtype=bool)
        ent = active_bg[self._bg_owner] if len(self.bg) else np.zeros(0, dtype=bool)
        idx_bg = self._bg_idx_flat[ent]
        lens_bg = self._bg_lens[active_bg]
        owner_bg = (np.cumsum(active_bg) - 1)[self._bg_owner[ent]] if len(self.bg) else np.zeros(0, dtype=np.int64)
        n_bg = len(lens_bg)
        base = self._baseline(active_bg, idx_bg, lens_bg)
        kv = list(self.kv.values())
        self._kv_list = kv
        if kv:
            bg_rates, kv_rates = self._share(active_bg, idx_bg, lens_bg, [f.res for f in kv])
        else:
            bg_rates, kv_rates = base, np.zeros(0)
        self._kv_rates = kv_rates
        res_bg = np.bincount(idx_bg, weights=bg_rates[owner_bg], minlength=n_res) if n_bg else np.zeros(n_res)
        res_kv = np.zeros(n_res)
        for f, r in zip(kv, kv_rates):
            res_kv[f.res] += r
        self._res_bg_rate, self._res_rate = res_bg, res_bg + res_kv
        # QoS accounting for this allocation
        self._viol_throttle: set = set()
        self._viol_thr: set = set()
        self._shortfall_rate = 0.0
        if kv and n_bg:
            short = base - bg_rates
            thr_mask = short > np.maximum(base, 1.0) * 1e-6
            if thr_mask.any():
                self._shortfall_rate = float(short[thr_mask].sum())
                hit = np.bincount(idx_bg[thr_mask[owner_bg]], minlength=n_res) > 0
                self._viol_throttle = {f.tid for f in kv if hit[f.res].any()}
            over = (res_bg > 1.0) & (res_kv > 0.0) & (res_bg + res_kv > self.net.thr * self.net.cap * (1 + 1e-9))
            if over.any():
                self._viol_thr = {f.tid for f in kv if over[f.res].any()}
        self._dirty = False

    # ------------------------------------------------------------------ time
    def _advance(self, t_new: float) -> None:
        dt = t_new - self.t
        if dt > 0.0:
            self.res_bytes += self._res_rate * dt
            self.res_bg_bytes += self._res_bg_rate * dt
            for f, r in zip(self._kv_list, self._kv_rates):
                f.remaining -= r * dt
            if dt > TIME_EPS:
                self.shortfall_bytes += self._shortfall_rate * dt
                for tid in self._viol_throttle:
                    rec = self.transfers.get(tid)
                    if rec is not None:
                        rec.throttled = True
                for tid in self._viol_thr:
                    rec = self.transfers.get(tid)
                    if rec is not None:
                        rec.over_thr = True
        self.t = t_new

    def _next_data_finish(self) -> float:
        best = math.inf
        for f, r in zip(self._kv_list, self._kv_rates):
            if r > 0.0:
                tf = self.t + max(f.remaining, 0.0) / r
                if tf < best:
                    best = tf
        return best

    def current_rate_gbps(self, tid: int) -> float:
        return sum(r for f, r in zip(self._kv_list, self._kv_rates) if f.tid == tid) / GB

    # ------------------------------------------------------------------ main loop
    def run(self, until: float = math.inf, stop_tid: Optional[int] = None, max_events: int = 10 ** 7) -> None:
        """Run until time `until`, until transfer `stop_tid` completes, or until nothing is left."""
        while self.events < max_events:
            if self._dirty:
                self._alloc()
            t_data = self._next_data_finish()
            t_tog = float(self.next_toggle.min()) if len(self.next_toggle) else math.inf
            t_heap = self._heap[0][0] if self._heap else math.inf
            t_arr = self.arrivals[self._arr_i][0] if self._arr_i < len(self.arrivals) else math.inf
            t_smp = self.monitor.next_tick if self.monitor is not None else math.inf
            # sampling ticks and toggles alone never end a run that has nothing else to do
            pending = self._kv_list or self._heap or self._arr_i < len(self.arrivals)
            if not pending and until == math.inf:
                break
            t_next = min(t_data, t_tog, t_heap, t_arr, t_smp)
            if t_next > until:
                self._advance(until)
                break
            if t_next == math.inf:
                break
            self._advance(max(t_next, self.t))
            self.events += 1
            now = self.t
            # 1. drained KV flows
            if t_data <= now + TIME_EPS:
                for f, r in list(zip(self._kv_list, self._kv_rates)):
                    if r > 0.0 and f.remaining <= r * DRAIN_EPS_S + 1e-6:
                        self._drain(f, now)
            # 2. background toggles
            if t_tog <= now + TIME_EPS:
                for g in np.flatnonzero(self.next_toggle <= now + TIME_EPS):
                    self.group_on[g], self.next_toggle[g] = self.groups[g].state_at(now + 2 * TIME_EPS)
                    self._dirty = True
            # 3. completions (feedback to the monitor)
            done_stop = False
            while self._heap and self._heap[0][0] <= now + TIME_EPS:
                _, _, ev = heapq.heappop(self._heap)
                done_stop |= self._complete(ev, now) == stop_tid and stop_tid is not None
            # 4. monitor sample
            if self.monitor is not None and self.monitor.next_tick <= now + TIME_EPS:
                self.monitor.on_sample(self)
            if done_stop:
                break
            # 5. arrivals
            while self._arr_i < len(self.arrivals) and self.arrivals[self._arr_i][0] <= now + TIME_EPS:
                _, req = self.arrivals[self._arr_i]
                self._arr_i += 1
                if self._dirty:
                    self._alloc()
                plan = self.policy(self, req)
                self.start_transfer(req, plan)

    def _drain(self, f: _KVFlow, now: float) -> None:
        del self.kv[(f.tid, f.sub)]
        self._dirty = True
        on_drain = getattr(self.monitor, "on_drain", None)
        if on_drain is not None:
            on_drain(f)
        dur = max(now - f.start, 1e-15)
        fill = 0.0
        if f.n_relays:
            # the selector's relay model (selector/cost_model.py) at the flow's average rate
            fill = relay_fill_s(f.n_relays, f.nbytes, f.nbytes / dur, self.params.relay_chunk_bytes,
                                self.params.relay_overhead_us)
        self._push(now + f.lat_s + fill, ("sub", f.tid, f.sub, f.links, f.nbytes, f.start, f.n_relays))

    def _complete(self, ev: tuple, now: float) -> Optional[int]:
        _, tid, sub, links, nbytes, start, n_relays = ev
        if self.monitor is not None and nbytes > 0:
            self.monitor.report(links, nbytes, now - start, relays=n_relays, key=(tid, sub))
        rec = self.transfers.get(tid)
        if rec is None:
            return None
        rec.sub_done[sub] = now
        if all(x is not None for x in rec.sub_done):
            rec.finish = now
            return tid
        return None

    # ------------------------------------------------------------------ what-if
    def simulate_plan(self, request, plan: Plan, horizon_s: float = 60.0) -> TransferRecord:
        """Fork, start `plan` now, run until it completes; the record (fct, QoS flags) of the fork."""
        s = self.fork()
        rec = s.start_transfer(request, plan)
        s.run(until=self.t + horizon_s, stop_tid=rec.tid)
        return rec
