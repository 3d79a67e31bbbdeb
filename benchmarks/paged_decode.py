"""Where the decode figures in backend/prefix_sdpa.py come from: one decode step's attention (every
layer, a batch of requests, one query token each) as SGLang's torch_native computes it (gather each
request's keys and values into new tensors, then SDPA) and as `flexflow_sdpa` does (the compiled
kernel reads the paged KV in place), side by side in one process, alternating per repeat; the
gather alone (timed separately) shows how much of torch_native's time is the copy. Outputs of the
two are compared (max abs difference).

    python benchmarks/paged_decode.py [--layers 16] [--heads 8] [--kv-heads 8] [--head-dim 128]
        [--batch 2] [--context 1300] [--dtype float32] [--threads 2,1] [--repeats 9] [--out out/paged_decode]

Defaults are the kv128k preset's shapes (16 layers x 8 KV heads x 128, float32: 128 KB of KV per
token) with the multi-turn benchmark's histories (~1,300 tokens, 2 in flight); slots are scattered
over a pool 4x the batch's tokens, as in a server that has run a while. Writes paged_decode.json and
paged_decode.png under --out.
"""
import argparse

import torch
from tqdm import tqdm

from _attention_bench import (add_shape_args, alternating_medians, new_record, random_pool, require_kernel,
                              scattered_slots, write_record)
from flexflow_sglang.backend import prefix_sdpa


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap, "out/paged_decode")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=1300)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    require_kernel("paged_decode")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    pool = 4 * a.batch * a.context
    K, V = random_pool(a, pool, g)
    r2t = torch.zeros(a.batch + 1, a.context, dtype=torch.int32)
    for b in range(a.batch):
        r2t[b + 1] = scattered_slots(pool, a.context, g)
    rows = torch.arange(1, a.batch + 1)
    lens = torch.full((a.batch,), a.context, dtype=torch.int64)
    q = torch.randn(a.batch, a.heads, a.head_dim, generator=g).to(dt)
    native, ours = object.__new__(TorchNativeAttnBackend), object.__new__(prefix_sdpa.prefix_sdpa_backend_class())
    gqa = a.heads != a.kv_heads
    out_n, out_p = torch.empty_like(q), torch.empty_like(q)
    scale = a.head_dim ** -0.5

    def step(backend, out):
        for layer in range(a.layers):
            backend._run_sdpa_forward_decode(q, out, K[layer], V[layer], r2t, rows, lens, None,
                                             scaling=scale, enable_gqa=gqa)

    def gather_only():
        for layer in range(a.layers):
            for b in range(a.batch):
                t = r2t[b + 1, :a.context]
                K[layer][t], V[layer][t]

    result = new_record("paged_decode", a, K)
    threads = [int(x) for x in a.threads.split(",") if x.strip()]
    for th in tqdm(threads, desc="paged decode", unit="thread count"):
        torch.set_num_threads(th)
        med = alternating_medians([("torch_native", lambda: step(native, out_n)), ("paged", lambda: step(ours, out_p)),
                                   ("gather_only", gather_only)], a.repeats)
        result["runs"].append({"threads": th, "median_ms": {k: round(v, 2) for k, v in med.items()},
                               "paged_over_native": round(med["paged"] / med["torch_native"], 3),
                               "gather_share_of_native": round(med["gather_only"] / med["torch_native"], 3),
                               "max_abs_diff": float((out_n.float() - out_p.float()).abs().max())})
        print(f"threads {th}: torch_native {med['torch_native']:.1f} ms, paged {med['paged']:.1f} ms "
              f"({med['paged'] / med['torch_native']:.2f}x), gather alone {med['gather_only']:.1f} ms; "
              f"max |diff| {result['runs'][-1]['max_abs_diff']:.2e}")

    def plot(ax):
        names = ["torch_native", "gather_only", "paged"]
        w = 0.8 / len(result["runs"])
        for i, run in enumerate(result["runs"]):
            ax.bar([x + i * w for x in range(len(names))], [run["median_ms"][n] for n in names], w,
                   label=f"{run['threads']} thread(s)")
        ax.set_xticks([x + w * (len(result["runs"]) - 1) / 2 for x in range(len(names))], names)
        ax.set_ylabel("ms per decode step (all layers)")
        ax.set_title(f"decode attention, {a.batch} x {a.context} tokens, {a.dtype}", fontsize=9)
        ax.legend()
    write_record("paged_decode", a.out, result, plot)


if __name__ == "__main__":
    main()
