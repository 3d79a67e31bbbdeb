"""Where `EXTEND_KERNEL_MAX_ROWS` (backend/prefix_sdpa.py) comes from: one prefix hit's extend
attention (every layer; a cached prefix plus a suffix of new tokens) through `flexflow_sdpa`'s two
paths, side by side in one process, alternating per repeat, for a sweep of suffix lengths:

- paged: the compiled kernel reads the paged KV in place (the path for short suffixes);
- sdpa: gather the request's keys and values into new tensors, then SDPA with the shifted causal
  mask (the path for long suffixes, and what every hit took before the kernel).

Outputs of the two are compared (max abs difference).

    python benchmarks/paged_extend.py [--layers 16] [--heads 8] [--kv-heads 8] [--head-dim 128]
        [--prefix 2048] [--suffixes 1,16,64,128,256,512] [--dtype float32] [--threads 2]
        [--repeats 5] [--out out/paged_extend]

Defaults are the kv128k preset's shapes (16 layers x 8 KV heads x 128, float32: 128 KB of KV per
token) with the layer-wise benchmark's 2,048-token prefix; slots are scattered over a pool 4x the
request's tokens, as in a server that has run a while. Writes paged_extend.json and
paged_extend.png under --out.
"""
import argparse
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

from flexflow_sglang.backend import prefix_sdpa
from flexflow_sglang.tools.bench import measured_commit


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffixes", default="1,16,64,128,256,512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="out/paged_extend")
    a = ap.parse_args()
    if prefix_sdpa._pa is None:
        raise SystemExit("paged_extend: flexflow_sglang._paged_attention is not built (pip install -e .)")
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    suffixes = [int(x) for x in a.suffixes.split(",") if x.strip()]
    g = torch.Generator().manual_seed(0)
    context = a.prefix + max(suffixes)
    pool = 4 * context
    K = [torch.randn(pool, a.kv_heads, a.head_dim, generator=g).to(dt) for _ in range(a.layers)]
    V = [torch.randn(pool, a.kv_heads, a.head_dim, generator=g).to(dt) for _ in range(a.layers)]
    r2t = torch.zeros(2, context, dtype=torch.int32)
    r2t[1] = (torch.randperm(pool - 1, generator=g)[:context] + 1).to(torch.int32)
    backend = object.__new__(prefix_sdpa.prefix_sdpa_backend_class())
    group = a.heads // a.kv_heads
    scale = a.head_dim ** -0.5
    default_rows = prefix_sdpa.EXTEND_KERNEL_MAX_ROWS

    def forward(q, out, suffix, kernel_rows):
        prefix_sdpa.EXTEND_KERNEL_MAX_ROWS = kernel_rows
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)
        for layer in range(a.layers):
            backend._run_sdpa_forward_extend(q, out, K[layer], V[layer], r2t, t([1]), t([a.prefix + suffix]),
                                             t([a.prefix]), t([suffix]), None, scaling=scale,
                                             enable_gqa=group > 1, causal=True)

    result = {"command": "python benchmarks/paged_extend.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "commit": measured_commit(), "kv_bytes_per_token": 2 * a.layers * a.kv_heads * a.head_dim * K[0].element_size(),
        "kernel_max_rows": default_rows, "runs": []}
    try:
        for suffix in tqdm(suffixes, desc="paged extend", unit="suffix"):
            q = torch.randn(suffix, a.heads, a.head_dim, generator=g).to(dt)
            out_p, out_s = torch.empty_like(q), torch.empty_like(q)
            paths = [("paged", lambda: forward(q, out_p, suffix, 1 << 30)),
                     ("sdpa", lambda: forward(q, out_s, suffix, 0))]
            times = {name: [] for name, _ in paths}
            for _, fn in paths:  # warm-up
                fn()
            for r in range(a.repeats):
                for name, fn in (paths if r % 2 == 0 else paths[::-1]):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            run = {"suffix": suffix, "rows": suffix * group, "median_ms": {k: round(v, 2) for k, v in med.items()},
                   "paged_over_sdpa": round(med["paged"] / med["sdpa"], 3),
                   "max_abs_diff": float((out_p.float() - out_s.float()).abs().max())}
            result["runs"].append(run)
            tqdm.write(f"suffix {suffix} ({run['rows']} rows): paged {med['paged']:.1f} ms, sdpa "
                       f"{med['sdpa']:.1f} ms ({run['paged_over_sdpa']:.2f}x); max |diff| {run['max_abs_diff']:.2e}")
    finally:
        prefix_sdpa.EXTEND_KERNEL_MAX_ROWS = default_rows
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "paged_extend.json"), "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        xs = [r["suffix"] for r in result["runs"]]
        for name in ("sdpa", "paged"):
            ax.plot(xs, [r["median_ms"][name] for r in result["runs"]], marker="o", label=name)
        ax.axvline(default_rows / group, color="grey", ls=":", label="kernel's row limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens after the cached prefix")
        ax.set_ylabel("ms per extend (all layers)")
        ax.set_title(f"extend attention, {a.prefix}-token prefix, {a.dtype}, {a.threads} thread(s)", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "paged_extend.png"), dpi=120)
    except Exception as e:  # noqa: BLE001 - the JSON is the record
        print(f"paged_extend: plot failed: {e}")
    print(f"wrote {os.path.join(a.out, 'paged_extend.json')}")


if __name__ == "__main__":
    main()
