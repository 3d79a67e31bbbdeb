"""Build a tiny random Llama checkpoint plus a locally trained byte-level BPE tokenizer (no hub).

Usage::

    python -m flexflow_sglang.tools.cpu_support.tiny_model DIR [--preset tiny|bench|kv128k]
        [--layers N] [--hidden H] [--intermediate I] [--heads A] [--kv-heads K] [--head-dim D]
        [--seed S] [--max-position-embeddings P] [--force]

The output is deterministic for a given set of parameters and seed (same weights, same
tokenizer). The tokenizer is trained on random sentences over a small vocabulary of cache words
("the cache radix tree prefix token server model request page ..."), so prompts made of those
words cost about one token per word; the vocabulary comes out at a few hundred entries.

Presets: ``tiny`` (default: 2 layers, hidden 64, intermediate 128, 4 heads, 2 KV heads, ~120k
parameters, ~0.5 MB) for functional tests; ``bench`` (4 layers, hidden 512, intermediate 4096,
8 heads, 4 KV heads, ~29M parameters) for benchmarks where prefill must cost real time;
``kv128k`` (16 layers, hidden 256, 8 heads = 8 KV heads of head_dim 128) whose KV is 128 KB per
token in float32, as large as an 8B model's, for benchmarks of KV transfers (served with
``--dtype float32``: SGLang's ``--dtype auto`` serves float32 checkpoints in float16).

A rebuild is skipped when DIR already holds a ``config.json`` and a marker file
(:data:`MARKER_FILE`) written with the same parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Optional

MARKER_FILE = "flexflow_tiny_model.json"
FORMAT_VERSION = 1

#: Words of the tokenizer's training corpus (prompts built from them tokenize compactly).
WORDS = (
    "the cache radix tree prefix token server model request page block evict hit miss node key "
    "value batch decode prefill alpha beta gamma delta one two three four five"
).split()

PRESETS = {
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2),
    # MLP-heavy on purpose: SGLang's CPU attention backend (torch_native) recomputes attention over
    # the cached prefix on every extend, so prefill must be dominated by the MLP for a prefix hit to
    # show what it saves on a GPU backend
    "bench": dict(layers=4, hidden=512, intermediate=4096, heads=8, kv_heads=4),
    # KV as large per token as an 8B model's (Llama-3-8B: 128 KB in bf16): 16 layers x K,V x 8 KV
    # heads x head_dim 128 = 128 KB per token in float32 (serve with --dtype float32: SGLang's auto
    # serves float32 checkpoints in float16, 64 KB), with a small
    # hidden size so compute stays cheap: transfers, not matmuls, dominate (issue 13's benchmarks)
    "kv128k": dict(layers=16, hidden=256, intermediate=512, heads=8, kv_heads=8, head_dim=128),
}


def kv_bytes_per_token(layers, kv_heads, head_dim=None, hidden=None, heads=None, dtype_bytes=4, **_) -> int:
    """KV bytes one token occupies (K and V, every layer)."""
    hd = head_dim or (hidden // heads)
    return 2 * layers * kv_heads * hd * dtype_bytes


def _params(layers, hidden, intermediate, heads, kv_heads, seed, max_position_embeddings, head_dim=None) -> dict:
    p = dict(
        layers=int(layers), hidden=int(hidden), intermediate=int(intermediate), heads=int(heads),
        kv_heads=int(kv_heads), seed=int(seed), max_position_embeddings=int(max_position_embeddings),
    )
    if head_dim is not None:  # only when set: markers of models built without it stay valid
        p["head_dim"] = int(head_dim)
        if p["head_dim"] <= 0 or p["head_dim"] % 2:
            raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    elif p["hidden"] % p["heads"]:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if p["heads"] % p["kv_heads"]:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if min(p["layers"], p["hidden"], p["intermediate"], p["heads"], p["kv_heads"]) <= 0:
        raise ValueError(f"model dimensions must be positive: {p}")
    return p


def read_marker(out_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(out_dir, MARKER_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_built(out_dir: str, params: dict) -> bool:
    """True when ``out_dir`` holds a model built with exactly ``params``."""
    marker = read_marker(out_dir)
    return (
        os.path.isfile(os.path.join(out_dir, "config.json"))
        and marker is not None
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("params") == params
    )


def _corpus(seed: int, n: int = 5000) -> list:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(n)]


def make_tiny_model(
    out_dir,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 8192,
    force: bool = False,
    head_dim: Optional[int] = None,
) -> str:
    """Build (or reuse) the tiny model in ``out_dir``; returns its absolute path."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    params = _params(layers, hidden, intermediate, heads, kv_heads, seed, max_position_embeddings, head_dim)
    if not force and is_built(out_dir, params):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    marker_path = os.path.join(out_dir, MARKER_FILE)
    if os.path.exists(marker_path):  # invalidate first: a half-written rebuild must not look valid
        os.unlink(marker_path)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(params["seed"]), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    hf_tok.model_max_length = params["max_position_embeddings"]
    hf_tok.save_pretrained(out_dir)

    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=params["hidden"],
        intermediate_size=params["intermediate"],
        num_hidden_layers=params["layers"],
        num_attention_heads=params["heads"],
        num_key_value_heads=params["kv_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        tie_word_embeddings=False,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        **({"head_dim": params["head_dim"]} if "head_dim" in params else {}),
    )
    # Seed a private generator state for the random init, restoring the caller's RNG afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = LlamaForCausalLM(cfg).eval()
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bar
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    n_params = sum(p.numel() for p in model.parameters())

    with open(marker_path, "w", encoding="utf-8") as f:
        json.dump(
            {"format_version": FORMAT_VERSION, "params": params, "vocab_size": len(hf_tok),
             "num_parameters": n_params},
            f, indent=1, sort_keys=True,
        )
        f.write("\n")
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flexflow_sglang.tools.cpu_support.tiny_model",
        description="Build a tiny random Llama + local byte-level BPE tokenizer (deterministic, no hub).",
    )
    ap.add_argument("out_dir")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="tiny (default), bench (4 layers, hidden 512, MLP 4096: prefill costs real time) or "
                         "kv128k (16 layers, 8 KV heads x head_dim 128: 128 KB of float32 KV per token, an 8B "
                         "model's KV volume)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-position-embeddings", type=int, default=8192)
    ap.add_argument("--force", action="store_true", help="rebuild even if DIR is up to date")
    args = ap.parse_args(argv)

    kw = dict(PRESETS[args.preset])
    for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    params = _params(seed=args.seed, max_position_embeddings=args.max_position_embeddings, **kw)
    out_dir = os.path.abspath(args.out_dir)
    if not args.force and is_built(out_dir, params):
        print(f"tiny_model: {out_dir} is up to date ({params}); skipped")
        return 0
    t0 = time.perf_counter()
    try:
        make_tiny_model(out_dir, force=True, **kw, seed=args.seed,
                        max_position_embeddings=args.max_position_embeddings)
    except ValueError as e:
        print(f"tiny_model: error: {e}", file=sys.stderr)
        return 2
    m = read_marker(out_dir) or {}
    print(f"tiny_model: built {out_dir} in {time.perf_counter() - t0:.1f} s: {params}, "
          f"vocab {m.get('vocab_size')}, {m.get('num_parameters')} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
