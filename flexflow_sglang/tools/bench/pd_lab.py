"""`flexflow bench pd`: SGLang PD KV transfer time per request, routed vs not, on real capped links.

Needs root + iproute2 (network namespaces); see docs/pd.md. The lab:

    c (client) --mgmt-- p (prefill)      p <== rail0 (tbf --rate) ==> d    KV may use only the rails
    c (client) --mgmt-- d (decode)       p <== rail1 (tbf --rate) ==> d    (UCX_TLS=tcp, UCX_NET_DEVICES)

The management links (uncapped) carry HTTP, the bootstrap exchange and ZMQ control; p and d reach each
other's management address through c. Background traffic (UDP at --loads x rate, or greedy TCP flows)
runs from p to d's rail0 address; a sink in d measures what it delivered while each policy ran.

Policies (the prefill server is restarted per policy; the decode server stays up):
  primary     SGLang's own NIXL agent, UCX over both rail devices (UCX multi-rail)
  first_rail  every chunk on rail0: a deployment pinned to one NIC
  adaptive    FlexFlow's selector per KV chunk (sysfs counters of the rails + the chunks' feedback)

Per request the client records end-to-end latency; per KV chunk the prefill side's FlexFlow manager
writes the transfer time (first post -> last completion) to FLEXFLOW_PD_TRACE.
The driver runs inside namespace c (it re-executes itself there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List

from . import nearest_rank
from .contention.netlab import rate_bps

POLICIES = ("primary", "first_rail", "adaptive")
UDP_PORT, TCP_PORT = 7100, 7101
MODEL_ARGS = dict(layers=8, hidden=512, intermediate=512, heads=8, kv_heads=8)  # 16 KiB of KV per token
WORDS = ("the cache radix tree prefix token server model request page decode prefill transfer rail "
         "link route path node host memory tier load store hit miss").split()


def make_prompts(n: int, words: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" {i}" for i in range(n)]


# ----------------------------------------------------------------------------- outer (root namespace)
def run_outer(args) -> int:
    from .contention.netlab import NetLab, available
    ok, why = available()
    if not ok:
        print(f"flexflow bench pd: needs network namespaces: {why}", file=sys.stderr)
        return 2
    from flexflow_sglang.tools.cpu_support.tiny_model import make_tiny_model
    model = make_tiny_model(args.model_dir or os.path.join(tempfile.gettempdir(), "flexflow-pd-model"),
                            **MODEL_ARGS)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    with NetLab(["c", "p", "d"], tag="pd") as lab:
        lab.link("c", "p", None)
        lab.link("c", "d", None)
        lab.link("p", "d", args.rate)
        lane = lab.add_lane("p", "d", args.rate)
        lab.route_via("p", "d", via="c")
        spec = {
            "ns": {n: lab.ns(n) for n in ("c", "p", "d")},
            "prefill_host": lab.addr("p", "c"), "decode_host": lab.addr("d", "c"),
            "rails_p": [lab.lane_dev("p", "d", 0), lab.lane_dev("p", "d", lane)],
            "rails_d": [lab.lane_dev("d", "p", 0), lab.lane_dev("d", "p", lane)],
            "d_rail0_addr": lab.lane_addr("d", "p", 0), "model": model,
        }
        spec_path = os.path.join(out_dir, "lab.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        argv = [sys.executable, "-m", "flexflow_sglang.tools.bench.pd_lab", "--inner", spec_path, *args.passthrough]
        p = lab.spawn("c", argv)
        try:
            return p.wait()
        except KeyboardInterrupt:
            lab.kill(p)
            return 130


# ----------------------------------------------------------------------------- inner (namespace c)
def _ns_server_class():
    from flexflow_sglang.tools.server_utils import SGLangServer

    class NamespacedServer(SGLangServer):
        """SGLangServer whose launcher runs in another namespace (`ip netns exec NS python ...`)."""

        def __init__(self, ns: str, *a, **kw):
            self.ns = ns
            super().__init__(*a, **kw)

        def build_command(self) -> list:
            return ["ip", "netns", "exec", self.ns] + super().build_command()

    return NamespacedServer


def _write_cfg(path: str, policy: str, rails: List[str], link_bps: float) -> str:
    import yaml
    cfg = {"pd": {"enabled": True, "policy": policy, "rails": list(rails), "rail_gbps": link_bps / 8e9},
           "topology": {"source": "mock", "mock": "single"}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


#: environment of both servers' UCX/NIXL (each adds its rail devices and host address)
UCX_ENV = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_WARN_UNUSED_ENV_VARS": "n"}


@dataclass
class _InnerLab:
    """What the steps of one inner run share: the lab spec, the servers' class, the helpers
    `run_inner` imported, the decode server and sink channel once up, and the prompts not sent yet."""
    args: Any
    spec: dict
    out_dir: str
    link_bps: float
    server_cls: Any
    pd_generate: Callable
    load_trace: Callable
    find_free_port: Callable
    decode: Any = None
    sink_ch: Any = None
    prompts: Iterator[str] = field(default_factory=lambda: iter(()))


def run_inner(args, spec: dict) -> int:
    """Inside namespace c: the decode server and the traffic sink stay up; per policy a prefill server
    runs every load cell (_run_policy); then pd.json, the table and the figure (_write_report)."""
    from tqdm import tqdm

    from flexflow_sglang.pd.router import pd_generate
    from flexflow_sglang.pd.stats import load_trace
    from flexflow_sglang.tools.server_utils import find_free_port
    from .contention.channel import ParentChannel

    lab = _InnerLab(args, spec, os.path.abspath(args.out), rate_bps(args.rate), _ns_server_class(),
                    pd_generate, load_trace, find_free_port)
    lab.decode = _decode_server(lab)
    sink, lab.sink_ch = _start_sink(spec["ns"]["d"], ParentChannel)
    loads = [x.strip() for x in args.loads.split(",") if x.strip()]
    lab.prompts = iter(make_prompts((args.requests * len(loads) + args.warmup) * len(args.policies),
                                    args.words, args.seed))
    results: Dict[str, dict] = {}
    lab.decode.start()
    try:
        lab.decode.wait_ready()
        bar = tqdm(total=len(args.policies) * len(loads) * args.requests, desc="pd requests", unit="req",
                   file=sys.stderr)
        for policy in args.policies:
            _run_policy(lab, policy, loads, bar, results)
        bar.close()
    finally:
        lab.decode.stop()
        _stop_sink(sink, lab.sink_ch)
    _write_report(args, lab.out_dir, loads, results)
    return 0


def _decode_server(lab: _InnerLab):
    """The decode server (not started), in namespace d, its KV on both rail devices."""
    spec, args = lab.spec, lab.args
    cfg = _write_cfg(os.path.join(lab.out_dir, "decode.yaml"), "primary", [], lab.link_bps)
    # ports are picked here (namespace c): the servers' namespaces are fresh, nothing else listens there
    return lab.server_cls(spec["ns"]["d"], spec["model"], os.path.join(lab.out_dir, "decode.log"),
                          host=spec["decode_host"], port=lab.find_free_port(),
                          flexflow_config=cfg, max_total_tokens=args.max_total_tokens, timeout=600,
                          env=dict(UCX_ENV, UCX_NET_DEVICES=",".join(spec["rails_d"]),
                                   SGLANG_HOST_IP=spec["decode_host"]),
                          extra_args=["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl",
                                      "--disaggregation-decode-host-receive-threshold", "1",
                                      "--disaggregation-decode-retraction-backup", "cpu_tensor"])


def _prefill_server(lab: _InnerLab, policy: str, trace: str, bport: int):
    """The prefill server of `policy` (not started), in namespace p, writing its KV chunks to `trace`."""
    spec, args = lab.spec, lab.args
    cfg = _write_cfg(os.path.join(lab.out_dir, f"prefill-{policy}.yaml"), policy, spec["rails_p"], lab.link_bps)
    return lab.server_cls(spec["ns"]["p"], spec["model"], os.path.join(lab.out_dir, f"prefill-{policy}.log"),
                          host=spec["prefill_host"], port=lab.find_free_port(), flexflow_config=cfg,
                          max_total_tokens=args.max_total_tokens,
                          timeout=600, env=dict(UCX_ENV, UCX_NET_DEVICES=",".join(spec["rails_p"]),
                                                SGLANG_HOST_IP=spec["prefill_host"], FLEXFLOW_PD_TRACE=trace),
                          extra_args=["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                                      "nixl", "--disaggregation-bootstrap-port", str(bport)])


def _start_sink(ns: str, channel_cls):
    """The background traffic's sink in namespace `ns`, once it said it is ready: (process, channel)."""
    sink = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m",
                             "flexflow_sglang.tools.bench.contention.traffic", "sink", str(UDP_PORT), str(TCP_PORT)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ch = channel_cls(sink, "sink")
    ch.recv(timeout=60)
    return sink, ch


def _stop_sink(sink, ch) -> None:
    try:
        ch.send(op="quit")
    except Exception:
        pass
    sink.kill()


def _run_policy(lab: _InnerLab, policy: str, loads: List[str], bar, results: Dict[str, dict]) -> None:
    """One prefill server for `policy`: warm-up requests, then one cell per load into `results`."""
    args, host = lab.args, lab.spec["prefill_host"]
    trace = os.path.join(lab.out_dir, f"trace-{policy}.jsonl")
    if os.path.exists(trace):
        os.unlink(trace)
    bport = lab.find_free_port()
    prefill = _prefill_server(lab, policy, trace, bport)
    prefill.start()
    try:
        prefill.wait_ready()
        body = {"sampling_params": {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}}
        for _ in range(args.warmup):  # connection set-up, first-use allocations
            lab.pd_generate(prefill.url, lab.decode.url, host, bport, dict(body, text=next(lab.prompts)))
        n_warm = len(lab.load_trace(trace)) if os.path.exists(trace) else 0
        for load in loads:
            results[f"{policy}/{load}"], n = _measure_cell(lab, prefill, bport, body, trace, n_warm, policy,
                                                           load, bar)
            n_warm += n
    finally:
        prefill.stop()


def _measure_cell(lab: _InnerLab, prefill, bport: int, body: dict, trace: str, n_seen: int, policy: str,
                  load: str, bar):
    """`args.requests` requests under background `load`: (the cell's summary, its KV chunks in the
    trace after the first `n_seen`)."""
    args, host = lab.args, lab.spec["prefill_host"]
    bg = _start_background(lab.spec["ns"]["p"], lab.spec["d_rail0_addr"], load, lab.link_bps)
    time.sleep(args.settle_s)
    t_start = time.monotonic()
    lat, outs = [], []
    for _ in range(args.requests):
        t0 = time.perf_counter()
        r = lab.pd_generate(prefill.url, lab.decode.url, host, bport, dict(body, text=next(lab.prompts)))
        lat.append(time.perf_counter() - t0)
        outs.append(r.get("meta_info", {}).get("prompt_tokens"))
        bar.update(1)
    t_end = time.monotonic()
    _stop(bg)
    time.sleep(0.3)
    recs = lab.load_trace(trace)[n_seen:]
    ser = lab.sink_ch.call(op="series", since=t_start - 0.01, trim=True)["series"]
    return _summarise(policy, load, lat, recs, outs, ser, t_start, t_end, lab.link_bps), len(recs)


def _write_report(args, out_dir: str, loads: List[str], results: Dict[str, dict]) -> None:
    """pd.json (cells, ratios, the command), the table on stdout, pd.png unless --no-plot."""
    doc = {"rate": args.rate, "requests": args.requests, "words": args.words, "loads": loads,
           "policies": list(args.policies), "model": MODEL_ARGS, "results": results,
           "ratios": _ratios(results, args.policies, loads),
           "command": "flexflow bench pd " + " ".join(args.passthrough)}
    with open(os.path.join(out_dir, "pd.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(format_table(doc))
    if args.plot:
        _plot(doc, os.path.join(out_dir, "pd.png"))


def _start_background(ns: str, dst: str, load: str, link_bps: float):
    m = "flexflow_sglang.tools.bench.contention.traffic"
    if load in ("0", "idle", "none"):
        return None
    if load.startswith("tcp"):
        flows = int(load[3:] or 1)
        argv = [sys.executable, "-m", m, "tcp", dst, str(TCP_PORT), str(flows)]
    else:
        argv = [sys.executable, "-m", m, "udp", dst, str(UDP_PORT), str(float(load) / 100.0 * link_bps)]
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(p) -> None:
    if p is None:
        return
    p.terminate()
    try:
        p.wait(3)
    except subprocess.TimeoutExpired:
        p.kill()


def _summarise(policy, load, lat, recs, prompt_tokens, series, t0, t1, link_bps) -> dict:
    secs = [r["seconds"] for r in recs if r["ok"]]
    per_req_bytes = [r["bytes"] for r in recs if r["ok"]]
    paths: Dict[str, int] = {}
    rail_bytes: Dict[str, int] = {}
    for r in recs:
        paths[r["path"]] = paths.get(r["path"], 0) + 1
        for leg in r["legs"]:
            k = "sglang" if leg["rail"] < 0 else f"rail{leg['rail']}"
            rail_bytes[k] = rail_bytes.get(k, 0) + leg["bytes"]
    pts = [p for p in series if t0 <= p[0] <= t1]
    bg_mbps = None
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        dt = pts[-1][0] - pts[0][0]
        bg_mbps = ((pts[-1][1] - pts[0][1]) + (pts[-1][2] - pts[0][2])) * 8 / dt / 1e6
    return {"policy": policy, "load": load, "requests": len(lat), "chunks": len(recs),
            "failed_chunks": sum(1 for r in recs if not r["ok"]),
            "e2e_p50_s": nearest_rank(lat, 0.5), "e2e_p99_s": nearest_rank(lat, 0.99),
            "xfer_p50_s": nearest_rank(secs, 0.5), "xfer_p99_s": nearest_rank(secs, 0.99),
            "xfer_mean_s": statistics.fmean(secs) if secs else None,
            "kv_bytes_mean": statistics.fmean(per_req_bytes) if per_req_bytes else None,
            "prompt_tokens_mean": statistics.fmean([t for t in prompt_tokens if t]) if any(prompt_tokens) else None,
            "paths": paths, "rail_bytes": rail_bytes, "background_mbps": bg_mbps,
            "background_offered_mbps": (None if load in ("0", "idle") or load.startswith("tcp")
                                        else float(load) / 100 * link_bps / 1e6)}


def _ratios(results: dict, policies, loads) -> dict:
    out = {}
    for load in loads:
        a = results.get(f"adaptive/{load}")
        if not a or not a["xfer_p50_s"]:
            continue
        for base in policies:
            b = results.get(f"{base}/{load}")
            if base == "adaptive" or not b or not b["xfer_p50_s"]:
                continue
            out[f"{base}_over_adaptive/{load}"] = {
                "xfer_p50": b["xfer_p50_s"] / a["xfer_p50_s"],
                "xfer_p99": (b["xfer_p99_s"] / a["xfer_p99_s"]) if a["xfer_p99_s"] else None,
                "e2e_p50": b["e2e_p50_s"] / a["e2e_p50_s"]}
    return out


def format_table(doc: dict) -> str:
    lines = [f"PD KV transfer per request, rails {doc['rate']} x2, {doc['requests']} requests per cell",
             f"{'policy':<11} {'load':>5} {'xfer p50':>9} {'xfer p99':>9} {'e2e p50':>8} {'KV MiB':>7} "
             f"{'bg Mbit/s':>9}  paths / bytes per rail"]
    for r in doc["results"].values():
        f = (lambda v, s=1000.0: f"{v * s:8.1f}" if v is not None else "       -")
        bytes_ = ", ".join(f"{k} {v / 2**20:.0f}M" for k, v in sorted(r["rail_bytes"].items()))
        bg = f"{r['background_mbps']:9.1f}" if r["background_mbps"] is not None else "        -"
        kv = f"{r['kv_bytes_mean'] / 2**20:7.1f}" if r["kv_bytes_mean"] else "      -"
        lines.append(f"{r['policy']:<11} {r['load']:>5} {f(r['xfer_p50_s'])}ms {f(r['xfer_p99_s'])}ms "
                     f"{f(r['e2e_p50_s'])}ms {kv} {bg}  {r['paths']} / {bytes_}")
    for k, v in doc["ratios"].items():
        lines.append(f"{k}: transfer p50 {v['xfer_p50']:.2f}x, p99 "
                     f"{(v['xfer_p99'] or float('nan')):.2f}x, end-to-end p50 {v['e2e_p50']:.2f}x")
    return "\n".join(lines)


def _plot(doc: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    loads = doc["loads"]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(doc["policies"]))
    for i, pol in enumerate(doc["policies"]):
        ys = [(doc["results"].get(f"{pol}/{l}") or {}).get("xfer_p50_s") or 0 for l in loads]
        ax.bar([j + i * w for j in range(len(loads))], [y * 1000 for y in ys], w, label=pol)
    ax.set_xticks([j + w * (len(doc["policies"]) - 1) / 2 for j in range(len(loads))])
    ax.set_xticklabels([f"{l}% UDP on rail0" if l[0].isdigit() and l != "0" else ("idle" if l == "0" else l)
                        for l in loads])
    ax.set_ylabel("PD KV transfer p50 (ms)")
    ax.set_title(f"SGLang PD (NIXL) KV transfer, 2 rails x {doc['rate']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flexflow bench pd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tbf cap of each rail (default 1gbit)")
    ap.add_argument("--loads", default="0,85", help="background per cell: UDP percent of --rate, or tcpN "
                                                   "(N greedy TCP flows); default 0,85")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"subset of {','.join(POLICIES)}")
    ap.add_argument("--requests", type=int, default=8, help="requests per (policy, load) cell")
    ap.add_argument("--words", type=int, default=1000, help="prompt length in words (~tokens)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=8192)
    ap.add_argument("--settle-s", type=float, default=1.0, help="background runs this long before requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default="runs/pd")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        print(f"flexflow bench pd: --policies {bad}: choose from {list(POLICIES)}", file=sys.stderr)
        return 2
    rate_bps(args.rate)
    if args.inner:
        args.passthrough = [a for i, a in enumerate(argv) if a != "--inner" and (i == 0 or argv[i - 1] != "--inner")]
        with open(args.inner) as f:
            return run_inner(args, json.load(f))
    args.passthrough = argv
    return run_outer(args)


if __name__ == "__main__":
    sys.exit(main())
