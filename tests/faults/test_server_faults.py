"""An adversarial client against `flexflow tier-server`: random frames, oversized counts and lengths,
idle and slowloris sockets, clients that never read, HELLOs that try to change the page size, lease
theft, and the memory one connection can make the server hold. A normal RemoteTier client must keep
being served throughout."""
from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import numpy as np
import pytest

from flexflow_sglang.tiers.remote import RemoteTier
from flexflow_sglang.tiers.wire import (HEADER, MAGIC, MAX_KEYS_PER_FRAME, SERVER_MAX_BLOB, SERVER_MAX_JSON,
                                        WIRE_VERSION, MsgType, read_frame, write_frame)

from fault_helpers import closed, conn, hello, keys_for, pages_for, rpc, rss_kib
from tier_helpers import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(120)]
P = 4096
FAST = ("--page-nbytes", str(P), "--idle-timeout-s", "1", "--frame-timeout-s", "0.5")


def normal_client_works(addr, tag=b"n", n=4):
    t = RemoteTier([addr], timeout_ms=3000, retry_after_s=30)
    try:
        ks, pg = keys_for(n, tag), pages_for(n, P, seed=len(tag))
        assert t.put_many(ks, pg) == n, t.stats()["peers"]
        out = np.zeros_like(pg)
        assert t.get_many_into(ks, out) == n and np.array_equal(out, pg)
    finally:
        t.close()


def stats(addr):
    s = conn(addr)
    try:
        return rpc(s, MsgType.STATS).body
    finally:
        s.close()


def test_random_frames_never_take_the_server_down(tier_server):
    srv = tier_server(*FAST)
    types = [int(t) for t in MsgType] + [0, 99, 200]
    fields = ["klen", "n", "pin", "sums", "lease", "ok", "drop", "page_nbytes", "owner", "timeout_ms", "mac"]
    values = [0, -1, 1, 32, 2**31, 2**63, 1e308, None, True, "x" * 50, [], [1, 2, 3], [-1] * 5, {"a": 1},
              [[[]]], "127.0.0.1:1"]

    def fuzz(seed):
        rng = random.Random(seed)
        for _ in range(12):  # bursts, each on a fresh connection (framing may be lost)
            s = conn(srv.addr)
            for _ in range(5):
                kind = rng.randrange(4)
                if kind == 0:    # random bytes
                    raw = os.urandom(rng.randrange(1, 64))
                elif kind == 1:  # a valid header, a body that lies about its length
                    js = json.dumps({rng.choice(fields): rng.choice(values)}).encode()
                    raw = HEADER.pack(MAGIC, WIRE_VERSION, rng.choice(types), 0, len(js) + rng.randrange(3), 0) + js
                else:            # well-formed frames with random bodies and blobs
                    body = {f: rng.choice(values) for f in rng.sample(fields, rng.randrange(0, 5))}
                    js = json.dumps(body).encode()
                    blob = os.urandom(rng.choice([0, 3, 32, 64, 96]))
                    raw = HEADER.pack(MAGIC, WIRE_VERSION, rng.choice(types), 0, len(js), len(blob)) + js + blob
                try:
                    s.sendall(raw)
                except OSError:
                    break
            try:  # answers, an ERROR, EOF, or nothing (a short frame: the frame deadline closes it)
                s.settimeout(0.3)
                s.recv(65536)
            except (socket.timeout, OSError):
                pass
            s.close()
    ths = [threading.Thread(target=fuzz, args=(seed,)) for seed in range(6)]  # 360 frames
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert srv.alive()
    normal_client_works(srv.addr)
    st = stats(srv.addr)
    assert st["errors"] > 50 and st["page_nbytes"] == P


@pytest.mark.parametrize("case", ["count", "json", "blob", "nested", "flags", "klen0"])
def test_oversized_counts_and_lengths(module_server, case):
    srv = module_server
    s = conn(srv.addr)
    hello(s, P)
    if case == "count":   # more keys than one frame may name: refused, the connection stays
        n = MAX_KEYS_PER_FRAME + 1
        f = rpc(s, MsgType.LOOKUP, {"klen": 1, "n": n, "pin": True}, b"k" * n)
        assert f.type == MsgType.ERROR and str(MAX_KEYS_PER_FRAME) in f.body["error"]
        assert rpc(s, MsgType.PING).type == MsgType.PONG
    elif case == "klen0":
        f = rpc(s, MsgType.PUT, {"klen": 0, "n": 5, "sums": [0] * 5}, b"")
        assert f.type == MsgType.ERROR
    elif case == "nested":
        js = b"[" * 100_000 + b"]" * 100_000
        s.sendall(HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.PING), 0, len(js), 0) + js)
        f = read_frame(s, time.monotonic() + 5)
        assert f.type == MsgType.ERROR and "JSON" in f.body["error"]
    else:                 # lengths past the server's limits, or reserved flags: ERROR, then closed
        jlen, blen, flags = {"json": (SERVER_MAX_JSON + 1, 0, 0), "blob": (2, SERVER_MAX_BLOB + 1, 0),
                             "flags": (2, 0, 0x8000)}[case]
        s.sendall(HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.LOOKUP), flags, jlen, blen))
        f = read_frame(s, time.monotonic() + 5)
        assert f.type == MsgType.ERROR
        assert closed(s)
    s.close()
    normal_client_works(srv.addr)


def test_hello_cannot_change_the_page_size(tier_server):
    srv = tier_server("--idle-timeout-s", "5", "--frame-timeout-s", "1")  # no --page-nbytes
    rss0 = rss_kib(srv.pid)
    for bad in (1, 63, 2**40, -5, "4096", True):
        s = conn(srv.addr)
        f = rpc(s, MsgType.HELLO, {"client": "evil", "page_nbytes": bad})
        assert f.type == MsgType.ERROR, bad
        s.close()
    assert stats(srv.addr)["page_nbytes"] is None  # still open for the first real client
    assert rss_kib(srv.pid) - rss0 < 8 << 10       # no per-byte slot objects were built
    normal_client_works(srv.addr)
    s = conn(srv.addr)
    f = rpc(s, MsgType.HELLO, {"client": "evil", "page_nbytes": 8192})
    assert f.type == MsgType.ERROR and "mismatch" in f.body["error"]
    s.close()
    assert stats(srv.addr)["page_nbytes"] == P
    normal_client_works(srv.addr, b"again")


def test_idle_sockets_cannot_lock_clients_out(tier_server):
    srv = tier_server(*FAST, "--max-conns", "8", "--idle-timeout-s", "30")
    idle = [conn(srv.addr) for _ in range(8)]
    time.sleep(1.1)  # idle >= 1 s: evictable (a socket younger than that keeps its place)
    t0 = time.monotonic()
    normal_client_works(srv.addr)  # takes the place of the longest-idle socket(s)
    assert time.monotonic() - t0 < 5
    st = stats(srv.addr)
    assert st["conns_evicted"] >= 1 and st["conns_refused"] == 0
    assert sum(closed(s, 0.1) for s in idle) == st["conns_evicted"]


def test_silent_sockets_are_cut_at_the_idle_deadline(module_server):
    srv = module_server
    cut0 = stats(srv.addr)["idle_cut"]
    idle = [conn(srv.addr) for _ in range(6)]
    t0 = time.monotonic()
    assert all(closed(s, 4) for s in idle)
    assert 0.8 < time.monotonic() - t0 < 4
    assert stats(srv.addr)["idle_cut"] - cut0 >= 6
    normal_client_works(srv.addr)
    for s in idle:
        s.close()


def test_slowloris_is_cut_while_a_normal_client_is_served(module_server):
    srv = module_server
    cut0 = stats(srv.addr)["slow_cut"]
    slow = [conn(srv.addr) for _ in range(4)]
    frame = HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.PING), 0, 2, 0) + b"{}"
    stop = threading.Event()

    def trickle(s):
        for b in frame:
            if stop.is_set():
                return
            try:
                s.sendall(bytes([b]))
            except OSError:
                return
            time.sleep(0.2)
    ths = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in slow]
    for th in ths:
        th.start()
    normal_client_works(srv.addr)
    time.sleep(1.2)
    stop.set()
    assert all(closed(s, 2) for s in slow)
    assert stats(srv.addr)["slow_cut"] - cut0 >= 4
    for s in slow:
        s.close()


def test_client_that_never_reads_its_replies_is_cut(module_server):
    srv = module_server
    cut0 = stats(srv.addr)["slow_cut"]
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = srv.addr.rsplit(":", 1)
    s.connect((host, int(port)))
    req = HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.STATS), 0, 2, 0) + b"{}"
    s.settimeout(0.5)
    sent = 0
    try:
        for _ in range(20000):  # ~1 KB of reply each; we never read
            s.sendall(req)
            sent += 1
    except (socket.timeout, OSError):
        pass
    deadline = time.monotonic() + 5
    while stats(srv.addr)["slow_cut"] - cut0 < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats(srv.addr)["slow_cut"] - cut0 >= 1, sent
    s.close()
    normal_client_works(srv.addr)


def test_leases_belong_to_their_connection(module_server):
    srv = module_server
    denied0 = stats(srv.addr)["lease_denied"]
    a, b = conn(srv.addr), conn(srv.addr)
    hello(a, P)
    hello(b, P)
    ks = keys_for(2, b"lease")
    f = rpc(a, MsgType.PUT, {"klen": 32, "n": 2, "sums": [0, 0]}, b"".join(ks))
    lid = f.body["lease"]
    assert f.type == MsgType.PUT_OK and lid and f.body["status"] == [0, 0]
    assert lid > 1 << 20  # not a guessable sequence number
    thief = rpc(b, MsgType.COMMIT, {"lease": lid, "ok": [1, 1]})
    assert thief.type == MsgType.COMMIT_OK and thief.body["stored"] == []
    assert rpc(a, MsgType.COMMIT, {"lease": lid, "ok": [1, 1]}).body["stored"] == [1, 1]
    # a pin lease cannot be released (nor its pages dropped) by another connection
    g = rpc(a, MsgType.LOOKUP, {"klen": 32, "n": 2, "pin": True}, b"".join(ks))
    assert g.body["count"] == 2 and g.body["lease"]
    write_frame(b, MsgType.RELEASE, {"lease": g.body["lease"], "drop": [0, 1]}, deadline=time.monotonic() + 2)
    assert rpc(b, MsgType.LOOKUP, {"klen": 32, "n": 2, "pin": False}, b"".join(ks)).body["count"] == 2
    st = stats(srv.addr)
    assert st["lease_denied"] - denied0 == 2 and st["leases"] == 1  # a's pin lease is still a's
    a.close()
    time.sleep(0.3)
    assert stats(srv.addr)["leases"] == 0  # ended with a's connection
    b.close()


def test_memory_per_connection_is_bounded(tier_server):
    """Worst case a client can make the server hold: N connections each sending the largest legal
    LOOKUP at once (32768 keys of 64 bytes). The old reader took 100+ MiB for one 4 MiB LOOKUP of
    2-byte keys; now that frame is refused before any key object exists."""
    srv = tier_server(*FAST, "--idle-timeout-s", "10", capacity_gb=0.01)
    s = conn(srv.addr)
    hello(s, P)
    normal_client_works(srv.addr)
    rss0 = rss_kib(srv.pid)
    n = 2 << 20  # the frame: 4 MiB of 2-byte keys
    f = rpc(s, MsgType.LOOKUP, {"klen": 2, "n": n, "pin": True}, b"\0" * 0)
    assert f.type == MsgType.ERROR
    s.close()
    N = 16
    socks = [conn(srv.addr, timeout=30) for _ in range(N)]
    for c in socks:
        hello(c, P)
    frame_keys = os.urandom(64) * MAX_KEYS_PER_FRAME
    body = json.dumps({"klen": 64, "n": MAX_KEYS_PER_FRAME, "pin": True}).encode()
    frame = HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.LOOKUP), 0, len(body), len(frame_keys)) + body + frame_keys
    for _ in range(3):
        for c in socks:
            c.sendall(frame)
        for c in socks:
            assert read_frame(c, time.monotonic() + 30).type == MsgType.LOOKUP_OK
    grown = rss_kib(srv.pid) - rss0
    per_conn_mib = grown / 1024 / N
    print(f"\nRSS growth {grown / 1024:.1f} MiB for {N} connections x max LOOKUP: {per_conn_mib:.2f} MiB each")
    assert per_conn_mib < 12, per_conn_mib
    for c in socks:
        c.close()
    normal_client_works(srv.addr, b"after")


def test_client_reconnects_after_the_server_cut_its_idle_connection(module_server):
    """The idle deadline must not turn into a miss for a normal client: it notices the closed
    connection before its next call and reconnects in that call (peer never marked down)."""
    t = RemoteTier([module_server.addr], timeout_ms=3000, retry_after_s=30)
    try:
        ks, pg = keys_for(3, b"stale"), pages_for(3, P, seed=3)
        assert t.put_many(ks, pg) == 3
        time.sleep(1.6)  # past the module server's 1 s idle deadline
        out = np.zeros_like(pg)
        assert t.get_many_into(ks, out) == 3 and np.array_equal(out, pg)
        peer = t.stats()["peers"][module_server.addr]
        assert peer["down_events"] == 0 and peer["failures"] == 0, peer
    finally:
        t.close()
