"""Benchmarks (`flexflow bench ...`): shared helpers."""

from typing import Callable, Optional, Sequence


def nearest_rank(xs: Sequence[float], q: float, empty: Optional[float] = None) -> Optional[float]:
    """Nearest-rank percentile (q in [0, 1]) of a small sample; `empty` when there is none."""
    if not xs:
        return empty
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


#: what `--model smollm2` names in every benchmark's output
SMOLLM2_NAME = "SmolLM2-135M-Instruct (bf16, 30 layers, 3 KV heads x 64)"


def kv_bytes_per_token_of(model_dir: str, served_dtype: str = "auto") -> Optional[int]:
    """KV bytes one token occupies on the SGLang server (all layers, K and V) from a HF config.json;
    None if unknown. With SGLang's `--dtype auto` a float32 checkpoint is served in float16 (as in
    vLLM; gemma: bfloat16), so its KV is half of what the checkpoint's dtype suggests."""
    import json
    import os
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        dtype = served_dtype if served_dtype != "auto" else str(c.get("torch_dtype") or c.get("dtype") or "float32")
        width = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}.get(dtype, 2)
        if served_dtype == "auto" and width == 4:
            width = 2
        from flexflow_sglang.tools.cpu_support.tiny_model import kv_bytes_per_token  # the one formula, presets use it too
        return kv_bytes_per_token(int(c["num_hidden_layers"]), kv_heads, head_dim=head_dim, dtype_bytes=width)
    except (OSError, KeyError, ValueError, TypeError):
        return None


def resolve_model(spec: Optional[str], workdir: str, preset: str) -> tuple:
    """`--model` of a benchmark -> (model dir, name for reports). None: the tiny random `preset`
    built under `workdir`; 'smollm2': the real model (`flexflow make-model smollm2`); else a dir."""
    import os
    if spec is None:
        from flexflow_sglang.tools.cpu_support.tiny_model import PRESETS, make_tiny_model
        path = make_tiny_model(os.path.join(workdir, f"model-{preset}"), **PRESETS[preset])
        return path, f"tiny random Llama, preset '{preset}'"
    if spec == "smollm2":
        from flexflow_sglang.tools.cpu_support.real_model import make_real_model
        return make_real_model("smollm2"), SMOLLM2_NAME
    return spec, os.path.basename(os.path.abspath(spec))


def measured_commit() -> str:
    """The measured commit (`+dirty` with uncommitted changes), or "unknown" outside a checkout."""
    import os

    from .refresh import RefreshError, current_commit
    try:
        return current_commit(os.path.dirname(os.path.abspath(__file__)))
    except RefreshError:
        return "unknown"


def save_result(out_dir: str, name: str, result: dict, plot: Callable[[dict, str], None], bench: str) -> None:
    """`name`.json into out_dir, then `name`.png from `plot(result, path)`; a failing plot is reported
    on stderr and does not fail the benchmark (the JSON is the result)."""
    import json
    import os
    import sys
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(result, os.path.join(out_dir, f"{name}.png"))
    except Exception as e:  # noqa: BLE001 - the JSON is the result
        print(f"bench {bench}: plot failed: {e}", file=sys.stderr)


def add_attention_backend_arg(ap) -> None:
    """`--attention-backend` of every server a benchmark starts (SGLangServer(attention_backend=))."""
    ap.add_argument("--attention-backend", default=None,
                    help="SGLang --attention-backend of every server (default: torch_native on CPU). flexflow_sdpa "
                         "computes only the new tokens' queries, as GPU backends do (torch_native recomputes the "
                         "whole prefix's attention on every hit)")


def add_storage_tier_args(ap) -> None:
    """--storage-layout and --storage-backend: `storage_tier.layout` / `.backend` of a bench's
    generated storage tier."""
    ap.add_argument("--storage-layout", choices=("files", "slabs"), default="slabs",
                    help="storage_tier.layout of that storage tier")
    ap.add_argument("--storage-backend", choices=("auto", "posix", "os"), default="auto",
                    help="storage_tier.backend of that storage tier: auto (NIXL POSIX where NIXL is installed), "
                         "posix, or os (positioned system calls, one compiled call per batch)")


def flush_dirty_pages() -> float:
    """os.sync(), timed: a server then starts with no earlier run's dirty page cache left to write
    back (a storage tier's server writes ~1.4 GB in a kv128k multi-turn run), so the kernel cannot
    charge that write-back to whichever server runs next. A precaution: in the runs so far the sync
    took under 1 s and did not change the spread. Seconds taken."""
    import os
    import time
    t = time.perf_counter()
    os.sync()
    return time.perf_counter() - t
