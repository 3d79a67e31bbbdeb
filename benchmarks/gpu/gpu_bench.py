"""Driver of benchmarks/gpu/run.sh: the GPU checks, each bounded in time, results as JSON.

On a machine without CUDA, or with --dry-run, every step runs its CPU-side logic on CPU tensors
(small sizes) so the script is known to parse and run before it meets a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MiB = 1 << 20


def step_host_tier(out_dir: str, dry: bool) -> dict:
    from flexflow_sglang.tools.bench.host_tier_bench import run
    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    tokens, layers = (256, 2) if dry else (16384, 32)
    res = run(num_tokens=tokens, layers=layers, heads=8, head_dim=128, page_size=16, repeats=2 if dry else 10,
              checksums=None, progress=False, device=device)
    target = 0.9 if device == "cuda" else 0.8
    res["target_ratio"] = target
    res["target_met"] = {m: res[m]["store_ratio"] >= target and res[m]["load_ratio"] >= target
                         for m in ("with_checksums", "without_checksums") if m in res}
    return res


def _copy_time(dst, src, sync) -> float:
    sync()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    sync()
    return time.perf_counter() - t0


def _relay(dst, src, via, chunk: int, sync) -> float:
    """src -> via -> dst, chunk by chunk, the second hop of chunk i overlapping the first of i+1."""
    n = src.numel()
    sync()
    t0 = time.perf_counter()
    if src.is_cuda:
        s1, s2 = torch.cuda.Stream(src.device), torch.cuda.Stream(via.device)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            with torch.cuda.stream(s1):
                via[i:j].copy_(src[i:j], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(s1)
            with torch.cuda.stream(s2):
                s2.wait_event(ev)
                dst[i:j].copy_(via[i:j], non_blocking=True)
    else:
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            via[i:j].copy_(src[i:j])
            dst[i:j].copy_(via[i:j])
    sync()
    return time.perf_counter() - t0


def step_peer(out_dir: str, dry: bool) -> dict:
    """Direct vs relay vs split gpu0 -> gpu1 with a competing copy stream saturating gpu0 <-> gpu1."""
    from flexflow_sglang import NodeAgent, PathSelector, PathType, Topology, TransferRequest
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dry and n_gpu < 2:
        return {"skipped": f"needs >= 2 GPUs, found {n_gpu}"}
    cuda = not dry
    devs = ([torch.device("cuda", i) for i in range(3 if n_gpu >= 3 else 2)] if cuda
            else [torch.device("cpu")] * 3)
    nbytes = 8 * MiB if dry else 256 * MiB
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=devs[0])
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=devs[1])
    via = torch.zeros(nbytes, dtype=torch.uint8, device=devs[-1])
    res = {"bytes": nbytes, "gpus": n_gpu, "relay_gpu": str(devs[-1])}
    res["direct_idle_s"] = _copy_time(dst, src, sync)
    stop = threading.Event()
    bg_bytes = [0]

    def competitor():  # saturate the direct link with another copy stream
        a = torch.empty(64 * MiB if cuda else MiB, dtype=torch.uint8, device=devs[0])
        b = torch.empty_like(a, device=devs[1])
        stream = torch.cuda.Stream(devs[0]) if cuda else None
        while not stop.is_set():
            if cuda:
                with torch.cuda.stream(stream):
                    b.copy_(a, non_blocking=True)
                stream.synchronize()
            else:
                b.copy_(a)
            bg_bytes[0] += a.numel()

    th = threading.Thread(target=competitor, daemon=True)
    th.start()
    time.sleep(0.2)
    try:
        res["direct_contended_s"] = _copy_time(dst, src, sync)
        dst.zero_()
        res["relay_contended_s"] = _relay(dst, src, via, 8 * MiB if cuda else MiB, sync)
        res["relay_bytes_ok"] = bool(torch.equal(dst.cpu(), src.cpu()))
        # the selector's view: discovered topology (NVML) on a GPU box, a mock mesh otherwise
        topo = Topology.discover() if cuda else Topology.make_mock_dgx(3)
        if not topo.nodes_of_kind("gpu"):
            topo = Topology.make_mock_dgx(3)
        agent = NodeAgent(topo, source="mock")
        if topo.links_between("gpu0", "gpu1"):
            agent.set_utilization("gpu0", "gpu1", 0.85)
        d = PathSelector(topo, agent).select(TransferRequest("gpu0", "gpu1", nbytes))
        res["selector_decision"] = d.to_dict()
        if d.chosen_type == PathType.SplitPath:
            shares = [sp.nbytes for sp in d.subpaths]
            k = shares[0]
            dst.zero_()
            sync()
            t0 = time.perf_counter()
            direct_first = d.subpaths[0].type == PathType.Direct
            a, b = (slice(0, k), slice(k, nbytes)) if direct_first else (slice(k, nbytes), slice(0, k))
            dst[a].copy_(src[a], non_blocking=True)
            _relay(dst[b], src[b], via[b], 8 * MiB if cuda else MiB, lambda: None)
            sync()
            res["split_contended_s"] = time.perf_counter() - t0
            res["split_bytes_ok"] = bool(torch.equal(dst.cpu(), src.cpu()))
    finally:
        stop.set()
        th.join(10)
    for k in [k for k in res if k.endswith("_s")]:
        res[k.replace("_s", "_gbps")] = round(nbytes / res[k] / 1e9, 3)
    res["relay_over_direct_contended"] = round(res["direct_contended_s"] / res["relay_contended_s"], 3)
    return res


def step_verify(out_dir: str, dry: bool) -> dict:
    """Plain server baseline vs flexflow server test phase on the tiny model (GPU when present)."""
    from flexflow_sglang.tools.cpu_support.tiny_model import make_tiny_model
    from flexflow_sglang.tools.server_utils import SGLangServer
    prompts = os.path.join(ROOT, "flexflow_sglang", "data", "prompts.jsonl")
    if dry:
        return {"skipped": "dry run: would build the tiny model, run verify_outputs baseline on a plain server and "
                           "--phase test on a flexflow server", "prompts": os.path.exists(prompts)}
    model = make_tiny_model(os.path.join(out_dir, "tiny-model"))
    base = os.path.join(out_dir, "baseline.json")
    res = {}
    cfg = os.path.join(ROOT, "configs", "dgx-a100.yaml")
    for name, kw in (("plain", {}), ("flexflow", {"radix_cache_backend": "flexflow", "flexflow_config": cfg})):
        with SGLangServer(model, os.path.join(out_dir, f"server-{name}.log"), timeout=180,
                          extra_args=["--enable-metrics"], **kw) as srv:
            phase = ["--phase", "baseline", "--out", base] if name == "plain" else \
                ["--phase", "test", "--baseline", base]
            import subprocess
            p = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.verify_outputs", "--no-progress", "--url",
                                srv.url, "--prompts", prompts, *phase], capture_output=True, text=True, timeout=200)
            res[name] = {"rc": p.returncode, "last_line": (p.stdout.strip().splitlines() or [""])[-1],
                         "startup_s": srv.startup_s}
    res["ok"] = res["flexflow"]["rc"] == 0 and res["flexflow"]["last_line"] == "Total mismatches: 0"
    return res


def step_layerwise(out_dir: str, dry: bool) -> dict:
    """Host-hit TTFT with layer-wise load-back (side stream + per-layer events) on vs off, one ABAB
    round on the kv128k preset in bfloat16 (64 KB of KV per token, 256 MiB per 4k-token hit)."""
    argv = ["--out", os.path.join(out_dir, "layerwise"), "--families", "2", "--repeats", "3", "--rounds", "1",
            "--prefix-tokens", "4096", "--dtype", "bfloat16", "--host-gb", "4", "--max-total-tokens", "20480",
            "--start-timeout", "150"]
    from flexflow_sglang.tools.bench.layerwise_bench import main as layerwise_main, parse_args
    parsed = parse_args(argv)  # a dry run still checks the arguments against the bench's parser
    if dry:
        return {"skipped": "dry run: would run flexflow bench layerwise " + " ".join(argv),
                "prefix_tokens": parsed.prefix_tokens}
    rc = layerwise_main(argv)
    with open(os.path.join(out_dir, "layerwise", "bench_layerwise.json")) as f:
        res = json.load(f)
    return {"rc": rc, "summary": res["summary"], "commit": res["commit"], "target_ratio": 0.75}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summary = {"dry_run": args.dry_run, "cuda": torch.cuda.is_available(),
               "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
               "torch": torch.__version__, "steps": {}}
    dry = args.dry_run or not torch.cuda.is_available()
    for name, fn in (("host_tier", step_host_tier), ("peer_relay_split", step_peer), ("verify_outputs", step_verify),
                     ("layerwise", step_layerwise)):
        t0 = time.time()
        try:
            r = fn(args.out, dry)
        except Exception as e:  # one failing step must not hide the others' results
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        r["wall_s"] = round(time.time() - t0, 1)
        summary["steps"][name] = r
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(r, f, indent=2)
        print(f"[{name}] {json.dumps({k: v for k, v in r.items() if k != 'traceback'})[:400]}", flush=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(summary, f, indent=2)
    failed = [k for k, v in summary["steps"].items() if "error" in v]
    print(f"wrote {os.path.join(args.out, 'gpu_bench.json')}; failed steps: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
