#!/usr/bin/env bash
# One self-contained GPU check (1-8 NVIDIA GPUs, no internet), finishing within ~9.5 minutes:
#   1. host tier H2D/D2H through the connector vs a pinned cudaMemcpy of the same bytes
#   2. with >= 2 GPUs: direct vs relay vs split between GPUs while a competing copy saturates the direct link
#   3. verify_outputs on the tiny model: plain server vs --radix-cache-backend flexflow, on the GPU
#   4. layer-wise load-back on vs off (flexflow bench layerwise, kv128k preset in bfloat16, one ABAB round)
# Writes $OUT/gpu_bench.json (+ one JSON per step). `--dry-run` exercises the driver on CPU.
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh [--dry-run]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/runs/gpu}"
PY="${PYTHON:-python3}"
if [ -x "$ROOT/.venv/bin/python" ] && [ -z "${PYTHON:-}" ]; then PY="$ROOT/.venv/bin/python"; fi
mkdir -p "$OUT"
export NIXL_LOG_LEVEL=WARN PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import flexflow_sglang" 2>/dev/null; then
  echo "flexflow_sglang not importable with $PY; installing from the checkout (offline)" >&2
  "$PY" -m pip install --no-build-isolation --no-deps --no-index -e "$ROOT" >&2 || true
fi
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); fi
exec timeout 560 "$PY" "$ROOT/benchmarks/gpu/gpu_bench.py" --out "$OUT" "${DRY[@]}"
