"""Control channel between the orchestrator (host namespace) and the lab programs: JSON lines over
the child's stdin/stdout pipes. The pipes never touch the lab's links, so control traffic cannot
disturb (or be delayed by) the measured transfers.

In the child, `ChildChannel()` moves the control pipe off fd 1 and points fd 1 at stderr: NIXL/UCX
log to stdout, and a stray log line must not corrupt the protocol.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Optional


class ChannelError(RuntimeError):
    pass


class ChildChannel:
    def __init__(self):
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._in = sys.stdin.buffer
        self._fd = sys.stdin.fileno()
        self._buf = b""

    def send(self, **msg) -> None:
        self._out.write(json.dumps(msg, separators=(",", ":")) + "\n")
        self._out.flush()

    def poll(self, timeout: float = 0.0) -> Optional[dict]:
        """One command if available within timeout (doubles as the poll loop's sleep)."""
        if b"\n" not in self._buf:
            r, _, _ = select.select([self._fd], [], [], timeout)
            if r:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    return {"op": "quit", "eof": True}
                self._buf += chunk
        if b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            return json.loads(line)
        return None

    def recv(self) -> dict:
        while True:
            m = self.poll(1.0)
            if m is not None:
                return m


class ParentChannel:
    """Wraps a Popen started with stdin=PIPE, stdout=PIPE."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self.proc, self.name = proc, name
        self._fd = proc.stdout.fileno()
        self._buf = b""

    def send(self, **msg) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg, separators=(",", ":")) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ChannelError(f"{self.name}: cannot send {msg.get('op')!r}: {e} (rc={self.proc.poll()})") from None

    def recv(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelError(f"{self.name}: no reply within {timeout:.0f} s")
            r, _, _ = select.select([self._fd], [], [], min(left, 1.0))
            if r:
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    raise ChannelError(f"{self.name}: exited (rc={self.proc.poll()}) before replying")
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise ChannelError(f"{self.name}: exited (rc={self.proc.returncode}) before replying")
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg.get("error"):
            raise ChannelError(f"{self.name}: {msg['error']}")
        return msg

    def call(self, timeout: float = 60.0, **msg) -> dict:
        self.send(**msg)
        return self.recv(timeout)
