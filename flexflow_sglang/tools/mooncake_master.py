"""A Mooncake Store master for tests, benchmarks and labs (`mooncake_master` from
mooncake-transfer-engine-non-cuda; needs the Debian package libibverbs1 even for TCP).

    m = MooncakeMaster(log_dir).start()     # free ports below the ephemeral range, loopback
    cfg = m.extra_config()                  # what hicache_storage: {backend: mooncake} needs (TCP)
    m.kill(); m.start()                     # a crashed and restarted master: same ports, empty metadata

The master listens where it is told (loopback by default) and has no authentication; a lab that
runs it in a network namespace passes that namespace's address and a ``spawn`` callable.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence


def master_binary() -> str:
    """The `mooncake_master` next to this interpreter, else on PATH ('' if neither)."""
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return exe if os.path.exists(exe) else (shutil.which("mooncake_master") or "")


def mooncake_missing() -> str:
    """Why the Mooncake store cannot be used here ('' when it can)."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing libibverbs.so.1
        return f"mooncake is not importable ({type(e).__name__}: {e})"
    if not master_binary():
        return "mooncake_master is not on PATH or next to the interpreter"
    return ""


def _free_port() -> int:
    from .server_utils import find_free_port  # below the ephemeral range: bound seconds later
    return find_free_port()


class MooncakeMaster:
    def __init__(self, log_dir, rpc_port: int = 0, metrics_port: int = 0, host: str = "127.0.0.1",
                 spawn: Optional[Callable[..., subprocess.Popen]] = None):
        self.host = host
        self.rpc_port = rpc_port or _free_port()
        self.metrics_port = metrics_port or _free_port()
        self.log_path = os.path.join(str(log_dir), f"mooncake-master-{self.rpc_port}.log")
        self._spawn = spawn or (lambda argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw))
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def argv(self) -> Sequence[str]:
        return [master_binary(), f"-rpc_address={self.host}", f"-rpc_port={self.rpc_port}",
                "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}", "-rpc_thread_num=2",
                "-enable_http_metadata_server=false"]

    def extra_config(self, segment_mb: int = 64, local_hostname: str = "127.0.0.1") -> dict:
        """What a flexflow `hicache_storage: {backend: mooncake}` client needs to reach this master
        over TCP; `local_hostname` is the address the client's own segment is served on."""
        return {"master_server_address": self.address, "protocol": "tcp", "device_name": "",
                "metadata_server": "P2PHANDSHAKE", "local_hostname": local_hostname,
                "global_segment_size": segment_mb << 20}

    def start(self, timeout_s: float = 20.0, probe: Optional[Callable[[], bool]] = None) -> "MooncakeMaster":
        """Start and wait until the RPC port accepts; `probe` replaces the connect check (a master
        in another network namespace cannot be reached from here)."""
        with open(self.log_path, "a") as log:
            self.proc = self._spawn(list(self.argv()), stdout=log, stderr=subprocess.STDOUT)
        probe = probe or self._listening
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.tail()}")
            if probe():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout_s} s: {self.tail()}")

    def _listening(self) -> bool:
        try:
            with socket.create_connection((self.host, self.rpc_port), timeout=0.5):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL (what a crashed master looks like)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""
