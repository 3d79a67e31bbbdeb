"""`flexflow bench layerwise`: host-hit TTFT with layer-wise load-back on vs off, real SGLang server.

Workload: `--families` prompts of `--prefix-tokens` random token ids (default 2048) each. Per family a
cold request stores the prefix in the host tier; then, `--repeats` times, POST /flush_cache (the device
tree is emptied, the host tier keeps its pages) and send the prefix plus a new `--suffix-tokens`
suffix with max_new_tokens 1: its latency is the TTFT of a host hit whose load is `prefix` tokens.
The same prompts are also sent without a flush (device hits: the forward alone, the floor any
overlap can reach). Servers with `host_tier.layerwise_load: true` and `false` alternate (ABAB over
`--rounds`) so that drift on a shared machine hits both; the ratio is on / off of median TTFTs.

Default model: the `kv128k` preset (16 layers x 8 KV heads x 128, float32 KV: 128 KB per token, an
8B model's volume), so a 2k-token prefix is 256 MiB of KV to load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import List, Optional

from tqdm import tqdm

from . import add_attention_backend_arg, kv_bytes_per_token_of, measured_commit, resolve_model


def _config(path: str, layerwise: str, capacity_gb: float) -> str:
    import yaml
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_gb": capacity_gb, "write_policy": "write_through", "layerwise_load": layerwise == "on"}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _timed(url: str, ids: List[int]) -> tuple:
    from flexflow_sglang.tools.server_utils import generate
    t0 = time.perf_counter()
    r = generate(url, input_ids=ids, max_new_tokens=1)
    return time.perf_counter() - t0, int(r["meta_info"].get("cached_tokens") or 0), list(r["output_ids"])


def run_server(mode: str, model: str, workdir: str, prompts, args, bar) -> dict:
    from flexflow_sglang.tools.server_utils import SGLangServer, flexflow_metrics, flush_cache
    cfg = _config(os.path.join(workdir, f"layerwise-{mode}.yaml"), mode, args.host_gb)
    srv = SGLangServer(model, os.path.join(workdir, f"server-{mode}.log"), radix_cache_backend="flexflow",
                       flexflow_config=cfg, max_total_tokens=args.max_total_tokens,
                       chunked_prefill_size=args.max_total_tokens, page_size=args.page_size,
                       extra_args=["--enable-metrics", "--dtype", args.dtype], timeout=args.start_timeout,
                       attention_backend=args.attention_backend)
    srv.start()
    host, device, cached, outputs = [], [], [], []
    try:
        rng = random.Random(args.seed + 1)
        for prefix in prompts:
            flush_cache(srv.url)
            _timed(srv.url, prefix + [rng.randrange(10, args.vocab) for _ in range(args.suffix_tokens)])  # cold
            for _ in range(args.repeats):
                suffix = [rng.randrange(10, args.vocab) for _ in range(args.suffix_tokens)]
                flush_cache(srv.url)
                time.sleep(0.2)
                dt, c, out = _timed(srv.url, prefix + suffix)  # host hit
                host.append(dt)
                cached.append(c)
                outputs.append(out)
                dt, _, _ = _timed(srv.url, prefix + suffix[::-1])  # device hit, same lengths
                device.append(dt)
                bar.update(1)
        m = flexflow_metrics(srv.url)
    finally:
        srv.stop()
    return {"mode": mode, "host_hit_ttft_s": host, "device_hit_ttft_s": device, "cached_tokens": cached,
            "outputs": outputs, "layerwise_load_backs": m.get("flexflow_cache_layerwise_load_backs", 0),
            "startup_s": srv.startup_s}


def summarize(runs: List[dict], prefix_tokens: int, kv_per_token: Optional[int]) -> dict:
    out = {}
    for mode in ("on", "off"):
        rs = [r for r in runs if r["mode"] == mode]
        host = [x for r in rs for x in r["host_hit_ttft_s"]]
        dev = [x for r in rs for x in r["device_hit_ttft_s"]]
        out[mode] = {"host_hit_ttft_median_s": statistics.median(host), "host_hit_ttft_min_s": min(host),
                     "device_hit_ttft_median_s": statistics.median(dev), "samples": len(host),
                     "layerwise_load_backs": sum(r["layerwise_load_backs"] for r in rs)}
    on, off = out["on"], out["off"]
    out["ttft_ratio_on_off"] = on["host_hit_ttft_median_s"] / off["host_hit_ttft_median_s"]
    # what the load costs without overlap, and the share of TTFT it is: overlap can hide at most that
    load_s = off["host_hit_ttft_median_s"] - off["device_hit_ttft_median_s"]
    out["load_cost_off_s"] = load_s
    out["load_share_of_ttft_off"] = load_s / off["host_hit_ttft_median_s"]
    out["best_possible_ratio"] = (off["device_hit_ttft_median_s"] / off["host_hit_ttft_median_s"])
    if kv_per_token:
        out["kv_bytes_loaded_per_hit"] = kv_per_token * prefix_tokens
    return out


def plot(runs: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    data, labels = [], []
    for mode, name in (("off", "whole load first"), ("on", "layer-wise")):
        data.append([x * 1000 for r in runs if r["mode"] == mode for x in r["host_hit_ttft_s"]])
        labels.append(f"host hit, {name}")
    data.append([x * 1000 for r in runs for x in r["device_hit_ttft_s"]])
    labels.append("device hit (floor)")
    ax.boxplot(data, tick_labels=labels)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("layer-wise load-back: host-hit TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="flexflow bench layerwise", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-layerwise")
    ap.add_argument("--model", default=None, help="model dir (default: the kv128k preset, built in --out)")
    ap.add_argument("--families", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="host hits per family per server")
    ap.add_argument("--rounds", type=int, default=2, help="on/off server pairs, ABAB")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--host-gb", type=float, default=2.0)
    ap.add_argument("--max-total-tokens", type=int, default=12288)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--dtype", default=None,
                    help="SGLang --dtype (default: float32 for the kv128k preset, so that it really holds 128 KB "
                         "of KV per token; SGLang's auto serves it in float16, 64 KB; auto for a model dir)")
    add_attention_backend_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_model(args.model, args.out, "kv128k")
    args.dtype = args.dtype or ("float32" if args.model is None else "auto")
    with open(os.path.join(model, "config.json")) as f:
        args.vocab = min(int(json.load(f)["vocab_size"]), 32000)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prefix_tokens)] for _ in range(args.families)]
    commit = measured_commit()
    runs = []
    total = 2 * args.rounds * args.families * args.repeats
    with tqdm(total=total, desc="layerwise bench", unit="hit") as bar:
        for rnd in range(args.rounds):
            for mode in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
                r = run_server(mode, model, args.out, prompts, args, bar)
                r["round"] = rnd
                runs.append(r)
    # the two modes must produce the same first token for every host hit (same prompts, same order)
    ref = {r["round"]: r["outputs"] for r in runs if r["mode"] == "off"}
    same = all(r["outputs"] == ref[r["round"]] for r in runs if r["mode"] == "on")
    kvt = kv_bytes_per_token_of(model, args.dtype)
    summary = summarize(runs, args.prefix_tokens, kvt)
    summary["outputs_identical"] = same
    res = {"command": "flexflow bench layerwise " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit, "model": model_name, "kv_bytes_per_token": kvt,
           "workload": {"families": args.families, "prefix_tokens": args.prefix_tokens,
                        "suffix_tokens": args.suffix_tokens, "repeats": args.repeats, "rounds": args.rounds,
                        "page_size": args.page_size, "dtype": args.dtype,
                        "attention_backend": args.attention_backend},
           "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs], "summary": summary}
    path = os.path.join(args.out, "bench_layerwise.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    plot(runs, os.path.join(args.out, "bench_layerwise.png"))
    on, off = summary["on"], summary["off"]
    print(f"model: {model_name}; {args.prefix_tokens}-token prefix + {args.suffix_tokens}-token suffix; commit {commit}")
    print(f"host-hit TTFT median: layer-wise {on['host_hit_ttft_median_s'] * 1000:.1f} ms, whole load first "
          f"{off['host_hit_ttft_median_s'] * 1000:.1f} ms -> {summary['ttft_ratio_on_off']:.3f}x "
          f"(device hit {off['device_hit_ttft_median_s'] * 1000:.1f} ms: best possible "
          f"{summary['best_possible_ratio']:.3f}x; the load is {summary['load_share_of_ttft_off'] * 100:.1f} % of TTFT)")
    print(f"layer-wise load-backs counted: {on['layerwise_load_backs']} (on), {off['layerwise_load_backs']} (off); "
          f"first tokens identical: {same}")
    print(f"wrote {path} and bench_layerwise.png")
    return 0 if same else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
