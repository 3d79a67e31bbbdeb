"""Where the figures in backend/prefix_sdpa.py come from: one attention layer of a prefix hit, as
SGLang's torch_native computes it (the whole sequence's queries, is_causal, new rows kept) and as
`flexflow_sdpa` does (only the new tokens' queries, causal mask shifted by the prefix), side by side;
then a bit-equality sweep of the new rows over random prefix/suffix shapes, per dtype.

    python benchmarks/prefix_sdpa.py [--heads 8] [--head-dim 128] [--new 32]
        [--prefixes 256,512,1024,2048] [--threads 1] [--shapes 60] [--out out/prefix_sdpa]

Writes prefix_sdpa.json and prefix_sdpa.png under --out. Shapes are those of the kv128k preset
(8 KV heads x 128, float32: 128 KB of KV per token over 32 layers); one layer is timed.
"""
import argparse
import json
import os
import random
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from tqdm import tqdm


def full_recompute(q, k, v, prefix):
    """torch_native: queries of the whole sequence, is_causal, the new rows kept."""
    return sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True).squeeze(0)[:, prefix:]


def new_rows_only(q, k, v, prefix):
    """flexflow_sdpa: the new queries against all keys, key j visible to new token i iff j <= P + i."""
    L = k.shape[1]
    qn = q[:, prefix:]
    visible = torch.arange(L).unsqueeze(0) <= torch.arange(prefix, L).unsqueeze(1)
    return sdpa(qn.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=visible).squeeze(0)


def mean_ms(fn, reps):
    fn()  # warm-up (oneDNN primitive creation)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def qkv(heads, dim, L, dtype, gen):
    return [torch.randn(heads, L, dim, generator=gen).to(dtype) for _ in range(3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--new", type=int, default=32, help="new tokens per request in the timing")
    ap.add_argument("--prefixes", default="256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (SGLang's CPU forward: 1 per rank here)")
    ap.add_argument("--shapes", type=int, default=60, help="random shapes per dtype in the equality sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/prefix_sdpa")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    prefixes = [int(x) for x in a.prefixes.split(",")]

    timing = []
    for P in tqdm(prefixes, desc="timing", unit="prefix"):
        q, k, v = qkv(a.heads, a.head_dim, P + a.new, torch.float32, gen)
        full = mean_ms(lambda: full_recompute(q, k, v, P), a.reps)
        new = mean_ms(lambda: new_rows_only(q, k, v, P), a.reps)
        timing.append(dict(prefix=P, new=a.new, full_ms=round(full, 3), new_rows_ms=round(new, 3),
                           ratio=round(new / full, 4)))

    # Bit equality of the new rows: what a prefix hit computes vs a full recompute of the same tokens.
    rng = random.Random(a.seed)
    equality = {}
    for dtype in (torch.bfloat16, torch.float32):
        differ, examples = 0, []
        for _ in tqdm(range(a.shapes), desc=f"equality {dtype}", unit="shape"):
            P, S = rng.randint(1, 512), rng.randint(1, 64)
            q, k, v = qkv(a.heads, a.head_dim, P + S, dtype, gen)
            if not torch.equal(full_recompute(q, k, v, P), new_rows_only(q, k, v, P)):
                differ += 1
                examples.append(dict(prefix=P, new=S))
        equality[str(dtype).replace("torch.", "")] = dict(shapes=a.shapes, differ=differ, differing=examples)

    os.makedirs(a.out, exist_ok=True)
    result = dict(heads=a.heads, head_dim=a.head_dim, threads=a.threads, reps=a.reps, timing=timing,
                  equality=equality, torch=torch.__version__)
    with open(os.path.join(a.out, "prefix_sdpa.json"), "w") as f:
        json.dump(result, f, indent=2)
    for t in timing:
        print(f"prefix {t['prefix']:5d} + {t['new']} new: torch_native {t['full_ms']:8.2f} ms, "
              f"flexflow_sdpa {t['new_rows_ms']:7.2f} ms ({t['ratio']:.3f}x)")
    for name, e in equality.items():
        print(f"{name}: new rows differ from a full recompute in {e['differ']} of {e['shapes']} shapes; "
              f"suffix lengths {sorted({x['new'] for x in e['differing']})}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(prefixes, [t["full_ms"] for t in timing], "o-", label="torch_native (full recompute)")
        ax.plot(prefixes, [t["new_rows_ms"] for t in timing], "s-", label="flexflow_sdpa (new rows)")
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel(f"ms per layer, {a.new} new tokens")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "prefix_sdpa.png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
