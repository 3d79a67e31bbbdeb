"""Fault-injection suite (issue 14): hostile clients, odd storage entries, bad configs and flags.

Fast by design (seconds): servers run with sub-second idle/frame deadlines. Tests that need root
(a read-only mount, files of another uid) carry the `root` marker and skip otherwise; tests that
need nixl carry `nixl`.

* ``tier_server(*flags)``: a ``flexflow tier-server`` subprocess on 127.0.0.1, stopped by PID;
  ``module_server``: one shared by a module (fast deadlines).
* ``inproc_server(**kw)``: a TierServer in this process (serve_forever in a thread), for tests that
  must reach into its buffer (page poisoning).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

_TIERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiers")
if _TIERS not in sys.path:
    sys.path.insert(0, _TIERS)

from tier_helpers import REPO, ServerProc, stop_proc, tier_env  # noqa: E402


def _starter(tmpdir, procs):
    def start(*flags, env=None, capacity_gb=0.02, wait_s=60.0):
        i = len(procs)
        ready, log = tmpdir / f"srv{i}.ready", tmpdir / f"srv{i}.log"
        argv = [sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", "127.0.0.1:0",
                "--capacity-gb", str(capacity_gb), "--ready-file", str(ready), "--log-level", "INFO", *flags]
        with open(log, "ab") as fh:
            p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=tier_env(env), cwd=REPO)
        procs.append(p)
        t0 = time.monotonic()
        while not ready.exists():
            if p.poll() is not None:
                raise RuntimeError(f"tier server exited ({p.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() - t0 > wait_s:
                raise RuntimeError("tier server not ready in time")
            time.sleep(0.02)
        return ServerProc(p, json.loads(ready.read_text())["listen"], str(log))
    return start


@pytest.fixture
def tier_server(tmp_path):
    procs = []
    yield _starter(tmp_path, procs)
    for p in procs:
        stop_proc(p)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One tier server for a module's tests (they read counter deltas): page 4096, 1 s idle and
    0.5 s frame deadlines."""
    procs = []
    srv = _starter(tmp_path_factory.mktemp("srv"), procs)(
        "--page-nbytes", "4096", "--idle-timeout-s", "1", "--frame-timeout-s", "0.5")
    yield srv
    for p in procs:
        stop_proc(p)


@pytest.fixture
def inproc_server():
    made = []

    def start(**kw):
        from flexflow_sglang.tiers.tier_server import TierServer
        kw.setdefault("capacity_bytes", 8 << 20)
        srv = TierServer("127.0.0.1:0", **kw)
        th = threading.Thread(target=srv.serve_forever, daemon=True)
        th.start()
        made.append((srv, th))
        return srv

    yield start
    for srv, th in made:
        srv.stop()
        th.join(timeout=10)
