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

import torch
from tqdm import tqdm

from _attention_bench import (add_shape_args, alternating_medians, new_record, random_pool, require_kernel,
                              scattered_slots, write_record)
from flexflow_sglang.backend import prefix_sdpa


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap, "out/paged_extend")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffixes", default="1,16,64,128,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    require_kernel("paged_extend")
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    suffixes = [int(x) for x in a.suffixes.split(",") if x.strip()]
    g = torch.Generator().manual_seed(0)
    context = a.prefix + max(suffixes)
    pool = 4 * context
    K, V = random_pool(a, pool, g)
    r2t = torch.zeros(2, context, dtype=torch.int32)
    r2t[1] = scattered_slots(pool, context, g)
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

    result = new_record("paged_extend", a, K, kernel_max_rows=default_rows)
    try:
        for suffix in tqdm(suffixes, desc="paged extend", unit="suffix"):
            q = torch.randn(suffix, a.heads, a.head_dim, generator=g).to(dt)
            out_p, out_s = torch.empty_like(q), torch.empty_like(q)
            med = alternating_medians([("paged", lambda: forward(q, out_p, suffix, 1 << 30)),
                                       ("sdpa", lambda: forward(q, out_s, suffix, 0))], a.repeats)
            run = {"suffix": suffix, "rows": suffix * group, "median_ms": {k: round(v, 2) for k, v in med.items()},
                   "paged_over_sdpa": round(med["paged"] / med["sdpa"], 3),
                   "max_abs_diff": float((out_p.float() - out_s.float()).abs().max())}
            result["runs"].append(run)
            tqdm.write(f"suffix {suffix} ({run['rows']} rows): paged {med['paged']:.1f} ms, sdpa "
                       f"{med['sdpa']:.1f} ms ({run['paged_over_sdpa']:.2f}x); max |diff| {run['max_abs_diff']:.2e}")
    finally:
        prefix_sdpa.EXTEND_KERNEL_MAX_ROWS = default_rows

    def plot(ax):
        xs = [r["suffix"] for r in result["runs"]]
        for name in ("sdpa", "paged"):
            ax.plot(xs, [r["median_ms"][name] for r in result["runs"]], marker="o", label=name)
        ax.axvline(default_rows / group, color="grey", ls=":", label="kernel's row limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("new tokens after the cached prefix")
        ax.set_ylabel("ms per extend (all layers)")
        ax.set_title(f"extend attention, {a.prefix}-token prefix, {a.dtype}, {a.threads} thread(s)", fontsize=9)
        ax.legend()
    write_record("paged_extend", a.out, result, plot)


if __name__ == "__main__":
    main()
