"""Helpers shared by the deep-tier tests (imported by name: pytest puts this directory on sys.path)."""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from flexflow_sglang.tiers.base import load_nixl  # noqa: E402

NIXL_WHY = load_nixl()[2]
requires_nixl = pytest.mark.skipif(bool(NIXL_WHY), reason=f"nixl is not importable: {NIXL_WHY}")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class ServerProc:
    proc: subprocess.Popen
    addr: str
    log: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


def stop_proc(p: subprocess.Popen) -> None:
    """SIGCONT (a test may have frozen it), SIGTERM, then SIGKILL after 5 s; by PID only."""
    if p.poll() is not None:
        return
    try:
        os.kill(p.pid, signal.SIGCONT)
        p.terminate()
        p.wait(timeout=5)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        p.kill()
        p.wait(timeout=5)


def freeze(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it is really stopped (kill() only queues the
    signal; a busy server could still answer one more request)."""
    import time
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            return
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise RuntimeError(f"process {pid} did not stop")


def tier_env(extra=None) -> dict:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra or {})
    return env


# the storage tier's data paths: NIXL POSIX (marked nixl) and the os backend, each with the compiled
# per-batch file calls (_file_batch) and with their Python twin (-python)
STORAGE_BACKENDS = [pytest.param("nixl", marks=[pytest.mark.nixl, requires_nixl]), "os",
                    pytest.param("nixl-python", marks=[pytest.mark.nixl, requires_nixl]), "os-python"]


def use_storage_backend(param: str, monkeypatch) -> str:
    """Make the storage tiers a test creates use `param`'s data path; returns "nixl" or "os"."""
    from flexflow_sglang.tiers import storage as storage_mod
    if param.startswith("os"):
        monkeypatch.setattr(storage_mod, "load_nixl", lambda: (None, None, "disabled by test"))
    if param.endswith("-python"):
        monkeypatch.setattr(storage_mod, "_fb", None)
    return param.split("-")[0]


def storage_tiers(cls, default_path):
    """Body of a `make` fixture (`yield from storage_tiers(...)`): yields mk(path=None, **kw), which
    opens a `cls` storage tier (1 GiB, a fixed fingerprint unless given) at `path` or
    `default_path`; every tier it opened is closed afterwards."""
    made = []

    def mk(path=None, **kw):
        kw.setdefault("capacity_gb", 1.0)
        kw.setdefault("fingerprint", "model-A|layout-1")
        t = cls(str(path or default_path), **kw)
        made.append(t)
        return t

    yield mk
    for t in made:
        t.close()
