#!/usr/bin/env bash
# GPU quickstart: build the image, serve a model with --radix-cache-backend flexflow, send a prompt,
# flush the device cache, send it again and print the host-tier hit. Needs docker + NVIDIA runtime.
#   MODEL_DIR=/path/to/hf/model bash docker/quickstart.sh      (default: a tiny model built in-image)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-flexflow-sglang:latest}"
PORT="${PORT:-30000}"
CONFIG="${FLEXFLOW_CONFIG_IN_IMAGE:-/opt/flexflow/configs/dgx-a100.yaml}"
NAME="flexflow-quickstart-$$"

docker build -f "$ROOT/docker/Dockerfile" -t "$IMAGE" "$ROOT"

if [ -n "${MODEL_DIR:-}" ]; then
  MOUNT=(-v "$MODEL_DIR:/model:ro")
  MODEL=/model
else
  MOUNT=()
  MODEL=/tmp/tiny-model
fi

cleanup() { docker rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

docker run -d --name "$NAME" --gpus all --ipc=host -p "127.0.0.1:$PORT:30000" "${MOUNT[@]}" \
  -e FLEXFLOW_CONFIG="$CONFIG" "$IMAGE" bash -c "
    set -e
    if [ ! -e '$MODEL/config.json' ]; then python3 -m flexflow_sglang.tools.cpu_support.tiny_model '$MODEL'; fi
    exec python3 -m sglang.launch_server --model-path '$MODEL' --host 0.0.0.0 --port 30000 \
      --radix-cache-backend flexflow --enable-metrics"

echo "waiting for the server on port $PORT ..."
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/model_info" >/dev/null; then break; fi
  sleep 2
done

PROMPT=$(printf 'the radix tree keeps every prefix token of the request in a page %.0s' $(seq 1 12))
BODY=$(printf '{"text": "%s", "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": true}}' "$PROMPT")
R1=$(curl -sf "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' -d "$BODY")
curl -sf -X POST "http://127.0.0.1:$PORT/flush_cache" >/dev/null
R2=$(curl -sf "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' -d "$BODY")

python3 - "$R1" "$R2" <<'PY'
import json, sys
r1, r2 = json.loads(sys.argv[1]), json.loads(sys.argv[2])
d = r2["meta_info"].get("cached_tokens_details") or {}
same = r1["output_ids"] == r2["output_ids"]
print(f"request 2: cached_tokens_details={d}, identical output: {same}")
sys.exit(0 if same and d.get("host", 0) > 0 else 1)
PY
curl -s "http://127.0.0.1:$PORT/metrics" | grep '^flexflow_' || true
