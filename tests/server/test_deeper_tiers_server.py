"""Deeper tiers with the real server (tiny model, CPU): a restarted server hits on KV that the
previous instance wrote to the storage tier, and two separate server instances share KV through a
`flexflow tier-server` (remote tier over NIXL UCX). Outputs byte-equal the plain server's."""

import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from server_helpers import (MAX_TOTAL_TOKENS, PROMPTS, flexflow_metrics, repo_env, verify, wait_transfers_settled,
                            write_config)

pytestmark = [pytest.mark.server, pytest.mark.nixl]



def _need_nixl():
    import importlib.util
    if importlib.util.find_spec("nixl") is None and importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip("nixl is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")


def _offloaded(stdout, round_name):
    """Tokens per prompt that round R1/R2 loaded from host / storage, parsed from verify_outputs' lines."""
    host, storage = [], []
    for m in re.finditer(rf"{round_name} cached=\d+ \(device \d+, host (\d+)(?:, storage (\d+))?\)", stdout):
        host.append(int(m.group(1)))
        storage.append(int(m.group(2) or 0))
    return host, storage


@pytest.mark.parametrize("layout", ["files", "slabs"])
def test_storage_tier_survives_restart(plain_baseline, tiny_model, start_server, tmp_path, layout):
    _need_nixl()
    kv_dir = tmp_path / "kv"
    # wait_complete: the fresh server holds each request until its prefetch from storage ended. The
    # default (timeout: 1 s + 0.25 s per 1k tokens) admits it without the pages when the fetch is
    # slower, which on a loaded 2-core machine with one file per 1-token page it often is; this test
    # is about what survives a restart, not about how long a fetch may take.
    cfg = write_config(tmp_path, "storage", storage_tier={"enabled": True, "path": str(kv_dir), "capacity_gb": 0.5,
                                                         "layout": layout},
                       transfer={"prefetch_policy": "wait_complete"})
    a = start_server(tiny_model, name="storage-a", radix_cache_backend="flexflow", flexflow_config=cfg,
                     max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"])
    rc, stdout, stderr, last = verify("--phase", "test", "--url", a.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline)
    assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + a.tail_log()
    # write-back to storage runs on the transfer engine's workers: what is still queued when SGLang
    # kills its scheduler is lost (a miss for the next instance, never a wrong token), so stop only
    # once the engine has settled - as an operator draining a node would
    m = wait_transfers_settled(a.url)
    assert m.get("flexflow_transfer_failed", 0) == 0 and m.get("flexflow_transfer_dropped", 0) == 0, m
    a.stop()
    # owner-only directory and files; names are hashes, never request content
    subdirs = [p for p in kv_dir.iterdir() if p.is_dir()]
    assert subdirs and stat.S_IMODE(kv_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in subdirs)
    files = [p for d in subdirs for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert files, "nothing was written to the storage tier"
    assert all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in files)
    assert all(re.fullmatch(r"[0-9a-f.]+[A-Za-z.]*" if layout == "files" else r"slab-\d{4,9}\.kvs", f.name)
               for f in files), [f.name for f in files]

    b = start_server(tiny_model, name="storage-b", radix_cache_backend="flexflow", flexflow_config=cfg,
                     max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"])
    rc, stdout, stderr, last = verify("--phase", "test", "--url", b.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline)
    assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + b.tail_log()
    _, storage_r1 = _offloaded(stdout, "R1")
    # a FRESH server's first request per prompt was served from what the previous instance stored
    m = flexflow_metrics(b.url)
    assert sum(1 for s in storage_r1 if s > 0) >= len(storage_r1) // 2, \
        stdout + str({k: v for k, v in m.items() if "prefetch" in k or "storage" in k})


def _start_tier_server(tmp_path):
    ready = tmp_path / "tier-ready.json"
    log = open(tmp_path / "tier-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flexflow_sglang.tools.cli.main", "tier-server", "--listen",
                             "127.0.0.1:0", "--capacity-gb", "0.25", "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, env=repo_env(), start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(open(tmp_path / "tier-server.log").read())
        time.sleep(0.2)
    assert ready.exists(), "tier server did not become ready"
    time.sleep(0.1)
    return proc, json.loads(ready.read_text())["listen"]


def test_two_instances_share_kv_through_tier_server(plain_baseline, tiny_model, start_server, tmp_path):
    _need_nixl()
    proc, listen = _start_tier_server(tmp_path)
    try:
        cfg = write_config(tmp_path, "remote", remote_tier={"enabled": True, "peers": [listen], "timeout_ms": 5000})
        a = start_server(tiny_model, name="remote-a", radix_cache_backend="flexflow", flexflow_config=cfg,
                         max_total_tokens=MAX_TOTAL_TOKENS)
        rc, stdout, stderr, last = verify("--phase", "test", "--url", a.url, "--prompts", PROMPTS,
                                          "--baseline", plain_baseline)
        assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + a.tail_log()
        # a second, independent instance: its first requests hit what instance A published
        b = start_server(tiny_model, name="remote-b", radix_cache_backend="flexflow", flexflow_config=cfg,
                         max_total_tokens=MAX_TOTAL_TOKENS)
        rc, stdout, stderr, last = verify("--phase", "test", "--url", b.url, "--prompts", PROMPTS,
                                          "--baseline", plain_baseline)
        assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + b.tail_log()
        _, deep_r1 = _offloaded(stdout, "R1")
        assert sum(1 for s in deep_r1 if s > 0) >= len(deep_r1) // 2, stdout
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_dead_peer_is_a_miss_not_a_hang(plain_baseline, tiny_model, start_server, tmp_path):
    """Remote tier configured with a peer that does not exist: every lookup times out quickly, the
    peer is marked down, and the server still serves identical outputs from host memory."""
    _need_nixl()
    cfg = write_config(tmp_path, "deadpeer", remote_tier={"enabled": True, "peers": ["127.0.0.1:9"],
                                                          "timeout_ms": 300, "retry_after_s": 1})
    srv = start_server(tiny_model, name="deadpeer", radix_cache_backend="flexflow", flexflow_config=cfg,
                       max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"])
    t0 = time.time()
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline)
    assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
    assert time.time() - t0 < 300
    pred = lambda m: any(v > 0 for k, v in m.items() if "down" in k or "timeout" in k or "fail" in k)  # noqa: E731
    m = flexflow_metrics(srv.url, until=pred)
    down = [v for k, v in m.items() if "down" in k or "timeout" in k or "fail" in k]
    assert down and max(down) > 0, m
