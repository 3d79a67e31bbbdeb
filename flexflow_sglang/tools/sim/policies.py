"""Routing policies compared by the simulator.

- `SelectorPolicy(selector, "direct")`: `PathSelector.always_direct` (the route a plain transport takes);
- `SelectorPolicy(selector, "adaptive")`: the real `PathSelector.select`, deciding from its NodeAgent's
  view (sampled counters + feedback + its own in-flight transfers, reserved on the agent), split
  shares executed as concurrent sub-flows. Select and reserve go through the production
  `TransferEngine.open` (the one place a KV move is routed); the monitor releases and reports the
  ticket's legs as the simulated sub-flows drain and complete (sim_agent.SimMonitor);
- `OraclePolicy`: hindsight per transfer: every candidate path, and 2-way splits of each of the
  `top_k` best candidates with its `partners` best link-disjoint partners, are simulated forward from the current state (with the real future background,
  in-flight transfers included) and the fastest is taken; QoS-aware by default (the fastest among
  options that cause no QoS violation, if any does not).
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

from flexflow_sglang.selector import PathSelector, TransferRequest
from flexflow_sglang.topology.graph import Path, PathType, Topology
from flexflow_sglang.transfer.engine import TransferEngine
from .engine import Plan, Simulator, SubPlan
from .sim_agent import sim_clock


class _PathIndex:
    """Maps a decision's sub-paths back to candidate `Path`s (for their relay count)."""

    def __init__(self, selector: PathSelector):
        self.selector = selector
        self._by_pair: Dict[Tuple[str, str], Dict[Tuple[int, ...], Path]] = {}

    def lookup(self, src: str, dst: str, links: Tuple[int, ...]) -> Path:
        d = self._by_pair.get((src, dst))
        if d is None:
            d = self._by_pair[(src, dst)] = {}
            for p in self.selector.candidates(src, dst):
                d.setdefault(tuple(p.links), p)
        return d[tuple(links)]


def plan_from_paths(label: str, paths_bytes: Sequence[Tuple[Path, int]], est_us: float = math.nan,
                    reason: str = "") -> Plan:
    return Plan(label, [SubPlan(p.type, tuple(p.nodes), tuple(p.links), int(b), len(p.relays))
                        for p, b in paths_bytes], est_us, reason)


class SelectorPolicy:
    def __init__(self, selector: PathSelector, mode: str = "adaptive", monitor=None):
        if mode not in ("adaptive", "direct"):
            raise ValueError(f"SelectorPolicy: mode must be 'adaptive' or 'direct', got {mode!r}")
        self.selector, self.mode, self.monitor = selector, mode, monitor
        self._index = _PathIndex(selector)
        self.decisions: List = []
        # adaptive: the production engine routes each move (select + reserve_decision); it starts
        # no threads (nothing is submitted). Reservations live on the monitor's agent, which the
        # monitor reports to; "direct" is the plain-transport baseline and routes nothing.
        self.engine = None
        if mode == "adaptive":
            agent = getattr(monitor, "agent", None)
            self.engine = TransferEngine(selector, selector.agent if agent is None else agent, name="ff-sim")

    def __call__(self, sim: Simulator, req: TransferRequest) -> Plan:
        if self.monitor is not None:
            self.monitor.before_decide(sim)
        ticket = None
        if self.mode == "adaptive":
            # reservations only where a monitor releases them at drain (and it has them on)
            reserve = bool(getattr(self.monitor, "reserve_inflight", False))
            with sim_clock(sim):  # the agent's reservation clock is the simulated one
                ticket = self.engine.open(req.src, req.dst, req.data_bytes, req.ttft_sensitive, reserve=reserve)
            d = ticket.decision
            if d is None:
                # open() swallows selector errors (production runs such a move unrouted); a
                # simulation must not: surface the selector's own error, else a plain one
                self.selector.candidates(req.src, req.dst)
                raise RuntimeError(f"SelectorPolicy: no route {req.src} -> {req.dst} ({req.data_bytes} bytes)")
        else:
            d = self.selector.always_direct(req)
        self.decisions.append(d)
        pb = [(self._index.lookup(req.src, req.dst, sp.links), sp.nbytes) for sp in d.subpaths]
        plan = plan_from_paths(d.chosen_type.value, pb, d.estimated_time_us, str(d.reason_code))
        if ticket is not None:
            plan.ticket = ticket  # the monitor releases / reports its legs and closes it
            if reserve:  # one token per leg, as reserve_decision returned them (for inspection)
                plan.tokens = tuple(ticket.tokens.get(i, 0) for i in range(len(d.subpaths)))
        return plan


class OraclePolicy:
    """Best single path or 2-way split in hindsight (per transfer, greedy in arrival order)."""

    def __init__(self, selector: PathSelector, qos_aware: bool = True, top_k: int = 5, partners: int = 3,
                 split_iters: int = 4):
        self.selector, self.qos_aware, self.top_k, self.partners = selector, qos_aware, top_k, partners
        self.split_iters = split_iters
        self.trials = 0

    def _best_split(self, sim, req, p1: Path, p2: Path, frac: float):
        """Secant search on the share of p1 that makes both legs finish together (<= split_iters sims)."""
        n = req.data_bytes
        best = (None, None)
        tried = {}

        def trial(f):
            b1 = int(round(n * min(0.98, max(0.02, f))))
            if b1 in tried:
                return tried[b1]
            plan = plan_from_paths(PathType.SplitPath.value, [(p1, b1), (p2, n - b1)])
            rec = sim.simulate_plan(req, plan)
            self.trials += 1
            g = (rec.sub_done[0] - rec.sub_done[1])  # > 0: leg 1 finishes last, give it less
            tried[b1] = (self._key(rec), plan, g, b1 / n)
            return tried[b1]

        xs = []
        f = frac
        for it in range(self.split_iters):
            k, plan, g, f_used = trial(f)
            if best[0] is None or k < best[0]:
                best = (k, plan)
            xs.append((f_used, g))
            if abs(g) < 1e-7:
                break
            if len(xs) == 1:
                f = f_used - 0.05 if g > 0 else f_used + 0.05
            else:
                (fa, ga), (fb, gb) = xs[-2], xs[-1]
                f = fb - gb * (fb - fa) / (gb - ga) if gb != ga else fb
        return best

    def _key(self, rec) -> tuple:
        return (rec.qos_violation, rec.fct) if self.qos_aware else (rec.fct,)

    def __call__(self, sim: Simulator, req: TransferRequest) -> Plan:
        cands: List[Path] = []
        seen = set()
        for p in self.selector.candidates(req.src, req.dst):
            if tuple(p.links) not in seen:
                seen.add(tuple(p.links))
                cands.append(p)
        n = req.data_bytes
        singles = []
        for p in cands:
            plan = plan_from_paths(p.type.value, [(p, n)])
            rec = sim.simulate_plan(req, plan)
            self.trials += 1
            singles.append((self._key(rec), rec.fct, p, plan))
        singles.sort(key=lambda x: x[0])
        best_key, best_plan = singles[0][0], singles[0][3]
        # pairs: each of the top_k singles with its best `partners` link-disjoint partners among all
        # candidates (a good split often pairs the direct rail with a mediocre but disjoint relay)
        pairs = []
        for i in range(min(self.top_k, len(singles))):
            found = 0
            for j in range(len(singles)):
                if j == i or not Topology.link_disjoint(singles[i][2], singles[j][2]):
                    continue
                key = (min(i, j), max(i, j))
                if key not in pairs:
                    pairs.append(key)
                found += 1
                if found >= self.partners:
                    break
        for i, j in pairs:
            (_, f1, p1, _), (_, f2, p2, _) = singles[i], singles[j]
            k, plan = self._best_split(sim, req, p1, p2, (1.0 / f1) / (1.0 / f1 + 1.0 / f2))
            if plan is not None and k < best_key:
                best_key, best_plan = k, plan
        return best_plan
