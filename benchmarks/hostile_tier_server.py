"""A tier server under misbehaving clients: does a normal client keep being served, and what does a
connection cost the server? Both phases in one run, against one `flexflow tier-server` process with
its default deadlines (idle 60 s, frame 10 s, 64 connections).

    python benchmarks/hostile_tier_server.py [--bad 128] [--flood 8] [--ops 200] [--page-kib 64] [--out runs/hostile]

1. idle: a RemoteTier client does `--ops` get_many_into of 8 pages (pages stored first); latency
   per call -> p50 / p99.
2. hostile: `--bad` misbehaving clients start (more than --max-conns), in another process so they
   do not share the measuring client's GIL: silent sockets, slowloris senders (a frame announcing
   1 MiB, one byte every 0.5 s), random-frame spammers that reconnect, and clients that send STATS
   and never read; then the same client does the same calls.
3. flood: additionally `--flood` clients send the largest legal LOOKUP (32768 x 64-byte keys) back
   to back: legal load, not misbehaviour; it shows what CPU contention alone costs.
   Reported per phase: p50 / p99 against the idle phase, failed calls, and the server's counters
   (idle_cut, slow_cut, conns_evicted, conns_refused, errors).
4. memory: K connections each send the largest legal LOOKUP at once, repeatedly; the server's peak
   RSS over its baseline / K is the measured worst case per connection.
Writes <out>/hostile_tier_server.json and a latency-CDF plot (hostile_tier_server.png).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flexflow_sglang.tiers.remote import RemoteTier  # noqa: E402
from flexflow_sglang.tiers.wire import (HEADER, MAGIC, MAX_KEYS_PER_FRAME, WIRE_VERSION, MsgType,  # noqa: E402
                                        read_frame, write_frame)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]  # nearest rank


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start_server(tmp, P, cap_gb):
    ready = os.path.join(tmp, "ready")
    if os.path.exists(ready):  # from an earlier run
        os.unlink(ready)
    p = subprocess.Popen([sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", "127.0.0.1:0",
                          "--capacity-gb", str(cap_gb), "--page-nbytes", str(P), "--ready-file", ready],
                         cwd=ROOT, env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "server.log"), "wb"))
    t0 = time.monotonic()
    while not os.path.exists(ready):
        if p.poll() is not None or time.monotonic() - t0 > 60:
            raise SystemExit("tier server did not start (see server.log)")
        time.sleep(0.02)
    return p, json.load(open(ready))["listen"]


def conn(addr, timeout=10.0):
    h, port = addr.rsplit(":", 1)
    return socket.create_connection((h, int(port)), timeout=timeout)


def server_stats(addr):
    s = conn(addr)
    try:
        write_frame(s, MsgType.STATS, {}, deadline=time.monotonic() + 10)
        return read_frame(s, time.monotonic() + 10).body
    finally:
        s.close()


def measure(t, keys, out, ops):
    lat, fails = [], 0
    for _ in range(ops):
        t0 = time.perf_counter()
        got = t.get_many_into(keys, out)
        lat.append((time.perf_counter() - t0) * 1e3)
        fails += got != len(keys)
    return lat, fails


def lookup_frame():
    keys = os.urandom(64) * MAX_KEYS_PER_FRAME
    body = json.dumps({"klen": 64, "n": MAX_KEYS_PER_FRAME, "pin": False}).encode()
    return HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.LOOKUP), 0, len(body), len(keys)) + body + keys


def bad_client(kind, addr, stop, seed):
    rng = random.Random(seed)
    big = lookup_frame() if kind == "flood" else b""
    stats_req = HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.STATS), 0, 2, 0) + b"{}"
    while not stop.is_set():
        try:
            s = conn(addr, 5)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            if kind == "idle":
                stop.wait(1.0)
                s.settimeout(0.01)
                try:
                    if s.recv(1) == b"":  # evicted or cut: come back
                        continue
                except socket.timeout:
                    pass
                while not stop.is_set():
                    s.settimeout(1.0)
                    try:
                        if s.recv(1) == b"":
                            break
                    except socket.timeout:
                        pass
            elif kind == "slowloris":
                for b in HEADER.pack(MAGIC, WIRE_VERSION, int(MsgType.PING), 0, 1 << 20, 0):
                    if stop.is_set():
                        break
                    s.sendall(bytes([b]))
                    stop.wait(0.5)
            elif kind == "random":
                for _ in range(20):
                    s.sendall(os.urandom(rng.randrange(1, 200)))
                stop.wait(0.05)
            elif kind == "flood":
                s.settimeout(30)
                for _ in range(50):
                    if stop.is_set():
                        break
                    s.sendall(big)
                    read_frame(s, time.monotonic() + 30)
            elif kind == "noread":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.settimeout(1.0)
                while not stop.is_set():
                    s.sendall(stats_req * 50)
        except (OSError, ValueError, TimeoutError, ConnectionError):
            pass
        finally:
            s.close()


def bad_worker(addr, kinds, n, seconds):
    """Child process: n misbehaving clients of `kinds` (round robin) for `seconds`."""
    stop = threading.Event()
    ths = [threading.Thread(target=bad_client, args=(kinds[i % len(kinds)], addr, stop, i), daemon=True)
           for i in range(n)]
    for th in ths:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in ths:
        th.join(5)


def spawn_bad(addr, kinds, n, seconds):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", addr, ",".join(kinds), str(n),
                             str(seconds)], cwd=ROOT)


def hostile_phase(t, keys, out, ops, addr, kinds, n, name):
    w = spawn_bad(addr, kinds, n, 600)
    try:
        time.sleep(3.0)  # let them take every connection slot
        lat, fail = measure(t, keys, out, ops)
    finally:
        w.terminate()
        w.wait(10)
    print(f"{name}: p50 {pct(lat, 50):.2f} ms  p99 {pct(lat, 99):.2f} ms  failed {fail}", flush=True)
    return lat, fail


def memory_phase(addr, pid, k, rounds=3):
    socks = [conn(addr, 60) for _ in range(k)]
    for s in socks:
        write_frame(s, MsgType.HELLO, {"client": "mem", "page_nbytes": 0}, deadline=time.monotonic() + 10)
        read_frame(s, time.monotonic() + 10)
    base = rss_kib(pid)
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.005)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    fr = lookup_frame()
    for _ in range(rounds):
        for s in socks:
            s.sendall(fr)
        for s in socks:
            read_frame(s, time.monotonic() + 60)
    done.set()
    th.join()
    for s in socks:
        s.close()
    return {"connections": k, "rss_base_mib": base / 1024, "rss_peak_mib": peak[0] / 1024,
            "per_connection_mib": (peak[0] - base) / 1024 / k, "frame_bytes": len(fr)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        bad_worker(sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), float(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bad", type=int, default=128, help="misbehaving clients (default 128: 2x max_conns)")
    ap.add_argument("--flood", type=int, default=8, help="clients flooding the largest LOOKUP (0: skip)")
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--mem-conns", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "hostile"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    P = a.page_kib * 1024
    proc, addr = start_server(a.out, P, 0.25)
    res = {"command": " ".join(["python", "benchmarks/hostile_tier_server.py", *sys.argv[1:]]),
           "page_nbytes": P, "pages_per_call": 8, "ops": a.ops, "bad_clients": a.bad,
           "loadavg_at_start": os.getloadavg()[0], "cpus": os.cpu_count()}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        res["commit"] = rev.stdout.strip()
        # retry at once after a miss: one slow call must cost one failed call, not a marked-down window
        t = RemoteTier([addr], timeout_ms=2000, retry_after_s=0.01)
        keys = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest() for i in range(8)]
        pages = np.random.default_rng(0).integers(0, 256, size=(8, P), dtype=np.uint8)
        assert t.put_many(keys, pages) == 8, t.stats()["peers"]
        out = np.empty_like(pages)
        measure(t, keys, out, 10)  # warm
        idle_lat, idle_fail = measure(t, keys, out, a.ops)
        print(f"idle:    p50 {pct(idle_lat, 50):.2f} ms  p99 {pct(idle_lat, 99):.2f} ms  failed {idle_fail}", flush=True)
        s0 = server_stats(addr)
        bad = ["idle", "slowloris", "random", "noread"]
        hostile_lat, hostile_fail = hostile_phase(t, keys, out, a.ops, addr, bad, a.bad, "hostile")
        s1 = server_stats(addr)
        flood_lat, flood_fail = hostile_phase(t, keys, out, a.ops, addr, ["flood"], a.flood, "flood  ") \
            if a.flood else ([0.0], 0)
        st = server_stats(addr)
        t.close()
        ctr = ("connections", "idle_cut", "slow_cut", "conns_evicted", "conns_refused", "errors")
        res.update(idle={"p50_ms": pct(idle_lat, 50), "p99_ms": pct(idle_lat, 99), "failed": idle_fail},
                   hostile={"p50_ms": pct(hostile_lat, 50), "p99_ms": pct(hostile_lat, 99), "failed": hostile_fail,
                            "p99_ratio": pct(hostile_lat, 99) / pct(idle_lat, 99),
                            "server": {k: s1[k] - s0[k] for k in ctr}},
                   flood={"clients": a.flood, "p50_ms": pct(flood_lat, 50), "p99_ms": pct(flood_lat, 99),
                          "failed": flood_fail, "p99_ratio": pct(flood_lat, 99) / pct(idle_lat, 99),
                          "server": {k: st[k] - s1[k] for k in ctr}},
                   server_limits={k: st[k] for k in ("max_conns", "idle_timeout_s", "frame_timeout_s")})
        time.sleep(1.0)
        res["memory"] = memory_phase(addr, proc.pid, a.mem_conns)
        m = res["memory"]
        print(f"memory:  {m['connections']} connections x largest LOOKUP ({m['frame_bytes'] >> 10} KiB): "
              f"+{m['rss_peak_mib'] - m['rss_base_mib']:.1f} MiB, {m['per_connection_mib']:.2f} MiB each", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(os.path.join(a.out, "hostile_tier_server.json"), "w") as f:
        json.dump(res, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, xs in (("idle server", idle_lat), (f"{a.bad} misbehaving clients", hostile_lat),
                         (f"{a.flood} clients flooding max LOOKUPs", flood_lat)):
            xs = sorted(xs)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        ax.set_xscale("log")
        ax.set_xlabel("get_many_into of 8 pages (ms)")
        ax.set_ylabel("CDF")
        ax.legend()
        ax.set_title(f"normal client, {a.page_kib} KiB pages ({res['commit']})")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "hostile_tier_server.png"), dpi=120)
    except Exception as e:  # noqa: BLE001 - the JSON is the result
        print(f"plot skipped: {e!r}")
    print(json.dumps({k: res[k] for k in ("hostile", "flood")}, indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
