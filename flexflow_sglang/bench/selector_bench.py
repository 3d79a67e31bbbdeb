"""`flexflow bench selector`: select() latency through the Python API, compiled core vs Python twin,
measured side by side in one run on the same inputs."""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from tqdm import tqdm

from ..monitor import NodeAgent
from ..selector import PathSelector, TransferRequest, selector_backend
from ..topology import make_mock


def _measure(sel, reqs, n, desc, progress=True):
    lat = []
    gc.disable()
    try:
        for i in tqdm(range(n), desc=desc, disable=not progress, mininterval=0.5, leave=False):
            r = reqs[i % len(reqs)]
            t0 = time.perf_counter_ns()
            sel.select(r)
            lat.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] / 1000.0
    return {"n": n, "median_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "mean_us": statistics.fmean(lat) / 1000.0}


def run(topologies=("dgx8", "cluster2x8"), n=50000, n_python=5000, seed=0, progress=True) -> dict:
    out = {"selector_backend": selector_backend(), "results": {}}
    for name in topologies:
        topo = make_mock(name)
        agent = NodeAgent(topo, source="mock")
        rng = random.Random(seed)
        for l in topo.links:  # a loaded, non-trivial state
            agent._mock[l.id] = rng.choice([0.0, 0.2, 0.5, 0.85])
        agent.refresh()
        gpus = [g.name for g in topo.nodes_of_kind("gpu")]
        reqs = [TransferRequest(*rng.sample(gpus, 2), rng.choice([1 << 20, 16 << 20, 64 << 20])) for _ in range(64)]
        res = {}
        impls = ["python"] + (["compiled"] if selector_backend() == "compiled" else [])
        for impl in impls:
            sel = PathSelector(topo, agent, impl=impl)
            for r in reqs:  # warm pair tables
                sel.select(r)
            res[impl] = _measure(sel, reqs, n if impl == "compiled" else n_python, f"{name}/{impl}", progress)
        if "compiled" in res:
            res["speedup_compiled_vs_python"] = round(res["python"]["median_us"] / res["compiled"]["median_us"], 1)
        out["results"][name] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow bench selector")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-n", type=int, default=50000)
    ap.add_argument("--topologies", default="dgx8,cluster2x8")
    args = ap.parse_args(argv)
    res = run(tuple(args.topologies.split(",")), n=args.n, progress=not args.json)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"selector core: {res['selector_backend']}")
    for name, r in res["results"].items():
        for impl in ("compiled", "python"):
            if impl in r:
                m = r[impl]
                print(f"{name:<12} {impl:<9} median {m['median_us']:7.2f} us  p90 {m['p90_us']:7.2f} us  "
                      f"p99 {m['p99_us']:7.2f} us  (n={m['n']})")
        if "speedup_compiled_vs_python" in r:
            print(f"{name:<12} compiled is {r['speedup_compiled_vs_python']}x faster than the Python twin (median)")
    return 0
