"""`flexflow bench serve`: cold vs warm TTFT of the real SGLang server, side by side in one run.

For each backend (plain SGLang, --radix-cache-backend flexflow, and SGLang's own
--enable-hierarchical-cache when it starts on this machine) a fresh server runs the same multi-turn,
shared-prefix workload twice: a cold pass, then POST /flush_cache (the device tree is emptied), then a
warm pass. Reported per backend and pass: TTFT p50/p90/p99 (streamed, time to the first token),
throughput, host-hit ratio and loaded bytes per second. JSON and a PNG go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import requests
from tqdm import tqdm

from . import nearest_rank

WORDS = ("the cache radix tree prefix token server model request page block evict hit miss node key value "
         "batch decode prefill alpha beta gamma delta one two three four five").split()


def make_workload(families: int, prefix_words: int, turns: int, turn_words: int, seed: int = 0) -> List[dict]:
    """`families` conversations; each turn's prompt = a long shared system prefix + all earlier turns."""
    rng = random.Random(seed)
    reqs = []
    for f in range(families):
        prefix = f"conversation {f}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        history = prefix
        for t in range(turns):
            history = history + f" turn {t}: " + " ".join(rng.choice(WORDS) for _ in range(turn_words))
            reqs.append({"id": f"f{f}t{t}", "text": history, "family": f, "turn": t})
    return reqs


def stream_generate(url: str, text: Optional[str], max_new_tokens: int, timeout: float = 600.0, *,
                    input_ids: Optional[List[int]] = None) -> dict:
    """Streamed greedy /generate of `text` (or of token ids, `input_ids`): returns ttft_s (first
    chunk), e2e_s, the final meta_info and the generated output_ids."""
    body = {"stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if input_ids is not None:
        body["input_ids"] = list(input_ids)
    else:
        body["text"] = text
    t0 = time.perf_counter()
    ttft, chunks, last = None, [], None
    with requests.post(url.rstrip("/") + "/generate", json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate -> HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(payload)
            chunks.append(last.get("output_ids") or [])
    e2e = time.perf_counter() - t0
    meta = (last or {}).get("meta_info", {})
    n = int(meta.get("completion_tokens", 0) or 0)
    # SGLang streams output_ids cumulatively by default, incrementally with --incremental-streaming-output
    out = chunks[-1] if chunks and len(chunks[-1]) == n else [t for c in chunks for t in c]
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "meta": meta,
            "output_ids": list(out) if last is not None else None}


def _pct(xs: List[float], q: float) -> float:
    return nearest_rank(xs, q, empty=float("nan"))


def run_pass(url: str, reqs: List[dict], max_new_tokens: int, concurrency: int, desc: str) -> dict:
    t0 = time.perf_counter()
    results: Dict[str, dict] = {}
    # turns of one family run in order (each builds on the previous); families run concurrently
    by_family: Dict[int, List[dict]] = {}
    for r in reqs:
        by_family.setdefault(r["family"], []).append(r)
    bar = tqdm(total=len(reqs), desc=desc, leave=False, mininterval=0.5)

    def family(rs):
        for r in rs:
            results[r["id"]] = stream_generate(url, r["text"], max_new_tokens)
            bar.update(1)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as ex:
        list(ex.map(family, by_family.values()))
    bar.close()
    wall = time.perf_counter() - t0
    ttfts = [v["ttft_s"] for v in results.values()]
    long_ids = {r["id"] for r in reqs if r["turn"] == max(x["turn"] for x in reqs)}
    # turn 0 of each family is the long shared prefix on its own: cold in the cold pass (nothing
    # cached), an offloaded hit in the warm pass; later turns hit the device tree in both passes
    first_ids = {r["id"] for r in reqs if r["turn"] == 0}
    prompt = sum(v["meta"].get("prompt_tokens", 0) for v in results.values())
    completion = sum(v["meta"].get("completion_tokens", 0) for v in results.values())
    host = sum(int((v["meta"].get("cached_tokens_details") or {}).get("host", 0) or 0) for v in results.values())
    device = sum(int((v["meta"].get("cached_tokens_details") or {}).get("device", 0) or 0) for v in results.values())
    return {
        "requests": len(results), "wall_s": wall,
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p90_s": _pct(ttfts, 0.9), "ttft_p99_s": _pct(ttfts, 0.99),
        "ttft_mean_longest_turn_s": statistics.fmean([results[i]["ttft_s"] for i in long_ids]),
        "ttft_mean_first_turn_s": statistics.fmean([results[i]["ttft_s"] for i in first_ids]),
        "throughput_tok_s": (prompt + completion) / wall, "prompt_tokens": prompt,
        "host_hit_tokens": host, "device_hit_tokens": device, "host_hit_ratio": host / max(prompt, 1),
        "outputs": {k: v["output_ids"] for k, v in results.items()},
    }


def run_miss_pass(url: str, n: int, prefix_words: int, max_new_tokens: int, desc: str) -> dict:
    """The miss path: `n` unique prompts nobody has seen (same prompts for every backend), one at a
    time; the first two are warm-up. Non-streamed end-to-end latency."""
    from flexflow_sglang.tools.server_utils import generate
    lat = []
    for i in tqdm(range(n + 2), desc=desc, leave=False, mininterval=0.5):
        text = make_workload(1, prefix_words, 1, 10, seed=100_000 + i)[0]["text"]
        t0 = time.perf_counter()
        generate(url, text, max_new_tokens)
        lat.append(time.perf_counter() - t0)
    lat = lat[2:]
    return {"requests": n, "latency_median_s": statistics.median(lat), "latency_mean_s": statistics.fmean(lat)}


def _flexflow_counters(url: str) -> dict:
    from flexflow_sglang.tools.server_utils import flexflow_metrics
    try:
        return flexflow_metrics(url)
    except Exception:  # metrics are informative only
        return {}


def _root_cause(log: str) -> str:
    """The last exception line of a failed server's log (e.g. why HiCache cannot start on CPU)."""
    import re
    try:
        lines = open(log, errors="replace").read().splitlines()
    except OSError:
        return ""
    hits = [l.strip() for l in lines if re.match(r"^\s*[A-Za-z_.]*(Error|Exception)\b.*:", l)
            and "Ignore import error" not in l and "ModuleNotFoundError" not in l]
    where = [l.strip() for l in lines if l.strip().startswith('File "') and "sglang" in l]
    return (hits[-1] + (f" (at {where[-1]})" if where else "")) if hits else ""


def bench_backend(name: str, model: str, workdir: str, reqs: List[dict], args) -> dict:
    from flexflow_sglang.tools.server_utils import SGLangServer, ServerStartError, flush_cache
    extra = ["--enable-metrics", "--max-running-requests", str(max(4, args.concurrency))]
    kw = {}
    if name == "flexflow":
        kw = {"radix_cache_backend": "flexflow", "flexflow_config": args.config}
    elif name == "hicache":
        extra += ["--enable-hierarchical-cache", "--hicache-ratio", "2"]
    log = os.path.join(workdir, f"server-{name}.log")
    server = SGLangServer(model, log, extra_args=extra, max_total_tokens=args.max_total_tokens,
                          page_size=args.page_size, timeout=args.start_timeout, **kw)
    try:
        server.start()
    except ServerStartError as e:
        return {"backend": name, "ran": False, "error": _root_cause(log) or str(e).splitlines()[0][:300], "log": log}
    try:
        flush_cache(server.url)
        cold = run_pass(server.url, reqs, args.max_new_tokens, args.concurrency, f"{name}/cold")
        before = _flexflow_counters(server.url)
        flush_cache(server.url)
        warm = run_pass(server.url, reqs, args.max_new_tokens, args.concurrency, f"{name}/warm")
        after = _flexflow_counters(server.url)
        miss = run_miss_pass(server.url, args.miss_requests, args.prefix_words, args.max_new_tokens, f"{name}/miss")
    finally:
        server.stop()
    res = {"backend": name, "ran": True, "startup_s": server.startup_s, "cold": cold, "warm": warm, "miss": miss,
           "log": log}
    loaded = {k: after.get(k, 0) - before.get(k, 0) for k in after if "load" in k and "bytes" in k}
    if loaded:
        res["warm_loaded_bytes"] = max(loaded.values())
        res["warm_loaded_bytes_per_s"] = max(loaded.values()) / warm["wall_s"]
    return res


def summarize(results: List[dict]) -> dict:
    """Ratios per backend; with several rounds (ABAB order) the miss-path overhead is the median of
    the per-round ratios, which cancels slow drifts of a noisy machine."""
    s: Dict[str, dict] = {}
    rounds: Dict[int, Dict[str, dict]] = {}
    for r in results:
        if r.get("ran"):
            rounds.setdefault(r.get("round", 0), {})[r["backend"]] = r
    for name in {r["backend"] for r in results if r.get("ran")}:
        runs = [rd[name] for rd in rounds.values() if name in rd]
        s[name] = {"warm_over_cold_ttft_first_turn": statistics.median(
                       r["warm"]["ttft_mean_first_turn_s"] / r["cold"]["ttft_mean_first_turn_s"] for r in runs),
                   "warm_over_cold_ttft_p50": statistics.median(
                       r["warm"]["ttft_p50_s"] / r["cold"]["ttft_p50_s"] for r in runs),
                   "warm_over_cold_ttft_longest_turn": statistics.median(
                       r["warm"]["ttft_mean_longest_turn_s"] / r["cold"]["ttft_mean_longest_turn_s"] for r in runs),
                   "warm_host_hit_ratio": statistics.median(r["warm"]["host_hit_ratio"] for r in runs)}
    pairs = [(rd["baseline"], rd["flexflow"]) for rd in rounds.values() if "baseline" in rd and "flexflow" in rd]
    if pairs:
        s["flexflow_miss_latency_over_baseline"] = statistics.median(
            f["miss"]["latency_median_s"] / b["miss"]["latency_median_s"] for b, f in pairs)
        s["flexflow_cold_pass_throughput_over_baseline"] = statistics.median(
            f["cold"]["throughput_tok_s"] / b["cold"]["throughput_tok_s"] for b, f in pairs)
        s["outputs_identical_to_baseline"] = all(f["cold"]["outputs"] == b["cold"]["outputs"]
                                                 and f["warm"]["outputs"] == b["cold"]["outputs"] for b, f in pairs)
        s["rounds"] = len(pairs)
    return s


def plot(results: List[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in results if r.get("ran")]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(ran))
    for i, (pas, color) in enumerate((("cold", "#888888"), ("warm", "#1f77b4"))):
        ax.bar([k + i * 0.38 for k in x], [r[pas]["ttft_p50_s"] * 1000 for r in ran], 0.38, label=f"{pas} p50",
               color=color)
        ax.errorbar([k + i * 0.38 for k in x], [r[pas]["ttft_p50_s"] * 1000 for r in ran],
                    yerr=[[0] * len(ran), [(r[pas]["ttft_p99_s"] - r[pas]["ttft_p50_s"]) * 1000 for r in ran]],
                    fmt="none", ecolor="black", capsize=3)
    ax.set_xticks([k + 0.19 for k in x])
    ax.set_xticklabels([f"{r['backend']} r{r.get('round', 0) + 1}" for r in ran])
    ax.set_ylabel("TTFT (ms), bar p50, whisker p99")
    ax.set_title("cold pass vs warm pass after /flush_cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-serve")
    ap.add_argument("--model", default=None,
                    help="model dir, or 'smollm2' for the real SmolLM2-135M-Instruct (flexflow make-model smollm2); "
                         "default: the tiny random 'bench' preset, built in --out")
    ap.add_argument("--backends", default="baseline,flexflow,hicache")
    ap.add_argument("--config", default=None, help="FLEXFLOW_CONFIG (default configs/cpu-dev.yaml)")
    ap.add_argument("--families", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prefix-words", type=int, default=1000)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--miss-requests", type=int, default=6, help="unique prompts in the miss-path pass")
    ap.add_argument("--rounds", type=int, default=1, help="repeat all backends (ABAB order) to cancel drift")
    args = ap.parse_args(argv)
    from flexflow_sglang.config import DEFAULT_CONFIG_PATH
    args.config = args.config or os.path.join(os.path.dirname(DEFAULT_CONFIG_PATH), "cpu-dev.yaml")
    os.makedirs(args.out, exist_ok=True)
    from . import resolve_model
    model, model_name = resolve_model(args.model, args.out, "bench")
    reqs = make_workload(args.families, args.prefix_words, args.turns, args.turn_words)
    results = []
    skip = set()
    for rnd in range(args.rounds):
        for name in [b.strip() for b in args.backends.split(",")]:
            if name in skip:
                continue
            print(f"== {name} (round {rnd + 1}/{args.rounds})", flush=True)
            r = bench_backend(name, model, args.out, reqs, args)
            r["round"] = rnd
            results.append(r)
            if not r.get("ran"):
                skip.add(name)  # e.g. HiCache cannot start on CPU: say so once
    summary = summarize(results)
    for r in results:
        for pas in ("cold", "warm"):
            if r.get("ran"):
                r[pas].pop("outputs", None)
    out = {"command": "flexflow bench serve " + " ".join(argv or sys.argv[1:]), "model": model_name,
           "model_path": model, "workload": {
        "families": args.families, "turns": args.turns, "prefix_words": args.prefix_words,
        "turn_words": args.turn_words, "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency},
        "results": results, "summary": summary}
    with open(os.path.join(args.out, "bench_serve.json"), "w") as f:
        json.dump(out, f, indent=2)
    plot(results, os.path.join(args.out, "bench_serve.png"))
    for r in results:
        if not r.get("ran"):
            print(f"{r['backend']:<9} did not start: {r['error']}")
            continue
        for pas in ("cold", "warm"):
            p = r[pas]
            print(f"{r['backend']:<9} r{r['round'] + 1} {pas}: TTFT p50 {p['ttft_p50_s'] * 1000:8.1f} ms  p90 {p['ttft_p90_s'] * 1000:8.1f}"
                  f"  p99 {p['ttft_p99_s'] * 1000:8.1f}  first-turn {p['ttft_mean_first_turn_s'] * 1000:8.1f} ms  "
                  f"{p['throughput_tok_s']:8.0f} tok/s  host-hit {p['host_hit_ratio']:.2f}")
        print(f"{r['backend']:<9} r{r['round'] + 1} miss path: median {r['miss']['latency_median_s'] * 1000:.1f} ms "
              f"over {r['miss']['requests']} unique prompts")
    print(json.dumps(summary, indent=2))
    print(f"model: {model_name}")
    print(f"wrote {os.path.join(args.out, 'bench_serve.json')} and bench_serve.png")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
