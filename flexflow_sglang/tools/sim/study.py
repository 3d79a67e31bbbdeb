"""Simulation study CLI: `python -m flexflow_sglang.tools.sim.study --out DIR [--quick]`.

Runs every (machine, load, payload) scenario under always-direct, adaptive (PathSelector.select),
adaptive without SplitPath, and the hindsight oracles; writes results.json, results.md and PNG
figures (into --img-dir, default DIR/img).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import List, Optional

from flexflow_sglang.selector.cost_model import RELAY_CHUNK_BYTES, RELAY_OVERHEAD_US
from .engine import SimParams
from .scenario_runner import DEFAULT_POLICIES, MonitorSettings, run_scenario
from .scenarios import EXTRA_LOADS, LOADS, MACHINES, PAYLOADS_MIB, Scenario

QUICK_MACHINES = ("dgx-a100", "dgx8", "nvswitch8", "cluster2x8x4")
QUICK_PAYLOADS = (4, 64)


def build_scenarios(machines, loads, payloads, n_transfers, seed, gap_ms) -> List[Scenario]:
    return [Scenario(m, l, float(p), n_transfers=n_transfers, seed=seed, gap_ms=gap_ms)
            for m in machines for l in loads for p in payloads]


def _work(args):
    scn, policies, mon, params = args
    return run_scenario(scn, policies, monitor=mon, params=params)


def run_all(scenarios: List[Scenario], policies=DEFAULT_POLICIES, monitor: Optional[MonitorSettings] = None,
            jobs: int = 1, progress: bool = True, params: Optional[SimParams] = None) -> List[dict]:
    from tqdm import tqdm
    tasks = [(s, tuple(policies), monitor or MonitorSettings(), params or SimParams()) for s in scenarios]
    # the slowest (large cluster, bursty background) first, for a better parallel tail
    order = sorted(range(len(tasks)), key=lambda i: (-len(MACHINES[scenarios[i].machine].name),
                                                     scenarios[i].load != "tp", -scenarios[i].payload_mib))
    results = [None] * len(tasks)
    bar = tqdm(total=len(tasks), desc="simulate", unit="scn", disable=not progress, file=sys.stderr)
    if jobs > 1:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(jobs) as pool:
            for i, r in zip(order, pool.imap(_work, [tasks[i] for i in order])):
                results[i] = r
                bar.update(1)
    else:
        for i in order:
            results[i] = _work(tasks[i])
            bar.update(1)
    bar.close()
    return results


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="flexflow bench simulate",
                                 description="Flow-level simulation of KV routing policies on mock topologies.")
    ap.add_argument("--out", required=True, help="output directory (results.json, results.md, img/)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smoke subset: machines {','.join(QUICK_MACHINES)}, payloads "
                         f"{','.join(map(str, QUICK_PAYLOADS))} MiB, 6 transfers each")
    ap.add_argument("--machines", default=None, help=f"comma list from: {','.join(MACHINES)}")
    ap.add_argument("--loads", default=None, help=f"comma list from: {','.join(LOADS + EXTRA_LOADS)}")
    ap.add_argument("--payloads", default=None, help="comma list of MiB (default 1,4,16,64,256)")
    ap.add_argument("--transfers", type=int, default=None, help="KV transfers per scenario (default 12, quick 6)")
    ap.add_argument("--gap-ms", type=float, default=30.0, help="mean gap between KV arrivals (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--monitor-mode", choices=("counters", "background"), default="counters",
                    help="what the NodeAgent samples: link byte counters incl. our own traffic (real agent "
                         "path) or background load only (idealised)")
    ap.add_argument("--observe", choices=("all", "counters"), default="all",
                    help="links the monitor samples: all, or only those with a hardware counter in the topology")
    ap.add_argument("--sample-interval-ms", type=float, default=100.0)
    ap.add_argument("--lag-intervals", type=int, default=0, help="extra monitor reporting delay, in intervals")
    ap.add_argument("--no-feedback", action="store_true", help="do not report completed transfers to the agent")
    ap.add_argument("--no-reserve", action="store_true",
                    help="the adaptive policy does not reserve its in-flight transfers on the agent (ablation)")
    ap.add_argument("--relay-chunk-kib", type=int, default=RELAY_CHUNK_BYTES >> 10,
                    help="store-and-forward pipeline chunk of a relay in the simulated network (the selector's "
                         f"model assumes {RELAY_CHUNK_BYTES >> 10})")
    ap.add_argument("--relay-overhead-us", type=float, default=RELAY_OVERHEAD_US,
                    help="per-relay hand-off cost in the simulation")
    ap.add_argument("--img-dir", default=None, help="where to write PNGs (default OUT/img)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    machines = a.machines.split(",") if a.machines else (QUICK_MACHINES if a.quick else tuple(MACHINES))
    loads = a.loads.split(",") if a.loads else LOADS
    payloads = [float(x) for x in a.payloads.split(",")] if a.payloads else (QUICK_PAYLOADS if a.quick else PAYLOADS_MIB)
    for m in machines:
        if m not in MACHINES:
            raise SystemExit(f"unknown machine {m!r}; choose from {', '.join(MACHINES)}")
    for l in loads:
        if l not in LOADS + EXTRA_LOADS:
            raise SystemExit(f"unknown load {l!r}; choose from {', '.join(LOADS + EXTRA_LOADS)}")
    n = a.transfers or (6 if a.quick else 12)
    mon = MonitorSettings(sample_interval_ms=a.sample_interval_ms, mode=a.monitor_mode, observe=a.observe,
                          feedback=not a.no_feedback, lag_intervals=a.lag_intervals, reserve=not a.no_reserve)
    scenarios = build_scenarios(machines, loads, payloads, n, a.seed, a.gap_ms)
    t0 = time.time()
    params = SimParams(relay_chunk_bytes=a.relay_chunk_kib << 10, relay_overhead_us=a.relay_overhead_us)
    results = run_all(scenarios, DEFAULT_POLICIES, mon, jobs=max(1, a.jobs), progress=not a.no_progress,
                      params=params)
    wall = time.time() - t0

    from . import report
    summ = report.summary(results)
    os.makedirs(a.out, exist_ok=True)
    meta = {"argv": list(argv) if argv is not None else sys.argv[1:], "wall_s": round(wall, 1),
            "python": platform.python_version(), "monitor": vars(mon), "sim_params": vars(params), "n_transfers": n, "seed": a.seed,
            "gap_ms": a.gap_ms}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "summary": summ, "scenarios": [s.to_dict() for s in scenarios],
                   "results": results}, f, indent=1)
    md = ["# Simulation results", "", f"`{' '.join(['flexflow bench simulate'] + meta['argv'])}` "
          f"({len(results)} scenarios, {n} transfers each, {wall:.0f} s)", "", "## Summary", "",
          report.summary_md(summ), "## flexFlow's experiment (4xA100 NVLink)", "", report.flexflow_table(results),
          "## Per machine and load (geomean over payloads)", "",
          report.machine_load_table(results), "## Every scenario", "", report.scenario_table(results)]
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(md))
    files = []
    if not a.no_plots:
        files = report.plot_all(results, a.img_dir or os.path.join(a.out, "img"))
    print(report.summary_md(summ))
    print(f"wrote {os.path.join(a.out, 'results.json')}, {os.path.join(a.out, 'results.md')}"
          + (f", {len(files)} figures in {os.path.dirname(files[0])}" if files else "") + f" ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
