"""`flexflow bench prefetch`: TTFT of requests whose prefix lives only in the storage tier, queued
behind another request, against the same requests hitting the host tier (issue 13, "prefetch on
arrival"). Real SGLang server on CPU; no root needed.

1. fill: a server with a storage tier (write-through, local disk) serves `--targets` prompts of
   `--prefix-tokens` random token ids; their KV is written through to storage. The server stops.
2. per mode (`transfer.prefetch_policy`, default `timeout,off`), a fresh server on the same storage
   directory (empty device pool and host tier; `--max-running-requests 1`, so requests queue):
   * deep: a blocker request (`--blocker-tokens` decoded tokens) starts, then the targets arrive,
     each its prefix + a suffix, max_new_tokens 1: their prefixes are only in storage. With
     prefetch on arrival the engine fetches them into the host tier while they wait in the queue;
     with `off` each load-back fetches inline when the request is scheduled.
   * host: POST /flush_cache (the device tree is emptied, the host tier keeps what the deep phase
     loaded), then the same blocker + the same targets: host-tier hits (their first tokens must
     equal the deep phase's and every other mode's).
   Each target's latency from its arrival (max_new_tokens 1: its TTFT) is recorded; the ratio is the
   median deep TTFT / median host TTFT per mode (target <= 1.2 when the queue wait covers the fetch).

Default model: the `kv128k` preset (128 KB of KV per token, an 8B model's volume), served in float32.
Writes prefetch.json and prefetch.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from typing import Dict, List, Optional

from tqdm import tqdm

from . import add_attention_backend_arg, kv_bytes_per_token_of, measured_commit, resolve_model, save_result

POLICIES = ("best_effort", "wait_complete", "timeout", "off")


def parse_mode(mode: str) -> tuple:
    """'timeout' -> ('timeout', 0); 'timeout:nice10' -> ('timeout', 10) (transfer.worker_nice)."""
    policy, _, rest = mode.partition(":")
    nice = 0
    if rest:
        if not rest.startswith("nice") or not rest[4:].isdigit() or not 0 <= int(rest[4:]) <= 19:
            raise ValueError(f"mode {mode!r}: expected POLICY or POLICY:niceN (N in 0..19)")
        nice = int(rest[4:])
    if policy not in POLICIES:
        raise ValueError(f"prefetch policy must be one of {POLICIES}, got {policy!r}")
    return policy, nice


def bench_config(storage: str, host_tokens: int, mode: str) -> dict:
    """FLEXFLOW_CONFIG of every server of the run (fill: the first mode's)."""
    policy, nice = parse_mode(mode)
    return {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
            "host_tier": {"capacity_tokens": int(host_tokens), "write_policy": "write_through",
                          "pin_memory": "never"},
            "storage_tier": {"enabled": True, "path": storage, "capacity_gb": 8.0, "write_through": True},
            "transfer": {"prefetch_policy": policy, "load_timeout_ms": 30000.0, "worker_nice": nice,
                         # generous: the comparison is prefetched vs host hit, not the budget
                         "prefetch_timeout_base_s": 30.0}}


def make_prompts(n: int, prefix_tokens: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    lo, hi = 100, max(101, vocab - 100)
    return [[rng.randrange(lo, hi) for _ in range(prefix_tokens)] for _ in range(n)]


def suffix(vocab: int, seed: int, n: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, max(101, vocab - 100)) for _ in range(n)]


def ratio_summary(phases: Dict[str, dict]) -> Dict[str, Optional[float]]:
    """median deep / median host, of the TTFT from arrival and of the time once the running slot was
    free (None when a phase has no samples)."""
    out: Dict[str, Optional[float]] = {}
    for key, name in (("ttft_s", "deep_over_host"), ("after_blocker_s", "deep_over_host_after_blocker")):
        deep, host = phases.get("deep", {}).get(key) or [], phases.get("host", {}).get(key) or []
        out[name] = round(statistics.median(deep) / statistics.median(host), 3) if deep and host and \
            statistics.median(host) > 0 else None
    return out


def _vocab(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f).get("vocab_size") or 32000)
    except (OSError, ValueError):
        return 32000


def _wait_written(url: str, pages: int, timeout: float) -> float:
    """Wait until the server's write-through has stored `pages` pages (its /metrics)."""
    from flexflow_sglang.tools.server_utils import flexflow_metrics
    end = time.monotonic() + timeout
    got = 0.0
    while time.monotonic() < end:
        try:
            got = flexflow_metrics(url).get("flexflow_pages_written_through", 0.0)
        except Exception:  # noqa: BLE001 - the server may still be exporting
            got = 0.0
        if got >= pages:
            break
        time.sleep(0.5)
    return got


def _phase(url: str, prompts: List[List[int]], sfx: List[List[int]], blocker: List[int], args) -> dict:
    """Blocker first, the targets once it runs; per target its latency and cached tokens."""
    from flexflow_sglang.tools.server_utils import generate
    n = len(prompts)
    out = {"ttft_s": [None] * n, "cached": [None] * n, "first_token": [None] * n, "errors": 0}
    t_arr, t_done, blk_done = [0.0] * n, [None] * n, [None]

    def blk():
        try:
            generate(url, input_ids=blocker, max_new_tokens=args.blocker_tokens, timeout=900)
        except Exception:  # noqa: BLE001
            out["errors"] += 1
        blk_done[0] = time.perf_counter()

    def one(i: int):
        t0 = t_arr[i] = time.perf_counter()
        try:
            r = generate(url, input_ids=prompts[i] + sfx[i], max_new_tokens=1, timeout=900)
        except Exception:  # noqa: BLE001 - counted; the others still measure
            out["errors"] += 1
            return
        t_done[i] = time.perf_counter()
        out["ttft_s"][i] = t_done[i] - t0
        out["cached"][i] = int(r["meta_info"].get("cached_tokens") or 0)
        out["first_token"][i] = (r.get("output_ids") or [None])[0]

    b = threading.Thread(target=blk)
    b.start()
    time.sleep(args.blocker_lead_s)  # the blocker holds the one running slot when the targets arrive
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts + [b]:
        t.join()
    # the blocker's decode is slowed by whatever else runs on the CPU (a prefetch's I/O here), so the
    # queue wait differs between phases; `after_blocker_s` is each target's time once the running
    # slot was free (its load-back and prefill, and those of targets ahead of it)
    out["blocker_s"] = round(blk_done[0] - (min(t_arr) - args.blocker_lead_s), 4) if blk_done[0] else None
    out["after_blocker_s"] = [round(d - max(a, blk_done[0] or a), 4) for a, d in zip(t_arr, t_done) if d is not None]
    out["targets_before_blocker_end"] = sum(1 for a in t_arr if blk_done[0] and a < blk_done[0])
    out["ttft_s"] = [x for x in out["ttft_s"] if x is not None]
    return out


def run(args) -> dict:
    import yaml

    from flexflow_sglang.tools.server_utils import SGLangServer, flexflow_metrics, flush_cache
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_model(args.model, args.out, "kv128k")
    dtype = args.dtype or ("float32" if args.model is None else "auto")
    vocab = _vocab(model)
    storage = os.path.join(args.out, "storage")
    if os.path.isdir(storage):
        import shutil
        shutil.rmtree(storage)
    prompts = make_prompts(args.targets, args.prefix_tokens, vocab, args.seed)
    blocker = suffix(vocab, args.seed + 999, 32)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    res = {"command": "flexflow bench prefetch " + " ".join(args.argv), "commit": measured_commit(), "model": model,
           "model_name": model_name, "dtype": dtype, "kv_bytes_per_token": kv_bytes_per_token_of(model, dtype),
           "targets": args.targets, "prefix_tokens": args.prefix_tokens, "blocker_tokens": args.blocker_tokens,
           "forward_threads": args.forward_threads,
           "modes": {}}

    def server(name: str, policy: str) -> SGLangServer:
        cfg = os.path.join(args.out, f"{name}.yaml")
        with open(cfg, "w") as f:
            yaml.safe_dump(bench_config(storage, args.host_tokens, policy), f)
        return SGLangServer(model, os.path.join(args.out, f"server-{name}.log"), radix_cache_backend="flexflow",
                            flexflow_config=cfg, max_total_tokens=args.max_total_tokens, max_running_requests=1,
                            extra_args=["--enable-metrics", "--dtype", dtype], timeout=args.start_timeout,
                            attention_backend=args.attention_backend,
                            env={"OMP_NUM_THREADS": str(args.forward_threads)} if args.forward_threads else None)

    bar = tqdm(total=1 + 2 * len(modes), desc="bench prefetch", unit="phase")
    from flexflow_sglang.tools.server_utils import generate
    with server("fill", modes[0]) as srv:
        for p in prompts:  # stored into the host tier and written through to storage
            generate(srv.url, input_ids=p, max_new_tokens=1, timeout=900)
        res["fill_pages_written"] = _wait_written(srv.url, args.targets * args.prefix_tokens, 300)
    bar.update(1)
    # one suffix per target, the same in every phase and mode: the first tokens must all be equal
    # (a load never changes an output). The host phase then also hits the suffix the deep phase
    # stored, so its TTFT is a slightly lower bar (the ratio is conservative); later modes find the
    # suffix in storage too.
    sfx = [suffix(vocab, 10_000 + i, args.suffix_tokens) for i in range(len(prompts))]
    for mode in modes:
        rec: Dict[str, dict] = {}
        with server(f"mode-{mode.replace(':', '-')}", mode) as srv:
            # a fresh server's first forward pays one-time set-up: not part of any phase
            generate(srv.url, input_ids=suffix(vocab, args.seed + 7, 32), max_new_tokens=4, timeout=900)
            rec["deep"] = _phase(srv.url, prompts, sfx, blocker, args)
            bar.update(1)
            flush_cache(srv.url)
            rec["host"] = _phase(srv.url, prompts, sfx, blocker, args)
            bar.update(1)
            try:
                m = flexflow_metrics(srv.url)
                rec["metrics"] = {k2: v for k2, v in m.items() if any(s in k2 for s in (
                    "prefetch", "hits_by_tier", "pages_loaded", "fetch", "load_back", "promote"))}
            except Exception as e:  # noqa: BLE001
                rec["metrics_error"] = repr(e)
        for ph in ("deep", "host"):
            xs, ys = rec[ph]["ttft_s"], rec[ph]["after_blocker_s"]
            rec[ph]["median_ttft_s"] = round(statistics.median(xs), 4) if xs else None
            rec[ph]["median_after_blocker_s"] = round(statistics.median(ys), 4) if ys else None
        rec.update(ratio_summary(rec))
        res["modes"][mode] = rec
    bar.close()
    # the same prompt's first token in every phase and mode (greedy): loads never change outputs
    firsts = {tuple(r[ph]["first_token"]) for r in res["modes"].values() for ph in ("deep", "host")}
    res["first_tokens_equal"] = len(firsts) == 1 and None not in next(iter(firsts))
    return res


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(res["modes"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(modes))
    for off, ph in ((-0.2, "deep"), (0.2, "host")):
        ax.bar([i + off for i in x], [1e3 * (res["modes"][m][ph].get("median_ttft_s") or 0) for m in modes], 0.4,
               label={"deep": "prefix only in storage", "host": "host-tier hit"}[ph])
    ax.set_xticks(list(x), [f"prefetch_policy\n{m}" for m in modes])
    ax.set_ylabel("median TTFT (ms), queued behind a blocker")
    ax.set_title(f"{res['model_name']}, {res['targets']} x {res['prefix_tokens']}-token prefixes", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="flexflow bench prefetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench-prefetch")
    ap.add_argument("--model", default=None, help="checkpoint dir, or 'smollm2' (default: the kv128k preset)")
    ap.add_argument("--dtype", default=None, help="SGLang --dtype (default float32 for the preset, else auto)")
    ap.add_argument("--modes", default="timeout,off",
                    help=f"prefetch policies to compare, of {POLICIES}; POLICY:niceN also sets transfer.worker_nice")
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=16)
    ap.add_argument("--blocker-tokens", type=int, default=64, help="tokens the blocker decodes while targets queue")
    ap.add_argument("--blocker-lead-s", type=float, default=0.5)
    ap.add_argument("--host-tokens", type=int, default=16384)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    add_attention_backend_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-threads", type=int, default=0,
                    help="OMP_NUM_THREADS of every server (0: torch's default, all cores); 1 on a 2-core machine "
                         "leaves a core to the transfer engine, as a GPU server's host CPU has")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.argv = argv
    for m in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            parse_mode(m)
        except ValueError as e:
            ap.error(f"--modes: {e}")
    for k in ("targets", "prefix_tokens", "suffix_tokens", "blocker_tokens", "host_tokens", "max_total_tokens"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be > 0, got {getattr(args, k)}")
    res = run(args)
    save_result(args.out, "prefetch", res, plot, "prefetch")
    print(f"model {res['model_name']}, {(res['kv_bytes_per_token'] or 0) // 1024} KB KV/token, "
          f"{res['targets']} targets x {res['prefix_tokens']} tokens, commit {res['commit']}")
    print(f"{'policy':14} {'deep TTFT ms':>13} {'host TTFT ms':>13} {'deep/host':>10} {'after slot':>11} "
          f"{'blocker s deep/host':>20}")
    nan = float("nan")
    for m, r in res["modes"].items():
        d, h = r["deep"].get("median_ttft_s"), r["host"].get("median_ttft_s")
        print(f"{m:14} {1e3 * d if d else nan:13.1f} {1e3 * h if h else nan:13.1f} "
              f"{r.get('deep_over_host') or nan:10.2f} {r.get('deep_over_host_after_blocker') or nan:11.2f} "
              f"{r['deep'].get('blocker_s') or nan:9.2f} / {r['host'].get('blocker_s') or nan:.2f}")
    print("first tokens equal in every phase and mode:", res["first_tokens_equal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
