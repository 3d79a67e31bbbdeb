"""Data parallelism with one shared host tier vs one host tier per DP rank, in one run.

    python benchmarks/dp_shared_tier.py [--model DIR] [--groups 24] [--per-group 2] [--system-len 600]
                                        [--question-len 24] [--output-len 4] [--out runs/dp_shared_tier]

A generated-shared-prefix workload, the shape of `python -m sglang.bench_serving --dataset-name
generated-shared-prefix` (that client needs the `datasets` package, which the CPU constraints do
not carry, so this is a small equivalent): `--groups` system prompts of `--system-len` tokens, each
followed by `--per-group` questions of `--question-len` tokens, all requests shuffled (seed 0),
sent one at a time with streaming to measure TTFT. The device KV pool (`--max-total-tokens`) holds
only a few prefixes, so a repeat of a group is served by the host tier or recomputed.

Two servers with the same flags (`--dp-size 2`, SGLang's default DP dispatch), started one after
the other: host_tier.shared false (each rank its own tier) and true (one /dev/shm segment). For each:
host-tier hit rate (host tokens / prompt tokens, from meta_info.cached_tokens_details), mean and p50
TTFT, and the host-tier bytes reserved on the node (per-rank tiers: the ranks' tier allocations from
their start-up log lines; shared: the segment's size, counted once) and in use (shared: the
segment's resident blocks). Writes <out>/dp_shared_tier.json and dp_shared_tier.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flexflow_sglang.tools.server_utils import SGLangServer  # noqa: E402

WORDS = ("the cache radix tree prefix token server model request page block evict hit miss node key value "
         "batch decode prefill alpha beta gamma delta one two three four five").split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(groups, per_group, system_len, question_len, seed=0):
    """[(group, text)]: roughly one word per token with the tiny model's byte-level BPE."""
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        system = f"system {g}: " + words(rng, system_len)
        for q in range(per_group):
            reqs.append((g, system + f" question {q}: " + words(rng, question_len)))
    rng.shuffle(reqs)
    return reqs


def stream_one(url, text, max_new):
    body = {"text": text, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, meta = None, {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            meta = json.loads(line[5:]).get("meta_info", meta)
    d = meta.get("cached_tokens_details") or {}
    return {"ttft_s": ttft, "prompt_tokens": meta.get("prompt_tokens", 0), "host": int(d.get("host") or 0),
            "device": int(d.get("device") or 0), "storage": int(d.get("storage") or 0)}


def run_config(args, shared, tmp):
    import yaml
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_tokens": args.host_tokens, "shared": shared}}
    path = os.path.join(tmp, f"cfg-{'shared' if shared else 'per-rank'}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = os.path.join(tmp, f"server-{'shared' if shared else 'per-rank'}.log")
    reqs = workload(args.groups, args.per_group, args.system_len, args.question_len)
    out = {"shared": shared}
    with SGLangServer(args.model, log_path=log, radix_cache_backend="flexflow", flexflow_config=path,
                      dp_size=2, max_total_tokens=args.max_total_tokens, timeout=600) as srv:
        stream_one(srv.url, "warm up the server", 1)  # not counted
        res = []
        try:
            from tqdm import tqdm
            it = tqdm(reqs, desc=f"{'shared' if shared else 'per-rank'} tier", unit="req", file=sys.stderr)
        except ImportError:
            it = reqs
        for _, text in it:
            res.append(stream_one(srv.url, text, args.output_len))
        text = open(log).read()
        segs = sorted(set(re.findall(r"flexflow: shared host tier (\S+) \(", text)))
        alloc = [float(m) for m in re.findall(r"host tier \d+ pages \(([\d.]+) MiB", text)]
        if shared:
            st = [os.stat(s) for s in segs]
            out["segments"] = len(segs)
            out["host_bytes_reserved"] = sum(s.st_size for s in st)
            out["host_bytes_resident"] = sum(s.st_blocks * 512 for s in st)
        else:
            out["segments"] = 0
            out["host_bytes_reserved"] = int(sum(alloc) * 2**20)
        out["tier_instances"] = len(alloc)
    prompt = sum(r["prompt_tokens"] for r in res)
    ttft = sorted(r["ttft_s"] for r in res)
    out.update(requests=len(res), prompt_tokens=prompt, host_tokens=sum(r["host"] for r in res),
               device_tokens=sum(r["device"] for r in res),
               host_hit_rate=sum(r["host"] + r["storage"] for r in res) / max(1, prompt),
               device_hit_rate=sum(r["device"] for r in res) / max(1, prompt),
               mean_ttft_s=sum(ttft) / len(ttft), p50_ttft_s=ttft[len(ttft) // 2], per_request=res)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: build the tiny model into <out>/tiny)")
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--system-len", type=int, default=600)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=2048, help="device KV pool per rank")
    ap.add_argument("--host-tokens", type=int, default=65536, help="host tier capacity (tokens)")
    ap.add_argument("--out", default="runs/dp_shared_tier")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.model is None:
        from flexflow_sglang.tools.cpu_support.tiny_model import make_tiny_model
        args.model = make_tiny_model(os.path.join(args.out, "tiny"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    runs = [run_config(args, False, args.out), run_config(args, True, args.out)]
    per, sh = runs
    summary = {"commit": commit, "model": args.model, "args": {k: v for k, v in vars(args).items() if k != "out"},
               "hit_rate_ratio": sh["host_hit_rate"] / per["host_hit_rate"] if per["host_hit_rate"] else None,
               "mean_ttft_ratio": sh["mean_ttft_s"] / per["mean_ttft_s"], "runs": runs}
    with open(os.path.join(args.out, "dp_shared_tier.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for r in runs:
        print(f"{'shared  ' if r['shared'] else 'per-rank'}: host hit rate {r['host_hit_rate']:.3f} "
              f"(device {r['device_hit_rate']:.3f}), mean TTFT {r['mean_ttft_s'] * 1e3:.1f} ms, "
              f"p50 {r['p50_ttft_s'] * 1e3:.1f} ms, host-tier bytes reserved {r['host_bytes_reserved']} "
              f"in {r['tier_instances']} tier instance(s), {r['segments']} segment(s)"
              + (f", resident {r['host_bytes_resident']}" if r["shared"] else ""))
    print(f"shared / per-rank: hit rate x{summary['hit_rate_ratio']:.2f}, mean TTFT x{summary['mean_ttft_ratio']:.2f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        names = ["per-rank", "shared"]
        ax[0].bar(names, [r["host_hit_rate"] for r in runs])
        ax[0].set_ylabel("host-tier hit rate (tokens)")
        for r, name in zip(runs, names):
            xs = sorted(x["ttft_s"] * 1e3 for x in r["per_request"])
            ax[1].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax[1].set_xlabel("TTFT (ms)")
        ax[1].set_ylabel("CDF")
        ax[1].legend()
        fig.suptitle(f"DP=2, {args.groups} groups x {args.per_group}, system {args.system_len} words ({commit})")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "dp_shared_tier.png"), dpi=110)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
