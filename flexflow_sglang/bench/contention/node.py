"""The programs that run inside the lab's namespaces, one NIXL (UCX over TCP) agent per path.

    python -m flexflow_sglang.bench.contention.node target RUNDIR MAX_BYTES   (in n2)
    python -m flexflow_sglang.bench.contention.node relay  RUNDIR SLOTS CHUNK (in n1)
    python -m flexflow_sglang.bench.contention.node sender RUNDIR MAX_BYTES   (in n0)

Agents and the device each one is pinned to (UCX_NET_DEVICES, read when the backend is created):

    n0: s-direct (v02) -> n2: t-direct (v20)                     Direct
    n0: s-relay  (v01) -> n1: r-in (v10) | r-out (v12) -> n2: t-relay (v21)   relay through n1
    n0: s-multi  (all) -> n2: t-multi (all)                      UCX's own multi-rail (kernel route via n1)

Relay protocol (application relay, one request in flight per hop): s-relay WRITEs chunk i into ring
slot i % SLOTS of r-in with notification `c|xid|i|slot|dst_off|len`; the relay forwards each chunk
with r-out to t-relay at dst_off as soon as the previous forward completed, then notifies s-relay
`a|xid|i`. The sender keeps at most SLOTS chunks unacknowledged (slot reuse) and one in flight.

Metadata goes through files in RUNDIR (namespaces share the filesystem); control (commands,
results) through stdin/stdout JSON lines with the orchestrator (see channel.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
import time
import zlib
from collections import deque
from typing import Dict, List, Optional

import numpy as np

logger = logging.getLogger(__name__)

POLL_S = float(os.environ.get("FFC_POLL_S", "0.001"))  # poll sleep: keeps each process at a few % CPU at 1-2 Gbit/s (busy polling = 1 core)
STAMP_BLOCK = 64 << 10
FEEDBACK_WINDOW = 4  # chunks per fed-back rate (4 x 1 MiB ~ 34 ms at 1 Gbit/s)


# ----------------------------------------------------------------------------- NIXL helpers
def make_agent(name: str, dev: Optional[str]):
    from nixl._api import nixl_agent, nixl_agent_config
    os.environ["UCX_NET_DEVICES"] = dev or "all"
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    a.create_backend("UCX")
    return a


def publish(rundir: str, name: str, agent, buf: np.ndarray) -> None:
    doc = {"md": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": int(buf.ctypes.data),
           "len": int(buf.nbytes)}
    tmp = os.path.join(rundir, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(rundir, f"{name}.md"))


def fetch(rundir: str, name: str, timeout: float = 60.0) -> dict:
    path = os.path.join(rundir, f"{name}.md")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no metadata from agent {name!r} in {rundir} after {timeout:.0f} s")
        time.sleep(0.01)
    with open(path) as f:
        doc = json.load(f)
    doc["md"] = base64.b64decode(doc["md"])
    return doc


def connect(agent, rundir: str, peer: str) -> dict:
    doc = fetch(rundir, peer)
    doc["name"] = agent.add_remote_agent(doc["md"])
    if isinstance(doc["name"], bytes):
        doc["name"] = doc["name"].decode()
    return doc


def register(agent, buf: np.ndarray):
    return agent.register_memory([(int(buf.ctypes.data), int(buf.nbytes), 0, "")], "DRAM")


def write(agent, peer: str, laddr: int, raddr: int, n: int, notif: bytes = b""):
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(laddr, n, 0)], "DRAM"),
                              agent.get_xfer_descs([(raddr, n, 0)], "DRAM"), peer, notif)
    st = agent.transfer(h)
    if st == "ERR":
        raise RuntimeError(f"NIXL transfer post failed ({agent.name} -> {peer}, {n} bytes)")
    return h


def _notifs(agent) -> Dict[str, List[bytes]]:
    out = agent.get_new_notifs()
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in out.items()}


# ----------------------------------------------------------------------------- target (n2)
def run_target(rundir: str, max_bytes: int) -> int:
    from .channel import ChildChannel
    ch = ChildChannel()
    buf = np.empty(max_bytes, dtype=np.uint8)
    buf.fill(0)  # fault the pages in now, not during the first measured transfer
    agents = {"t-direct": make_agent("t-direct", "v20"), "t-relay": make_agent("t-relay", "v21"),
              "t-multi": make_agent("t-multi", None)}
    for name, a in agents.items():
        register(a, buf)
        publish(rundir, name, a, buf)
    ch.send(ready=True, pid=os.getpid())
    while True:
        for a in agents.values():  # the target must progress (UCX over TCP)
            a.get_new_notifs()
        m = ch.poll(POLL_S)
        if m is None:
            continue
        op = m.get("op")
        if op == "quit":
            return 0
        if op == "verify":
            n = int(m["len"])
            crc = zlib.crc32(memoryview(buf)[:n])
            ch.send(ok=crc == int(m["crc"]), crc=crc, len=n)
        else:
            ch.send(error=f"target: unknown op {op!r}")


# ----------------------------------------------------------------------------- relay (n1)
def run_relay(rundir: str, slots: int, chunk: int) -> int:
    from .channel import ChildChannel
    ch = ChildChannel()
    ring = np.empty(slots * chunk, dtype=np.uint8)
    ring.fill(0)
    rin, rout = make_agent("r-in", "v10"), make_agent("r-out", "v12")
    register(rin, ring)
    register(rout, ring)
    publish(rundir, "r-in", rin, ring)
    tgt = connect(rout, rundir, "t-relay")
    src = connect(rin, rundir, "s-relay")  # for the acknowledgements
    base = int(ring.ctypes.data)
    queue: deque = deque()
    fwd = None  # (handle, xid, i)
    forwarded = 0
    ch.send(ready=True, pid=os.getpid())
    while True:
        busy = False
        for msgs in _notifs(rin).values():
            for msg in msgs:
                parts = msg.decode().split("|")
                if parts[0] == "c":
                    queue.append(tuple(int(x) for x in parts[1:]))
        if fwd is not None:
            st = rout.check_xfer_state(fwd[0])
            if st == "ERR":
                ch.send(error=f"relay: forward of chunk {fwd[2]} of transfer {fwd[1]} failed")
                return 1
            if st == "DONE":
                rout.release_xfer_handle(fwd[0])
                rin.send_notif(src["name"], f"a|{fwd[1]}|{fwd[2]}".encode())
                forwarded += 1
                fwd = None
                busy = True
        if fwd is None and queue:
            xid, i, slot, dst_off, n = queue.popleft()
            h = write(rout, tgt["name"], base + slot * chunk, tgt["addr"] + dst_off, n)
            fwd = (h, xid, i)
            busy = True
        m = ch.poll(0.0 if busy else POLL_S)
        if m is not None:
            if m.get("op") == "quit":
                return 0
            ch.send(forwarded=forwarded, queued=len(queue))


# ----------------------------------------------------------------------------- sender (n0)
class Leg:
    """One subpath of a transfer, moved chunk by chunk: bytes [off, off+nbytes) of the payload."""

    def __init__(self, kind: str, links, off: int, nbytes: int, chunk: int, hops: int):
        self.kind, self.links, self.off, self.nbytes, self.chunk, self.hops = kind, tuple(links), off, nbytes, chunk, hops
        self.n_chunks = max(1, -(-nbytes // chunk)) if nbytes else 0
        self.next = 0  # next chunk index to post
        self.done_chunks = 0
        self.done_bytes = 0
        self.t_start = self.t_last = self.t_end = None
        self.stopped = False  # deadline passed: post nothing more
        self.chunk_log: List[tuple] = []  # (t_done, bytes, seconds) per completed chunk

    def span(self, i):
        lo = self.off + i * self.chunk
        return lo, min(self.chunk, self.off + self.nbytes - lo)

    @property
    def finished(self) -> bool:
        return self.done_chunks >= (self.next if self.stopped else self.n_chunks) and not self.inflight()

    def inflight(self) -> int:
        raise NotImplementedError

    def _completed(self, n: int, now: float, agent, report: bool):
        # Throughput, not latency: a chunk's interval is the time since the previous completion on
        # this leg (the first chunk also paid the pipeline fill, once per hop). The rate fed back is
        # over the last FEEDBACK_WINDOW intervals: one chunk's interval is noisy (poll granularity, a
        # short last chunk that still pays the fixed per-chunk overhead), and the NodeAgent lets the
        # latest observation replace older ones.
        dt = (now - self.t_last) if self.done_chunks else (now - self.t_start) / self.hops
        self.t_last = now
        self.done_chunks += 1
        self.done_bytes += n
        self.chunk_log.append((now, n, dt))
        if report and agent is not None:
            win = self.chunk_log[-FEEDBACK_WINDOW:]
            rate = sum(c[1] for c in win) / max(sum(c[2] for c in win), 1e-6)
            # own bytes: exactly this chunk; seconds: what this chunk took at the windowed rate
            agent.report_transfer(self.links, n, max(n / rate, 1e-6))


class DirectLeg(Leg):
    def __init__(self, nixl, peer: dict, src_addr: int, links, off, nbytes, chunk, window, kind="direct"):
        super().__init__(kind, links, off, nbytes, chunk, 1)
        self.nixl, self.peer, self.src_addr, self.window = nixl, peer, src_addr, window
        self.q: deque = deque()

    def inflight(self):
        return len(self.q)

    def step(self, now, node_agent, report) -> bool:
        busy = False
        while self.q:
            h, n = self.q[0]
            st = self.nixl.check_xfer_state(h)
            if st == "ERR":
                raise RuntimeError(f"{self.kind} leg: chunk transfer failed")
            if st != "DONE":
                break
            self.nixl.release_xfer_handle(h)
            self.q.popleft()
            self._completed(n, now, node_agent, report)
            busy = True
        while not self.stopped and self.next < self.n_chunks and len(self.q) < self.window:
            lo, n = self.span(self.next)
            self.q.append((write(self.nixl, self.peer["name"], self.src_addr + lo, self.peer["addr"] + lo, n), n))
            self.next += 1
            busy = True
        if self.finished and self.t_end is None:
            self.t_end = now
        return busy


class RelayLeg(Leg):
    def __init__(self, nixl, relay: dict, src_addr: int, xid: int, links, off, nbytes, chunk, slots,
                 acks: deque):
        super().__init__("relay", links, off, nbytes, chunk, 2)
        self.nixl, self.relay, self.src_addr, self.xid, self.slots = nixl, relay, src_addr, xid, slots
        self.hop1 = None  # (handle, i)
        self.acks = acks  # chunk indices acknowledged end to end (filled by the sender loop)

    def inflight(self):
        return self.next - self.done_chunks

    def step(self, now, node_agent, report) -> bool:
        busy = False
        while self.acks:
            i = self.acks.popleft()
            self._completed(self.span(i)[1], now, node_agent, report)
            busy = True
        if self.hop1 is not None:
            st = self.nixl.check_xfer_state(self.hop1)
            if st == "ERR":
                raise RuntimeError("relay leg: hop-1 chunk transfer failed")
            if st == "DONE":
                self.nixl.release_xfer_handle(self.hop1)
                self.hop1 = None
                busy = True
        if (self.hop1 is None and not self.stopped and self.next < self.n_chunks
                and self.next - self.done_chunks < self.slots):
            i = self.next
            lo, n = self.span(i)
            slot = i % self.slots
            notif = f"c|{self.xid}|{i}|{slot}|{lo}|{n}".encode()
            self.hop1 = write(self.nixl, self.relay["name"], self.src_addr + lo,
                              self.relay["addr"] + slot * self.chunk, n, notif)
            self.next += 1
            busy = True
        if self.finished and self.t_end is None:
            self.t_end = now
        return busy


def build_topology(capacity_gbps: float = 0.125):
    """n0, n1, n2 host-memory nodes; Ethernet links with the counter each is read from *inside n0*.
    n1-n2 has no counter n0 can read (it lives in other namespaces): feedback only."""
    from ...topology import LinkType, NodeKind, Topology
    topo = Topology("netlab-hosts3", "netlab")
    for h in ("n0", "n1", "n2"):
        topo.add_node(h, NodeKind.CPU, h, 0)
    topo.add_link("n0", "n1", LinkType.ETHERNET, capacity_gbps, 70.0, counter={"sysfs_net": "v01"})
    topo.add_link("n0", "n2", LinkType.ETHERNET, capacity_gbps, 70.0, counter={"sysfs_net": "v02"})
    topo.add_link("n1", "n2", LinkType.ETHERNET, capacity_gbps, 70.0)
    return topo


class Sender:
    POLICIES = ("direct", "relay", "split50", "multirail", "adaptive")

    def __init__(self, rundir: str, max_bytes: int, chunk: int, slots: int, window: int,
                 sample_interval_ms: float, capacity_gbps: float):
        from ...monitor import NodeAgent
        from ...selector import PathSelector, SelectorConfig
        self.chunk, self.slots, self.window = chunk, slots, window
        rng = np.random.default_rng(12345)
        self.src = rng.integers(0, 256, size=max_bytes, dtype=np.uint8)
        self.src64 = self.src[: max_bytes // 8 * 8].view(np.uint64)
        self.addr = int(self.src.ctypes.data)
        self.a_direct, self.a_relay, self.a_multi = (make_agent("s-direct", "v02"), make_agent("s-relay", "v01"),
                                                     make_agent("s-multi", None))
        for a in (self.a_direct, self.a_relay, self.a_multi):
            register(a, self.src)
        publish(rundir, "s-relay", self.a_relay, self.src)
        self.p_direct = connect(self.a_direct, rundir, "t-direct")
        self.p_relay = connect(self.a_relay, rundir, "r-in")
        self.p_multi = connect(self.a_multi, rundir, "t-multi")
        self.topo = build_topology(capacity_gbps)
        self.l01, self.l02, self.l12 = (self.topo.links_between("n0", "n1")[0].id, self.topo.links_between("n0", "n2")[0].id,
                                        self.topo.links_between("n1", "n2")[0].id)
        self.agent = NodeAgent(self.topo, sample_interval_ms=sample_interval_ms, source="sysfs", sysfs_root="/sys")
        self.selector = PathSelector(self.topo, self.agent, SelectorConfig())
        self._matched = None
        self.acks: deque = deque()
        self.cur_xid = -1
        self.trace: List[list] = []
        self._last_trace = 0.0

    def matched_selector(self):
        """Ablation: the same selector, but its relay pipeline model uses this executor's chunk size
        instead of the default SelectorConfig.relay_chunk_bytes (4 MiB). Shares the NodeAgent."""
        if self._matched is None:
            from ...selector import PathSelector, SelectorConfig
            sel = PathSelector(self.topo, self.agent, SelectorConfig(relay_chunk_bytes=int(self.chunk)))
            self._matched = sel
        return self._matched

    def start(self):
        self.agent.start()

    def close(self):
        self.agent.stop()

    def _poll_acks(self):
        for msgs in _notifs(self.a_relay).values():
            for msg in msgs:
                parts = msg.decode().split("|")
                if parts[0] == "a" and int(parts[1]) == self.cur_xid:
                    self.acks.append(int(parts[2]))

    def _stamp(self, xid: int, nbytes: int) -> int:
        # a unique tag per 64 KiB block: stale bytes from an earlier transfer (or a chunk written to
        # the wrong offset) change the checksum at the destination
        words = STAMP_BLOCK // 8
        nblk = -(-nbytes // STAMP_BLOCK)
        idx = np.arange(nblk, dtype=np.uint64)
        pos = idx * np.uint64(words)
        ok = pos * 8 + 8 <= nbytes
        self.src64[pos[ok]] = (np.uint64(xid) << np.uint64(32)) | idx[ok]
        return zlib.crc32(memoryview(self.src)[:nbytes])

    def _legs(self, policy: str, xid: int, nbytes: int, decision=None) -> List[Leg]:
        c = self.chunk
        relay_links = (self.l01, self.l12)
        mk_direct = lambda off, n: DirectLeg(self.a_direct, self.p_direct, self.addr, (self.l02,), off, n, c, self.window)
        mk_relay = lambda off, n: RelayLeg(self.a_relay, self.p_relay, self.addr, xid, relay_links, off, n, c,
                                           self.slots, self.acks)
        if policy == "direct":
            return [mk_direct(0, nbytes)]
        if policy == "relay":
            return [mk_relay(0, nbytes)]
        if policy == "split50":
            h = nbytes // 2
            return [mk_direct(0, h), mk_relay(h, nbytes - h)]
        if policy == "multirail":
            return [DirectLeg(self.a_multi, self.p_multi, self.addr, (self.l02, self.l01, self.l12), 0, nbytes, c,
                              self.window, kind="multirail")]
        if policy == "adaptive":
            legs, off = [], 0
            for sub in decision.subpaths:
                if sub.nbytes <= 0:
                    continue
                if sub.type.value == "Direct":
                    legs.append(mk_direct(off, sub.nbytes))
                elif sub.type.value == "CrossNodeRelay":
                    legs.append(mk_relay(off, sub.nbytes))
                else:
                    raise RuntimeError(f"adaptive: unexpected subpath type {sub.type}")
                off += sub.nbytes
            if off != nbytes:
                raise RuntimeError(f"adaptive: subpath shares sum to {off}, expected {nbytes}")
            return legs
        raise ValueError(f"unknown policy {policy!r}; choose one of {self.POLICIES}")

    def _tr(self, now, force=False):
        if force or now - self._last_trace >= 0.005:
            self._last_trace = now
            u = self.agent.util
            self.trace.append([round(now, 6), round(float(u[self.l02]), 4), round(float(u[self.l01]), 4),
                               round(float(u[self.l12]), 4)])

    def transfer(self, xid: int, policy: str, nbytes: int, deadline: Optional[float] = None,
                 report: Optional[str] = None) -> dict:
        """Move payload bytes [0, nbytes) to n2 [0, nbytes). report: 'chunk' (feedback per completed
        chunk), 'leg' (one report per leg at its end), or None (default: 'chunk' for adaptive)."""
        from ...selector import TransferRequest
        if report is None:
            report = "chunk" if policy.startswith("adaptive") else "none"
        label = policy
        crc = self._stamp(xid, nbytes)
        self.cur_xid = xid
        self.acks.clear()
        decision = None
        t_sel = time.monotonic()
        if policy == "adaptive-chunkmodel":  # ablation, see matched_selector()
            decision = self.matched_selector().select(TransferRequest("n0", "n2", nbytes))
            policy = "adaptive"
        elif policy == "adaptive":
            decision = self.selector.select(TransferRequest("n0", "n2", nbytes))
        t_sel = time.monotonic() - t_sel
        legs = self._legs(policy, xid, nbytes, decision)
        util_at = [round(float(x), 4) for x in self.agent.util]
        t0 = time.monotonic()
        for leg in legs:
            leg.t_start = leg.t_last = t0
        per_chunk = report == "chunk"
        while True:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                for leg in legs:
                    leg.stopped = True
            if any(isinstance(l, RelayLeg) for l in legs):
                self._poll_acks()
            busy = False
            for leg in legs:
                if not leg.finished or leg.t_end is None:
                    busy |= leg.step(now, self.agent, per_chunk)
            self._tr(now)
            if all(l.finished for l in legs):
                break
            if not busy:
                time.sleep(POLL_S)
        t1 = max(l.t_end for l in legs)
        if report == "leg":
            for l in legs:
                if l.done_bytes:
                    self.agent.report_transfer(l.links, l.done_bytes, max(l.t_end - l.t_start, 1e-6))
        self._tr(time.monotonic(), force=True)
        done = sum(l.done_bytes for l in legs)
        out = {"xid": xid, "policy": label, "nbytes": nbytes, "delivered": done, "complete": done == nbytes,
               "t0": t0, "t1": t1, "seconds": t1 - t0, "crc": crc, "select_us": round(t_sel * 1e6, 1),
               "util_at_decision": util_at,
               "legs": [{"kind": l.kind, "off": l.off, "nbytes": l.nbytes, "done": l.done_bytes,
                         "seconds": round(l.t_end - l.t_start, 6)} for l in legs]}
        if decision is not None:
            out["decision"] = {"type": decision.chosen_type.value, "reason": decision.reason,
                               "shares": [[s.type.value, s.nbytes] for s in decision.subpaths]}
        return out


def run_sender(rundir: str, max_bytes: int, chunk: int, slots: int, window: int, interval_ms: float,
               capacity_gbps: float) -> int:
    from .channel import ChildChannel
    ch = ChildChannel()
    s = Sender(rundir, max_bytes, chunk, slots, window, interval_ms, capacity_gbps)
    try:
        # establish every connection (UCX connects lazily) before anything is measured
        for pol in ("direct", "relay", "multirail"):
            s.transfer(0, pol, 2 * chunk)
        s.start()
        ch.send(ready=True, pid=os.getpid(), selector=s.selector.impl,
                links={"n0-n1": s.l01, "n0-n2": s.l02, "n1-n2": s.l12})
        while True:
            m = ch.recv()
            op = m.get("op")
            if op == "quit":
                return 0
            try:
                if op == "xfer":
                    dl = m.get("deadline")
                    ch.send(**s.transfer(int(m["xid"]), m["policy"], int(m["nbytes"]),
                                         float(dl) if dl is not None else None, m.get("report")))
                elif op == "trace":
                    t0 = float(m.get("since", 0.0))
                    ch.send(trace=[r for r in s.trace if r[0] >= t0])
                    s.trace = [r for r in s.trace if r[0] >= time.monotonic() - 1.0]
                elif op == "state":
                    ch.send(util=[float(x) for x in s.agent.util], samples=s.agent.samples,
                            feedback=s.agent.feedback_count, snapshot=s.agent.snapshot())
                elif op == "clear":
                    s.agent.clear()
                    ch.send(ok=True)
                else:
                    ch.send(error=f"sender: unknown op {op!r}")
            except Exception as e:  # report, keep serving: the orchestrator decides
                logger.exception("sender: %s failed", op)
                ch.send(error=f"{type(e).__name__}: {e}")
    finally:
        s.close()


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get("FLEXFLOW_BENCH_LOG", "WARNING"), stream=sys.stderr)
    ap = argparse.ArgumentParser(prog="contention-node")
    sub = ap.add_subparsers(dest="role", required=True)
    a = sub.add_parser("target")
    a.add_argument("rundir")
    a.add_argument("max_bytes", type=int)
    a = sub.add_parser("relay")
    a.add_argument("rundir")
    a.add_argument("slots", type=int)
    a.add_argument("chunk", type=int)
    a = sub.add_parser("sender")
    a.add_argument("rundir")
    a.add_argument("max_bytes", type=int)
    a.add_argument("--chunk", type=int, default=1 << 20)
    a.add_argument("--slots", type=int, default=8)
    a.add_argument("--window", type=int, default=2)
    a.add_argument("--interval-ms", type=float, default=100.0)
    a.add_argument("--capacity-gbps", type=float, default=0.125)
    args = ap.parse_args(argv)
    if args.role == "target":
        return run_target(args.rundir, args.max_bytes)
    if args.role == "relay":
        return run_relay(args.rundir, args.slots, args.chunk)
    return run_sender(args.rundir, args.max_bytes, args.chunk, args.slots, args.window, args.interval_ms,
                      args.capacity_gbps)


if __name__ == "__main__":
    sys.exit(main())
