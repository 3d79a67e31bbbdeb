"""Run one scenario under each policy and summarise (speedups, QoS, chosen path types)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence

import numpy as np

from flexflow_sglang.selector import PathSelector, SelectorConfig
from .engine import Network, SimParams, Simulator, TransferRecord
from .sim_agent import SimMonitor
from .policies import OraclePolicy, SelectorPolicy
from .scenarios import MACHINES, Scenario, build_background, build_requests, thresholds

#: policy name -> (kind, SelectorConfig overrides)
POLICIES = {
    "direct": ("direct", {}),
    "adaptive": ("adaptive", {}),
    "adaptive-nosplit": ("adaptive", {"enable_split_path": False}),
    "oracle": ("oracle", {}),  # fastest option that causes no QoS violation (if any)
    "oracle-fast": ("oracle-fast", {}),  # fastest option, QoS ignored
}
DEFAULT_POLICIES = ("direct", "adaptive", "adaptive-nosplit", "oracle", "oracle-fast")


@dataclass
class MonitorSettings:
    sample_interval_ms: float = 100.0
    mode: str = "counters"  # counters | background
    observe: str = "all"  # all | counters (only links with a hardware counter attribute)
    feedback: bool = True
    feedback_half_life_ms: float = 500.0
    lag_intervals: int = 0
    reserve: bool = True  # the adaptive policy reserves its in-flight legs on the agent


def _topology_cache():
    cache = {}

    def get(name):
        t = cache.get(name)
        if t is None:
            t = cache[name] = MACHINES[name].factory()
        return t
    return get


_TOPO = _topology_cache()


def run_policy(scn: Scenario, policy: str, base_cfg: Optional[SelectorConfig] = None,
               monitor: Optional[MonitorSettings] = None, params: Optional[SimParams] = None,
               overrides: Optional[dict] = None) -> List[TransferRecord]:
    """Simulate `scn` under one policy; the transfer records in arrival order."""
    topo = _TOPO(scn.machine)
    base_cfg = base_cfg or SelectorConfig()
    kind, over = POLICIES[policy] if policy in POLICIES else ("adaptive", {})
    cfg = replace(base_cfg, **{**over, **(overrides or {})})
    # QoS is judged against the default thresholds whatever the policy's knobs
    net = Network(topo, thresholds(topo, SelectorConfig()))
    bg, groups = build_background(scn, topo, net)
    ms = monitor or MonitorSettings()
    mon = None
    if kind == "adaptive":
        phase = float(scn.rng("monitor").uniform(0, ms.sample_interval_ms))
        mon = SimMonitor(topo, ms.sample_interval_ms, ms.mode, ms.observe, ms.feedback,
                         ms.feedback_half_life_ms, ms.lag_intervals, phase_ms=phase, reserve=ms.reserve)
        selector = PathSelector(topo, mon.agent, cfg)
        pol = SelectorPolicy(selector, "adaptive", mon)
    elif kind == "direct":
        pol = SelectorPolicy(PathSelector(topo, None, cfg), "direct")
    else:
        pol = OraclePolicy(PathSelector(topo, None, cfg), qos_aware=(kind == "oracle"))
    sim = Simulator(net, bg, groups, params, policy=pol, monitor=mon)
    sim.add_arrivals(build_requests(scn))
    sim.run()
    recs = sorted(sim.transfers.values(), key=lambda r: r.tid)
    if any(r.finish is None for r in recs):
        raise RuntimeError(f"{scn.key}/{policy}: {sum(r.finish is None for r in recs)} transfers did not finish")
    return recs


def summarise(recs: Sequence[TransferRecord]) -> dict:
    fct = np.array([r.fct for r in recs]) * 1e6
    types = Counter(r.plan.label for r in recs)
    est = np.array([r.plan.est_us for r in recs])
    ok = np.isfinite(est)
    return {
        "mean_fct_us": float(fct.mean()),
        "p50_fct_us": float(np.median(fct)),
        "max_fct_us": float(fct.max()),
        "qos_violations": int(sum(r.qos_violation for r in recs)),
        "qos_throttled": int(sum(r.throttled for r in recs)),
        "qos_over_threshold": int(sum(r.over_thr for r in recs)),
        "n": len(recs),
        "types": dict(sorted(types.items())),
        "est_over_actual": float(np.mean(est[ok] / fct[ok])) if ok.any() else None,
    }


def run_scenario(scn: Scenario, policies: Sequence[str] = DEFAULT_POLICIES, **kw) -> dict:
    out = {"scenario": scn.key, "machine": scn.machine, "load": scn.load, "payload_mib": scn.payload_mib,
           "policies": {}}
    for p in policies:
        out["policies"][p] = summarise(run_policy(scn, p, **kw))
    base = out["policies"].get("direct")
    if base:
        for p, s in out["policies"].items():
            s["speedup"] = base["mean_fct_us"] / s["mean_fct_us"]
    orc = out["policies"].get("oracle")
    if orc:
        for p, s in out["policies"].items():
            s["vs_oracle"] = orc["mean_fct_us"] / s["mean_fct_us"]  # 1.0 = as fast as the oracle
    return out
