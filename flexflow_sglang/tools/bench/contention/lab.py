"""ContentionLab: the triangle n0-n1-n2 (1 Gbit/s veths), the node programs, and background traffic.

    with ContentionLab(max_bytes=64 << 20) as lab:
        lab.start_background("udp", pct=0.85)
        r = lab.xfer("adaptive", 32 << 20)      # runs in n0, verified at n2 (r["verified"])
        lab.stop_background()
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from .channel import ChannelError, ParentChannel
from .netlab import NetLab, rate_bps

logger = logging.getLogger(__name__)

PKG = __package__  # flexflow_sglang.tools.bench.contention
UDP_PORT, TCP_PORT = 7000, 7001
NIXL_ENV = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error",
            "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}


RUNDIR_PREFIX = "ffc-contention-"


def sweep_stale_rundirs() -> None:
    """Remove metadata directories of labs whose owner died (SIGKILL leaves them behind)."""
    from .netlab import _pid_alive
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(RUNDIR_PREFIX):
            continue
        pid = name[len(RUNDIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def nixl_available():
    try:
        from nixl._api import nixl_agent  # noqa: F401
        return True, ""
    except Exception as e:  # ImportError, or a broken backend package
        return False, f"nixl is not importable ({type(e).__name__}: {e})"


class ContentionLab:
    def __init__(self, max_bytes: int = 256 << 20, chunk: int = 1 << 20, slots: int = 8, window: int = 2,
                 interval_ms: float = 100.0, rate: str = "1gbit", capacity_gbps: float = 0.125,
                 tag: Optional[str] = None, log_dir: Optional[str] = None):
        self.max_bytes, self.chunk, self.slots, self.window = max_bytes, chunk, slots, window
        self.interval_ms, self.rate, self.capacity_gbps = interval_ms, rate, capacity_gbps
        self.tag = tag
        self.log_dir = log_dir
        self.net: Optional[NetLab] = None
        self.rundir: Optional[str] = None
        self.ch = {}
        self.bg: List[subprocess.Popen] = []
        self.bg_desc = "none"
        self._bg_started = None
        self._xid = 0
        self.info = {}

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "ContentionLab":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _log(self, name):
        if self.log_dir is None:
            return subprocess.DEVNULL
        return open(os.path.join(self.log_dir, f"{name}.log"), "w")

    def _spawn(self, node, name, argv, env=None):
        p = self.net.spawn(node, [sys.executable, "-m", *argv], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=self._log(name))
        self.ch[name] = ParentChannel(p, name)
        return self.ch[name]

    def _start(self):
        t = time.monotonic()
        self.net = net = NetLab(["n0", "n1", "n2"], tag=self.tag).__enter__()
        net.link("n0", "n1", self.rate)
        net.link("n0", "n2", self.rate)
        net.link("n1", "n2", self.rate)
        # kernel route n0 -> n2's n1-side address through n1: only the unrestricted (multi-rail)
        # agents use it; pinned agents only see their own device's subnet
        net.route_via("n0", "n2", via="n1")
        self.dst_direct = net.addr("n2", "n0")
        sweep_stale_rundirs()
        self.rundir = tempfile.mkdtemp(prefix=f"{RUNDIR_PREFIX}{os.getpid()}-")
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        self._spawn("n2", "sink", [f"{PKG}.traffic", "sink", str(UDP_PORT), str(TCP_PORT)])
        node = f"{PKG}.node"
        self._spawn("n2", "target", [node, "target", self.rundir, str(self.max_bytes)], NIXL_ENV)
        self._spawn("n1", "relay", [node, "relay", self.rundir, str(self.slots), str(self.chunk)], NIXL_ENV)
        self._spawn("n0", "sender", [node, "sender", self.rundir, str(self.max_bytes), "--chunk", str(self.chunk),
                                     "--slots", str(self.slots), "--window", str(self.window),
                                     "--interval-ms", str(self.interval_ms),
                                     "--capacity-gbps", str(self.capacity_gbps)], NIXL_ENV)
        for name in ("sink", "target", "relay", "sender"):
            msg = self.ch[name].recv(timeout=90.0)
            if name == "sender":
                self.info.update(selector_impl=msg.get("selector"), link_ids=msg.get("links"))
        self.info.update(setup_s=round(time.monotonic() - t, 2),
                         tcp_cc=net.read_sysctl("n0", "net.ipv4.tcp_congestion_control"),
                         mtu=net.mtu, rate=self.rate, namespaces=[net.ns(n) for n in net.nodes])

    def close(self):
        for name in ("sender", "relay", "target", "sink"):
            c = self.ch.get(name)
            if c is not None and c.proc.poll() is None:
                try:
                    c.send(op="quit")
                except ChannelError:
                    pass
        deadline = time.monotonic() + 3.0
        for c in self.ch.values():
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if self.net is not None:
            self.net.close()  # kills whatever is left, deletes namespaces
        if self.rundir:
            shutil.rmtree(self.rundir, ignore_errors=True)
            self.rundir = None

    # ----------------------------------------------------------------- transfers
    def xfer(self, policy: str, nbytes: int, deadline: Optional[float] = None, report: Optional[str] = None,
             verify: bool = True, timeout: float = 600.0) -> dict:
        self._xid += 1
        r = self.ch["sender"].call(op="xfer", xid=self._xid, policy=policy, nbytes=int(nbytes), deadline=deadline,
                                   report=report, timeout=timeout)
        if verify and r["complete"]:
            v = self.ch["target"].call(op="verify", len=r["nbytes"], crc=r["crc"])
            r["verified"] = bool(v["ok"])
        else:
            r["verified"] = None
        return r

    def clear(self) -> None:
        """Make the sender's NodeAgents forget feedback and elasticity evidence (a new scenario
        must not inherit what the previous one taught them)."""
        self.ch["sender"].call(op="clear")

    def trace(self, since: float) -> list:
        return self.ch["sender"].call(op="trace", since=since)["trace"]

    def state(self) -> dict:
        return self.ch["sender"].call(op="state")

    # ----------------------------------------------------------------- background traffic
    def start_background(self, kind: str, pct: float = 0.0, flows: int = 1, start_at: Optional[float] = None):
        """kind 'udp' (fixed rate, pct of the link's capacity, on-wire) or 'tcp' (`flows` greedy flows),
        from n0 to n2 over the direct link. start_at: CLOCK_MONOTONIC time to begin (shared by namespaces)."""
        self.stop_background()
        m = f"{PKG}.traffic"
        delay = []
        if start_at is not None:
            delay = ["--start-at", repr(start_at)]
        if kind == "udp":
            if pct <= 0:
                return
            argv = [sys.executable, "-m", m, "udp", self.dst_direct, str(UDP_PORT), str(pct * rate_bps(self.rate)), *delay]
            self.bg_desc = f"udp {pct:.0%}"
        elif kind == "tcp":
            argv = [sys.executable, "-m", m, "tcp", self.dst_direct, str(TCP_PORT), str(flows), *delay]
            self.bg_desc = f"tcp x{flows}"
        else:
            raise ValueError(f"background kind {kind!r}: expected 'udp' or 'tcp'")
        out = subprocess.PIPE if start_at is not None else subprocess.DEVNULL
        self.bg.append(self.net.spawn("n0", argv, stdout=out, stderr=self._log(f"bg-{kind}")))
        self._bg_started = None

    def background_started(self) -> Optional[float]:
        """CLOCK_MONOTONIC time a --start-at background sender actually started (None: not yet)."""
        if self._bg_started is None and self.bg and self.bg[0].stdout is not None:
            import select
            r, _, _ = select.select([self.bg[0].stdout], [], [], 0.0)
            if r:
                line = self.bg[0].stdout.readline().decode().split()
                if len(line) == 2 and line[0] == "started":
                    self._bg_started = float(line[1])
        return self._bg_started

    def stop_background(self):
        for p in self.bg:
            self.net.kill(p, timeout=2.0)
        self.bg = []
        self.bg_desc = "none"

    def series(self, since: float) -> dict:
        """Background bytes delivered at n2: {'series': [[t, udp_cum, tcp_cum], ...]} (on-wire for UDP)."""
        return self.ch["sink"].call(op="series", since=since, trim=False)

    def set_direct_rate(self, rate: str):
        self.net.change_rate("n0", "n2", rate)
        self.net.links[frozenset(("n0", "n2"))]["rate"] = rate

    def cap_changer(self):
        """Returns change(rate) -> CLOCK_MONOTONIC time the change was written to two running
        `tc -batch` processes (n0's v02 and n2's v20), and a close() that stops them."""
        procs = [(self.net.tc_batch("n0"), ("n0", "n2")), (self.net.tc_batch("n2"), ("n2", "n0"))]
        time.sleep(0.2)  # let both start

        def change(rate: str) -> float:
            t = time.monotonic()
            for p, (a, b) in procs:
                p.stdin.write(self.net.tbf_line(a, b, rate))
                p.stdin.flush()
            self.net.links[frozenset(("n0", "n2"))]["rate"] = rate
            return t

        def close():
            # EOF first, so tc applies every line written before it exits; kill only stragglers
            for p, _ in procs:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            for p, _ in procs:
                try:
                    p.wait(3.0)
                except subprocess.TimeoutExpired:
                    pass
                self.net.kill(p, timeout=1.0)
        return change, close

    def check_rates(self) -> None:
        """Re-apply the nominal cap on any link whose qdisc does not show it (after live changes)."""
        want = self.rate.lower().replace("gbit", "Gbit").replace("mbit", "Mbit")
        for a, b in (("n0", "n1"), ("n0", "n2"), ("n1", "n2")):
            for x, y in ((a, b), (b, a)):
                if f"rate {want}" not in self.net.qdisc_stats(x, y):
                    logger.warning("ContentionLab: %s->%s lost its %s cap; re-applying", x, y, self.rate)
                    self.net.set_rate(a, b, self.rate)
