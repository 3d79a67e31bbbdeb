"""Fixtures for the deep-tier tests (storage, remote, wire).

* NIXL-dependent tests carry ``@pytest.mark.nixl`` and ``requires_nixl`` (tier_helpers), which
  skips them with the import error when nixl cannot be imported.
* ``spawn_server(**opts)``: starts ``python -m flexflow_sglang.tiers.tier_server`` on 127.0.0.1
  (port 0 unless given), waits for its ready file, and always stops it by PID at teardown
  (SIGCONT first, in case a test froze it). Returns a ``ServerProc`` (proc, addr, pid, log path).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from tier_helpers import REPO, ServerProc, stop_proc, tier_env  # noqa: E402


@pytest.fixture
def spawn_server(tmp_path):
    procs = []

    def start(capacity_gb=0.05, listen="127.0.0.1:0", storage_path=None, env=None, extra=(), wait_s=60.0):
        i = len(procs)
        ready = tmp_path / f"server{i}.ready"
        log = tmp_path / f"server{i}.log"
        argv = [sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", listen,
                "--capacity-gb", str(capacity_gb), "--ready-file", str(ready), "--log-level", "INFO", *extra]
        if storage_path:
            argv += ["--storage-path", str(storage_path)]
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
        info = json.loads(ready.read_text())
        return ServerProc(p, info["listen"], str(log))

    yield start
    for p in procs:
        stop_proc(p)
