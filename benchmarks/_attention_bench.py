"""What benchmarks/paged_decode.py and benchmarks/paged_extend.py share: the kv128k shape arguments,
a scattered random KV pool, alternating timed repeats, and the JSON + plot record."""
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from flexflow_sglang.backend import prefix_sdpa
from flexflow_sglang.tools.bench import measured_commit


def add_shape_args(ap, out: str) -> None:
    """The kv128k preset's shapes by default (16 layers x 8 KV heads x 128, float32: 128 KB per token)."""
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=out)


def require_kernel(script: str) -> None:
    if prefix_sdpa._pa is None:
        raise SystemExit(f"{script}: flexflow_sglang._paged_attention is not built (pip install -e .)")


def random_pool(a, pool: int, g: torch.Generator) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per-layer K and V buffers of `pool` slots in SGLang's layout ([slots, kv heads, head dim])."""
    dt = getattr(torch, a.dtype)
    K = [torch.randn(pool, a.kv_heads, a.head_dim, generator=g).to(dt) for _ in range(a.layers)]
    V = [torch.randn(pool, a.kv_heads, a.head_dim, generator=g).to(dt) for _ in range(a.layers)]
    return K, V


def scattered_slots(pool: int, n: int, g: torch.Generator) -> torch.Tensor:
    """n distinct slots scattered over 1..pool-1 (slot 0 is SGLang's padding slot), as in a server
    that has run a while."""
    return (torch.randperm(pool - 1, generator=g)[:n] + 1).to(torch.int32)


def new_record(script: str, a, K: Sequence[torch.Tensor], **extra) -> dict:
    """The JSON record's head: the command as run, the commit, the KV bytes per token."""
    return {"command": f"python benchmarks/{script}.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "commit": measured_commit(), "kv_bytes_per_token": 2 * a.layers * a.kv_heads * a.head_dim * K[0].element_size(),
        **extra, "runs": []}


def alternating_medians(paths: Sequence[Tuple[str, Callable[[], object]]], repeats: int) -> Dict[str, float]:
    """Median ms of each path after one warm-up each, the order reversed every other repeat so that
    drift of a noisy machine hits every path alike."""
    times: Dict[str, List[float]] = {name: [] for name, _ in paths}
    for _, fn in paths:
        fn()
    for r in range(repeats):
        for name, fn in (paths if r % 2 == 0 else list(paths)[::-1]):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def write_record(script: str, out: str, result: dict, plot: Callable) -> None:
    """<out>/<script>.json, then <out>/<script>.png drawn by plot(ax) (a failed plot only warns:
    the JSON is the record)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{script}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        plot(ax)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{script}.png"), dpi=120)
    except Exception as e:  # noqa: BLE001 - the JSON is the record
        print(f"{script}: plot failed: {e}")
    print(f"wrote {path}")
