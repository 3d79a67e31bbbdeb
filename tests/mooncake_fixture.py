"""A Mooncake Store master on loopback for tests (mooncake-transfer-engine-non-cuda, `mooncake_master`).

`need_mooncake()` skips with the reason when the package, its binary or libibverbs is missing.
`MooncakeMaster(tmp_path)` picks free loopback ports; `start()`, `kill()` (SIGKILL: what a crashed
master looks like) and `start()` again on the same ports (a restarted master: empty metadata)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest


def master_binary() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return exe if os.path.exists(exe) else (shutil.which("mooncake_master") or "")


def need_mooncake() -> None:
    """Skip (with the reason) unless the Mooncake store can be imported and its master started."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing libibverbs.so.1
        pytest.skip(f"mooncake is not importable ({type(e).__name__}: {e}); install it with "
                    "apt-get install libibverbs1 && pip install -c .ci/constraints-cpu.txt "
                    "mooncake-transfer-engine-non-cuda (or .ci/setup-cpu.sh)")
    if not master_binary():
        pytest.skip("mooncake_master is not on PATH or next to the interpreter")


def free_port() -> int:
    # below the ephemeral range: the master binds it after a start-up delay (see find_free_port)
    from flexflow_sglang.tools.server_utils import find_free_port
    return find_free_port()


class MooncakeMaster:
    def __init__(self, log_dir, rpc_port: int = 0, metrics_port: int = 0):
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_path = os.path.join(str(log_dir), f"mooncake-master-{self.rpc_port}.log")
        self.proc = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def extra_config(self, segment_mb: int = 64) -> dict:
        """What a flexflow `hicache_storage: {backend: mooncake}` needs to reach this master over TCP."""
        return {"master_server_address": self.address, "protocol": "tcp", "device_name": "",
                "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
                "global_segment_size": segment_mb << 20}

    def start(self, timeout_s: float = 20.0) -> "MooncakeMaster":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [master_binary(), "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
             "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}", "-rpc_thread_num=2",
             "-enable_http_metadata_server=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout_s} s: {self.tail()}")

    def kill(self) -> None:
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
