"""Issue 20's experiment, reproducible: does a host-tier hit reproduce the device hit it replaces (bf16)?

For each server mode: a plain SGLang server records the baseline (R1 fresh in file order, R2 device
hits), then two flexflow servers run `verify_outputs --phase test` (R1, R2d device hit, flush, R2 host
hit) with `host_tier.canonical_on_insert` off (the behaviour before the fix) and on (the default),
each with `FLEXFLOW_KV_DUMP_DIR`, so that every host-loaded prefix is compared byte for byte with the
device prefix of the same tokens read before the flush.

    python benchmarks/bf16_drift.py --out runs/bf16-drift [--modes page1,page4-chunked,tp2] \\
        [--prompts flexflow_sglang/tools/data/chat_prompts.jsonl] [--model DIR]

Writes <out>/bf16_drift.json and prints one line per (mode, setting). Model: SmolLM2-135M-Instruct
(bf16) from `flexflow make-model smollm2` unless --model is given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))

MODES = {"page1": {}, "page4-chunked": {"page_size": 4, "chunked_prefill_size": 128}, "tp2": {"tp_size": 2}}


def _verify(*args) -> tuple:
    p = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.verify_outputs", "--no-progress", *args],
                       capture_output=True, text=True, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    return p.returncode, p.stdout, (lines[-1] if lines else p.stderr[-500:])


def main(argv=None) -> int:
    from tqdm import tqdm

    from flexflow_sglang.tools.cpu_support.real_model import make_real_model
    from flexflow_sglang.tools.server_utils import SGLangServer
    from server_helpers import compare_kv_dumps

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bf16-drift")
    ap.add_argument("--modes", default="page1,page4-chunked,tp2")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "flexflow_sglang", "data", "chat_prompts.jsonl"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--max-total-tokens", type=int, default=24000)
    ap.add_argument("--mem-fraction-static", type=float, default=0.15,
                    help="large enough that every server's pool is --max-total-tokens (same pool on both sides)")
    ap.add_argument("--reuse-baseline", action="store_true", help="keep <out>/<mode>/baseline.json if present")
    args = ap.parse_args(argv)
    # a SIGTERM (timeout, Ctrl-C from a supervisor) unwinds the with-blocks: no server is left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    model = args.model or make_real_model("smollm2")
    rows = []
    modes = [m for m in args.modes.split(",") if m]
    bar = tqdm(total=3 * len(modes), desc="servers", unit="server")
    for mode in modes:
        sa = MODES[mode]
        d = os.path.join(args.out, mode)
        os.makedirs(d, exist_ok=True)
        base = os.path.join(d, "baseline.json")
        if args.reuse_baseline and os.path.exists(base):
            rc, last = 0, "reused"
        else:
            with SGLangServer(model, os.path.join(d, "plain.log"), max_total_tokens=args.max_total_tokens,
                              mem_fraction_static=args.mem_fraction_static, **sa) as srv:
                rc, out, last = _verify("--phase", "baseline", "--url", srv.url, "--prompts", args.prompts,
                                        "--out", base, "--max-new-tokens", str(args.max_new_tokens))
        bar.update(1)
        if rc != 0:
            print(f"{mode}: baseline failed: {last}")
            return 1
        ref = json.load(open(base))["prompts"]
        ref_drift = sum(1 for e in ref.values() if not e.get("r2", {}).get("equals_r1", True))
        for canonical in (False, True):
            tag = f"canonical_{'on' if canonical else 'off'}"
            cfg = os.path.join(d, f"{tag}.yaml")
            with open(cfg, "w") as f:
                yaml.safe_dump({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                                "host_tier": {"capacity_gb": 1.0, "canonical_on_insert": canonical}}, f)
            dump = os.path.join(d, f"kv-{tag}")
            report = os.path.join(d, f"report-{tag}.json")
            t0 = time.time()
            with SGLangServer(model, os.path.join(d, f"flexflow-{tag}.log"), radix_cache_backend="flexflow",
                              flexflow_config=cfg, max_total_tokens=args.max_total_tokens,
                              mem_fraction_static=args.mem_fraction_static,
                              env={"FLEXFLOW_KV_DUMP_DIR": dump}, **sa) as srv:
                rc, out, last = _verify("--phase", "test", "--url", srv.url, "--prompts", args.prompts,
                                        "--baseline", base, "--out", report)
            bar.update(1)
            rep = json.load(open(report)) if os.path.exists(report) else {}
            prompts = rep.get("prompts", {})
            kv = compare_kv_dumps(dump)
            row = {"mode": mode, "setting": tag, "total_mismatches": rep.get("total_mismatches"),
                   "prompts": len(prompts), "prompts_with_mismatch": sum(1 for p in prompts.values() if not p["ok"]),
                   "r2_vs_r2d_mismatches": sum(1 for p in prompts.values()
                                               if any("R2d (device hit" in x for x in p["problems"])),
                   "r1_mismatches": sum(1 for p in prompts.values() if any(x.startswith("R1 vs") for x in p["problems"])),
                   "drift_vs_fresh": rep.get("drift_vs_fresh"), "reference_drift": ref_drift,
                   "kv_loaded_records": kv["loaded"], "kv_compared": kv["compared"], "kv_byte_mismatches": kv["mismatched"],
                   "kv_stitched": kv["stitched"], "kv_details": kv["details"][:10], "wall_s": round(time.time() - t0, 1),
                   "last_line": last}
            rows.append(row)
            print(f"{mode:14s} {tag:13s} mismatches {row['total_mismatches']} ({row['prompts_with_mismatch']} of "
                  f"{row['prompts']} prompts; R2 vs R2d {row['r2_vs_r2d_mismatches']}, R1 {row['r1_mismatches']}), "
                  f"KV byte mismatches {kv['mismatched']} of {kv['compared']} compared; drift vs fresh "
                  f"{row['drift_vs_fresh']} (plain server's own: {ref_drift})", flush=True)
    bar.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    with open(os.path.join(args.out, "bf16_drift.json"), "w") as f:
        json.dump({"model": model, "prompts": args.prompts, "commit": commit, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
