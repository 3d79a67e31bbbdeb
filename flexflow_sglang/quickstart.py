"""`flexflow quickstart`: the README's main job, end to end on this machine.

Builds the tiny local Llama (no hub), starts the real SGLang server with `--radix-cache-backend
flexflow` and a config from configs/, sends a prompt, flushes the device cache, sends the same
prompt again, shows that the second answer came from the host tier (cached_tokens_details.host > 0)
with identical output, prints the backend's counters, and stops the server it started (by PID).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .config import DEFAULT_CONFIG_PATH

_CONFIGS = os.path.dirname(DEFAULT_CONFIG_PATH)
PROMPT = " ".join(["the radix tree keeps every prefix token of the request in a page"] * 12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow quickstart", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.getcwd(), "runs", "quickstart"),
                    help="model, logs and JSON result go here (default ./runs/quickstart)")
    ap.add_argument("--config", default=os.path.join(_CONFIGS, "cpu-dev.yaml"), help="FLEXFLOW_CONFIG file")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)

    from .config import load_config
    from .cpu_support.tiny_model import make_tiny_model
    from .server_utils import SGLangServer, flush_cache, generate

    load_config(args.config)  # a bad config fails here, with one message, before any server starts
    os.makedirs(args.workdir, mode=0o700, exist_ok=True)
    model_dir = os.path.join(args.workdir, "tiny-model")
    t0 = time.time()
    print(f"[1/5] tiny model -> {model_dir}", flush=True)
    make_tiny_model(model_dir)
    log = os.path.join(args.workdir, "server.log")
    print(f"[2/5] starting SGLang with --radix-cache-backend flexflow (FLEXFLOW_CONFIG={args.config}); "
          f"log: {log}", flush=True)
    server = SGLangServer(model_dir, log, port=args.port, radix_cache_backend="flexflow",
                          flexflow_config=args.config, page_size=args.page_size,
                          extra_args=["--enable-metrics"])
    with server:
        print(f"      server pid {server.pid} ready at {server.url} in {server.startup_s:.1f} s", flush=True)
        print("[3/5] request 1 (cold)", flush=True)
        r1 = generate(server.url, PROMPT, args.max_new_tokens)
        print("[4/5] POST /flush_cache (device tree emptied; the host tier keeps its copy)", flush=True)
        flush_cache(server.url)
        print("[5/5] request 2 (same prompt)", flush=True)
        r2 = generate(server.url, PROMPT, args.max_new_tokens)
        time.sleep(1.5)  # the backend exports its counters at most once a second
        metrics = _flexflow_metrics(server.url)
    m1, m2 = r1["meta_info"], r2["meta_info"]
    d2 = m2.get("cached_tokens_details") or {}
    same = r1["output_ids"] == r2["output_ids"] and r1["text"] == r2["text"]
    host = int(d2.get("host", 0) or 0)
    result = {"prompt_tokens": m1["prompt_tokens"], "request1_cached_tokens": m1.get("cached_tokens"),
              "request2_cached_tokens": m2.get("cached_tokens"), "request2_cached_tokens_details": d2,
              "identical_output": same, "request1_e2e_s": m1.get("e2e_latency"),
              "request2_e2e_s": m2.get("e2e_latency"), "flexflow_metrics": metrics,
              "server_stopped": not server.is_running(), "wall_s": round(time.time() - t0, 1)}
    with open(os.path.join(args.workdir, "quickstart.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    ok = same and host > 0
    print(("OK: the second answer came from the host tier: %d of %d prompt tokens loaded back, identical output"
           % (host, m2["prompt_tokens"])) if ok else
          "FAILED: expected identical output and cached_tokens_details.host > 0 on request 2", flush=True)
    return 0 if ok else 1


def _flexflow_metrics(url: str) -> dict:
    """The headline flexflow_* counters (present with --enable-metrics), without the prefix."""
    from .server_utils import flexflow_metrics
    try:
        m = flexflow_metrics(url)
    except Exception as e:  # metrics are informative only
        return {"error": str(e)}
    keep = ("pages_stored", "pages_loaded", "bytes_loaded", "bytes_stored", "hits_by_tier", "load_failures",
            "store_failures", "host_tier_used_bytes", "host_tier_capacity_bytes", "cache_load_backs",
            "cache_load_back_tokens", "bandwidth")
    return {k[len("flexflow_"):]: v for k, v in m.items() if any(w in k for w in keep)}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
