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

from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.selector import PathSelector, TransferRequest, selector_backend
from flexflow_sglang.topology import make_mock


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


def _load_core(path):
    """The PairCore of another build of the compiled core (e.g. an older commit's .so), for a
    before/after comparison in one run: `--baseline-core <old build dir>/_selector_core....so`."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.ExtensionFileLoader("flexflow_baseline._selector_core", path)
    spec = importlib.util.spec_from_file_location("flexflow_baseline._selector_core", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.PairCore


def run(topologies=("dgx8", "cluster2x8"), n=50000, n_python=5000, seed=0, progress=True,
        baseline_core=None) -> dict:
    out = {"selector_backend": selector_backend(), "results": {}}
    base_cls = _load_core(baseline_core) if baseline_core else None
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
        if base_cls is not None and "compiled" in impls:
            impls = ["python", "baseline", "compiled"]
        for impl in impls:
            sel = PathSelector(topo, agent, impl="compiled" if impl == "baseline" else impl)
            if impl == "baseline":
                sel._core_cls = base_cls
                # an older core has no decide(): the old Python wrapping, as it was
                sel.select = _old_select(sel)
            for r in reqs:  # warm pair tables
                sel.select(r)
            res[impl] = _measure(sel, reqs, n_python if impl == "python" else n, f"{name}/{impl}", progress)
            if impl == "baseline":  # same decisions as the current core, or the comparison is void
                cur = PathSelector(topo, agent, impl="compiled")
                res["baseline_same_decisions"] = all(
                    sel.select(r)._raw == cur.select(r)._raw for r in reqs)
        if "compiled" in res:
            res["speedup_compiled_vs_python"] = round(res["python"]["median_us"] / res["compiled"]["median_us"], 1)
        if "baseline" in res:
            res["speedup_compiled_vs_baseline"] = round(res["baseline"]["median_us"] / res["compiled"]["median_us"], 2)
        out["results"][name] = res
    return out


def _old_select(sel):
    from flexflow_sglang.selector.types import PathDecision

    def select(request):
        t = sel._tables.get((request.src, request.dst))
        if t is None:
            t = sel._table(request.src, request.dst)
        raw = t.core.select(request.data_bytes, request.ttft_sensitive or sel.config.ttft_sensitive)
        return PathDecision(request, t.paths, raw, sel)
    return select


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow bench selector")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-n", type=int, default=50000)
    ap.add_argument("--topologies", default="dgx8,cluster2x8")
    ap.add_argument("--baseline-core", default=None, metavar="SO",
                    help="another build of flexflow_sglang/_selector_core*.so (e.g. built at an older "
                         "commit) measured side by side as 'baseline'")
    args = ap.parse_args(argv)
    res = run(tuple(args.topologies.split(",")), n=args.n, progress=not args.json,
              baseline_core=args.baseline_core)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"selector core: {res['selector_backend']}")
    for name, r in res["results"].items():
        for impl in ("compiled", "baseline", "python"):
            if impl in r:
                m = r[impl]
                print(f"{name:<12} {impl:<9} median {m['median_us']:7.2f} us  p90 {m['p90_us']:7.2f} us  "
                      f"p99 {m['p99_us']:7.2f} us  (n={m['n']})")
        if "speedup_compiled_vs_python" in r:
            print(f"{name:<12} compiled is {r['speedup_compiled_vs_python']}x faster than the Python twin (median)")
        if "speedup_compiled_vs_baseline" in r:
            print(f"{name:<12} compiled is {r['speedup_compiled_vs_baseline']}x faster than the baseline core "
                  f"(median; same decisions: {r['baseline_same_decisions']})")
    return 0
