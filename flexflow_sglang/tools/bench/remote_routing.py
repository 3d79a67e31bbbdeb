"""`flexflow bench remote-routing`: remote-tier routing on the serving path (root: namespaces + tc)

Three namespaces joined pairwise by veth pairs capped with tbf (default 200 Mbit/s each):

  n0  a real SGLang server (--radix-cache-backend flexflow), one fresh server per mode
  n1  a relay-only `flexflow tier-server` (--node n1 --relay-peers n2=<n2 as seen from n1>)
  n2  the owner tier server (--node n2): the prompts' KV lives here

The server's FLEXFLOW_CONFIG names a topology file with the nodes n0, n1, n2 (n0 is the host-memory
node next to the device pool gpu0) and the two n0 links with their veth counters (monitor.source:
sysfs), so the connector's remote tier is routed from n0 (connector._route_remote_tiers).

Phase 1 (fill): a server runs every prompt twice (greedy; the second run's output is the reference)
and writes its KV through to the owner n2. Phase 2, per mode, in one run: a fresh server (empty device
pool and host tier, no storage tier: the prompts' KV is only in n2) serves the same requests one
at a time; `transfer.prefetch_policy: wait_complete` holds each request until its deep pages are
fetched, so the remote fetch is on the TTFT's critical path. Modes: {adaptive, direct} x {idle, udp}:
`adaptive` is the shipped selector (Direct, CrossNodeRelay via n1 or SplitPath); `direct` is
forced direct: its topology has no n1 (no relay path exists, so every decision is Direct) and no
relay peer. `udp` runs a paced UDP sender in n2 at --udp-share of the cap towards n0 (the data
direction of a get) for the whole mode. Reported per mode: median TTFT, the remote tier's fetch
seconds / bytes / routes (its /metrics counters), outputs vs the reference; ratios direct/adaptive
per load (targets: udp >= 3x, idle >= 1x). Writes remote_routing.json and remote_routing.png into --out.

Outputs are compared with the fill's second run of each prompt, a hit in SGLang's own prefix cache
(cached prefix + last tokens prefilled, as in every measured request), and across modes; the fill's
first run (full prefill) can differ from both in bf16 and is reported, not required. Fetch time is
the remote tier's `read_s` (transfer legs; the client's page checks come after it): the TTFT holds
the rest. Page size: the client checks one CRC per page on an engine worker, one zlib call per
page; each call waits for the GIL behind SGLang's busy scheduler thread, so with SGLang's default
1-token pages a 1.5k-token prompt costs 4-7 s of checks (measured, 35 MB at 300 Mbit/s: ~1 s of
transfer). --page-size 16 (the default here) cuts the calls 16x. Link rate: a relayed leg is driven
chunk by chunk by Python on an engine worker, which shares the GIL and 2 cores with SGLang's busy
scheduler: measured 115-175 Mbit/s in serving at 300 Mbit/s links (230 Mbit/s for the same tier
calls outside SGLang), so the default links are 200 Mbit/s, where the link, not the CPU, limits.

    sudo flexflow bench remote-routing [--out DIR] [--model smollm2] [--rate 200mbit] [--udp-share 0.85]
                                       [--prompts 12] [--prompt-tokens 1536] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

POLICIES = ("adaptive", "direct")
LOADS = ("idle", "udp")
DEFAULT_MODES = "direct-idle,adaptive-idle,direct-udp,adaptive-udp"
TIER_PORT = 7410
UDP_PORT = 7011
#: the remote tier's counters (flexflow_deeper_tiers_remote_*) and the connector's that a mode reports
REMOTE_KEYS = ("hits", "misses", "bytes_read", "read_s", "route_direct", "route_relay", "route_split",
               "relay_pages_read", "relay_fallbacks", "relay_failures", "relay_unsupported", "timeouts",
               "peer_down", "corrupt_dropped")
CONNECTOR_KEYS = ("pages_loaded_deep", "prefetch_pages", "prefetches", "prefetch_failures", "prefetch_capped",
                  "fetch_timeouts", "pages_written_through", "write_through_dropped", "cache_prefetch_holds",
                  "cache_prefetch_timeouts")


# ------------------------------------------------------------------------------------------ pure logic
def parse_modes(spec: str) -> List[str]:
    """'direct-idle,adaptive-udp' -> the list, validated (each POLICY-LOAD once)."""
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    if not modes:
        raise ValueError("no modes given")
    for m in modes:
        pol, _, load = m.partition("-")
        if pol not in POLICIES or load not in LOADS:
            raise ValueError(f"mode {m!r}: use POLICY-LOAD with POLICY in {POLICIES} and LOAD in {LOADS}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"repeated mode in {spec!r}")
    return modes


def topology_dict(link_gbytes_s: float, dev_n1: str, dev_n2: str, relay: bool) -> dict:
    """The server's topology: gpu0 (SGLang's KV pool) and n0 (its host memory) on host n0, the
    tier servers' nodes n2 (and n1) on hosts of their own, so that n1 is a CrossNodeRelay (another
    host's memory), never transit. Only n0's links carry counters: its sysfs sees them (n1-n2 gets
    the legs' feedback only). relay=False: no n1, so Direct is the only path (forced direct)."""
    nodes = [{"name": "gpu0", "kind": "gpu", "host": "n0"}, {"name": "n0", "kind": "cpu", "host": "n0"},
             {"name": "n2", "kind": "cpu", "host": "n2"}]
    eth = {"type": "ethernet", "capacity_gbps": link_gbytes_s, "latency_us": 70.0}
    links = [{"a": "gpu0", "b": "n0", "type": "pcie", "capacity_gbps": 10.0, "latency_us": 1.0},
             {"a": "n0", "b": "n2", **eth, "counter": {"sysfs_net": dev_n2}}]
    if relay:
        nodes.append({"name": "n1", "kind": "cpu", "host": "n1"})
        links += [{"a": "n0", "b": "n1", **eth, "counter": {"sysfs_net": dev_n1}}, {"a": "n1", "b": "n2", **eth}]
    return {"name": "remote-routing-lab" + ("" if relay else "-direct"), "nodes": nodes, "links": links}


def server_config(policy: str, *, topology_file: str, owner: str, relay: Optional[str], host_tokens: int,
                  timeout_ms: float, write_through: bool) -> dict:
    """FLEXFLOW_CONFIG of one server. `policy`: adaptive | direct (the fill uses direct)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    remote = {"enabled": True, "peers": [owner], "timeout_ms": float(timeout_ms), "retry_after_s": 30,
              "write_through": bool(write_through), "local_node": "n0"}
    if policy == "adaptive" and relay:
        remote["relay_peers"] = [relay]
    return {"topology": {"source": "file", "file": topology_file},
            "monitor": {"source": "sysfs", "sample_interval_ms": 100},
            # the host tier holds every prompt: nothing is spilled back to the remote tier meanwhile
            "host_tier": {"capacity_tokens": int(host_tokens), "pin_memory": "never"},
            "storage_tier": {"enabled": False},
            "remote_tier": remote,
            "selector": {"enable_split_path": policy == "adaptive"},
            # the request waits for its deep pages (the fetch is on the TTFT), however long they take;
            # a 1 GiB queue: no write-through copy or prefetch grant is cut short
            "transfer": {"prefetch_policy": "wait_complete", "load_timeout_ms": float(timeout_ms),
                         "queue_bytes": 1 << 30}}


def host_tokens_for(prompts: int, prompt_tokens: int, new_tokens: int) -> int:
    return max(4096, 2 * prompts * (prompt_tokens + new_tokens + 64))


def words_for(prompt_tokens: int) -> int:
    """Words of `prompt` that give about `prompt_tokens` SmolLM2 tokens (1.1 tokens per word)."""
    return max(8, round(prompt_tokens / 1.1))


def prompt_text(seed: int, words: int) -> str:
    from .stall import prompt
    return prompt(seed, words)


def metric_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """Per-mode figures from two /metrics snapshots: remote-tier counters (remote_*) and the connector's."""
    out = {}
    for k in REMOTE_KEYS:
        name = "flexflow_deeper_tiers_remote_" + k
        out["remote_" + k] = round(after.get(name, 0.0) - before.get(name, 0.0), 6)
    for k in CONNECTOR_KEYS:
        out[k] = round(after.get("flexflow_" + k, 0.0) - before.get("flexflow_" + k, 0.0), 6)
    return out


def mode_summary(requests: List[dict], delta: Dict[str, float], reference: List[str]) -> dict:
    """Per-mode figures: TTFT of the deep hits, the fetch, the routes, outputs vs the reference."""
    ttfts = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    equal = [i < len(reference) and r.get("text") == reference[i] for i, r in enumerate(requests)]
    fetch_s, nbytes = delta.get("remote_read_s", 0.0), delta.get("remote_bytes_read", 0.0)
    return {"n": len(requests), "ttft_median_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "fetch_s": round(fetch_s, 4), "fetch_bytes": int(nbytes),
            "fetch_gbit_s": round(8 * nbytes / fetch_s / 1e9, 3) if fetch_s > 0 else None,
            "routes": {k: int(delta.get("remote_route_" + k, 0)) for k in ("direct", "relay", "split")},
            "outputs_equal": bool(requests) and all(equal), "outputs_mismatched": [i for i, e in enumerate(equal) if not e]}


def ratios(modes: Dict[str, dict]) -> Dict[str, dict]:
    """Per load: forced direct / adaptive for the fetch seconds and the median TTFT (> 1: adaptive
    faster); bytes_equal: both fetched the same bytes."""
    out = {}
    for load in LOADS:
        d, a = modes.get(f"direct-{load}", {}).get("summary"), modes.get(f"adaptive-{load}", {}).get("summary")
        if not d or not a:
            continue
        r = {"bytes_equal": d["fetch_bytes"] == a["fetch_bytes"] and d["fetch_bytes"] > 0}
        for key, name in (("fetch_s", "fetch"), ("ttft_median_s", "ttft_median")):
            r[name] = round(d[key] / a[key], 3) if d.get(key) and a.get(key) else None
        out[load] = r
    return out


def targets(rat: Dict[str, dict], udp_target: float = 3.0, idle_target: float = 1.0) -> Dict[str, Optional[bool]]:
    """The claim: under UDP the fetch finishes >= 3x faster than forced direct; idle, no slower."""
    def met(load, tgt):
        f = rat.get(load, {}).get("fetch")
        return None if f is None else bool(f >= tgt and rat[load]["bytes_equal"])
    return {"udp_fetch_ge_3x": met("udp", udp_target), "idle_fetch_ge_1x": met("idle", idle_target)}


def outputs_check(fill: dict, modes: Dict[str, dict]) -> dict:
    """Greedy outputs: every mode vs the reference (the fill's prefix-cache-hit run, what
    mode_summary compared), the modes among themselves (the same bytes fetched by another route
    must give the same text), and how many prompts the fill's full prefill answered the same."""
    ref = [r.get("text") for r in fill.get("requests", [])]
    full = [r.get("text") for r in fill.get("full_prefill", [])]
    texts = {m: [r.get("text") for r in v.get("requests", [])] for m, v in modes.items() if v.get("requests")}
    same = len({tuple(t) for t in texts.values()}) == 1 if texts else None
    return {"modes_equal_reference": {m: t == ref for m, t in texts.items()},
            "modes_equal_each_other": same,
            "full_prefill_equal_reference": sum(a == b for a, b in zip(full, ref)) if full else None,
            "prompts": len(ref)}


def udp_bps(rate: str, share: float) -> float:
    from .contention.netlab import rate_bps
    return rate_bps(rate) * share


# ------------------------------------------------------------------------------------------ inside n0
def stream_request(url: str, text: str, max_new_tokens: int, timeout: float = 900.0) -> dict:
    """One greedy streamed request: TTFT (first chunk), end-to-end time, final text, cached tokens."""
    import requests
    body = {"text": text, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    t0, sent = time.perf_counter(), time.monotonic()  # CLOCK_MONOTONIC: comparable with the server's logs
    ttft, last = None, {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
    meta = last.get("meta_info", {})
    return {"ttft_s": round(ttft, 4) if ttft is not None else None, "e2e_s": round(time.perf_counter() - t0, 4),
            "text": last.get("text"), "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"), "sent_monotonic": round(sent, 3)}


def _rx_bytes(dev: str) -> int:
    try:
        with open(f"/sys/class/net/{dev}/statistics/rx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def _fresh_metrics(url: str, text: str) -> Dict[str, float]:
    """/metrics after an export: the backend exports at most once a second, on a scheduler tick, so
    wait past that and run a tiny request (its tick exports)."""
    from flexflow_sglang.tools.server_utils import flexflow_metrics, generate
    time.sleep(1.2)
    generate(url, text, 2)
    time.sleep(0.3)
    return flexflow_metrics(url)


def _aux_text(mode: str, what: str, fixed: bool = False) -> str:
    """Warm-up and metrics-flush texts. Their first word ('fill' / 'measure') is never the first
    word of another server's texts (prompts start with 'request'): a measuring server finds no page
    of them in the remote tier, so they add nothing to the fetch counters."""
    return f"{'fill' if mode == 'fill' else 'measure'} {what}" + ("" if fixed else f" {time.time_ns()}")


def _settle_write_through(url: str, timeout: float = 300.0) -> Dict[str, float]:
    """Fill phase: wait until every write-through job ended (engine idle, submitted == done +
    dropped + failed) and the written-through page count stops moving: every prompt's KV is at
    the owner before the fill server stops. The flush text is fixed: from its second run on it
    stores nothing new."""
    last, stable, end = None, 0, time.monotonic() + timeout
    m: Dict[str, float] = {}
    while time.monotonic() < end:
        m = _fresh_metrics(url, _aux_text("fill", "settle", fixed=True))
        wt = "flexflow_transfer_by_kind_write_through_"
        idle = not m.get("flexflow_transfer_queued") and not m.get("flexflow_transfer_running") and \
            m.get(wt + "submitted", 0) == sum(m.get(wt + k, 0) for k in ("done", "dropped", "failed"))
        cur = m.get("flexflow_pages_written_through")
        stable = stable + 1 if idle and cur == last else 0
        if stable >= 2:
            return m
        last = cur
    return m


def run_inside(args) -> int:
    """One server in n0 (fill or one mode): start it, run the requests one at a time, write a JSON."""
    from flexflow_sglang.tools.server_utils import SGLangServer, generate
    with open(args.prompts) as f:
        prompts = json.load(f)
    reference = []
    if args.reference:
        with open(args.reference) as f:
            reference = json.load(f)
    # UDP sink: the cross traffic lands on a bound socket never read (no ICMP port-unreachable back)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("0.0.0.0", UDP_PORT))
    server = SGLangServer(args.model, os.path.join(args.workdir, f"server-{args.mode}.log"),
                          radix_cache_backend="flexflow", flexflow_config=args.config,
                          max_total_tokens=args.max_total_tokens, max_running_requests=4, page_size=args.page_size,
                          extra_args=["--enable-metrics", "--dtype", args.dtype], timeout=args.start_timeout)
    res = {"mode": args.mode, "config": args.config}
    server.start()
    try:
        url = server.url
        generate(url, _aux_text(args.mode, "warm up"), 4)
        before = _fresh_metrics(url, _aux_text(args.mode, "flush before"))
        # n0's veths (NetLab.dev names for nodes [n0, n1, n2]): what the links carried meanwhile
        rx0, t0 = {d: _rx_bytes(d) for d in ("v01", "v02")}, time.monotonic()
        reqs, full = [], []
        for i, text in enumerate(prompts):
            if args.mode == "fill":
                # the reference is the prompt's second run, a hit in SGLang's own prefix cache: the
                # same compute shape as a measured request (cached prefix + the last tokens
                # prefilled); the first run (full prefill) is kept to show where they differ (bf16)
                full.append(stream_request(url, text, args.new_tokens))
            r = stream_request(url, text, args.new_tokens)
            reqs.append(r)
            print(f"[{args.mode}] request {i}: ttft {r['ttft_s']} s, cached {r['cached_tokens']}/{r['prompt_tokens']}",
                  flush=True)
        window = time.monotonic() - t0
        rx = {d: _rx_bytes(d) - rx0[d] for d in rx0}
        after = _settle_write_through(url) if args.mode == "fill" else \
            _fresh_metrics(url, _aux_text(args.mode, "flush after"))
        delta = metric_delta(before, after)
        # the backend's longest hooks on the scheduler thread (did any of them hold the requests?)
        res["sched_max_ms"] = {k[len("flexflow_cache_sched_"):-len("_max_ms")]: v for k, v in after.items()
                               if k.startswith("flexflow_cache_sched_") and k.endswith("_max_ms")}
        res.update(requests=reqs, delta=delta, window_s=round(window, 3), **({"full_prefill": full} if full else {}),
                   rx_mbit_s={d: round(8 * b / window / 1e6, 1) for d, b in rx.items()})
        if args.mode != "fill":
            res["summary"] = mode_summary(reqs, delta, reference)
    finally:
        server.stop()
        sink.close()
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0


# ------------------------------------------------------------------------------------------ driver
def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "fetch_s", "remote fetch time, all requests (s)"),
                           (axes[1], "ttft_median_s", "median TTFT (s)")):
        for j, pol in enumerate(POLICIES):
            xs, ys = [], []
            for i, load in enumerate(LOADS):
                s = result["modes"].get(f"{pol}-{load}", {}).get("summary") or {}
                if s.get(key) is not None:
                    xs.append(i + (j - 0.5) * 0.38)
                    ys.append(s[key])
            ax.bar(xs, ys, 0.38, label={"adaptive": "adaptive (relay / split)", "direct": "forced direct"}[pol])
        rat = [f"{load} {r:.2f}x" for load in LOADS
               if (r := result["ratios"].get(load, {}).get("fetch" if key == "fetch_s" else "ttft_median"))]
        ax.set_title("forced direct / adaptive: " + (", ".join(rat) or "n/a"), fontsize=9)
        ax.set_xticks(range(len(LOADS)), ["idle", f"UDP {int(100 * result['udp_share'])} % on n2->n0"])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['model_name']}, links {result['rate']}, {result['prompts']} prompts x "
                 f"~{result['prompt_tokens']} tokens, page size {result.get('page_size', 1)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_mode(lab, mode: str, args, env: dict, config: str, prompts: str, reference: Optional[str]) -> dict:
    result = os.path.join(args.out, f"mode-{mode}.json")
    if os.path.exists(result):
        os.unlink(result)
    cmd = [sys.executable, "-m", "flexflow_sglang.tools.bench.remote_routing", "--inside", "--mode", mode,
           "--config", config, "--prompts-file", prompts, "--result", result, "--workdir", args.out,
           "--model", args.model_dir, "--dtype", args.dtype, "--new-tokens", str(args.new_tokens),
           "--page-size", str(args.page_size),
           "--max-total-tokens", str(args.max_total_tokens), "--start-timeout", str(args.start_timeout)]
    if reference:
        cmd += ["--reference", reference]
    udp = None
    if mode.endswith("-udp"):  # n2 -> n0 at the share of the cap, for the whole mode (server start included)
        udp = lab.spawn("n2", [sys.executable, "-m", "flexflow_sglang.tools.bench.contention.traffic", "udp",
                               lab.addr("n0", "n2"), str(UDP_PORT), str(udp_bps(args.rate, args.udp_share))],
                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with open(os.path.join(args.out, f"runner-{mode}.log"), "wb") as log:
            rc = lab.spawn("n0", cmd, env={**env, "UCX_NET_DEVICES": f"{lab.dev('n0', 'n1')},{lab.dev('n0', 'n2')}"},
                           stdout=log, stderr=subprocess.STDOUT).wait()
    finally:
        if udp is not None:
            lab.kill(udp)
    if rc != 0 or not os.path.exists(result):
        return {"error": f"runner exited {rc}; see runner-{mode}.log and server-{mode}.log"}
    with open(result) as f:
        return json.load(f)


def run_driver(args) -> int:
    import yaml
    from tqdm import tqdm

    from flexflow_sglang.tiers.base import load_nixl
    from . import kv_bytes_per_token_of, measured_commit, resolve_model, save_result
    from .contention import netlab
    ok, why = netlab.available()
    if not ok:
        print(f"bench remote-routing: skipped: needs root, iproute2 and tc ({why})", file=sys.stderr)
        return 2
    nixl_why = load_nixl()[2]
    if nixl_why:
        print(f"bench remote-routing: skipped: the tier servers need NIXL ({nixl_why})", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    args.model_dir, model_name = resolve_model(args.model, args.out, "kv128k")
    args.dtype = args.dtype or ("float32" if args.model is None else "auto")
    kvpt = kv_bytes_per_token_of(args.model_dir, args.dtype) or 0
    modes = parse_modes(args.modes)
    texts = [prompt_text(9000 + i, words_for(args.prompt_tokens)) for i in range(args.prompts)]
    prompts = os.path.join(args.out, "prompts.json")
    with open(prompts, "w") as f:
        json.dump(texts, f)
    out = {"command": "flexflow bench remote-routing " + " ".join(args.argv), "commit": measured_commit(),
           "model": args.model_dir, "model_name": model_name, "dtype": args.dtype, "kv_bytes_per_token": kvpt,
           "rate": args.rate, "udp_share": args.udp_share, "prompts": args.prompts,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "page_size": args.page_size,
           "page_bytes": kvpt * args.page_size, "modes": {}}
    env = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_WARN_UNUSED_ENV_VARS": "n",
           "PYTHONUNBUFFERED": "1"}
    host_tokens = host_tokens_for(args.prompts, args.prompt_tokens, args.new_tokens)
    with netlab.NetLab(["n0", "n1", "n2"]) as lab:
        for a, b in (("n0", "n1"), ("n0", "n2"), ("n1", "n2")):
            lab.link(a, b, args.rate)
        tiers = [netlab.spawn_tier_server(lab, node, TIER_PORT, args.out, f"tier-{node}", extra=extra, env=env,
                                          capacity_gb=args.tier_capacity_gb,
                                          ucx_devs=",".join(lab.dev(node, o) for o in lab.nodes if o != node))
                 for node, extra in (("n2", ["--no-relay"]),
                                     ("n1", ["--relay-peers", f"n2={lab.addr('n2', 'n1')}:{TIER_PORT}"]))]
        if not netlab.wait_ready(lab, tiers):
            print("bench remote-routing: tier servers did not start; see tier-n*.log", file=sys.stderr)
            return 1
        owner, relay = f"{lab.addr('n2', 'n0')}:{TIER_PORT}", f"{lab.addr('n1', 'n0')}:{TIER_PORT}"
        gbs = netlab.rate_bps(args.rate) / 8e9
        configs = {}
        for pol in POLICIES:
            topo = os.path.join(args.out, f"topology-{pol}.yaml")
            with open(topo, "w") as f:
                yaml.safe_dump(topology_dict(gbs, lab.dev("n0", "n1"), lab.dev("n0", "n2"), pol == "adaptive"), f)
            for phase, wt in (("fill", True), ("measure", False)):
                path = configs[(pol, phase)] = os.path.join(args.out, f"flexflow-{pol}-{phase}.yaml")
                with open(path, "w") as f:
                    yaml.safe_dump(server_config(pol, topology_file=topo, owner=owner, relay=relay,
                                                 host_tokens=host_tokens, timeout_ms=args.timeout_ms,
                                                 write_through=wt), f)
        bar = tqdm(["fill"] + modes, desc="bench remote-routing", unit="mode")
        fill = None
        for mode in bar:
            bar.set_postfix_str(mode)
            if mode == "fill":  # direct, so that the owner's copy is written the same way for every mode
                fill = out["fill"] = _run_mode(lab, "fill", args, env, configs[("direct", "fill")], prompts, None)
                if "error" in fill:
                    print(f"bench remote-routing: fill failed: {fill['error']}", file=sys.stderr)
                    break
                reference = os.path.join(args.out, "reference.json")
                with open(reference, "w") as f:
                    json.dump([r["text"] for r in fill["requests"]], f)
                continue
            out["modes"][mode] = _run_mode(lab, mode, args, env, configs[(mode.split("-")[0], "measure")],
                                           prompts, reference)
    out["outputs"] = outputs_check(out.get("fill") or {}, out["modes"])
    out["ratios"] = ratios(out["modes"])
    out["targets"] = targets(out["ratios"])
    save_result(args.out, "remote_routing", out, plot, "remote-routing")
    print_table(out)
    return 0 if fill and "error" not in fill else 1


def print_table(out: dict) -> None:
    print(f"model {out['model_name']}, {out['kv_bytes_per_token']} B KV/token, page size {out.get('page_size')}, "
          f"links {out['rate']}, "
          f"UDP {out['udp_share']:.0%} n2->n0, commit {out['commit']}")
    print(f"{'mode':14} {'TTFT med s':>10} {'fetch s':>8} {'fetch MB':>9} {'Gbit/s':>7} {'routes d/r/s':>13} "
          f"{'v02 rx Mb/s':>11} {'outputs':>8}")
    for m, r in out["modes"].items():
        s = r.get("summary")
        if not s:
            print(f"{m:14} {r.get('error', 'no result')}")
            continue
        rt = s["routes"]
        print(f"{m:14} {s['ttft_median_s'] or float('nan'):10.3f} {s['fetch_s']:8.3f} {s['fetch_bytes'] / 1e6:9.1f} "
              f"{s['fetch_gbit_s'] or float('nan'):7.3f} {rt['direct']:>4}/{rt['relay']}/{rt['split']:<4} "
              f"{r['rx_mbit_s'].get('v02', 0):11.1f} {'equal' if s['outputs_equal'] else 'DIFFER':>8}")
    for load, r in out["ratios"].items():
        print(f"direct/adaptive, {load}: fetch {r['fetch']}x, median TTFT {r['ttft_median']}x, "
              f"bytes equal {r['bytes_equal']}")
    print("outputs:", out.get("outputs"))
    print("targets:", out["targets"])


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="flexflow bench remote-routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench-remote-routing")
    ap.add_argument("--model", default="smollm2", help="'smollm2' (the real SmolLM2-135M-Instruct, default), a "
                                                      "checkpoint dir, or 'kv128k' for the 128 KB/token preset")
    ap.add_argument("--dtype", default=None, help="SGLang --dtype (default: float32 for kv128k, else auto)")
    ap.add_argument("--rate", default="200mbit",
                    help="tbf cap of every link (n0-n1, n0-n2, n1-n2). Default 200mbit: on a 2-core machine the "
                         "serving process's relay legs are CPU-bound near 120-170 Mbit/s (see the docstring)")
    ap.add_argument("--udp-share", type=float, default=0.85, help="UDP on n2->n0 as a share of the cap (udp modes)")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"POLICY-LOAD list, policies {POLICIES}, loads {LOADS}")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per request (outputs compared)")
    ap.add_argument("--page-size", type=int, default=16,
                    help="SGLang --page-size (tokens per KV page, one remote-tier key each). Default 16: with "
                         "1-token pages the client-side checks of a fetch cost more than the transfer (see the docstring)")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--timeout-ms", type=float, default=120000.0,
                    help="remote_tier.timeout_ms and transfer.load_timeout_ms: a slow fetch is waited for")
    ap.add_argument("--tier-capacity-gb", type=float, default=2.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    # inside n0 (spawned by the driver)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", dest="prompts_file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = argv
    errors = validate(args)
    if errors:
        ap.error("; ".join(errors))
    if args.inside:
        args.prompts = args.prompts_file
        return run_inside(args)
    if args.model == "kv128k":
        args.model = None
    return run_driver(args)


def validate(args) -> List[str]:
    """Argument errors (empty: fine)."""
    errs = []
    for k in ("prompt_tokens", "new_tokens", "max_total_tokens", "timeout_ms", "tier_capacity_gb", "page_size"):
        if getattr(args, k) <= 0:
            errs.append(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if not args.inside and args.prompts <= 0:
        errs.append(f"--prompts must be positive, got {args.prompts}")
    if not 0.0 < args.udp_share < 1.0:
        errs.append(f"--udp-share must be in (0, 1), got {args.udp_share}")
    try:
        parse_modes(args.modes)
    except ValueError as e:
        errs.append(f"--modes: {e}")
    try:
        from .contention.netlab import rate_bps
        rate_bps(args.rate)
    except ValueError as e:
        errs.append(f"--rate: {e}")
    if args.prompt_tokens + args.new_tokens + 64 > args.max_total_tokens:
        errs.append(f"--max-total-tokens {args.max_total_tokens} cannot hold one request "
                    f"({args.prompt_tokens} + {args.new_tokens} tokens)")
    return errs


if __name__ == "__main__":
    sys.exit(main())
