"""`flexflow bench multiturn`: multi-turn conversations in the style of SGLang's
benchmark/hicache/bench_multiturn.py, on plain SGLang and on the flexflow backend, side by side.

`--clients` conversations run `--rounds` rounds each. Round r of a client sends its whole history so
far (a system prompt, then for every earlier round the user turn and the model's own reply) plus a
new user turn of `--request-length` tokens, and generates `--output-length` tokens greedily; the
reply is appended to the history, as bench_multiturn does. Clients wait in one FIFO queue and
`--max-parallel` workers take them in turn, so between two rounds of one client every other client
runs one: once the histories outgrow the device KV pool (`--max-total-tokens`), plain SGLang
prefills them again while flexflow loads them back from its host tier (and the storage tier with
`--storage`). Requests carry token ids (`/generate` with `input_ids`), so a tiny preset with a
word-level tokenizer (kv128k: 128 KB of KV per token) runs the same workload as a real model.

Reported per backend and round: mean / p50 / p99 TTFT (streamed: time to the first chunk), request
throughput, the share of prompt tokens served from cache (the server's `cached_tokens`) and from
flexflow's tiers; then flexflow / plain ratios over rounds 2.. (round 1 has nothing to reuse) and
whether the two servers generated the same tokens for every request.

    flexflow bench multiturn --model kv128k --host-tokens 4096 --storage --max-total-tokens 4096 \\
        --attention-backend flexflow_sdpa --out runs/bench-multiturn
JSON and a PNG go to --out.
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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import requests
from tqdm import tqdm

from . import add_attention_backend_arg, add_storage_tier_args, flush_dirty_pages, measured_commit, nearest_rank
from .serve import stream_generate

#: lowest token id a generated turn uses: below it sit a tokenizer's special tokens (BOS, EOS, pad)
FIRST_PLAIN_TOKEN = 100


def make_turns(clients: int, rounds: int, system_len: int, request_len: int, vocab: int,
               seed: int) -> List[List[List[int]]]:
    """turns[c][0] is client c's system prompt, turns[c][r + 1] its user turn of round r: random token
    ids in [FIRST_PLAIN_TOKEN, vocab), deterministic in `seed`, different per client."""
    if vocab <= FIRST_PLAIN_TOKEN + 1:
        raise ValueError(f"vocab size {vocab} leaves no token ids above {FIRST_PLAIN_TOKEN}")
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]
    return [[draw(system_len)] + [draw(request_len) for _ in range(rounds)] for _ in range(clients)]


def run_conversations(url: str, turns, rounds: int, output_len: int, max_parallel: int,
                      timeout: float, desc: str) -> List[dict]:
    """Every client's rounds, FIFO over clients, `max_parallel` in flight; one record per request.
    A failed request stops the run (raised): a benchmark with holes would compare unlike work."""
    history = [list(t[0]) for t in turns]
    ready = deque(range(len(turns)))
    done_rounds = [0] * len(turns)
    cv = threading.Condition()
    state = {"inflight": 0, "error": None}
    records: List[dict] = []
    bar = tqdm(total=len(turns) * rounds, desc=desc, leave=False, mininterval=0.5)
    t_start = time.perf_counter()

    def worker():
        while True:
            with cv:
                # a client re-enters the queue only after its reply: wait while others are in flight
                while not ready and state["inflight"] > 0 and state["error"] is None:
                    cv.wait()
                if not ready or state["error"] is not None:
                    return
                c = ready.popleft()
                r = done_rounds[c]
                state["inflight"] += 1
                prompt = history[c] + turns[c][r + 1]
            try:
                res = stream_generate(url, None, output_len, timeout, input_ids=prompt)
            except Exception as e:  # noqa: BLE001 - handed to the caller below
                with cv:
                    state["error"] = e
                    state["inflight"] -= 1
                    cv.notify_all()
                return
            with cv:
                history[c] = prompt + res["output_ids"]
                done_rounds[c] += 1
                if done_rounds[c] < rounds:
                    ready.append(c)
                records.append({"client": c, "round": r, "prompt_tokens": len(prompt),
                                "t_end_s": time.perf_counter() - t_start, **res})
                state["inflight"] -= 1
                cv.notify_all()
            bar.update(1)

    with ThreadPoolExecutor(max_workers=max_parallel) as ex:
        for f in [ex.submit(worker) for _ in range(max_parallel)]:
            f.result()
    bar.close()
    if state["error"] is not None:
        raise RuntimeError(f"a request failed: {state['error']}")
    return records


def round_stats(records: List[dict], rnd: Optional[int] = None) -> dict:
    rs = [x for x in records if rnd is None or x["round"] == rnd]
    if not rs:
        return {}
    ttft = [x["ttft_s"] * 1e3 for x in rs]
    prompt = sum(int(x["meta"].get("prompt_tokens", x["prompt_tokens"]) or 0) for x in rs)
    cached = sum(int(x["meta"].get("cached_tokens", 0) or 0) for x in rs)
    # SGLang's per-request breakdown: {"device", "host"[, "storage"]}. A prefix prefetched from the
    # storage tier and loaded back counts as "storage", so the deeper tiers' share is both together.
    details = [x["meta"].get("cached_tokens_details") or {} for x in rs]
    host = sum(int(d.get("host", 0) or 0) for d in details)
    storage = sum(int(d.get("storage", 0) or 0) for d in details)
    span = max(x["t_end_s"] for x in rs) - min(x["t_end_s"] - x["e2e_s"] for x in rs)
    return {"requests": len(rs), "mean_ttft_ms": statistics.fmean(ttft), "median_ttft_ms": statistics.median(ttft),
            "p99_ttft_ms": nearest_rank(ttft, 0.99), "request_throughput": len(rs) / span if span > 0 else 0.0,
            "prompt_tokens": prompt, "cached_ratio": cached / prompt if prompt else 0.0,
            "tier_ratio": (host + storage) / prompt if prompt else 0.0,
            "host_ratio": host / prompt if prompt else 0.0, "storage_ratio": storage / prompt if prompt else 0.0}


def summarize(results: List[dict]) -> dict:
    """flexflow / plain over rounds 2.. (the rounds with something to reuse), and output identity."""
    by = {r["backend"]: r for r in results if r.get("ran")}
    if "baseline" not in by or "flexflow" not in by:
        return {}
    b, f = by["baseline"]["later_rounds"], by["flexflow"]["later_rounds"]
    ratios = {k: (f[k] / b[k] if b.get(k) else None)
              for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "request_throughput")}
    key = lambda x: (x["client"], x["round"])
    bo = {key(x): x["output_ids"] for x in by["baseline"]["records"]}
    fo = {key(x): x["output_ids"] for x in by["flexflow"]["records"]}
    same = sum(1 for k in bo if fo.get(k) == bo[k])
    return {"later_rounds_flexflow_over_plain": ratios,
            "later_rounds_cached_ratio": {"plain": b["cached_ratio"], "flexflow": f["cached_ratio"]},
            "outputs_identical": same == len(bo) == len(fo), "requests_with_identical_output": same,
            "requests": len(bo)}


#: issue 13's serving targets, flexflow / plain over rounds 2..: mean TTFT at most, requests/s at least
TARGET_TTFT_RATIO, TARGET_THROUGHPUT_RATIO = 0.5, 1.5


def aggregate(summaries: List[dict]) -> dict:
    """Repeats of the same paired run: min / median / max of each ratio, how many repeats met both
    targets, and whether every repeat's outputs were identical. A repeat with a missing backend
    (empty summary) counts as not met."""
    keys = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "request_throughput")
    done = [s for s in summaries if s]
    out: dict = {"repeats": len(summaries), "paired": len(done)}
    for k in keys:
        xs = sorted(s["later_rounds_flexflow_over_plain"][k] for s in done
                    if s["later_rounds_flexflow_over_plain"].get(k) is not None)
        if xs:
            out[k] = {"min": xs[0], "median": statistics.median(xs), "max": xs[-1]}
    out["both_targets_met"] = sum(
        1 for s in done
        if s["later_rounds_flexflow_over_plain"]["mean_ttft_ms"] is not None
        and s["later_rounds_flexflow_over_plain"]["mean_ttft_ms"] <= TARGET_TTFT_RATIO
        and (s["later_rounds_flexflow_over_plain"]["request_throughput"] or 0) >= TARGET_THROUGHPUT_RATIO)
    out["outputs_identical_every_repeat"] = bool(done) and len(done) == len(summaries) and all(
        s["outputs_identical"] for s in done)
    return out


def run_backend(name: str, model: str, turns, args) -> dict:
    from flexflow_sglang.tools.server_utils import SGLangServer, ServerStartError
    from .serve import _root_cause
    kw = {"radix_cache_backend": "flexflow", "flexflow_config": args.config} if name == "flexflow" else {}
    log = os.path.join(args.out, f"server-{name}.log")
    server = SGLangServer(model, log, max_total_tokens=args.max_total_tokens, timeout=args.start_timeout,
                          page_size=args.page_size, max_running_requests=max(4, args.max_parallel),
                          attention_backend=args.attention_backend,
                          extra_args=["--enable-metrics", "--dtype", args.dtype],
                          env={"OMP_NUM_THREADS": str(args.forward_threads)} if args.forward_threads else None, **kw)
    synced_s = flush_dirty_pages()  # the previous server's writes are not this one's cost
    try:
        server.start()
    except ServerStartError as e:
        return {"backend": name, "ran": False, "error": _root_cause(log) or str(e).splitlines()[0][:300], "log": log}
    from .serve import _flexflow_counters
    try:
        before = _flexflow_counters(server.url)
        records = run_conversations(server.url, turns, args.rounds, args.output_length, args.max_parallel,
                                    args.request_timeout, f"{name}")
        time.sleep(1.1)  # the backend exports its counters at most once a second
        after = _flexflow_counters(server.url)
    except (RuntimeError, requests.RequestException) as e:
        return {"backend": name, "ran": False, "error": str(e)[:600], "log": log}
    finally:
        server.stop()
    records.sort(key=lambda x: (x["round"], x["client"]))
    # what the data plane did (deltas): loads per tier, prefetches, timeouts, drops
    moved = {k[len("flexflow_"):]: after[k] - before.get(k, 0) for k in after
             if "sched" not in k and after[k] - before.get(k, 0)}
    return {"backend": name, "ran": True, "startup_s": server.startup_s, "synced_s": round(synced_s, 3), "log": log,
            "records": records,
            "flexflow_counters": moved,
            "rounds": [round_stats(records, r) for r in range(args.rounds)],
            "later_rounds": round_stats([x for x in records if x["round"] > 0])}


def plot(results: List[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r, style in zip([r for r in results if r.get("ran")], ("o-", "s-")):
        xs = [i + 1 for i, s in enumerate(r["rounds"]) if s]
        ax.plot(xs, [s["mean_ttft_ms"] for s in r["rounds"] if s], style, label=r["backend"])
        for x, s in zip(xs, [s for s in r["rounds"] if s]):
            ax.annotate(f"{s['cached_ratio']:.0%}", (x, s["mean_ttft_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 4), ha="center")
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT ms (label: prompt tokens from cache)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="flexflow bench multiturn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench-multiturn")
    ap.add_argument("--model", default="kv128k",
                    help="a tiny_model preset (kv128k: 8B-sized KV), 'smollm2' (the real model) or a model dir")
    ap.add_argument("--backends", default="baseline,flexflow", help="comma list of baseline, flexflow")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--system-length", type=int, default=256, help="tokens of each client's first message")
    ap.add_argument("--request-length", type=int, default=256, help="tokens of each new user turn")
    ap.add_argument("--output-length", type=int, default=8)
    ap.add_argument("--max-parallel", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=4096, help="device KV pool of every server")
    ap.add_argument("--host-tokens", type=int, default=4096, help="host tier of the flexflow server (tokens)")
    ap.add_argument("--storage", action="store_true", help="a storage tier under --out catches host-tier spills")
    add_storage_tier_args(ap)
    ap.add_argument("--config", default=None, help="FLEXFLOW_CONFIG instead of --host-tokens/--storage")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="SGLang --dtype (default: float32 for a tiny preset, else auto)")
    add_attention_backend_arg(ap)
    ap.add_argument("--forward-threads", type=int, default=0, help="OMP_NUM_THREADS of every server (0: all cores)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="paired runs of every backend (order reversed on every other one; a fresh storage "
                         "tier each, unless --config names one): min / median / max of each ratio")
    args = ap.parse_args(argv)
    for k in ("clients", "rounds", "system_length", "request_length", "output_length", "max_parallel",
              "max_total_tokens", "host_tokens", "repeats"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("baseline", "flexflow") for b in backends):
        ap.error(f"--backends: {args.backends!r}; valid: baseline, flexflow")
    from .sglang_serving import resolve_served_model, write_config
    commit = measured_commit()  # before the runs: the code that ran, not HEAD after them
    os.makedirs(args.out, exist_ok=True)
    model, model_name = resolve_served_model(args)
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    turns = make_turns(args.clients, args.rounds, args.system_length, args.request_length, vocab, args.seed)
    repeats = []
    for rep in range(args.repeats):
        # each repeat in its own directory with a fresh storage tier (a warm one would carry the last
        # repeat's pages); odd repeats run the backends in reverse order, so drift on a noisy machine
        # does not always favour the same one
        rep_out = args.out if args.repeats == 1 else os.path.join(args.out, f"repeat{rep + 1}")
        os.makedirs(rep_out, exist_ok=True)
        rep_args = argparse.Namespace(**vars(args))
        rep_args.out = rep_out
        results = []
        order = backends if rep % 2 == 0 else backends[::-1]
        for name in tqdm(order, desc=f"bench multiturn {rep + 1}/{args.repeats}", unit="server"):
            if name == "flexflow" and args.config is None:
                rep_args.config = write_config(rep_out, args.host_tokens, args.storage,  # fresh storage tier
                                               args.storage_layout, args.storage_backend)
            r = run_backend(name, model, turns, rep_args)
            results.append(r)
            if not r.get("ran"):
                print(f"{name}: {r['error']}", file=sys.stderr)
        results.sort(key=lambda r: backends.index(r["backend"]))
        repeats.append({"out": rep_out, "results": results, "summary": summarize(results)})
        try:
            plot(results, os.path.join(rep_out, "bench_multiturn.png"), f"multi-turn, {model_name}")
        except Exception as e:  # noqa: BLE001 - the JSON is the result
            print(f"bench multiturn: plot failed: {e}", file=sys.stderr)
    workload = {k: getattr(args, k) for k in ("clients", "rounds", "system_length", "request_length",
                                              "output_length", "max_parallel", "max_total_tokens", "host_tokens",
                                              "storage", "storage_layout", "storage_backend", "config", "page_size", "dtype",
                                              "attention_backend", "forward_threads", "seed", "repeats")}
    results, summary = repeats[0]["results"], repeats[0]["summary"]
    out = {"command": "flexflow bench multiturn " + " ".join(argv), "commit": commit, "model": model_name,
           "workload": workload, "results": results, "summary": summary}
    if args.repeats > 1:
        out["repeats"] = repeats
        out["across_repeats"] = aggregate([r["summary"] for r in repeats])
    with open(os.path.join(args.out, "bench_multiturn.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"model {model_name}, commit {out['commit']}")
    print(f"{'backend':10} {'round':>5} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'req/s':>7} {'cached':>7} {'tiers':>7}")
    for i_rep, rp in enumerate(repeats):
        if args.repeats > 1:
            print(f"repeat {i_rep + 1}")
        for r in rp["results"]:
            for i, s in enumerate(r.get("rounds", [])):
                if s:
                    print(f"{r['backend']:10} {i + 1:5d} {s['mean_ttft_ms']:10.1f} {s['median_ttft_ms']:8.1f} "
                          f"{s['p99_ttft_ms']:8.1f} {s['request_throughput']:7.2f} {s['cached_ratio']:7.1%} "
                          f"{s['tier_ratio']:7.1%}")
    if args.repeats > 1:
        for i_rep, rp in enumerate(repeats):
            print(f"repeat {i_rep + 1}: " + json.dumps(rp["summary"].get("later_rounds_flexflow_over_plain")))
        summary = out["across_repeats"]
    print(json.dumps(summary, indent=1))
    print(f"wrote {os.path.join(args.out, 'bench_multiturn.json')} and the plots")
    return 0 if all(r.get("ran") for rp in repeats for r in rp["results"]) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
