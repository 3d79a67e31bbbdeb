"""Remote tier over loopback: tier server subprocesses + clients (this process and subprocesses).

Data moves with NIXL UCX; the control channel is the wire format of flexflow_sglang.tiers.wire."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from flexflow_sglang.tiers import remote as remote_mod
from flexflow_sglang.tiers.base import KVTier
from flexflow_sglang.tiers.remote import RemoteTier
from flexflow_sglang.tiers.wire import HEADER, MsgType, read_frame, write_frame

from tier_helpers import REPO, freeze, requires_nixl, tier_env

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(120)]

P = 64 * 1024 + 8


def keys_for(n, tag=b"r"):
    import hashlib
    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


def pages_for(n, seed=0, p=P):
    return np.random.default_rng(seed).integers(0, 256, size=(n, p), dtype=np.uint8)


@pytest.fixture
def clients():
    made = []

    def mk(peers, **kw):
        kw.setdefault("timeout_ms", 2000)
        kw.setdefault("retry_after_s", 30)
        t = RemoteTier(peers, **kw)
        made.append(t)
        return t

    yield mk
    for t in made:
        t.close()


def test_two_processes_put_get_byte_equal(spawn_server, clients):
    srv = spawn_server()
    t = clients([srv.addr])
    assert isinstance(t, KVTier)
    ks, pg = keys_for(24), pages_for(24)
    assert t.contains_prefix(ks) == 0
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0
    assert t.put_many(ks, pg) == 24
    assert t.contains_prefix(ks) == 24
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 24 and np.array_equal(out, pg)
    # a gap in the chain ends the prefix
    assert t.get_many_into(ks[:5] + keys_for(1, b"gap") + ks[5:], np.zeros((25, P), np.uint8)) == 5
    # a second client (fresh agent, fresh connection) hits the same pages
    t2 = clients([srv.addr])
    assert t2.contains_prefix(ks) == 24
    out2 = np.zeros_like(pg)
    assert t2.get_many_into(ks, out2) == 24 and np.array_equal(out2, pg)
    t.discard(ks[10:11])
    assert t2.contains_prefix(ks) == 10
    s = t.stats()
    assert s["hits"] >= 29 and s["bytes_written"] == 24 * P and s["timeouts"] == 0 and s["peer_down"] == 0
    assert s["read_gbps"] > 0 and s["peers"][srv.addr]["up"]
    st = t.server_stats(srv.addr)
    assert st["pages_stored"] == 24 and st["leases"] == 0 and st["page_nbytes"] == P


WRITER = textwrap.dedent("""
    import sys, hashlib, numpy as np
    from flexflow_sglang.tiers.remote import RemoteTier
    peers, n, P = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    keys = [hashlib.blake2b(b"m" + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]
    pages = np.random.default_rng(7).integers(0, 256, size=(n, P), dtype=np.uint8)
    t = RemoteTier(peers, timeout_ms=5000)
    print("stored", t.put_many(keys, pages), flush=True)
    t.close()
""")


def test_three_processes_store_on_one_hit_from_another(spawn_server, clients):
    """Two tier servers + a writer process + this process as the reader (4 processes)."""
    s1, s2 = spawn_server(), spawn_server()
    n = 40
    r = subprocess.run([sys.executable, "-c", WRITER, f"{s1.addr},{s2.addr}", str(n), str(P)],
                       capture_output=True, text=True, env=tier_env(), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith(f"stored {n}")
    reader = clients([s2.addr, s1.addr])  # peer order does not matter for placement
    ks = [__import__("hashlib").blake2b(b"m" + i.to_bytes(4, "little"), digest_size=32).digest()
          for i in range(n)]
    want = np.random.default_rng(7).integers(0, 256, size=(n, P), dtype=np.uint8)
    assert reader.contains_prefix(ks) == n
    out = np.zeros_like(want)
    assert reader.get_many_into(ks, out) == n and np.array_equal(out, want)
    a, b = reader.server_stats(s1.addr)["used_slots"], reader.server_stats(s2.addr)["used_slots"]
    assert a + b == n and a > 5 and b > 5  # rendezvous hashing spread the pages over both


def test_sigstop_mid_transfer_times_out_and_marks_down(spawn_server, clients, monkeypatch):
    # Over TCP the server must progress for a READ to complete (shared memory/CMA would let a
    # frozen peer's pages be read anyway), so both sides use UCX_TLS=tcp here.
    monkeypatch.setenv("UCX_TLS", "tcp")
    srv = spawn_server(env={"UCX_TLS": "tcp"})
    t = clients([srv.addr], timeout_ms=500, retry_after_s=1.5)
    ks, pg = keys_for(16), pages_for(16, p=1 << 20)
    assert t.put_many(ks, pg) == 16
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 16
    stopped = []

    def stop(op):
        freeze(srv.pid)
        stopped.append(op)

    t._before_data_phase = stop
    out[:] = 0
    t0 = time.monotonic()
    k = t.get_many_into(ks, out)
    dt = time.monotonic() - t0
    t._before_data_phase = None
    assert stopped == ["READ"]
    assert k == 0 and dt < 0.5 + 1.5, dt
    s = t.stats()
    assert s["timeouts"] == 1 and s["peer_down"] == 1 and s["parked_now"] == 1
    assert s["agent_recycles"] == 0  # destroying it would make the frozen server abort on resume
    assert not s["peers"][srv.addr]["up"] and "timed out" in s["peers"][srv.addr]["down_reason"]
    # while down: immediate misses, no waiting on the frozen peer
    t0 = time.monotonic()
    assert t.get_many_into(ks, out) == 0 and t.contains_prefix(ks) == 0
    assert t.put_many(ks, pg) == 0
    assert time.monotonic() - t0 < 0.2
    # resumed: the late transfer lands in the parked staging buffer, never in the caller's
    os.kill(srv.pid, signal.SIGCONT)
    time.sleep(0.3)
    assert not out.any()
    assert srv.alive()
    # after retry_after_s the peer serves again and the parked transfer is reaped
    time.sleep(1.5)
    assert t.get_many_into(ks, out) == 16 and np.array_equal(out, pg)
    s = t.stats()
    assert s["parked_now"] == 0 and s["peers"][srv.addr]["up"] and srv.alive()


def test_parked_transfers_over_budget_recycle_the_agent(spawn_server, clients, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    srv = spawn_server(env={"UCX_TLS": "tcp"})
    t = clients([srv.addr], timeout_ms=300, retry_after_s=30, max_parked_mb=0.5)
    ks, pg = keys_for(8), pages_for(8)
    assert t.put_many(ks, pg) == 8
    t._before_data_phase = lambda op: freeze(srv.pid)
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0
    t._before_data_phase = None
    s = t.stats()
    assert s["agent_recycles"] == 1 and s["parked_now"] == 0  # 4 MiB parked > 0.5 MiB budget
    srv.proc.kill()  # frozen for good; its pages are gone
    srv.proc.wait()
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0


def test_sigstop_control_channel_times_out(spawn_server, clients):
    srv = spawn_server()
    t = clients([srv.addr], timeout_ms=400, retry_after_s=0.5)
    ks, pg = keys_for(4), pages_for(4)
    assert t.put_many(ks, pg) == 4
    freeze(srv.pid)
    try:
        t0 = time.monotonic()
        assert t.get_many_into(ks, np.zeros_like(pg)) == 0
        assert time.monotonic() - t0 < 1.2
        assert t.stats()["timeouts"] == 1 and t.stats()["peer_down"] == 1
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    # after retry_after_s the peer is tried again and serves
    time.sleep(0.6)
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 4 and np.array_equal(out, pg)
    assert t.stats()["peers"][srv.addr]["up"]


def test_killed_server_then_restarted_on_same_port(spawn_server, clients):
    srv = spawn_server()
    t = clients([srv.addr], timeout_ms=1000, retry_after_s=0.3)
    ks, pg = keys_for(6), pages_for(6)
    assert t.put_many(ks, pg) == 6
    srv.proc.kill()
    srv.proc.wait()
    t0 = time.monotonic()
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0
    assert time.monotonic() - t0 < 1.0
    s = t.stats()
    assert s["peer_down"] == 1 and not s["peers"][srv.addr]["up"]
    # a new server process (new NIXL agent, empty memory) on the same address
    srv2 = spawn_server(listen=srv.addr)
    time.sleep(0.35)
    assert t.contains_prefix(ks) == 0
    assert t.put_many(ks, pg) == 6
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 6 and np.array_equal(out, pg)
    assert srv2.alive()


def test_one_of_two_peers_down_reroutes(spawn_server, clients):
    s1, s2 = spawn_server(), spawn_server()
    t = clients([s1.addr, s2.addr], timeout_ms=1000, retry_after_s=60)
    ks, pg = keys_for(30), pages_for(30)
    assert t.put_many(ks, pg) == 30
    s1.proc.kill()
    s1.proc.wait()
    out = np.zeros_like(pg)
    k = t.get_many_into(ks, out)          # stops at the first page that lived on s1
    assert k < 30 and np.array_equal(out[:k], pg[:k])
    assert t.stats()["peer_down"] == 1
    # with s1 down every key maps to s2: storing again makes the whole prefix available
    assert t.put_many(ks, pg) == 30
    assert t.get_many_into(ks, out) == 30 and np.array_equal(out, pg)
    assert all(t.node_for(k_) == s2.addr for k_ in ks)


@pytest.mark.parametrize("layout", ["files", "slabs"])
def test_server_storage_survives_restart(spawn_server, clients, tmp_path, layout):
    sp = tmp_path / "srv-store"
    srv = spawn_server(storage_path=sp, extra=("--storage-layout", layout))
    t = clients([srv.addr], retry_after_s=0.2)
    ks, pg = keys_for(8), pages_for(8)
    assert t.put_many(ks, pg) == 8
    assert t.server_stats(srv.addr)["storage"]["pages"] == 8  # written through
    srv.proc.terminate()
    srv.proc.wait(timeout=10)
    srv2 = spawn_server(storage_path=sp, listen=srv.addr, extra=("--storage-layout", layout))  # page size from disk
    t2 = clients([srv2.addr])
    assert t2.contains_prefix(ks) == 8  # a fresh client's first call is a lookup
    out = np.zeros_like(pg)
    assert t2.get_many_into(ks, out) == 8 and np.array_equal(out, pg)
    assert t2.server_stats(srv2.addr)["promoted"] == 8
    kinds = {f.rsplit(".", 1)[-1] for f in os.listdir(sp) if not f.startswith(".")}
    assert kinds == ({"kv"} if layout == "files" else {"kvs"}), kinds


def test_corrupt_remote_page_is_dropped(spawn_server, clients, monkeypatch):
    srv = spawn_server()
    t = clients([srv.addr])
    ks, pg = keys_for(5), pages_for(5)
    real = remote_mod.page_digests
    # the writer announces a wrong checksum for page 2 (what a torn or misdirected write looks like)
    monkeypatch.setattr(remote_mod, "page_digests",
                        lambda a, n, rows=None: [c ^ (1 if i == 2 else 0) for i, c in enumerate(real(a, n, rows))])
    assert t.put_many(ks, pg) == 5
    monkeypatch.setattr(remote_mod, "page_digests", real)
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 2 and np.array_equal(out[:2], pg[:2])
    assert t.stats()["corrupt_dropped"] == 1
    time.sleep(0.1)  # RELEASE (with the drop) is one-way
    assert t.contains_prefix(ks) == 2
    assert t.get_many_into(ks[3:], out[:2]) == 2


def _raw_conn(addr):
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.mark.parametrize("bad", ["magic", "version", "oversized", "pickle"])
def test_server_rejects_bad_frames_and_keeps_serving(spawn_server, clients, bad):
    srv = spawn_server()
    s = _raw_conn(srv.addr)
    if bad == "magic":
        s.sendall(HEADER.pack(b"HTTP", 1, int(MsgType.PING), 0, 2, 0) + b"{}")
    elif bad == "version":
        s.sendall(HEADER.pack(b"FFTW", 9, int(MsgType.PING), 0, 2, 0) + b"{}")
    elif bad == "oversized":
        s.sendall(HEADER.pack(b"FFTW", 1, int(MsgType.PUT), 0, 2, 1 << 31))
    else:
        import pickle
        s.sendall(pickle.dumps({"op": "lookup"}))
    f = read_frame(s, time.monotonic() + 5)
    assert f.type == MsgType.ERROR and f.body["error"]
    try:  # then the server closes that connection (RST when our unread bytes were pending)
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    s.close()
    # a well-formed conversation on another connection still works
    t = clients([srv.addr])
    assert t.put_many(keys_for(2), pages_for(2)) == 2
    # and a bad body (valid frame) is answered without dropping the connection
    s = _raw_conn(srv.addr)
    write_frame(s, MsgType.LOOKUP, {"klen": 32, "n": 3}, b"x" * 10, deadline=time.monotonic() + 5)
    f = read_frame(s, time.monotonic() + 5)
    assert f.type == MsgType.ERROR
    write_frame(s, MsgType.PING, {}, deadline=time.monotonic() + 5)
    assert read_frame(s, time.monotonic() + 5).type == MsgType.PONG
    s.close()


def test_page_size_mismatch_and_no_peers(spawn_server, clients):
    srv = spawn_server(extra=("--page-nbytes", "4096"))
    t = clients([srv.addr], retry_after_s=60)
    assert t.put_many(keys_for(2), pages_for(2)) == 0
    assert "page" in t.stats()["peers"][srv.addr]["down_reason"]
    empty = clients([])
    assert empty.contains_prefix(keys_for(1)) == 0 and empty.put_many(keys_for(1), pages_for(1)) == 0
    empty.close()
    empty.close()


def test_scheduler_thread_lookup_never_waits_for_a_transfer(spawn_server, clients):
    """A worker holds the remote tier's lock for a whole transfer over a slow link. A lookup made
    in no_wait_lookups (the connector's scheduler-thread lookup) is then a miss at once, counted;
    the same lookup from a worker waits and gets the real answer."""
    import threading

    from flexflow_sglang.tiers.base import no_wait_lookups
    srv = spawn_server()
    t = clients([srv.addr])
    ks, pg = keys_for(8), pages_for(8)
    assert t.put_many(ks, pg) == 8
    held, release = threading.Event(), threading.Event()

    def worker():  # stands in for a transfer in flight: the lock is held until `release`
        with t.lock:
            held.set()
            release.wait(10)
    th = threading.Thread(target=worker)
    th.start()
    assert held.wait(5)
    try:
        t0 = time.perf_counter()
        with no_wait_lookups():
            assert t.contains_prefix(ks) == 0
        assert time.perf_counter() - t0 < 1.0 and t.stats()["lookups_busy"] == 1
    finally:
        release.set()
        th.join(5)
    with no_wait_lookups():
        assert t.contains_prefix(ks) == 8  # lock free again: the real answer
    assert t.contains_prefix(ks) == 8
