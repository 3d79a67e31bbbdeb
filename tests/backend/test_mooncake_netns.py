"""Mooncake Store across a capped link (root): the master and a writing client in one network
namespace, a reading client in another, joined by a veth pair capped by `tbf` (NetLab, as the other
labs). Mooncake's TCP transport moves a get's bytes from the writer's segment to the reader, so the
read must take at least bytes / cap, arrive byte-equal, and a get whose budget (`timeout_ms`) is
shorter than the link needs must end as a counted miss in bounded time, never a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mooncake_fixture import MooncakeMaster, need_mooncake

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAP = "50mbit"
CAP_BPS = 50e6
PAGE = 64 << 10
PAGES = 96  # 6 MiB + headers: ~1 s at the cap

# Both clients: a HiCacheStorageTier("mooncake") whose Mooncake client advertises its own link address.
CLIENT_COMMON = r"""
import hashlib, json, os, sys, time
import numpy as np
from flexflow_sglang.backend.hicache_tier import HiCacheStorageTier

master, local_ip, n, page = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
FP = "model=netns|mooncake"

def keys_of(n):
    out, h = [], b"netns"
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(h)
    return out

def pages_of(n):
    return np.random.default_rng(7).integers(0, 256, size=(n, page), dtype=np.uint8)

def tier(timeout_ms):
    cfg = {"master_server_address": master, "protocol": "tcp", "device_name": "",
           "metadata_server": "P2PHANDSHAKE", "local_hostname": local_ip, "global_segment_size": 64 << 20}
    return HiCacheStorageTier("mooncake", fingerprint=FP, page_nbytes=page, extra_config=cfg, staging_mb=8,
                              timeout_ms=timeout_ms, retry_after_s=30.0)
"""

WRITER = CLIENT_COMMON + r"""
ready, done = sys.argv[6], sys.argv[7]
t = tier(30000)
put = t.put_many(keys_of(n), pages_of(n))
with open(ready + ".tmp", "w") as f:
    json.dump({"put": put}, f)
os.replace(ready + ".tmp", ready)   # the test polls for the file: it must never see it half written
end = time.monotonic() + 180
while not os.path.exists(done) and time.monotonic() < end:
    time.sleep(0.05)   # the pages live in this client's segment: stay until the reader is done
os._exit(0)
"""

READER = CLIENT_COMMON + r"""
out_path, short_ms = sys.argv[6], float(sys.argv[7])
keys, want = keys_of(n), pages_of(n)
res = {}
slow = tier(60000)
res["held"] = slow.contains_prefix(keys)
buf = np.zeros_like(want)
t0 = time.perf_counter()
res["got"] = slow.get_many_into(keys, buf)
res["seconds"] = time.perf_counter() - t0
res["equal"] = bool(np.array_equal(buf, want))
res["bytes_read"] = slow.stats()["bytes_read"]
# a budget far below what the link needs for the same pages: a miss, within the budget plus slack
short = tier(short_ms)
buf2 = np.zeros_like(want)
t0 = time.perf_counter()
res["short_got"] = short.get_many_into(keys, buf2)
res["short_seconds"] = time.perf_counter() - t0
s = short.stats()
res["short_timeouts"], res["short_misses"] = s["timeouts"], s["misses"]
with open(out_path, "w") as f:
    json.dump(res, f)
os._exit(0)   # the timed-out get may still run on the tier's I/O thread
"""


PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5)"


def _skip_reason() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces + tc)"
    from flexflow_sglang.tools.bench.contention import netlab
    ok, why = netlab.available()
    return "" if ok else f"netns lab unavailable: {why}"


def test_mooncake_get_crosses_the_capped_link_and_a_short_budget_is_a_miss(tmp_path):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    need_mooncake()
    from flexflow_sglang.tools.bench.contention.netlab import NetLab

    env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = []

    def log(name):
        path = tmp_path / f"{name}.log"
        logs.append(path)
        return open(path, "wb")

    def tails() -> str:
        return "".join(f"\n--- {p.name} ---\n" + p.read_text(errors="replace")[-2000:] for p in logs if p.exists())

    with NetLab(["m0", "m1"]) as lab:
        lab.link("m0", "m1", CAP)
        ip0, ip1 = lab.addr("m0", "m1"), lab.addr("m1", "m0")
        mc = MooncakeMaster(tmp_path, rpc_port=50051, metrics_port=50052, host=ip0,
                            spawn=lambda argv, **kw: lab.spawn("m0", argv, **kw))
        # the master listens inside m0: ask m0 whether its port is open
        mc.start(probe=lambda: subprocess.run(["ip", "netns", "exec", lab.ns("m0"), sys.executable, "-c",
                                               PROBE, ip0, "50051"],
                                              stderr=subprocess.DEVNULL).returncode == 0)
        logs.append(tmp_path / os.path.basename(mc.log_path))
        master = mc.address
        ready, done = tmp_path / "writer.ready", tmp_path / "reader.done"
        w = lab.spawn("m0", [sys.executable, "-c", WRITER, "w", master, ip0, str(PAGES), str(PAGE), str(ready),
                             str(done)], env=env, stdout=log("writer"), stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert w.poll() is None and time.monotonic() < deadline, "writer did not store its pages" + tails()
            time.sleep(0.1)
        assert json.loads(ready.read_text())["put"] == PAGES, tails()

        out = tmp_path / "reader.json"
        need_s = PAGES * PAGE * 8 / CAP_BPS
        short_ms = max(50.0, need_s * 1000 / 8)
        r = lab.spawn("m1", [sys.executable, "-c", READER, "r", master, ip1, str(PAGES), str(PAGE), str(out),
                             str(short_ms)], env=env, stdout=log("reader"), stderr=subprocess.STDOUT, cwd=REPO)
        try:
            r.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail("reader hung" + tails())
        done.write_text("1")
        assert out.exists(), f"reader exited {r.returncode} without a result" + tails()
        res = json.loads(out.read_text())
    print(f"mooncake over a {CAP} link: {res}, at least {need_s:.2f} s needed for the payload")
    assert res["held"] == PAGES and res["got"] == PAGES and res["equal"], res
    # the bytes crossed the cap: no faster than the link allows (tbf's 256 KB burst as slack) ...
    assert res["seconds"] >= 0.85 * need_s, (res, need_s)
    # ... and the budgeted get ended as a counted miss near its budget, not after the transfer
    assert res["short_got"] == 0 and res["short_timeouts"] >= 1 and res["short_misses"] >= PAGES, res
    assert res["short_seconds"] < short_ms / 1000 + 2.0, (res, short_ms)
