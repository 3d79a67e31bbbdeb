"""Sim vs real: the network-namespace lab of docs/contention.md, modelled in the simulator.

The real benchmark (`benchmarks/contention.py`) joins three hosts n0, n1, n2 pairwise with 1 Gbit/s
veth links and moves KV-sized payloads n0 -> n2, one after another, while background traffic runs
n0 -> n2 on the direct link. This module builds the same experiment in the flow-level simulator:

- topology `make_mock_hosts(3, link_gbps=0.125)`: the same three links (70 us each, `rdma` QoS
  class, threshold 80 %), in the same order as the benchmark's own topology;
- background on the direct link, in the transfer's direction: UDP as a constant-rate,
  non-responsive flow at 0, 50, 85 or 95 % of the link (it keeps its rate; our BBR flows share what
  it leaves; the main study's background is max-min fair instead), and 1 or 3 greedy TCP flows as
  elastic flows (max-min: an equal share per flow);
- workload: the benchmark's payload sequence (16, 1, 4, 2, 8, 32, 64, 16, 128, 256 MiB), each
  transfer starting when the previous one finished plus a verification gap (CRC32 at n2, stamping
  at n0), throughput over the same common prefix `n` the real run used;
- relay: the executor's application-level relay pipelines 1 MiB chunks, so a relayed leg pays one
  1 MiB chunk of pipeline fill (`SimParams.relay_chunk_bytes`), while the selector keeps its default
  4 MiB model (`SelectorConfig()`, as in the benchmark);
- monitor: the NodeAgent in n0 can read only its own interfaces (links n0-n1 and n0-n2, 100 ms
  sysfs counters); n1-n2 is known from feedback only. Own bytes are reported while the transfer
  runs (`report_progress`; the benchmark reports each 1 MiB chunk), feedback at each leg's end;
- policies: always-direct, relay only, split50, UCX multi-rail (a 50/50 split whose second rail is
  forwarded by the kernel: no application relay fill) and adaptive (the real `PathSelector`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from flexflow_sglang.selector import PathSelector, SelectorConfig, TransferRequest
from flexflow_sglang.selector.cost_model import RELAY_OVERHEAD_US
from flexflow_sglang.topology import make_mock_hosts
from flexflow_sglang.topology.graph import PathType, Topology
from .engine import GB, BgFlow, BgGroup, Network, Plan, SimParams, Simulator, SubPlan
from .sim_agent import SimMonitor
from .policies import SelectorPolicy, plan_from_paths
from .scenarios import thresholds

MiB = 1 << 20
LINK_GBPS = 0.125  # 1 Gbit/s
SEQ_MIB = (16, 1, 4, 2, 8, 32, 64, 16, 128, 256)
EXECUTOR_CHUNK = 1 << 20  # the benchmark relays (and posts direct legs) in 1 MiB chunks
POLICIES = ("direct", "relay", "split50", "multirail", "adaptive")

#: scenario -> (kind, fraction of the link for UDP / number of TCP flows)
SCENARIOS: Dict[str, Tuple[str, float]] = {
    "idle": ("none", 0.0),
    "udp50": ("udp", 0.50),
    "udp85": ("udp", 0.85),
    "udp95": ("udp", 0.95),
    "tcp1": ("tcp", 1),
    "tcp3": ("tcp", 3),
}

#: docs/contention.md, the full run (commit 912b2c9: the current selector defaults, the lab's executor
#: with work stealing between split legs and in-flight reservations; policy `adaptive`, the shipped
#: default): n = common prefix of SEQ_MIB, Mbit/s per policy over that prefix, adaptive's path mix
REAL = {
    "idle": dict(n=10, direct=995, relay=967, split50=1896, multirail=1956, adaptive=1901, paths="S:10"),
    "udp50": dict(n=9, direct=500, relay=955, split50=1007, multirail=1008, adaptive=1360, paths="S:9"),
    "udp85": dict(n=8, direct=152, relay=929, split50=312, multirail=311, adaptive=928, paths="R:8"),
    "udp95": dict(n=5, direct=54, relay=844, split50=108, multirail=113, adaptive=844, paths="R:5"),
    "tcp1": dict(n=9, direct=494, relay=954, split50=888, multirail=949, adaptive=892, paths="R:9"),
    "tcp3": dict(n=8, direct=238, relay=931, split50=474, multirail=495, adaptive=934, paths="R:8"),
}


@dataclass(frozen=True)
class LabSettings:
    seq_mib: Tuple[int, ...] = SEQ_MIB
    warmup_s: float = 1.0  # background alone before the first transfer (the benchmark: 3.3 s)
    gap_fixed_ms: float = 5.0  # between transfers: IPC round trips ...
    gap_ms_per_mib: float = 2.0  # ... and CRC32 of the payload at n2 plus stamping the next at n0
    sample_interval_ms: float = 100.0
    progress: bool = True  # own bytes reported while running (the benchmark: per 1 MiB chunk)
    feedback: bool = True
    relay_chunk_bytes: int = EXECUTOR_CHUNK  # the simulated executor's relay pipeline chunk
    relay_overhead_us: float = RELAY_OVERHEAD_US
    seed: int = 0
    udp_fair: bool = False  # ablation: UDP as a max-min fair flow (the main study's background model)
    selector: Dict[str, float] = field(default_factory=dict)  # SelectorConfig overrides for adaptive


_TOPO: Dict[int, Topology] = {}


def topology() -> Topology:
    t = _TOPO.get(0)
    if t is None:
        t = _TOPO[0] = make_mock_hosts(3, link_gbps=LINK_GBPS)
    return t


def _link(topo: Topology, a: str, b: str) -> int:
    return topo.links_between(a, b)[0].id


def build_background(scenario: str, net: Network, udp_fair: bool = False) -> List[BgFlow]:
    kind, x = SCENARIOS[scenario]
    topo = net.topo
    l02 = _link(topo, "n0", "n2")
    res = net.resources(("n0", "n2"), (l02,))
    if kind == "none":
        return []
    if kind == "udp":
        # non-responsive: it keeps its rate and our (BBR) flows get what it leaves
        return ([BgFlow(f"udp{x:.0%}", (l02,), res, x * topo.links[l02].capacity_gbps * GB, 0,
                        responsive=udp_fair)]
                if x > 0 else [])
    if kind == "tcp":  # greedy flows: elastic, an equal max-min share each
        return [BgFlow(f"tcp{k}", (l02,), res, math.inf, 0) for k in range(int(x))]
    raise ValueError(f"unknown background kind {kind!r}")


class _FixedPolicy:
    """direct / relay / split50 / multirail as the benchmark's fixed executors run them."""

    def __init__(self, topo: Topology, name: str):
        paths = topo.enumerate_paths("n0", "n2")
        self.direct = next(p for p in paths if p.type == PathType.Direct)
        self.relay = next(p for p in paths if p.type == PathType.CrossNodeRelay and p.relays == ("n1",))
        self.name = name

    def __call__(self, sim, req) -> Plan:
        n = req.data_bytes
        if self.name == "direct":
            return plan_from_paths("Direct", [(self.direct, n)])
        if self.name == "relay":
            return plan_from_paths("CrossNodeRelay", [(self.relay, n)])
        h = n // 2
        if self.name == "split50":
            return plan_from_paths("SplitPath", [(self.direct, h), (self.relay, n - h)])
        if self.name == "multirail":  # UCX rails: the second one is forwarded by n1's kernel (no app relay)
            d, r = self.direct, self.relay
            return Plan("multirail", [SubPlan(d.type, tuple(d.nodes), tuple(d.links), h, 0),
                                      SubPlan(r.type, tuple(r.nodes), tuple(r.links), n - h, 0)])
        raise ValueError(f"unknown fixed policy {self.name!r}")


def run_policy(scenario: str, policy: str, s: Optional[LabSettings] = None) -> List[dict]:
    """The payload sequence under one policy; per transfer: MiB, seconds, path label, shares."""
    s = s or LabSettings()
    topo = topology()
    net = Network(topo, thresholds(topo, SelectorConfig()))
    bg = build_background(scenario, net, s.udp_fair)
    params = SimParams(relay_chunk_bytes=s.relay_chunk_bytes, relay_overhead_us=s.relay_overhead_us)
    mon = None
    if policy == "adaptive":
        rng = np.random.default_rng([s.seed, sum(map(ord, scenario))])
        observed = [_link(topo, "n0", "n1"), _link(topo, "n0", "n2")]  # sysfs inside n0
        mon = SimMonitor(topo, s.sample_interval_ms, "counters", observed, s.feedback,
                         phase_ms=float(rng.uniform(0, s.sample_interval_ms)), progress=s.progress)
        pol = SelectorPolicy(PathSelector(topo, mon.agent, replace(SelectorConfig(), **s.selector)), "adaptive", mon)
    else:
        pol = _FixedPolicy(topo, policy)
    sim = Simulator(net, bg, [BgGroup("const")], params, policy=pol, monitor=mon)
    out = []
    t = s.warmup_s
    for i, mib in enumerate(s.seq_mib):
        sim.add_arrivals([(t, TransferRequest("n0", "n2", int(mib * MiB)))])
        sim.run(stop_tid=i)
        rec = sim.transfers[i]
        if rec.finish is None:
            raise RuntimeError(f"hosts3 {scenario}/{policy}: transfer {i} did not finish")
        out.append({"mib": mib, "seconds": rec.fct, "path": rec.plan.label,
                    "shares": [int(sp.nbytes) for sp in rec.plan.subs], "qos_violation": rec.qos_violation})
        nxt = s.seq_mib[i + 1] if i + 1 < len(s.seq_mib) else 0
        t = sim.t + (s.gap_fixed_ms + s.gap_ms_per_mib * (mib + nxt)) * 1e-3
    return out


_ABBR = {"Direct": "D", "SplitPath": "S", "CrossNodeRelay": "R", "NVLinkRelay": "R"}


def mbps(transfers: Sequence[dict], n: int) -> float:
    """Mbit/s over the first n transfers: their bytes over the sum of their completion times."""
    tr = transfers[:n]
    return sum(x["mib"] * MiB for x in tr) * 8 / sum(x["seconds"] for x in tr) / 1e6


def path_mix(transfers: Sequence[dict], n: int) -> str:
    c: Dict[str, int] = {}
    for x in transfers[:n]:
        k = _ABBR.get(x["path"], x["path"])
        c[k] = c.get(k, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def compare(scenarios: Sequence[str] = tuple(SCENARIOS), policies: Sequence[str] = POLICIES,
            s: Optional[LabSettings] = None) -> dict:
    """Simulated vs measured throughput per scenario and policy, on the real run's prefix n."""
    out = {}
    for sc in scenarios:
        n = REAL[sc]["n"]
        row = {"n": n, "sim": {}, "real": {p: REAL[sc][p] for p in policies}, "transfers": {}}
        for p in policies:
            tr = run_policy(sc, p, s)
            row["transfers"][p] = tr
            row["sim"][p] = mbps(tr, n)
        if "adaptive" in policies:
            row["sim_paths"] = path_mix(row["transfers"]["adaptive"], n)
            row["real_paths"] = REAL[sc]["paths"]
        if "adaptive" in policies and "direct" in policies:
            row["sim_ratio"] = row["sim"]["adaptive"] / row["sim"]["direct"]
            row["real_ratio"] = REAL[sc]["adaptive"] / REAL[sc]["direct"]
            row["ratio_err"] = row["sim_ratio"] / row["real_ratio"] - 1.0
        out[sc] = row
    return out


def table_md(res: dict) -> str:
    pols = [p for p in POLICIES if all(p in r["sim"] for r in res.values())]
    lines = ["| scenario | n | adaptive/direct sim | real | sim/real | adaptive paths sim / real | "
             + " | ".join(f"{p} Mbit/s sim / real" for p in pols) + " |",
             "|---|---:|---:|---:|---:|---|" + "---:|" * len(pols)]
    for sc, r in res.items():
        ratio = (f"{r['sim_ratio']:.2f}x | {r['real_ratio']:.2f}x | {r['sim_ratio'] / r['real_ratio']:.2f}"
                 if "sim_ratio" in r else "- | - | -")
        paths = f"{r.get('sim_paths', '-')} / {r.get('real_paths', '-')}"
        cells = " | ".join(f"{r['sim'][p]:.0f} / {r['real'][p]:.0f}" for p in pols)
        lines.append(f"| {sc} | {r['n']} | {ratio} | {paths} | {cells} |")
    return "\n".join(lines) + "\n"


#: docs/contention.md "Relay pipeline model" row (idle, the payload sequence; the run of commit 912b2c9):
#: Mbit/s over all payloads / over payloads <= 16 MiB, and the path per payload
REAL_RELAY_MODEL = {
    4 << 20: dict(all=1897, small=1667, paths="16:S 1:S 4:S 2:S 8:S 32:S 64:S 16:S 128:S 256:S"),
    1 << 20: dict(all=1923, small=1705, paths="16:S 1:S 4:S 2:S 8:S 32:S 64:S 16:S 128:S 256:S"),
}


def relay_model_ablation(s: Optional[LabSettings] = None) -> dict:
    """Idle, adaptive, the selector's relay model at 4 MiB (shipped default) vs the executor's 1 MiB."""
    s = s or LabSettings()
    out = {}
    for chunk, real in REAL_RELAY_MODEL.items():
        tr = run_policy("idle", "adaptive", replace(s, selector={**s.selector, "relay_chunk_bytes": chunk}))
        small = [x for x in tr if x["mib"] <= 16]
        out[chunk] = {"sim": {"all": mbps(tr, len(tr)), "small": mbps(small, len(small)),
                              "paths": " ".join(f"{x['mib']}:{_ABBR.get(x['path'], '?')}" for x in tr)},
                      "real": real}
    return out


def relay_model_md(res: dict) -> str:
    lines = ["| selector relay model | Mbit/s all, sim / real | Mbit/s payloads <= 16 MiB, sim / real "
             "| paths sim | paths real |",
             "|---|---:|---:|---|---|"]
    for chunk, r in res.items():
        lines.append(f"| {chunk >> 20} MiB chunk | {r['sim']['all']:.0f} / {r['real']['all']} | "
                     f"{r['sim']['small']:.0f} / {r['real']['small']} | {r['sim']['paths']} | {r['real']['paths']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> str:
    """Left: simulated vs measured Mbit/s of every (scenario, policy); right: adaptive/direct."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    markers = {"direct": "o", "relay": "s", "split50": "^", "multirail": "v", "adaptive": "*"}
    lo, hi = 40, 2200
    for p, m in markers.items():
        xs = [r["real"][p] for r in res.values() if p in r["sim"]]
        ys = [r["sim"][p] for r in res.values() if p in r["sim"]]
        a1.scatter(xs, ys, marker=m, s=60 if m == "*" else 30, label=p)
    xx = np.geomspace(lo, hi, 50)
    a1.plot(xx, xx, "k-", lw=0.8)
    a1.fill_between(xx, xx * 0.9, xx * 1.1, color="grey", alpha=0.2, label="±10 %")
    a1.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured Mbit/s (netns, veth 1 Gbit/s)",
           ylabel="simulated Mbit/s", title="throughput per scenario and policy")
    a1.legend(fontsize=8)
    names = [k for k, r in res.items() if "sim_ratio" in r]
    x = np.arange(len(names))
    a2.bar(x - 0.2, [res[k]["real_ratio"] for k in names], 0.4, label="measured")
    a2.bar(x + 0.2, [res[k]["sim_ratio"] for k in names], 0.4, label="simulated")
    for i, k in enumerate(names):
        a2.text(i, max(res[k]["real_ratio"], res[k]["sim_ratio"]) * 1.05, f"{res[k]['ratio_err']:+.0%}",
                ha="center", fontsize=8)
    a2.set(xticks=x, xticklabels=names, yscale="log", ylabel="adaptive / always-direct throughput",
           title="adaptive vs always-direct (label: sim/real - 1)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
