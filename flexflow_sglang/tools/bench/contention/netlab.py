"""NetLab: nodes as network namespaces, links as veth pairs capped by `tbf` (needs root + iproute2).

Every `ip`/`tc` command names a lab namespace (`ip -n NS ...` / `ip netns exec NS ...`): the host's
interfaces, routes and sysctls are never touched, and all traffic stays on the lab's veths.

Namespaces are called `ffc-<pid>-<tag>-<node>`, so a sweeper can tell stale labs (their creator's
pid is gone) from live ones. Processes are spawned in their own session (own process group) with
PR_SET_PDEATHSIG=SIGKILL, so they die with the lab owner even if it is SIGKILLed; `close()` kills
process groups first, then whatever `ip netns pids` still lists, then deletes the namespaces
(which deletes the veths). Processes would otherwise survive `ip netns del`.

    with NetLab(["n0", "n1", "n2"]) as lab:
        lab.link("n0", "n1", "1gbit"); lab.link("n0", "n2", "1gbit"); lab.link("n1", "n2", "1gbit")
        p = lab.spawn("n2", [sys.executable, "-c", "..."])
        lab.change_rate("n0", "n2", "100mbit")   # live cap change: `tc qdisc change`
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

NS_PREFIX = "ffc"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-([0-9a-z]+)-(.+)$")
DEFAULT_BURST = "256kb"
DEFAULT_LATENCY = "50ms"


class NetLabError(RuntimeError):
    pass


def rate_bps(rate: str) -> float:
    """A tc rate ("500mbit", "1gbit", "800kbit") in bits per second."""
    r = rate.lower()
    for suf, mul in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mul
    raise ValueError(f"cannot parse rate {rate!r}: use e.g. 500mbit or 1gbit")


def _run(argv: Sequence[str], check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise NetLabError(f"`{' '.join(argv)}` failed (rc={p.returncode}): {p.stderr.strip()}")
    if p.returncode != 0 and not quiet:
        logger.debug("`%s` rc=%d: %s", " ".join(argv), p.returncode, p.stderr.strip())
    return p


def available() -> Tuple[bool, str]:
    """(True, "") when this process can build a lab; else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (apt-get install iproute2)"
    return _probe()


_PROBE: Optional[Tuple[bool, str]] = None


def _probe() -> Tuple[bool, str]:
    """Root is not enough in every sandbox: build and delete a throwaway namespace with a capped
    veth once per process, and report what failed (no CAP_NET_ADMIN, no veth or tbf support)."""
    global _PROBE
    if _PROBE is not None:
        return _PROBE
    ns = f"ffc-probe-{os.getpid()}"
    steps = [["ip", "netns", "add", ns],
             ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
             ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit",
              "burst", "256kb", "latency", "50ms"]]
    _PROBE = (True, "")
    try:
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            if p.returncode != 0:
                _PROBE = (False, f"`{' '.join(cmd[:4])} ...` failed: {(p.stderr or p.stdout).strip()[:200]}")
                break
    except (OSError, subprocess.SubprocessError) as e:
        _PROBE = (False, f"namespace probe failed: {e}")
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
    return _PROBE


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> List[str]:
    p = _run(["ip", "netns", "list"], check=False, quiet=True)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _kill_ns_pids(ns: str) -> int:
    p = _run(["ip", "netns", "pids", ns], check=False, quiet=True)
    n = 0
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
            n += 1
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    return n


def _delete_ns(ns: str) -> None:
    killed = _kill_ns_pids(ns)
    if killed:
        time.sleep(0.05)
    _run(["ip", "netns", "del", ns], check=False, quiet=True)


def sweep_stale(all_labs: bool = False) -> List[str]:
    """Delete lab namespaces whose owner process is gone (all of ours with all_labs=True),
    killing whatever still runs inside them first. Returns the names removed."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m:
            continue
        if all_labs or not _pid_alive(int(m.group(1))):
            _delete_ns(ns)
            removed.append(ns)
    if removed:
        logger.warning("NetLab: swept %d stale namespace(s): %s", len(removed), ", ".join(removed))
    return removed


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class NetLab:
    """One namespace per node, one veth pair per link, `tbf` caps on both ends of a link."""

    def __init__(self, nodes: Sequence[str], tag: Optional[str] = None, mtu: int = 9000):
        ok, why = available()
        if not ok:
            raise NetLabError(f"NetLab {why}")
        self.nodes = list(nodes)
        self.tag = (tag or uuid.uuid4().hex[:6]).lower()
        self.prefix = f"{NS_PREFIX}-{os.getpid()}-{self.tag}-"
        self.mtu = int(mtu)
        self.links: Dict[frozenset, dict] = {}
        self.lanes: Dict[tuple, dict] = {}  # (frozenset((a, b)), lane >= 1) -> parallel veth pairs
        self._subnets = 0
        self.procs: List[subprocess.Popen] = []
        self._created: List[str] = []
        self._closed = False

    # ----------------------------------------------------------------- naming
    def ns(self, node: str) -> str:
        return self.prefix + node

    def dev(self, a: str, b: str) -> str:
        """Interface in a's namespace facing b: 'v' + index(a) + index(b), e.g. v02 (n0 -> n2)."""
        ia, ib = self.nodes.index(a), self.nodes.index(b)
        return f"v{ia}{ib}" if max(ia, ib) < 10 else f"v{ia}-{ib}"

    def addr(self, a: str, b: str) -> str:
        """a's address on the a-b link."""
        info = self.links[frozenset((a, b))]
        return info["addr"][a]

    # ----------------------------------------------------------------- building
    def __enter__(self) -> "NetLab":
        sweep_stale()
        try:
            for n in self.nodes:
                ns = self.ns(n)
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def link(self, a: str, b: str, rate: Optional[str] = "1gbit") -> None:
        """veth pair a<->b created directly inside both namespaces; /24 per link (10.77.<k>.0)."""
        key = frozenset((a, b))
        if key in self.links:
            raise NetLabError(f"link {a}-{b} exists")
        k, addrs = self._veth(a, b, self.dev(a, b), self.dev(b, a))
        self.links[key] = {"k": k, "addr": addrs, "rate": None}
        if rate:
            self.set_rate(a, b, rate)

    def _veth(self, a: str, b: str, da: str, db: str) -> Tuple[int, Dict[str, str]]:
        """veth pair da (in a) <-> db (in b) on the next free /24 (10.77.<k>.0); returns (k, addrs)."""
        self._subnets += 1
        k = self._subnets
        _run(["ip", "link", "add", da, "netns", self.ns(a), "type", "veth", "peer", "name", db,
              "netns", self.ns(b)])
        addrs = {a: f"10.77.{k}.1", b: f"10.77.{k}.2"}
        for node, dev in ((a, da), (b, db)):
            _run(["ip", "-n", self.ns(node), "addr", "add", f"{addrs[node]}/24", "dev", dev])
            _run(["ip", "-n", self.ns(node), "link", "set", dev, "mtu", str(self.mtu)])
            _run(["ip", "-n", self.ns(node), "link", "set", dev, "up"])
        # `link set up` returns before the pair has carrier: a process started at once (UCX lists
        # its devices when its context is made) would find the device DOWN and refuse it
        for node, dev in ((a, da), (b, db)):
            self._wait_up(node, dev)
        return k, addrs

    def _wait_up(self, node: str, dev: str, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            out = subprocess.run(["ip", "-n", self.ns(node), "-br", "link", "show", "dev", dev],
                                 capture_output=True, text=True).stdout.split()
            state = out[1] if len(out) > 1 else "missing"
            if state == "UP":
                return
            time.sleep(0.05)
        raise NetLabError(f"{dev} in namespace {self.ns(node)} ({node}) is {state}, not UP, after {timeout} s")

    def add_lane(self, a: str, b: str, rate: Optional[str] = "1gbit") -> int:
        """Another veth pair between a and b (a parallel rail: two NICs between the same hosts),
        on its own /24; the a-b link itself is lane 0. Returns the new lane's index."""
        key = frozenset((a, b))
        if key not in self.links:
            raise NetLabError(f"add_lane {a}-{b}: create the link first")
        lane = 1 + sum(1 for (k, _) in self.lanes if k == key)
        k, addrs = self._veth(a, b, self.lane_dev(a, b, lane), self.lane_dev(b, a, lane))
        self.lanes[(key, lane)] = {"k": k, "addr": addrs, "rate": None}
        if rate:
            for x, y in ((a, b), (b, a)):
                self._tbf("replace", x, self.lane_dev(x, y, lane), rate, DEFAULT_BURST, DEFAULT_LATENCY)
            self.lanes[(key, lane)]["rate"] = rate
        return lane

    def lane_dev(self, a: str, b: str, lane: int) -> str:
        """a's interface on lane `lane` of the a-b link (lane 0 = dev(a, b))."""
        return self.dev(a, b) if lane == 0 else f"{self.dev(a, b)}l{lane}"

    def lane_addr(self, a: str, b: str, lane: int) -> str:
        if lane == 0:
            return self.addr(a, b)
        return self.lanes[(frozenset((a, b)), lane)]["addr"][a]

    def _tbf(self, verb: str, node: str, dev: str, rate: str, burst: str, latency: str) -> None:
        _run(["ip", "netns", "exec", self.ns(node), "tc", "qdisc", verb, "dev", dev, "root", "tbf",
              "rate", rate, "burst", burst, "latency", latency])

    def set_rate(self, a: str, b: str, rate: Optional[str], burst: str = DEFAULT_BURST,
                 latency: str = DEFAULT_LATENCY) -> None:
        """Cap both directions of a-b (`tc qdisc replace`); rate=None removes the caps."""
        for x, y in ((a, b), (b, a)):
            if rate is None:
                _run(["ip", "netns", "exec", self.ns(x), "tc", "qdisc", "del", "dev", self.dev(x, y), "root"],
                     check=False)
            else:
                self._tbf("replace", x, self.dev(x, y), rate, burst, latency)
        self.links[frozenset((a, b))]["rate"] = rate

    def change_rate(self, a: str, b: str, rate: str, burst: str = DEFAULT_BURST,
                    latency: str = DEFAULT_LATENCY, both: bool = True) -> None:
        """Live cap change (`tc qdisc change`): queued packets and sockets survive."""
        pairs = ((a, b), (b, a)) if both else ((a, b),)
        for x, y in pairs:
            self._tbf("change", x, self.dev(x, y), rate, burst, latency)
        self.links[frozenset((a, b))]["rate"] = rate

    def tc_batch(self, node: str) -> subprocess.Popen:
        """A `tc -batch -` process in node's namespace: write one command line per change
        (e.g. "qdisc change dev v02 root tbf rate 100mbit burst 256kb latency 50ms") and it
        applies within ~1 ms, instead of the ~30 ms it takes to start `ip netns exec ... tc`."""
        return self.spawn(node, ["tc", "-force", "-batch", "-"], stdin=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)

    def tbf_line(self, a: str, b: str, rate: str, verb: str = "change", burst: str = DEFAULT_BURST,
                 latency: str = DEFAULT_LATENCY) -> str:
        return f"qdisc {verb} dev {self.dev(a, b)} root tbf rate {rate} burst {burst} latency {latency}\n"

    def qdisc_stats(self, a: str, b: str) -> str:
        return _run(["ip", "netns", "exec", self.ns(a), "tc", "-s", "qdisc", "show", "dev", self.dev(a, b)]).stdout

    def route_via(self, src: str, dst: str, via: str) -> str:
        """Kernel relay: src reaches dst's address on the via-dst link through via (ip_forward in
        via, routes both ways). Returns that address (dst as seen through via)."""
        _run(["ip", "netns", "exec", self.ns(via), "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        dst_addr = self.addr(dst, via)
        net_dst = dst_addr.rsplit(".", 1)[0] + ".0/24"
        _run(["ip", "-n", self.ns(src), "route", "replace", net_dst, "via", self.addr(via, src)])
        net_src = self.addr(src, via).rsplit(".", 1)[0] + ".0/24"
        _run(["ip", "-n", self.ns(dst), "route", "replace", net_src, "via", self.addr(via, dst)])
        return dst_addr

    def sysctl(self, node: str, key: str, value) -> None:
        _run(["ip", "netns", "exec", self.ns(node), "sysctl", "-qw", f"{key}={value}"])

    def read_sysctl(self, node: str, key: str) -> str:
        return _run(["ip", "netns", "exec", self.ns(node), "sysctl", "-n", key]).stdout.strip()

    def iface_bytes(self, node: str, dev: str) -> Tuple[int, int]:
        """(tx_bytes, rx_bytes) of an interface inside a node."""
        out = _run(["ip", "-n", self.ns(node), "-s", "-j", "link", "show", "dev", dev]).stdout
        import json
        st = json.loads(out)[0]["stats64"]
        return int(st["tx"]["bytes"]), int(st["rx"]["bytes"])

    # ----------------------------------------------------------------- processes
    def spawn(self, node: str, argv: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Run argv inside node's namespace, in its own session (process group), dying with us."""
        if self._closed:
            raise NetLabError("NetLab is closed")
        full_env = {**os.environ, **(env or {})}
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=full_env,
                             start_new_session=True, preexec_fn=_pdeathsig, **kw)
        self.procs.append(p)
        return p

    def kill(self, p: subprocess.Popen, timeout: float = 3.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL it."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group, even if the leader exited
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                logger.warning("NetLab: pid %d did not die", p.pid)
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                if f:
                    f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            self.kill(p, timeout=0.5)
        for ns in reversed(self._created):
            _delete_ns(ns)
        left = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
        if left:
            logger.warning("NetLab: namespaces left after teardown: %s", left)


def spawn_tier_server(lab: NetLab, node: str, port: int, out_dir: str, name: str, *, capacity_gb: float,
                      ucx_devs: str, env: Optional[dict] = None, extra: Sequence[str] = ()
                      ) -> Tuple[subprocess.Popen, str]:
    """A flexflow tier server in `node`'s namespace on 0.0.0.0:`port` (a lab namespace: nothing
    outside the lab reaches it), its log `<name>.log` in out_dir; returns (process, ready file).
    Wait for it with `wait_ready`. The stall and remote-routing benchmarks start theirs here."""
    import sys
    ready = os.path.join(out_dir, f"{name}.ready")
    if os.path.exists(ready):
        os.unlink(ready)
    with open(os.path.join(out_dir, f"{name}.log"), "wb") as log:
        p = lab.spawn(node, [sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", f"0.0.0.0:{port}",
                             "--capacity-gb", str(capacity_gb), "--node", node, "--ready-file", ready, *extra],
                      env={**(env or {}), "UCX_NET_DEVICES": ucx_devs}, stdout=log, stderr=subprocess.STDOUT)
    return p, ready


def wait_ready(lab: NetLab, started: Sequence[Tuple[subprocess.Popen, str]], timeout: float = 60.0) -> bool:
    """True once every (process, ready file) is ready; False (and every one of them killed) if one
    exits first or `timeout` seconds pass."""
    end = time.monotonic() + timeout
    while not all(os.path.exists(r) for _, r in started):
        if time.monotonic() > end or any(p.poll() is not None for p, _ in started):
            for p, _ in started:
                lab.kill(p)
            return False
        time.sleep(0.1)
    return True


def main(argv=None) -> int:
    """`python -m flexflow_sglang.tools.bench.contention.netlab sweep [--all]`: remove stale lab namespaces."""
    import argparse
    ap = argparse.ArgumentParser(prog="netlab", description=main.__doc__)
    ap.add_argument("cmd", choices=["sweep", "list"])
    ap.add_argument("--all", action="store_true", help="remove every ffc-* namespace, live owner or not")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for ns in list_namespaces():
            if _NS_RE.match(ns):
                print(ns)
        return 0
    for ns in sweep_stale(all_labs=a.all):
        print(f"removed {ns}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
