"""`flexflow bench stall`: do deep-tier transfers stall decoding? (root: network namespaces + tc)

Two namespaces joined by one veth pair capped with tbf (default 200 Mbit/s): `srv` runs a real
SGLang server with --radix-cache-backend flexflow on the realistic-KV model (cpu_support
tiny_model preset kv128k: 128 KB of KV per token), `tier` runs a `flexflow tier-server`. Per mode,
in one run, a fresh server serves the same workload:

  * N decoding streams (short prompts, D new tokens each, streamed): their inter-token latencies
    (ITL) are what is measured;
  * W background clients at the same time send long prompts (P tokens, one new token; closed loop,
    or --bg-rate requests per second each, so that every mode does the same work): every one
    is stored (write-through to the storage tier and over the capped link to the remote tier), and
    after the first pass they revisit the earliest prompts, which the small device pool and host
    tier have pushed down: those load back from the storage / remote tier.

Modes: `off` (no deep tiers; its host tier holds every background prompt, so revisits are host
hits there too and all modes do the same compute: only the deep-tier traffic differs; set
--off-host-tokens to change it), `async` (storage + remote tiers, the transfer engine
moves their bytes on its workers, prefetch on arrival), `sync` (the same tiers with
transfer.mode: sync: every deep-tier byte on the scheduler thread, the behaviour before issue 13).
Reported per mode: ITL p50 / p99, and p99 relative to `off` (target: async <= 1.10x). Writes
stall.json and stall.png into --out.

    sudo flexflow bench stall [--out DIR] [--rate 200mbit] [--streams 4] [--decode-tokens 64]
                              [--writers 2] [--prompt-tokens 256] [--modes off,async,sync]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

from . import measured_commit, nearest_rank, save_result

MODES = ("off", "async", "sync")
TIER_PORT = 7400


# ------------------------------------------------------------------------------------------ pure logic
def mode_config(mode: str, *, host_tokens: int, storage_path: str, peer: Optional[str], worker_nice: int = 0) -> dict:
    """The FLEXFLOW_CONFIG of one mode (a dict to dump as YAML/JSON)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_tokens": int(host_tokens), "pin_memory": "never"}}
    if mode != "off":
        cfg["storage_tier"] = {"enabled": True, "path": storage_path, "capacity_gb": 4.0, "write_through": True}
        if peer:
            cfg["remote_tier"] = {"enabled": True, "peers": [peer], "timeout_ms": 30000, "write_through": True}
        cfg["transfer"] = {"mode": "sync" if mode == "sync" else "async", "worker_nice": int(worker_nice)}
    return cfg


def off_host_tokens(writers: int, fresh_prompts: int, prompt_tokens: int) -> int:
    """Host tier of the `off` mode: room for every background prompt (twice, for the LRU's slack)."""
    return max(1024, 2 * writers * fresh_prompts * (prompt_tokens + 16))


def prompt(seed: int, words: int) -> str:
    from flexflow_sglang.tools.cpu_support.tiny_model import WORDS
    rng = random.Random(seed)
    return f"request {seed} " + " ".join(rng.choice(WORDS) for _ in range(words))


def next_slot(t_next: float, rate: float, now: float) -> tuple:
    """Open-loop pacing: (the next request's start time, seconds to wait for it). A writer that
    fell behind its schedule starts at once and keeps the schedule (no catch-up burst beyond it)."""
    t = t_next + 1.0 / rate
    if t < now:  # late: restart the schedule from now rather than firing back-to-back to catch up
        return now, 0.0
    return t, t - now


def itl_stats(itls: List[float]) -> dict:
    return {"n": len(itls), "p50_ms": round(1e3 * nearest_rank(itls, 0.50, empty=float("nan")), 2),
            "p99_ms": round(1e3 * nearest_rank(itls, 0.99, empty=float("nan")), 2),
            "max_ms": round(1e3 * max(itls), 2) if itls else float("nan")}


def ratios(modes: Dict[str, dict]) -> Dict[str, dict]:
    base = modes.get("off", {}).get("itl")
    out = {}
    for m, r in modes.items():
        if base and r.get("itl") and base["p99_ms"] > 0:
            out[m] = {"p50_vs_off": round(r["itl"]["p50_ms"] / base["p50_ms"], 3),
                      "p99_vs_off": round(r["itl"]["p99_ms"] / base["p99_ms"], 3)}
    return out


# ------------------------------------------------------------------------------------------ inside srv
def _stream_itls(url: str, text: str, max_new_tokens: int) -> List[float]:
    import requests
    body = {"text": text, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    stamps = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the 2nd token on: decode steps only


def run_inside(args) -> int:
    """One mode, inside the srv namespace: start the server, run the workload, write a JSON."""
    import yaml

    from flexflow_sglang.tools.server_utils import SGLangServer, flexflow_metrics, generate
    work = tempfile.mkdtemp(prefix=f"ff-stall-{args.mode}-", dir=args.workdir)
    cfg_path = os.path.join(work, "flexflow.yaml")
    host_tokens = args.host_tokens
    if args.mode == "off":  # the same host hits as the deep tiers give the other modes (equal compute)
        host_tokens = args.off_host_tokens or off_host_tokens(args.writers, args.fresh_prompts, args.prompt_tokens)
    with open(cfg_path, "w") as f:
        yaml.safe_dump(mode_config(args.mode, host_tokens=host_tokens,
                                   storage_path=os.path.join(work, "kv"), peer=args.peer,
                                   worker_nice=args.worker_nice), f)
    server = SGLangServer(args.model, os.path.join(work, "server.log"), radix_cache_backend="flexflow",
                          flexflow_config=cfg_path, max_total_tokens=args.max_total_tokens,
                          max_running_requests=args.streams + args.writers + 2,
                          extra_args=["--enable-metrics", "--dtype", args.dtype or "auto"],
                          timeout=args.start_timeout,
                          # the forward's torch threads (every mode alike); the other cores are left
                          # to the data plane, as on a GPU server whose forward runs on the GPU
                          env={"OMP_NUM_THREADS": str(args.forward_threads)} if args.forward_threads else None)
    res = {"mode": args.mode, "log": server.log_path}
    server.start()
    try:
        url = server.url
        generate(url, "warm up the server", 4)
        stop = threading.Event()
        bg = {"requests": 0, "revisits": 0, "errors": 0, "late": 0}

        def writer(w: int) -> None:
            k = 0
            t_next = time.monotonic()
            while not stop.is_set():
                if args.bg_rate > 0:  # open loop: the same background work per second in every mode
                    t_next, wait = next_slot(t_next, args.bg_rate, time.monotonic())
                    if wait > 0:
                        stop.wait(wait)
                    else:
                        bg["late"] += 1  # the previous request outlasted its slot: this one starts late
                    if stop.is_set():
                        break
                seed = 1000 * (w + 1) + k
                # first pass: new prompts (stored, written through); then revisit the oldest ones,
                # long evicted from the device pool and the host tier: load-backs from deep tiers
                if k >= args.fresh_prompts:
                    seed = 1000 * (w + 1) + (k - args.fresh_prompts) % args.fresh_prompts
                    bg["revisits"] += 1
                try:
                    generate(url, prompt(seed, args.prompt_tokens), 1, timeout=900)
                    bg["requests"] += 1
                except Exception:  # noqa: BLE001 - counted; the decoders' ITL is the result
                    bg["errors"] += 1
                k += 1

        writers = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(args.writers)]
        for t in writers:
            t.start()
        time.sleep(args.lead_s)  # the background has KV in flight when decoding starts
        itls: List[List[float]] = [[] for _ in range(args.streams)]

        def decoder(i: int) -> None:
            for rnd in range(args.rounds):
                itls[i].extend(_stream_itls(url, prompt(50000 + 100 * i + rnd, 8), args.decode_tokens))

        t0 = time.perf_counter()
        decs = [threading.Thread(target=decoder, args=(i,)) for i in range(args.streams)]
        for t in decs:
            t.start()
        for t in decs:
            t.join()
        res["decode_wall_s"] = round(time.perf_counter() - t0, 2)
        stop.set()
        for t in writers:
            t.join(timeout=600)
        flat = [x for xs in itls for x in xs]
        res.update(itl=itl_stats(flat), itls_ms=[round(1e3 * x, 3) for x in flat], background=bg)
        try:
            m = flexflow_metrics(url)
            res["metrics"] = {k: v for k, v in m.items() if any(s in k for s in (
                "written_through", "pages_spilled", "pages_loaded", "dropped", "prefetch", "fetch_timeouts",
                "stores", "store_pages", "copied", "transfer_", "cache_sched_"))}
            # the backend's own time on the scheduler thread (backend/sched_clock.py): which hook, if
            # any, held every decoding request
            res["sched_hooks"] = {k[len("flexflow_cache_sched_"):]: v for k, v in m.items()
                                  if k.startswith("flexflow_cache_sched_")}
        except Exception as e:  # noqa: BLE001
            res["metrics_error"] = repr(e)
    finally:
        server.stop()
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0


# ------------------------------------------------------------------------------------------ driver
def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = [m for m in MODES if m in result["modes"] and result["modes"][m].get("itl")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], [result["modes"][m]["itl"]["p50_ms"] for m in modes], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [result["modes"][m]["itl"]["p99_ms"] for m in modes], 0.4, label="p99")
    ax.set_xticks(list(x), [{"off": "deep tiers off", "async": "async (engine)", "sync": "sync (ablation)"}[m]
                            for m in modes])
    ax.set_ylabel("decode inter-token latency (ms)")
    ax.set_title(f"{result['model_name']}, link {result['rate']}, {result['streams']} streams")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_driver(args) -> int:
    from tqdm import tqdm

    from . import kv_bytes_per_token_of, resolve_model
    from .contention import netlab
    ok, why = netlab.available()
    if not ok:
        print(f"bench stall: needs root, iproute2 and tc: {why}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_model(args.model, args.out, "kv128k")
    if args.model is None:
        model_name += " (16 layers, 8 KV heads x 128, float32)"
    # the preset's 128 KB per token is float32 KV: SGLang's --dtype auto would serve it as float16
    args.dtype = args.dtype or ("float32" if args.model is None else "auto")
    kvpt = kv_bytes_per_token_of(model, args.dtype) or 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bench stall: unknown mode(s) {bad}; valid: {list(MODES)}", file=sys.stderr)
        return 2
    out = {"command": "flexflow bench stall " + " ".join(args.argv), "commit": measured_commit(), "model": model,
           "dtype": args.dtype,
           "model_name": model_name,
           "kv_bytes_per_token": kvpt, "rate": args.rate, "streams": args.streams, "decode_tokens": args.decode_tokens,
           "writers": args.writers, "prompt_tokens": args.prompt_tokens, "bg_rate": args.bg_rate,
           "forward_threads": args.forward_threads, "modes": {}}
    env = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_WARN_UNUSED_ENV_VARS": "n",
           "PYTHONUNBUFFERED": "1"}
    with netlab.NetLab(["srv", "tier"]) as lab:
        lab.link("srv", "tier", args.rate)
        peer = f"{lab.addr('tier', 'srv')}:{TIER_PORT}"
        for mode in tqdm(modes, desc="bench stall", unit="mode"):
            # a fresh, empty tier server per mode: pages an earlier mode wrote would turn this
            # mode's first-pass prompts into remote hits (less compute, an unfair comparison)
            tier = None
            if mode != "off":
                tier, ready = netlab.spawn_tier_server(lab, "tier", TIER_PORT, args.out, f"tier-server-{mode}",
                                                       capacity_gb=args.tier_capacity_gb, env=env,
                                                       ucx_devs=lab.dev("tier", "srv"))
                if not netlab.wait_ready(lab, [(tier, ready)]):
                    print(f"bench stall: tier server did not start; see tier-server-{mode}.log", file=sys.stderr)
                    return 1
            result = os.path.join(args.out, f"stall-{mode}.json")
            cmd = [sys.executable, "-m", "flexflow_sglang.tools.bench.stall", "--inside", "--mode", mode, "--peer", peer,
                   "--model", model, "--result", result, "--workdir", args.out]
            for k in ("streams", "decode_tokens", "rounds", "writers", "prompt_tokens", "fresh_prompts",
                      "host_tokens", "off_host_tokens", "max_total_tokens", "lead_s", "start_timeout", "dtype",
                      "worker_nice", "bg_rate", "forward_threads"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            log = open(os.path.join(args.out, f"runner-{mode}.log"), "wb")
            p = lab.spawn("srv", cmd, env={**env, "UCX_NET_DEVICES": lab.dev("srv", "tier")}, stdout=log,
                          stderr=subprocess.STDOUT)
            rc = p.wait()
            if tier is not None:
                lab.kill(tier)
            if rc != 0 or not os.path.exists(result):
                out["modes"][mode] = {"error": f"runner exited {rc}; see runner-{mode}.log"}
                continue
            with open(result) as f:
                out["modes"][mode] = json.load(f)
    out["ratios"] = ratios(out["modes"])
    save_result(args.out, "stall", out, plot, "stall")
    print(f"model {out['model_name']}, {kvpt // 1024} KB KV/token, link {args.rate}, commit {out['commit']}")
    print(f"{'mode':8} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'p99 vs off':>11} {'bg requests':>12}")
    for m in modes:
        r = out["modes"].get(m, {})
        if "itl" not in r:
            print(f"{m:8} {r.get('error', 'no result')}")
            continue
        print(f"{m:8} {r['itl']['p50_ms']:11.1f} {r['itl']['p99_ms']:11.1f} "
              f"{out['ratios'].get(m, {}).get('p99_vs_off', float('nan')):11.2f} {r['background']['requests']:12d}")
        worst = sorted(((v, k[:-len("_max_ms")]) for k, v in r.get("sched_hooks", {}).items() if k.endswith("_max_ms")),
                       reverse=True)[:3]
        if worst:
            print(f"{'':8} longest scheduler-thread hooks: " + ", ".join(f"{h} {v:.1f} ms" for v, h in worst))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="flexflow bench stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-stall")
    ap.add_argument("--model", default=None, help="checkpoint dir, or 'smollm2' for the real SmolLM2-135M-Instruct "
                                                  "(default: build the kv128k preset under --out)")
    ap.add_argument("--dtype", default=None, help="SGLang --dtype (default: float32 for the kv128k preset, "
                                                  "so its KV really is 128 KB per token; auto otherwise)")
    ap.add_argument("--rate", default="200mbit", help="tbf cap of the srv <-> tier link")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="decode requests per stream, one after the other")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--fresh-prompts", type=int, default=4, help="new prompts per writer before it revisits")
    ap.add_argument("--host-tokens", type=int, default=1024, help="host tier of the async/sync modes")
    ap.add_argument("--off-host-tokens", type=int, default=0,
                    help="host tier of the off mode (0: every background prompt fits)")
    ap.add_argument("--max-total-tokens", type=int, default=3072)
    ap.add_argument("--tier-capacity-gb", type=float, default=1.0)
    ap.add_argument("--lead-s", type=float, default=3.0)
    ap.add_argument("--forward-threads", type=int, default=0,
                    help="OMP_NUM_THREADS of the server in every mode (0: torch's default, all cores); 1 on a "
                         "2-core machine leaves a core to the data plane, as a GPU server's host CPU has")
    ap.add_argument("--bg-rate", type=float, default=0.0,
                    help="background requests per second per writer (open loop, the same work in every mode; "
                         "0: closed loop, each writer sends its next request when the last one ends)")
    ap.add_argument("--worker-nice", type=int, default=0, help="transfer.worker_nice of the async/sync servers")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    # inside the srv namespace (spawned by the driver)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="async", help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = argv
    for k in ("streams", "decode_tokens", "rounds", "prompt_tokens", "fresh_prompts", "host_tokens", "max_total_tokens"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.writers < 0:
        ap.error(f"--writers must be >= 0, got {args.writers}")
    if args.inside:
        return run_inside(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
