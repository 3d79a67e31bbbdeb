"""`flexflow bench two-server`: a shared deep tier under SGLang's own bench_serving, split across two
servers (issue 18): no shared tier vs our tier server vs a Mooncake Store, in one run.

For each kind of shared tier: server A (flexflow backend) runs one bench_serving pass of the
generated-shared-prefix dataset and writes its KV through to the shared tier; then server B, a
second server with the same flags and config started while A is still up (Mooncake keeps objects in
its clients' segments), runs the same pass (same seed, same prompts). B has never seen the prompts:
whatever it does not prefill came from the shared tier. Reported per kind and server: bench_serving's
TTFT and throughput, the share of prompt tokens cached (device + flexflow tiers, from the server's
"Prefill batch" lines) and the share loaded from flexflow's tiers (its /metrics).

    flexflow bench two-server --model smollm2 --kinds none,tier-server,mooncake --out runs/two-server
A kind that cannot run here (NIXL or Mooncake missing) is reported with the reason; JSON and a PNG
go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable, List, Optional, Tuple

from tqdm import tqdm

from .sglang_serving import WORKLOAD_POSITIVE, add_workload_args, check_positive, resolve_served_model

KINDS = ("none", "tier-server", "mooncake")


def _write_config(out: str, kind: str, host_tokens: int, shared: Optional[dict]) -> str:
    import yaml
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_tokens": host_tokens, "write_policy": "write_through"},
           # B's first request of a prefix waits for its deep pages (a hit, not a race with the fetch)
           "transfer": {"prefetch_policy": "wait_complete"}}
    if kind == "tier-server":
        cfg["remote_tier"] = {"enabled": True, "peers": [shared["listen"]], "timeout_ms": 5000}
    elif kind == "mooncake":
        cfg["hicache_storage"] = {"enabled": True, "backend": "mooncake", "timeout_ms": 5000, "retry_after_s": 2,
                                  "extra_config": shared["extra_config"]}
    path = os.path.join(out, f"flexflow-{kind}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _start_tier_server(out: str) -> Tuple[dict, Callable[[], None]]:
    ready = os.path.join(out, "tier-ready.json")
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(os.path.join(out, "tier-server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "flexflow_sglang.tools.cli.main", "tier-server", "--listen",
                             "127.0.0.1:0", "--capacity-gb", "2", "--ready-file", ready],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()

    def stop():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise RuntimeError("tier server did not start (see tier-server.log)")
        time.sleep(0.2)
    time.sleep(0.1)
    with open(ready) as f:
        return {"listen": json.load(f)["listen"]}, stop


def _start_shared(kind: str, out: str) -> Tuple[Optional[dict], Callable[[], None]]:
    if kind == "none":
        return None, lambda: None
    if kind == "tier-server":
        from flexflow_sglang.tiers.base import load_nixl
        why = load_nixl()[2]
        if why:
            raise RuntimeError(f"nixl is not importable: {why}")
        return _start_tier_server(out)
    from flexflow_sglang.tools.mooncake_master import MooncakeMaster, mooncake_missing
    why = mooncake_missing()
    if why:
        raise RuntimeError(why)
    master = MooncakeMaster(out).start()
    return {"extra_config": master.extra_config(segment_mb=512)}, master.kill


def run_kind(kind: str, model: str, args) -> dict:
    """Server A's pass, then server B's pass of the same prompts, both sharing `kind`."""
    from flexflow_sglang.tools.server_utils import SGLangServer, ServerStartError
    from .sglang_serving import measure_pass
    from .serve import _root_cause
    try:
        shared, stop_shared = _start_shared(kind, args.out)
    except Exception as e:  # noqa: BLE001 - reported, the other kinds still run
        return {"kind": kind, "ran": False, "error": f"{type(e).__name__}: {e}"[:300]}
    cfg = _write_config(args.out, kind, args.host_tokens, shared)
    servers: List[SGLangServer] = []
    res = {"kind": kind, "ran": True, "config": cfg, "servers": {}}
    try:
        for name in ("A", "B"):
            log = os.path.join(args.out, f"server-{kind}-{name}.log")
            srv = SGLangServer(model, log, max_total_tokens=args.max_total_tokens, timeout=args.start_timeout,
                               max_running_requests=max(4, args.max_concurrency), radix_cache_backend="flexflow",
                               flexflow_config=cfg, attention_backend=args.attention_backend, extra_args=["--enable-metrics", "--dtype", args.dtype])
            servers.append(srv)
            try:
                srv.start()
            except ServerStartError as e:
                return {**res, "ran": False, "error": _root_cause(log) or str(e).splitlines()[0][:300]}
            jsonl = os.path.join(args.out, f"bench_serving-{kind}-{name}.jsonl")
            res["servers"][name] = measure_pass(srv.url, log, model, jsonl, args, f"{kind}, server {name}", 1)
            time.sleep(args.settle_s)  # A's write-through jobs finish before B asks
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {**res, "ran": False, "error": str(e)[:600]}
    finally:
        for srv in reversed(servers):
            srv.stop()
        stop_shared()
    return res


def summarize(results: List[dict]) -> dict:
    """Server B's figures per kind, and B's ratios against the no-shared-tier run."""
    b = {r["kind"]: r["servers"]["B"] for r in results if r.get("ran") and "B" in r.get("servers", {})}
    out = {"server_b": {k: {m: v.get(m) for m in ("tier_hit_ratio", "cached_ratio", "mean_ttft_ms",
                                                  "median_ttft_ms", "output_throughput")} for k, v in b.items()}}
    base = b.get("none")
    if base:
        for k, v in b.items():
            if k != "none" and base.get("mean_ttft_ms") and v.get("mean_ttft_ms") is not None:
                out[f"{k}_over_none_mean_ttft"] = v["mean_ttft_ms"] / base["mean_ttft_ms"]
    return out


def plot(results: List[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in results if r.get("ran")]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(ran):
        for j, name in enumerate(("A", "B")):
            p = r["servers"].get(name)
            if p is None:
                continue
            x = i + 0.4 * j
            ax.bar(x, p["mean_ttft_ms"], 0.38, color=("#888888", "#1f77b4")[j], label=f"server {name}" if i == 0 else None)
            ax.text(x, p["mean_ttft_ms"], f"{p['tier_hit_ratio']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.2 for i in range(len(ran))])
    ax.set_xticklabels([r["kind"] for r in ran])
    ax.set_ylabel("mean TTFT ms (label: share of prompt tokens from flexflow's tiers)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow bench two-server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/two-server")
    ap.add_argument("--model", default="smollm2", help="'smollm2', a tiny_model preset, or a model dir")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma list of " + ", ".join(KINDS))
    add_workload_args(ap, prompts_per_group=2, system_prompt_len=768, question_len=32, output_len=4)
    ap.add_argument("--host-tokens", type=int, default=32768)
    ap.add_argument("--settle-s", type=float, default=3.0, help="pause after each pass (write-through settles)")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: unknown {bad}; valid: {', '.join(KINDS)}")
    check_positive(ap, args, WORKLOAD_POSITIVE + ("host_tokens",))
    from . import measured_commit
    commit = measured_commit()  # before the runs
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_served_model(args)
    args.passes = 1
    results = []
    for kind in tqdm(kinds, desc="bench two-server", unit="kind"):
        results.append(run_kind(kind, model, args))
    doc = {"command": "flexflow bench two-server " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit, "model": model_name, "results": results, "summary": summarize(results)}
    with open(os.path.join(args.out, "bench_two_server.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(results, os.path.join(args.out, "bench_two_server.png"), f"{model_name}, commit {doc['commit']}")
    print(f"model {model_name}, commit {doc['commit']}")
    print(f"{'kind':12s} {'server':6s} {'TTFT mean':>10s} {'p50':>8s} {'cached':>7s} {'tiers':>6s}")
    for r in results:
        if not r.get("ran"):
            print(f"{r['kind']:12s} not run: {r.get('error')}")
            continue
        for name, p in r["servers"].items():
            print(f"{r['kind']:12s} {name:6s} {p['mean_ttft_ms']:10.1f} {p['median_ttft_ms']:8.1f} "
                  f"{p['cached_ratio']:7.1%} {p['tier_hit_ratio']:6.1%}")
    print(json.dumps(doc["summary"], indent=1))
    return 0 if all(r.get("ran") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
