"""Raw-socket helpers of the fault suite (imported by name; pytest puts this directory on sys.path)."""
from __future__ import annotations

import hashlib
import socket
import time

import numpy as np

from flexflow_sglang.tiers.wire import MsgType, read_frame, write_frame


def keys_for(n, tag=b"f"):
    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


def pages_for(n, p, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, p), dtype=np.uint8)


def conn(addr, timeout=5.0):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def rpc(s, mtype, body=None, blob=b"", timeout=5.0, auth=None):
    write_frame(s, mtype, body or {}, blob, deadline=time.monotonic() + timeout, auth=auth)
    return read_frame(s, time.monotonic() + timeout, auth=auth)


def closed(s, timeout=5.0) -> bool:
    """True when the server closed `s` (EOF or reset) within `timeout` (frames before EOF are skipped)."""
    s.settimeout(timeout)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            if s.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def hello(s, page_nbytes=4096):
    f = rpc(s, MsgType.HELLO, {"client": "fault", "page_nbytes": page_nbytes})
    assert f.type == MsgType.HELLO_OK, f.body
    return f
