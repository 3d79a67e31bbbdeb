"""Sweep the PathSelector's weights and margins in the flow-level simulator.

    python benchmarks/sweep_weights.py --out runs/sweep [--quick] [--img-dir docs/img]

For every scenario the always-direct and QoS-aware oracle runs are simulated once; each selector
configuration is then scored by
  - ratio: geomean over scenarios of oracle FCT / adaptive FCT (1.0 = as fast as the oracle),
  - speedup: geomean of direct FCT / adaptive FCT,
  - qos: transfers with a QoS violation (throttled inference flow or a shared link driven over its
    threshold), summed over scenarios.
Coordinate descent from the default SelectorConfig: one knob at a time over a grid, keeping a value
only if it raises the ratio without adding QoS violations (vs the best so far); two passes.
Ratios above 1 happen where the adaptive policy is faster than the QoS-aware oracle by violating
QoS (mostly under TP all-reduce traffic), which is why QoS is a hard constraint here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from flexflow_sglang.selector import SelectorConfig
from flexflow_sglang.tools.sim.report import geomean
from flexflow_sglang.tools.sim.scenario_runner import run_policy, summarise
from flexflow_sglang.tools.sim.scenarios import LOADS, PAYLOADS_MIB, Scenario

GRID = {
    "w_bandwidth": [0.25, 0.5, 1.0, 2.0, 4.0],
    "w_latency": [0.0, 0.25, 0.5, 1.0, 2.0],
    "w_hops": [0.0, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0],
    "w_qos_risk": [0.0, 0.15, 0.3, 0.6, 1.0, 2.0],
    "w_queue_delay": [0.0, 0.5, 1.0],
    "relay_benefit_margin": [0.0, 0.05, 0.1, 0.2, 0.4],
    "split_benefit_margin": [0.0, 0.05, 0.1, 0.15, 0.3, 0.5],
}
MACHINES = ("dgx-a100", "dgx8", "nvswitch8", "cluster2x8x1", "cluster2x8x4", "cluster4x8x8")
QUICK_MACHINES = ("dgx-a100", "dgx8", "cluster2x8x4")


def _ref(scn):
    d = summarise(run_policy(scn, "direct"))
    o = summarise(run_policy(scn, "oracle"))
    return d["mean_fct_us"], o["mean_fct_us"]


def _adaptive(args):
    scn, over = args
    s = summarise(run_policy(scn, "adaptive", overrides=over))
    return s["mean_fct_us"], s["qos_violations"]


class Evaluator:
    def __init__(self, scenarios, pool):
        self.scenarios, self.pool = scenarios, pool
        self.refs = self._map(_ref, scenarios)
        self.cache = {}

    def _map(self, fn, items):
        return list(self.pool.imap(fn, items)) if self.pool else [fn(x) for x in items]

    def __call__(self, over: dict) -> dict:
        key = tuple(sorted(over.items()))
        if key in self.cache:
            return self.cache[key]
        rs = self._map(_adaptive, [(s, over) for s in self.scenarios])
        ratio = geomean([o / a for (d, o), (a, q) in zip(self.refs, rs)])
        speed = geomean([d / a for (d, o), (a, q) in zip(self.refs, rs)])
        qos = sum(q for a, q in rs)
        within = sum((o / a) >= 0.9 for (d, o), (a, q) in zip(self.refs, rs))
        out = {"overrides": dict(over), "ratio": ratio, "speedup": speed, "qos": qos, "within_10pct": within,
               "n": len(rs)}
        self.cache[key] = out
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--transfers", type=int, default=None)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--img-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    machines = QUICK_MACHINES if a.quick else MACHINES
    payloads = (4, 64) if a.quick else PAYLOADS_MIB
    n = a.transfers or (6 if a.quick else 8)
    scenarios = [Scenario(m, l, float(p), n_transfers=n, seed=a.seed) for m in machines for l in LOADS
                 for p in payloads]
    t0 = time.time()
    pool = None
    if a.jobs > 1:
        import multiprocessing as mp
        pool = mp.get_context("fork").Pool(a.jobs)
    try:
        ev = Evaluator(scenarios, pool)
        base = ev({})
        print(f"default: ratio {base['ratio']:.3f} speedup {base['speedup']:.3f} qos {base['qos']} "
              f"within10 {base['within_10pct']}/{base['n']}", flush=True)
        best_over, best = {}, base
        curves = {}
        for p in range(a.passes):
            for knob, values in GRID.items():
                rows = []
                for v in values:
                    over = {**best_over, knob: v}
                    r = ev(over)
                    rows.append((v, r))
                    better = (r["qos"] <= best["qos"]) and (r["ratio"] > best["ratio"] + 1e-4)
                    if better:
                        best_over, best = over, r
                curves.setdefault(knob, []).append([(v, r["ratio"], r["speedup"], r["qos"]) for v, r in rows])
                print(f"pass {p} {knob:22s} " + "  ".join(f"{v:g}:{r['ratio']:.3f}/q{r['qos']}" for v, r in rows)
                      + f"  -> {best_over.get(knob, getattr(SelectorConfig(), knob))}", flush=True)
        # the tuned config without SplitPath too, for the flexFlow-shaped comparison
        nosplit_default = ev({"enable_split_path": False})
        nosplit_best = ev({**best_over, "enable_split_path": False})
    finally:
        if pool:
            pool.close()
    wall = time.time() - t0
    os.makedirs(a.out, exist_ok=True)
    res = {"default": base, "best": best, "best_overrides": best_over, "curves": curves,
           "nosplit_default": nosplit_default, "nosplit_best": nosplit_best,
           "default_config": asdict(SelectorConfig()), "machines": machines, "payloads": payloads,
           "transfers": n, "wall_s": round(wall, 1), "evaluated": len(ev.cache)}
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| config | adaptive/oracle (geomean) | speedup vs direct | within 10% of oracle | QoS-violating transfers |",
             "|---|---:|---:|---:|---:|"]
    for name, r in (("default", base), ("best " + json.dumps(best_over), best),
                    ("default, no split", nosplit_default), ("best, no split", nosplit_best)):
        lines.append(f"| {name} | {r['ratio']:.3f} | {r['speedup']:.3f}x | {r['within_10pct']}/{r['n']} | {r['qos']} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "sweep.md"), "w") as f:
        f.write(md)
    print(md)
    img = a.img_dir or os.path.join(a.out, "img")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        os.makedirs(img, exist_ok=True)
        fig, axes = plt.subplots(1, len(GRID), figsize=(2.6 * len(GRID), 2.8), sharey=True)
        for ax, (knob, passes) in zip(axes, curves.items()):
            for k, rows in enumerate(passes):
                ax.plot([r[0] for r in rows], [r[1] for r in rows], "o-" if k else "s--", ms=3,
                        label=f"pass {k}")
            ax.axvline(getattr(SelectorConfig(), knob), color="grey", ls=":", lw=0.8)
            ax.set_title(knob, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("oracle/adaptive FCT (geomean)")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(img, "sim_sweep.png"), dpi=110)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass
    print(f"wrote {a.out}/sweep.json, sweep.md ({wall:.0f} s, {len(ev.cache)} configs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
