"""`flexflow bench sglang-serving`: SGLang's own `bench_serving` (generated-shared-prefix) on plain
SGLang and on the flexflow backend, side by side in one run.

The workload is SGLang's: `python -m sglang.bench_serving --backend sglang --dataset-name
generated-shared-prefix`, groups of requests that share a long system prompt, shuffled. Each backend
gets a fresh server with the same flags and a device KV pool (`--max-total-tokens`) smaller than the
groups' prefixes together, so plain SGLang evicts and prefills them again while flexflow loads them
back from its host tier. Each backend runs `--passes` passes of the same dataset (same seed); pass 1
fills the caches. Reported per pass: bench_serving's own TTFT / ITL / throughput, the share of
prompt tokens served from cache, read from the server's own "Prefill batch" log lines, and the share
loaded from flexflow's tiers (its /metrics); then flexflow / plain ratios of the last pass.

Backends: `baseline` (plain SGLang), `flexflow` (the config as given: per-rank host tiers by
default) and `flexflow-shared` (the same config with `host_tier.shared: true`: one host tier per
node). With `--dp-size 2 --backends flexflow,flexflow-shared` the summary also compares the two
flexflow variants (host-tier hit rate and mean TTFT, shared / per rank), which is where a shared
tier matters: SGLang's DP controller sends a repeated prefix to either rank.
JSON, the raw bench_serving JSONL and a PNG go to --out. With `--verify`, each server also answers
verify_outputs with the prompts bench_serving sent (tools/bench/serving_verify.py): the plain server's
outputs are the baseline, the flexflow server's host / storage hits must equal them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from tqdm import tqdm

from . import add_attention_backend_arg, add_storage_tier_args, flush_dirty_pages, measured_commit

_PREFILL = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")
#: bench_serving's result keys this report keeps (its JSONL has many more)
KEEP = ("completed", "duration", "total_input_tokens", "request_throughput", "output_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms")


def prefill_tokens(log_path: str, offset: int) -> Dict[str, float]:
    """New vs cached prompt tokens from the server's "Prefill batch" lines after byte `offset`."""
    new = cached = 0
    with open(log_path, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            m = _PREFILL.search(line)
            if m:
                new += int(m.group(1))
                cached += int(m.group(2))
    total = new + cached
    return {"new_tokens": new, "cached_tokens": cached, "cached_ratio": cached / total if total else 0.0}


def bench_serving_cmd(url: str, model: str, out_file: str, args) -> List[str]:
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
            "--model", model, "--tokenizer", model, "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(args.gsp_num_groups), "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
            "--gsp-system-prompt-len", str(args.gsp_system_prompt_len), "--gsp-question-len", str(args.gsp_question_len),
            "--gsp-output-len", str(args.gsp_output_len), "--num-prompts", str(args.gsp_num_groups * args.gsp_prompts_per_group),
            "--request-rate", "inf", "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
            "--output-file", out_file, "--output-details", "--disable-tqdm"] + (["--tokenize-prompt"] if getattr(args, "tokenize_prompt", False) else [])


BACKENDS = ("baseline", "flexflow", "flexflow-shared")


def write_config(out: str, host_tokens: int, storage: bool, storage_layout: str = "slabs",
                 storage_backend: str = "auto") -> str:
    """A FLEXFLOW_CONFIG for this run: a host tier of `host_tokens` tokens (smaller than the working
    set makes pages spill), and with `storage` a storage tier under `out` (`storage_tier.layout`:
    `storage_layout`, `storage_tier.backend`: `storage_backend`) that catches the spills."""
    import shutil

    import yaml
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_tokens": host_tokens, "write_policy": "write_through"}}
    if storage:
        kv = os.path.join(out, "storage-kv")
        shutil.rmtree(kv, ignore_errors=True)  # every backend starts from an empty storage tier
        cfg["storage_tier"] = {"enabled": True, "path": kv, "capacity_gb": 8.0, "layout": storage_layout,
                               "backend": storage_backend}
    path = os.path.join(out, "flexflow.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def shared_variant(config_path: str, out: str) -> str:
    """The same FLEXFLOW_CONFIG with `host_tier.shared: true` (one host tier per node), written under
    `out`; every other key as the user gave it."""
    import yaml
    with open(config_path) as f:
        cfg = yaml.safe_load(f) or {}
    cfg.setdefault("host_tier", {})["shared"] = True
    path = os.path.join(out, "flexflow-shared.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path



def add_workload_args(ap, *, prompts_per_group: int, system_prompt_len: int, question_len: int,
                      output_len: int, max_total_tokens_help: Optional[str] = None) -> None:
    """The bench_serving workload and server flags every bench_serving-based benchmark takes
    (generated-shared-prefix shape, concurrency, device pool, dtype, seed, timeouts)."""
    ap.add_argument("--gsp-num-groups", type=int, default=8)
    ap.add_argument("--gsp-prompts-per-group", type=int, default=prompts_per_group)
    ap.add_argument("--gsp-system-prompt-len", type=int, default=system_prompt_len)
    ap.add_argument("--gsp-question-len", type=int, default=question_len)
    ap.add_argument("--gsp-output-len", type=int, default=output_len)
    ap.add_argument("--max-concurrency", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help=max_total_tokens_help)
    ap.add_argument("--dtype", default=None, help="SGLang --dtype (default: float32 for a tiny preset, so that "
                                                  "kv128k really holds 128 KB per token; auto otherwise)")
    add_attention_backend_arg(ap)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--pass-timeout", type=float, default=1800.0)


#: the integer options of add_workload_args that must be positive
WORKLOAD_POSITIVE = ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
                     "gsp_output_len", "max_concurrency", "max_total_tokens")


def check_positive(ap, args, names) -> None:
    for k in names:
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")


def resolve_served_model(args) -> tuple:
    """(model dir, name for reports) for `--model`; sets args.dtype and args.tokenize_prompt."""
    from flexflow_sglang.tools.cpu_support.tiny_model import PRESETS
    from . import resolve_model
    preset = args.model in PRESETS
    model, model_name = resolve_model(None if preset else args.model, args.out, args.model if preset else "bench")
    args.dtype = args.dtype or ("float32" if preset else "auto")
    # a tiny preset's word-level tokenizer does not round-trip bench_serving's generated text (the
    # server saw 1-token prompts): send the token ids themselves
    args.tokenize_prompt = preset
    return model, model_name


def measure_pass(url: str, log: str, model: str, jsonl: str, args, label: str, pass_no: int) -> dict:
    """One bench_serving pass against the server at `url` (its log at `log`): bench_serving's own
    figures, cached prompt tokens from the server log and tokens loaded from flexflow's tiers."""
    from .serve import _flexflow_counters
    if os.path.exists(jsonl):
        os.unlink(jsonl)  # bench_serving appends
    offset = os.path.getsize(log)
    before = _flexflow_counters(url)
    t0 = time.perf_counter()
    home = getattr(args, "bench_home", None)  # a scratch HOME: bench_serving's dataset cache (serving_verify)
    proc = subprocess.run(bench_serving_cmd(url, model, jsonl, args), capture_output=True, text=True,
                          timeout=args.pass_timeout, env={**os.environ, "HOME": home} if home else None)
    if proc.returncode != 0 or not os.path.exists(jsonl):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"bench_serving ({label}) exited {proc.returncode}: " + " | ".join(tail))
    with open(jsonl) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    time.sleep(1.1)  # the backend exports its counters at most once a second
    after = _flexflow_counters(url)
    host = sum(v for k, v in after.items() if k.startswith("flexflow_hits_by_tier")) - \
        sum(v for k, v in before.items() if k.startswith("flexflow_hits_by_tier"))
    tokens = prefill_tokens(log, offset)
    prompt = tokens["new_tokens"] + tokens["cached_tokens"]
    # what the data plane did in this pass (deltas): prefetches, their timeouts, deep loads, drops
    moved = {k[len("flexflow_"):]: after[k] - before.get(k, 0) for k in after
             if any(w in k for w in ("prefetch", "pages_loaded", "fetch_timeouts", "dropped", "store_pages_short",
                                     "deep_pages_recompute_cheaper")) and "sched" not in k
             and after[k] - before.get(k, 0)}
    return {"pass": pass_no, "wall_s": time.perf_counter() - t0, **{k: result.get(k) for k in KEEP},
            **tokens, "flexflow_loaded_tokens": host, "flexflow_counters": moved,
            # per request, in the dataset's order (same seed: the same prompts in the same order on
            # every server): compared across backends in the summary
            "generated_texts": result.get("generated_texts"),
            "input_lens": result.get("input_lens"),
            # tokens loaded from flexflow's tiers (host, or deeper through it) / prompt tokens
            "tier_hit_ratio": host / prompt if prompt else 0.0}


def run_backend(name: str, model: str, args) -> dict:
    from flexflow_sglang.tools.server_utils import SGLangServer, ServerStartError
    from .serve import _root_cause
    kw = {}
    if name != "baseline":
        cfg = shared_variant(args.config, args.out) if name == "flexflow-shared" else args.config
        kw = {"radix_cache_backend": "flexflow", "flexflow_config": cfg}
    log = os.path.join(args.out, f"server-{name}.log")
    server = SGLangServer(model, log, max_total_tokens=args.max_total_tokens, timeout=args.start_timeout,
                          dp_size=args.dp_size, page_size=args.page_size,
                          max_running_requests=max(4, args.max_concurrency),
                          attention_backend=args.attention_backend, extra_args=["--enable-metrics", "--dtype", args.dtype],
                          env={"OMP_NUM_THREADS": str(args.forward_threads)} if args.forward_threads else None, **kw)
    synced_s = flush_dirty_pages()  # the previous server's writes are not this one's cost
    try:
        server.start()
    except ServerStartError as e:
        return {"backend": name, "ran": False, "error": _root_cause(log) or str(e).splitlines()[0][:300], "log": log}
    passes = []
    try:
        for p in range(args.passes):
            jsonl = os.path.join(args.out, f"bench_serving-{name}-pass{p + 1}.jsonl")
            passes.append(measure_pass(server.url, log, model, jsonl, args, f"{name}, pass {p + 1}", p + 1))
        verify = verify_on(name, server.url, args)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"backend": name, "ran": False, "error": str(e)[:600], "log": log, "passes": passes}
    finally:
        server.stop()
    out = {"backend": name, "ran": True, "startup_s": server.startup_s, "synced_s": round(synced_s, 3), "passes": passes,
           "log": log}
    if verify is not None:
        out["verify"] = verify
    return out


def verify_on(name: str, url: str, args) -> Optional[dict]:
    """--verify, after the passes: verify_outputs' baseline phase on the plain server, its test phase
    on a flexflow one (against the plain server's baseline of this run); None otherwise."""
    from .serving_verify import run_verify
    if not getattr(args, "verify_prompts", None):
        return None
    baseline = os.path.join(args.out, "verify-baseline.json")
    if name == "baseline":
        phase = "baseline"
    elif name.startswith("flexflow") and os.path.exists(baseline):
        phase = "test"
    else:
        return None
    return run_verify(phase, url, args.verify_prompts, baseline, args.out, args.gsp_output_len, args.pass_timeout)


def _last_pass_ratios(results: List[dict], num: str, den: str, keys, pass_index: int = -1) -> Optional[dict]:
    """Median over rounds (ABAB order) of backend `num` / backend `den` on one pass (default: the
    last), per key."""
    rounds: Dict[int, Dict[str, dict]] = {}
    for r in results:
        if r.get("ran") and r["passes"]:
            rounds.setdefault(r["round"], {})[r["backend"]] = r["passes"][pass_index]
    pairs = [(rd[den], rd[num]) for rd in rounds.values() if den in rd and num in rd]
    if not pairs:
        return None
    out = {"rounds": len(pairs)}
    for k in keys:
        xs = [n[k] / d[k] for d, n in pairs if d.get(k) and n.get(k) is not None]
        out[k] = statistics.median(xs) if xs else None
    out["values"] = {den: {k: statistics.median(d.get(k) or 0.0 for d, _ in pairs) for k in keys},
                     num: {k: statistics.median(n.get(k) or 0.0 for _, n in pairs) for k in keys}}
    return out


def compare_outputs(results: List[dict], num: str, den: str) -> Optional[dict]:
    """Per pass, how many requests generated the same text on both backends (first round that ran
    both). Reported, not judged: the servers serve different cached lengths (plain recomputes what
    flexflow loads), and on CPU a GEMM over fewer rows can round differently; like-with-like identity
    (host hit vs device hit of the same length) is verify_outputs' job."""
    by = {}
    for r in results:
        if r.get("ran") and r.get("passes"):
            by.setdefault(r["round"], {})[r["backend"]] = r["passes"]
    for rd in sorted(by):
        if num in by[rd] and den in by[rd]:
            out = []
            for a, b in zip(by[rd][den], by[rd][num]):
                ta, tb = a.get("generated_texts"), b.get("generated_texts")
                if ta is None or tb is None or len(ta) != len(tb):
                    return None
                out.append({"pass": a.get("pass"), "requests": len(ta),
                            "identical": sum(1 for x, y in zip(ta, tb) if x == y)})
            return {"round": rd, "passes": out}
    return None


def summarize(results: List[dict]) -> dict:
    """flexflow / plain ratios of the last pass and, when both ran, shared / per-rank host tier on
    the first pass (cold tiers) and the last."""
    out: dict = {}
    plain = _last_pass_ratios(results, "flexflow", "baseline",
                              ("median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "output_throughput",
                               "request_throughput", "median_itl_ms", "cached_ratio"))
    if plain:
        out["rounds"] = plain["rounds"]
        out["outputs_vs_plain"] = compare_outputs(results, "flexflow", "baseline")
        out["last_pass_flexflow_over_plain"] = {k: v for k, v in plain.items() if k not in ("rounds", "values")}
        out["last_pass_cached_ratio"] = {"plain": plain["values"]["baseline"]["cached_ratio"],
                                         "flexflow": plain["values"]["flexflow"]["cached_ratio"]}
    # Two views of shared vs per-rank tiers. The first pass starts with empty tiers: a group's later
    # requests that SGLang's dispatcher sends to another rank than the one that computed the prefix
    # miss a per-rank tier and hit the shared one (issue 17's case). Later passes repeat the same
    # prompts: by then every per-rank tier has seen most prefixes, so the gap narrows.
    for label, idx in (("first_pass", 0), ("last_pass", -1)):
        shared = _last_pass_ratios(results, "flexflow-shared", "flexflow",
                                   ("tier_hit_ratio", "cached_ratio", "mean_ttft_ms", "median_ttft_ms",
                                    "output_throughput"), pass_index=idx)
        if shared:
            out[f"{label}_shared_over_per_rank"] = {k: v for k, v in shared.items() if k != "values"}
            out[f"{label}_tier_hit_ratio"] = {"per_rank": shared["values"]["flexflow"]["tier_hit_ratio"],
                                              "shared": shared["values"]["flexflow-shared"]["tier_hit_ratio"]}
    return out


def plot(results: List[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ran = [r for r in results if r.get("ran")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, max(len(r["passes"]) for r in ran) if ran else 1)
    for i, r in enumerate(ran):
        for j, p in enumerate(r["passes"]):
            x = i + j * width
            ax.bar(x, p["median_ttft_ms"], width, color=("#888888", "#1f77b4", "#2ca02c")[j % 3],
                   label=f"pass {p['pass']}" if i == 0 else None)
            ax.errorbar(x, p["median_ttft_ms"], yerr=[[0], [max(0.0, p["p99_ttft_ms"] - p["median_ttft_ms"])]],
                        fmt="none", ecolor="black", capsize=3)
            ax.text(x, p["median_ttft_ms"], f"{p['cached_ratio']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ran))])
    ax.set_xticklabels([f"{r['backend']} r{r['round'] + 1}" for r in ran])
    ax.set_ylabel("TTFT ms (bar median, whisker p99; label: cached share)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def verify_summary(results: List[dict], prompts: str) -> dict:
    """Per backend: verify_outputs' mismatches (the test phase's count is the verdict), and whether
    the verify prompts have the lengths bench_serving reported (the same dataset)."""
    from .serving_verify import same_prompts_as_bench
    out = {}
    for r in results:
        v = r.get("verify")
        if v is None:
            continue
        lens = (r.get("passes") or [{}])[0].get("input_lens")
        out[r["backend"]] = {**{k: v.get(k) for k in ("phase", "rc", "mismatches", "r2_differs_from_plain")},
                             "same_prompts_as_bench_serving": same_prompts_as_bench(prompts, lens)}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="flexflow bench sglang-serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench-sglang-serving")
    ap.add_argument("--model", default="smollm2",
                    help="'smollm2' (the real model, built if missing), a tiny_model preset (kv128k: 8B-sized KV), "
                         "or a model dir")
    ap.add_argument("--backends", default="baseline,flexflow", help="comma list of " + ", ".join(BACKENDS))
    ap.add_argument("--dp-size", type=int, default=1, help="SGLang --dp-size of every server (one core per rank)")
    ap.add_argument("--config", default=None, help="FLEXFLOW_CONFIG (default configs/cpu-dev.yaml)")
    add_workload_args(ap, prompts_per_group=4, system_prompt_len=1024, question_len=64, output_len=8,
                      max_total_tokens_help="device KV pool; below groups x system-prompt-len the device tree "
                                            "must evict")
    ap.add_argument("--host-tokens", type=int, default=None,
                    help="write a config with a host tier of this many tokens (instead of --config)")
    ap.add_argument("--storage", action="store_true", help="with --host-tokens: a storage tier under --out too")
    add_storage_tier_args(ap)
    ap.add_argument("--page-size", type=int, default=None,
                    help="SGLang --page-size of every server (default: SGLang's, 1); the tiers' pages follow it")
    ap.add_argument("--forward-threads", type=int, default=0,
                    help="OMP_NUM_THREADS of every server (0: torch's default, all cores); 1 on a 2-core machine "
                         "leaves a core to flexflow's transfer engine, as a GPU server's host CPU has")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat all backends (ABAB order) to cancel drift")
    ap.add_argument("--verify", action="store_true",
                    help="after each server's passes, run verify_outputs with the prompts bench_serving sent: "
                         "baseline phase on the plain server, test phase (host / storage hits) on flexflow")
    args = ap.parse_args(argv)
    check_positive(ap, args, WORKLOAD_POSITIVE + ("passes", "rounds", "dp_size"))
    if args.page_size is not None and args.page_size <= 0:
        ap.error(f"--page-size must be positive, got {args.page_size}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"--backends: unknown {bad}; valid: {', '.join(BACKENDS)}")
    if args.verify and backends[0] != "baseline":
        ap.error("--verify needs 'baseline' first in --backends (its outputs are the reference)")
    try:
        import datasets  # noqa: F401 - bench_serving imports every dataset loader at start
    except ImportError:
        print("bench sglang-serving: SGLang's bench_serving needs `datasets` (pip install -c .ci/constraints-cpu.txt "
              "datasets==5.2.0; .ci/setup-cpu.sh installs it)", file=sys.stderr)
        return 2
    from flexflow_sglang.config import DEFAULT_CONFIG_PATH
    commit = measured_commit()  # before the runs: the code that ran, not HEAD after them
    args.config = args.config or os.path.join(os.path.dirname(DEFAULT_CONFIG_PATH), "cpu-dev.yaml")
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_served_model(args)
    if args.host_tokens is not None:
        args.config = write_config(args.out, args.host_tokens, args.storage, args.storage_layout, args.storage_backend)
    elif args.storage:
        ap.error("--storage needs --host-tokens (the generated config)")
    from .serving_verify import bench_home, write_prompts
    args.bench_home = bench_home(args.out)
    if args.verify:
        args.verify_prompts = os.path.join(args.out, "verify-prompts.jsonl")
        write_prompts(model, args, args.verify_prompts)
    results = []
    jobs = [(rnd, b) for rnd in range(args.rounds) for b in backends]
    for rnd, name in tqdm(jobs, desc="bench sglang-serving", unit="server"):
        if args.host_tokens is not None:
            # an empty storage tier per server
            write_config(args.out, args.host_tokens, args.storage, args.storage_layout, args.storage_backend)
        r = run_backend(name, model, args)
        r["round"] = rnd
        results.append(r)
        if not r.get("ran"):
            print(f"{name}: {r['error']}", file=sys.stderr)
    summary = summarize(results)
    if args.verify:
        summary["verify"] = verify_summary(results, args.verify_prompts)
    workload = {k: getattr(args, k) for k in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len",
                                              "gsp_question_len", "gsp_output_len", "max_concurrency",
                                              "max_total_tokens", "passes", "seed", "dtype", "host_tokens",
                                              "storage", "config", "dp_size", "page_size", "forward_threads", "verify")}
    out = {"command": "flexflow bench sglang-serving " + " ".join(argv), "commit": commit, "model": model_name,
           "model_path": model, "workload": workload, "results": results, "summary": summary}
    with open(os.path.join(args.out, "bench_sglang_serving.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(results, os.path.join(args.out, "bench_sglang_serving.png"),
         f"bench_serving generated-shared-prefix, {model_name}")
    print(f"model {model_name}, commit {out['commit']}")
    print(f"{'backend':15} {'pass':>4} {'TTFT p50 ms':>12} {'TTFT mean':>10} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} "
          f"{'out tok/s':>10} {'cached':>7} {'tiers':>7}")
    for r in results:
        for p in r.get("passes", []):
            print(f"{r['backend']:15} {p['pass']:4d} {p['median_ttft_ms']:12.1f} {p['mean_ttft_ms']:10.1f} "
                  f"{p['p99_ttft_ms']:12.1f} {p['median_itl_ms']:11.1f} {p['output_throughput']:10.1f} "
                  f"{p['cached_ratio']:7.1%} {p['tier_hit_ratio']:7.1%}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {os.path.join(args.out, 'bench_sglang_serving.json')} and bench_sglang_serving.png")
    ok = all(r.get("ran") for r in results)
    if args.verify:
        verdicts = summary["verify"]
        ok = ok and bool(verdicts) and all(v["mismatches"] == 0 and v["rc"] == 0 for v in verdicts.values())
        print("verify_outputs: " + ", ".join(f"{b} {v['phase']}: {v['mismatches']} mismatches (rc {v['rc']})"
                                             for b, v in verdicts.items()) + f"; logs under {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
