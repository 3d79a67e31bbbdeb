"""Helpers shared by the tests in tests/server (paths, subprocess environment)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS_FILE = REPO_ROOT / "flexflow_sglang" / "tools" / "data" / "prompts.jsonl"


def repo_env(extra=None) -> dict:
    """Environment for ``python -m flexflow_sglang...`` subprocesses (source tree importable)."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra or {})
    return env


# ---------------------------------------------------------------- flexflow end-to-end helpers
import subprocess  # noqa: E402
import sys  # noqa: E402

PROMPTS = str(PROMPTS_FILE)
MAX_TOTAL_TOKENS = 8192


def verify(*args, timeout=900):
    """Run `python -m flexflow_sglang.tools.verify_outputs` as a user would; (rc, stdout, stderr, last line)."""
    p = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.verify_outputs", "--no-progress", *args],
                       capture_output=True, text=True, timeout=timeout, env=repo_env())
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    return p.returncode, p.stdout, p.stderr, last


def flexflow_metrics(url, until=None, timeout: float = 10.0) -> dict:
    """flexflow_* series from /metrics, summed over label sets (ranks). The backend exports at most
    once a second, so with `until` (a predicate on the dict) poll until it holds or `timeout`."""
    import time

    from flexflow_sglang.tools.server_utils import flexflow_metrics as flexflow_metrics_once
    deadline = time.time() + timeout
    while True:
        m = flexflow_metrics_once(url)
        if until is None or until(m) or time.time() > deadline:
            return m
        time.sleep(0.5)


def wait_transfers_settled(url, timeout: float = 180.0) -> dict:
    """Poll /metrics (the server needs --enable-metrics) until the backend's transfer engine has
    nothing queued or running and no store is in flight; returns the last metrics. Write-back is
    asynchronous: a test that stops a server and expects its pages in a deeper tier must wait for this
    first (on a loaded 2-core CI machine the engine's workers can trail the requests by seconds)."""
    keys = ("flexflow_transfer_queued", "flexflow_transfer_running", "flexflow_queued_stores",
            "flexflow_cache_inflight_stores")

    def settled(m):
        return all(k in m for k in keys) and all(m[k] == 0 for k in keys)
    m = flexflow_metrics(url, until=settled, timeout=timeout)
    missing = [k for k in keys if k not in m]
    assert not missing, f"{url}/metrics has no {missing} (is --enable-metrics set?)"
    assert settled(m), f"transfers still pending after {timeout} s: { {k: m[k] for k in keys} }"
    return m


def write_config(tmp_path, name, host_tier=None, **sections) -> str:
    """A FLEXFLOW_CONFIG for the CPU server (mock single-device topology) with overrides."""
    import yaml
    cfg = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
           "host_tier": {"capacity_gb": 0.25, **(host_tier or {})}, **sections}
    path = Path(tmp_path) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ---------------------------------------------------------------- the real model
CHAT_PROMPTS = str(REPO_ROOT / "flexflow_sglang" / "tools" / "data" / "chat_prompts.jsonl")
#: KV pool of the real-model servers: holds the whole chat prompt set (no device eviction)
REAL_MAX_TOTAL_TOKENS = 24000
#: enough that SGLang's memory profile never caps the pool below REAL_MAX_TOTAL_TOKENS (the profile
#: depends on the machine's free memory at start: a cap would give plain and flexflow different pools)
REAL_MEM_FRACTION = 0.15


def compare_kv_dumps(root) -> dict:
    """Pair every `loaded` KV record (host hit, after the load) with the `device` record of the same
    token prefix and length (a device hit before the flush) and compare them byte for byte."""
    import os

    from flexflow_sglang.backend import kv_dump
    out = {"loaded": 0, "compared": 0, "mismatched": 0, "stitched": 0, "details": []}
    if not os.path.isdir(root):
        return out
    recs = kv_dump.read_records(str(root))
    device = {}
    for meta, data in recs:
        if meta["kind"] == "device":
            device.setdefault((meta["rank"], meta["tokens_hash"], meta["tokens"]), data)
    for meta, data in recs:
        if meta["kind"] != "loaded":
            continue
        out["loaded"] += 1
        if meta.get("host_tokens", meta["tokens"]) < meta["tokens"]:
            out["stitched"] += 1  # device pages + host pages in one prefix
        ref = device.get((meta["rank"], meta["tokens_hash"], meta["tokens"]))
        if ref is None:
            continue
        out["compared"] += 1
        if ref != data:
            out["mismatched"] += 1
            row = meta["row_bytes"]
            first = next(i for i in range(len(data)) if data[i] != ref[i])
            out["details"].append(f"rank {meta['rank']} rid {meta.get('rid')} {meta['tokens']} tokens: first "
                                  f"differing byte in token {first // row}")
    return out
