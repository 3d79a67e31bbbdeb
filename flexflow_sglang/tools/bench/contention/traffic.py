"""Background traffic without iperf3: a paced UDP sender, greedy TCP senders, and a sink that
time-stamps what it receives (so the orchestrator can compute the background's delivered rate over
exactly the windows in which our transfers ran).

    python -m flexflow_sglang.tools.bench.contention.traffic sink UDP_PORT TCP_PORT   (control on stdin/stdout)
    python -m flexflow_sglang.tools.bench.contention.traffic udp HOST PORT RATE_BITS_PER_S [--size 8192]
    python -m flexflow_sglang.tools.bench.contention.traffic tcp HOST PORT NFLOWS

Rates are on-wire (what `tbf` counts: payload + UDP/IP/Ethernet headers).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys
import threading
import time

UDP_OVERHEAD = 8 + 20 + 14  # UDP + IPv4 + Ethernet headers, per datagram
SERIES_PERIOD_S = 0.005
#: the UDP sender's most catch-up after a stall (seconds of its rate)
MAX_BACKLOG_S = 0.01


def sink(udp_port: int, tcp_port: int) -> int:
    from .channel import ChildChannel
    ch = ChildChannel()
    us = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    us.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: the sink must not be the bottleneck
    us.bind(("0.0.0.0", udp_port))
    us.setblocking(False)
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", tcp_port))
    ls.listen(16)
    ls.setblocking(False)
    conns = []
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    udp_b = tcp_b = 0
    series = [(time.monotonic(), 0, 0)]
    ch.send(ready=True, pid=os.getpid())
    ctl = ch._fd
    while True:
        r, _, _ = select.select([us, ls, ctl, *conns], [], [], SERIES_PERIOD_S)
        for s in r:
            if s is us:
                while True:
                    try:
                        udp_b += us.recv_into(mv) + UDP_OVERHEAD
                    except BlockingIOError:
                        break
            elif s is ls:
                try:
                    c, _ = ls.accept()
                    c.setblocking(False)
                    conns.append(c)
                except BlockingIOError:
                    pass
            elif s is ctl:
                m = ch.poll(0.0)
                while m is not None:
                    op = m.get("op")
                    if op == "quit":
                        return 0
                    if op == "series":
                        t0 = float(m.get("since", 0.0))
                        pts = [p for p in series if p[0] >= t0]
                        ch.send(series=[[round(t, 6), u, k] for t, u, k in pts], udp=udp_b, tcp=tcp_b)
                        if m.get("trim"):
                            series[:] = series[-1:]
                    m = ch.poll(0.0) if b"\n" in ch._buf else None
            else:
                try:
                    n = s.recv_into(mv)
                except BlockingIOError:
                    continue
                except OSError:
                    n = 0
                if n == 0:
                    conns.remove(s)
                    s.close()
                else:
                    tcp_b += n
        now = time.monotonic()
        if now - series[-1][0] >= SERIES_PERIOD_S:
            series.append((now, udp_b, tcp_b))


def udp_sender(host: str, port: int, rate_bps: float, size: int) -> int:
    """Fixed-rate, non-responsive sender (what inference traffic looks like to a link)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Large send buffer: when the link is contended, datagrams queue in (and are dropped by) the
    # link's qdisc, as at a switch port, instead of the socket throttling the sender.
    s.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)  # SO_SNDBUFFORCE
    s.setblocking(False)
    payload = os.urandom(size)
    wire = size + UDP_OVERHEAD
    rate = rate_bps / 8.0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:  # the scenario is a constant rate: other jobs on the machine must not pause it (root only)
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass
    t0 = time.monotonic()
    sent = 0
    while not stop:
        target = (time.monotonic() - t0) * rate
        # after a stall (the process was not scheduled), no catch-up burst of more than MAX_BACKLOG_S:
        # a paused-then-bursting source would read as a link that is free for one sampling interval
        # and then overfull, which is not the fixed-rate traffic the scenario describes
        sent = max(sent, target - MAX_BACKLOG_S * rate)
        while sent < target:
            try:
                s.sendto(payload, (host, port))
            except (BlockingIOError, ConnectionRefusedError):
                pass  # offered but not sent: counts as lost
            sent += wire
        time.sleep(0.0005)
    return 0


def tcp_sender(host: str, port: int, nflows: int) -> int:
    """`nflows` greedy TCP flows (bulk transfers of other tenants)."""
    buf = os.urandom(1 << 20)

    def run():
        try:
            c = socket.create_connection((host, port))
            while True:
                c.sendall(buf)
        except OSError:
            pass

    for _ in range(nflows):
        threading.Thread(target=run, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="traffic")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("sink")
    a.add_argument("udp_port", type=int)
    a.add_argument("tcp_port", type=int)
    a = sub.add_parser("udp")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("rate_bps", type=float)
    a.add_argument("--size", type=int, default=8192)
    a.add_argument("--start-at", type=float, default=None, help="CLOCK_MONOTONIC time to start sending")
    a = sub.add_parser("tcp")
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument("nflows", type=int)
    a.add_argument("--start-at", type=float, default=None, help="CLOCK_MONOTONIC time to start sending")
    args = ap.parse_args(argv)
    if getattr(args, "start_at", None) is not None:
        time.sleep(max(0.0, args.start_at - time.monotonic()))
        # the actual start (interpreter start-up under CPU load can overrun the planned time)
        sys.stdout.write(f"started {time.monotonic():.6f}\n")
        sys.stdout.flush()
    if args.cmd == "sink":
        return sink(args.udp_port, args.tcp_port)
    if args.cmd == "udp":
        return udp_sender(args.host, args.port, args.rate_bps, args.size)
    return tcp_sender(args.host, args.port, args.nflows)


if __name__ == "__main__":
    sys.exit(main())
