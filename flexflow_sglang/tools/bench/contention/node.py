"""The programs that run inside the lab's namespaces, one NIXL (UCX over TCP) agent per path.

    python -m flexflow_sglang.tools.bench.contention.node target RUNDIR MAX_BYTES   (in n2)
    python -m flexflow_sglang.tools.bench.contention.node relay  RUNDIR SLOTS CHUNK (in n1)
    python -m flexflow_sglang.tools.bench.contention.node sender RUNDIR MAX_BYTES   (in n0)

Agents and the device each one is pinned to (UCX_NET_DEVICES, read when the backend is created):

    n0: s-direct (v02) -> n2: t-direct (v20)                     Direct
    n0: s-relay  (v01) -> n1: r-in (v10) | r-out (v12) -> n2: t-relay (v21)   relay through n1
    n0: s-multi  (all) -> n2: t-multi (all)                      UCX's own multi-rail (kernel route via n1)

Relay protocol (application relay, one request in flight per hop): s-relay WRITEs chunk i into ring
slot i % SLOTS of r-in with notification `c|xid|i|slot|dst_off|len`; the relay forwards each chunk
with r-out to t-relay at dst_off as soon as the previous forward completed, then notifies s-relay
`a|xid|i`. The sender keeps at most SLOTS chunks unacknowledged (slot reuse) and one in flight.
Chunk i here is the leg's i-th posted chunk (a leg may post chunks it took over from a sibling).

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
#: elastic-sharing probe (NodeAgent.probe_due): how long it keeps posting (3 sampling intervals of
#: evidence), the least time between two probes, and the scratch region at the target it writes to
PROBE_S = 0.35
PROBE_GAP_S = 1.0
PROBE_SCRATCH_BYTES = 1 << 20


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
    # payload region [0, max_bytes) + a scratch region that only elastic-sharing probes write to
    buf = np.empty(max_bytes + PROBE_SCRATCH_BYTES, dtype=np.uint8)
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
    """One subpath of a transfer, moved chunk by chunk: the byte ranges in `todo` of the payload.
    A sibling leg can take over unposted ranges (steal()), so a share planned from ~100 ms old
    counters costs at most the chunks already in flight when it turns out wrong."""

    def __init__(self, kind: str, links, off: int, nbytes: int, chunk: int, hops: int):
        self.kind, self.links, self.off, self.nbytes, self.chunk, self.hops = kind, tuple(links), off, nbytes, chunk, hops
        self.todo: deque = deque([[off, off + nbytes]] if nbytes > 0 else [])  # [lo, hi) ranges still to post
        self.done_chunks = 0
        self.done_bytes = 0
        self.stolen_bytes = 0  # taken over from siblings
        self.others = ()  # NodeAgents told about this leg's bytes as own traffic only (set by the sender)
        self.t_start = self.t_last = self.t_end = None
        self.stopped = False  # deadline passed: post nothing more
        self.chunk_log: List[tuple] = []  # (t_done, bytes, seconds) per completed chunk

    @property
    def todo_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.todo)

    def _take(self) -> tuple:
        """Next chunk to post: (offset, length) from the front of `todo`."""
        r = self.todo[0]
        n = min(self.chunk, r[1] - r[0])
        lo = r[0]
        r[0] += n
        if r[0] >= r[1]:
            self.todo.popleft()
        return lo, n

    def steal(self, victim: "Leg", nbytes: int) -> int:
        """Move up to `nbytes` (whole chunks, from the back) of victim's unposted bytes to this leg."""
        moved = 0
        while victim.todo and moved < nbytes:
            r = victim.todo[-1]
            n = min(r[1] - r[0], max(self.chunk, (nbytes - moved) // self.chunk * self.chunk))
            self.todo.append([r[1] - n, r[1]])
            r[1] -= n
            if r[1] <= r[0]:
                victim.todo.pop()
            moved += n
        self.stolen_bytes += moved
        return moved

    def rate(self, now: float) -> float:
        """Bytes/s this leg has delivered so far (0 before its first chunk)."""
        return self.done_bytes / max(now - self.t_start, 1e-6) if self.done_bytes else 0.0

    @property
    def finished(self) -> bool:
        return (self.stopped or not self.todo) and not self.inflight()

    def inflight(self) -> int:
        raise NotImplementedError

    def _completed(self, n: int, now: float, agent, report: bool):
        # Throughput, not latency: a chunk's interval is the time since the previous completion on
        # this leg (the first chunk also paid the pipeline fill, once per hop). The rate fed back is
        # over the last FEEDBACK_WINDOW intervals: one interval is noisy (poll granularity, a short
        # last chunk that still pays the fixed per-chunk overhead), and the NodeAgent lets the
        # latest observation replace older ones.
        dt = (now - self.t_last) if self.done_chunks else (now - self.t_start) / self.hops
        self.t_last = now
        self.done_chunks += 1
        self.done_bytes += n
        self.chunk_log.append((now, n, dt))
        win = self.chunk_log[-FEEDBACK_WINDOW:]
        rate = sum(c[1] for c in win) / max(sum(c[2] for c in win), 1e-6)
        # the chunk crossed the link over about the last n / rate seconds, not all in the sampling
        # interval it completes in: the NodeAgents subtract from the coming sample only the part
        # after the last one (NodeAgent.report_progress(seconds=)). Subtracting it whole there made
        # a chunk that crawled at 5 % of a link saturated by UDP read the link as nearly free.
        secs = max(n / rate, 1e-6)
        if report and agent is not None:
            agent.report_progress(self.links, n, seconds=secs)
            # feedback: this chunk at the windowed rate (own bytes already reported just above)
            agent.report_transfer(self.links, n, secs, progress_reported=True)
        for o in self.others:  # the host's other NodeAgents: our bytes, not foreign load (no feedback)
            o.report_progress(self.links, n, seconds=secs)


class DirectLeg(Leg):
    def __init__(self, nixl, peer: dict, src_addr: int, links, off, nbytes, chunk, window, kind="direct"):
        super().__init__(kind, links, off, nbytes, chunk, 1)
        self.nixl, self.peer, self.src_addr, self.window = nixl, peer, src_addr, window
        self.q: deque = deque()

    def inflight(self):
        return len(self.q)

    def _remote(self, lo: int) -> int:
        return self.peer["addr"] + lo

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
        while not self.stopped and self.todo and len(self.q) < self.window:
            lo, n = self._take()
            self.q.append((write(self.nixl, self.peer["name"], self.src_addr + lo, self._remote(lo), n), n))
            busy = True
        if self.finished and self.t_end is None:
            self.t_end = now
        return busy


class ProbeLeg(DirectLeg):
    """Elastic-sharing probe: chunks over one link to the target's scratch region for
    PROBE_S, reported to the NodeAgent like a transfer so its sampling thread learns whether the
    foreign load on the link yields. Not part of any KV transfer: nothing waits for it."""

    def __init__(self, nixl, peer: dict, src_addr: int, scratch_addr: int, links, nbytes, chunk, window, now):
        super().__init__(nixl, peer, src_addr, links, 0, nbytes, chunk, window, kind="probe")
        self.scratch = scratch_addr
        self.t_start = self.t_last = now
        self.until = now + PROBE_S

    def _remote(self, lo: int) -> int:
        return self.scratch  # every chunk to the same scratch bytes: their content does not matter

    def step(self, now, node_agent, report) -> bool:
        if now >= self.until:
            self.stopped = True
        return super().step(now, node_agent, report)


class RelayLeg(Leg):
    def __init__(self, nixl, relay: dict, src_addr: int, xid: int, links, off, nbytes, chunk, slots,
                 acks: deque):
        super().__init__("relay", links, off, nbytes, chunk, 2)
        self.nixl, self.relay, self.src_addr, self.xid, self.slots = nixl, relay, src_addr, xid, slots
        self.hop1 = None  # handle of the chunk being written into the relay's ring
        self.posted = 0  # chunks posted: chunk k uses ring slot k % slots (the relay forwards in order)
        self.sizes: Dict[int, int] = {}  # chunk number -> bytes, until acknowledged end to end
        self.acks = acks  # chunk numbers acknowledged end to end (filled by the sender loop)

    def inflight(self):
        return len(self.sizes)

    def step(self, now, node_agent, report) -> bool:
        busy = False
        while self.acks:
            k = self.acks.popleft()
            n = self.sizes.pop(k, None)
            if n is not None:
                self._completed(n, now, node_agent, report)
                busy = True
        if self.hop1 is not None:
            st = self.nixl.check_xfer_state(self.hop1)
            if st == "ERR":
                raise RuntimeError("relay leg: hop-1 chunk transfer failed")
            if st == "DONE":
                self.nixl.release_xfer_handle(self.hop1)
                self.hop1 = None
                busy = True
        if self.hop1 is None and not self.stopped and self.todo and len(self.sizes) < self.slots:
            k = self.posted
            lo, n = self._take()
            slot = k % self.slots
            notif = f"c|{self.xid}|{k}|{slot}|{lo}|{n}".encode()
            self.hop1 = write(self.nixl, self.relay["name"], self.src_addr + lo,
                              self.relay["addr"] + slot * self.chunk, n, notif)
            self.sizes[k] = n
            self.posted += 1
            busy = True
        if self.finished and self.t_end is None:
            self.t_end = now
        return busy


def rebalance(legs: List[Leg], now: float) -> int:
    """Work stealing between the legs of one split transfer: a leg with nothing left to post takes
    over part of the unposted bytes of the sibling with the most left, in proportion to the two
    legs' delivered rates (all of it from a sibling that has delivered nothing yet). The selector's
    shares are a plan from ~100 ms old counters; this corrects them while the transfer runs."""
    moved = 0
    for thief in legs:
        if thief.stopped or thief.todo or thief.inflight() > 1:
            continue
        victim = max((l for l in legs if l is not thief and l.todo), key=lambda l: l.todo_bytes, default=None)
        if victim is None:
            break
        rt, rv = thief.rate(now), victim.rate(now)
        want = victim.todo_bytes * (rt / (rt + rv) if rt > 0 and rv > 0 else 1.0)
        if want >= victim.chunk or rv == 0:
            moved += thief.steal(victim, int(want))
    return moved


def build_topology(capacity_gbps: float = 0.125):
    """n0, n1, n2 host-memory nodes; Ethernet links with the counter each is read from *inside n0*.
    n1-n2 has no counter n0 can read (it lives in other namespaces): feedback only."""
    from flexflow_sglang.topology import LinkType, NodeKind, Topology
    topo = Topology("netlab-hosts3", "netlab")
    for h in ("n0", "n1", "n2"):
        topo.add_node(h, NodeKind.CPU, h, 0)
    topo.add_link("n0", "n1", LinkType.ETHERNET, capacity_gbps, 70.0, counter={"sysfs_net": "v01"})
    topo.add_link("n0", "n2", LinkType.ETHERNET, capacity_gbps, 70.0, counter={"sysfs_net": "v02"})
    topo.add_link("n1", "n2", LinkType.ETHERNET, capacity_gbps, 70.0)
    return topo


#: policies executed from a PathDecision: work stealing between legs, reservations
ADAPTIVE = ("adaptive", "adaptive-elastic")


class Sender:
    POLICIES = ("direct", "relay", "split50", "multirail", "adaptive", "adaptive-elastic")

    def __init__(self, rundir: str, max_bytes: int, chunk: int, slots: int, window: int,
                 sample_interval_ms: float, capacity_gbps: float, elastic_share: float = 0.5):
        from flexflow_sglang.monitor import NodeAgent
        from flexflow_sglang.selector import PathSelector, SelectorConfig
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
        # the same selector with elastic sharing on (monitor.elastic_share): its own NodeAgent, so
        # its evidence and feedback come only from its own transfers
        self.agent_el = NodeAgent(self.topo, sample_interval_ms=sample_interval_ms, source="sysfs",
                                  sysfs_root="/sys", elastic_share=elastic_share)
        self.selector_el = PathSelector(self.topo, self.agent_el, SelectorConfig())
        self._matched = None
        self._engines: Dict[int, object] = {}  # id(selector) -> TransferEngine (see engine_for)
        self.max_bytes = max_bytes
        self.probe: Optional[ProbeLeg] = None
        self.probe_token = 0
        self.next_probe_t = 0.0
        self.probes: List[dict] = []  # one record per finished probe (returned with each transfer)
        self.acks: deque = deque()
        self.cur_xid = -1
        self.trace: List[list] = []
        self._last_trace = 0.0

    def matched_selector(self):
        """Ablation: the same selector, but its relay pipeline model uses this executor's chunk size
        instead of the default SelectorConfig.relay_chunk_bytes (4 MiB). Shares the NodeAgent."""
        if self._matched is None:
            from flexflow_sglang.selector import PathSelector, SelectorConfig
            sel = PathSelector(self.topo, self.agent, SelectorConfig(relay_chunk_bytes=int(self.chunk)))
            self._matched = sel
        return self._matched

    def engine_for(self, selector, agent):
        """The TransferEngine that routes this selector's moves (select + reserve, release per
        leg): one per (selector, NodeAgent) pair, made on first use. It starts no threads (the
        lab runs its legs itself and submits nothing)."""
        engines = self.__dict__.setdefault("_engines", {})  # (tests build a Sender without __init__)
        eng = engines.get(id(selector))
        if eng is None:
            from flexflow_sglang.transfer.engine import TransferEngine
            eng = engines[id(selector)] = TransferEngine(selector, agent, name="ff-lab")
        return eng

    def start(self):
        self.agent.start()
        self.agent_el.start()

    def close(self):
        self.agent.stop()
        self.agent_el.stop()

    # ----------------------------------------------------------------- elastic-sharing probe
    def step_probe(self, now: float, allow_start: bool) -> bool:
        """Advance the probe of the elastic agent; start one on the direct link when the agent asks
        for it (only the direct link has an endpoint here). Returns True when this step did work
        (started the probe, completed or posted a chunk), like Leg.step: the callers' polling loops
        sleep POLL_S otherwise. It used to return True for as long as a probe ran, so the transfer
        loop spun without sleeping for the whole probe (0.35 s, longer with its chunks stuck under
        UDP at 95 %): 4x the sender's CPU over the elastic block's first transfers, on two cores
        shared with the relay, the target and the background sender, and one of those transfers
        took 231 ms instead of 42 (issue 15 item 4)."""
        ag = self.agent_el
        started = False
        if self.probe is None:
            if not allow_start or now < self.next_probe_t or not ag.probe_due(self.l02):
                return False
            nbytes = min(self.max_bytes, 64 << 20)
            self.probe = ProbeLeg(self.a_direct, self.p_direct, self.addr, self.p_direct["addr"] + self.max_bytes,
                                  (self.l02,), nbytes, min(self.chunk, PROBE_SCRATCH_BYTES), self.window, now)
            self.probe.others = (self.agent,)
            # a low predicted rate: the reservation marks the link as ours-in-use (evidence) without
            # its estimate hiding much foreign load while the probe reports nothing
            self.probe_token = ag.reserve((self.l02,), 1 << 20, PROBE_S)
            started = True
        busy = self.probe.step(now, ag, True) or started
        if (self.probe.stopped or not self.probe.todo) and self.probe_token:
            # held only while it posts: chunks still in flight after that are not "trying"
            ag.release(self.probe_token)
            self.probe_token = 0
        if self.probe.finished:
            p = self.probe
            self.probes.append({"t0": round(p.t_start, 6), "t1": round(now, 6), "bytes": p.done_bytes,
                                "mbps": round(p.done_bytes * 8 / max(now - p.t_start, 1e-6) / 1e6, 1)})
            self.probe, self.probe_token = None, 0
            self.next_probe_t = now + PROBE_GAP_S
            return True
        return busy

    def stop_probe(self) -> None:
        """Post no more probe chunks (another policy's transfer is about to be measured)."""
        if self.probe is not None:
            self.probe.stopped = True

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
        mk_direct = lambda off, n: DirectLeg(self.a_direct, self.p_direct, self.addr, (self.l02,), off, n, c,
                                             self.window)
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
        if policy in ADAPTIVE:
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
            u, e = self.agent.util, self.agent_el
            # [t, util n0-n2, n0-n1, n1-n2 (default agent), elastic agent: util n0-n2, its sampled
            # foreign load, its yield estimate]
            self.trace.append([round(now, 6), round(float(u[self.l02]), 4), round(float(u[self.l01]), 4),
                               round(float(u[self.l12]), 4), round(float(e.util[self.l02]), 4),
                               round(float(e._sampled[self.l02]), 4), round(float(e.elastic_est[self.l02]), 3)])

    def transfer(self, xid: int, policy: str, nbytes: int, deadline: Optional[float] = None,
                 report: Optional[str] = None) -> dict:
        """Move payload bytes [0, nbytes) to n2 [0, nbytes). report: 'chunk' (feedback per completed
        chunk), 'leg' (one report per leg at its end), or None (default: 'chunk' for adaptive)."""
        if report is None:
            report = "chunk" if policy.startswith("adaptive") else "none"
        label = policy
        crc = self._stamp(xid, nbytes)
        self.cur_xid = xid
        self.acks.clear()
        engine = None
        if policy == "adaptive-chunkmodel":  # ablation, see matched_selector()
            engine = self.engine_for(self.matched_selector(), self.agent)
            policy = "adaptive"
        elif policy == "adaptive":
            engine = self.engine_for(self.selector, self.agent)
        elif policy == "adaptive-elastic":
            engine = self.engine_for(self.selector_el, self.agent_el)
        adaptive = policy in ADAPTIVE
        elastic = policy == "adaptive-elastic"
        agent = self.agent_el if elastic else self.agent
        # the view the decision is taken from (before our reservation adds to it)
        util_at = [round(float(x), 4) for x in agent.util]
        elastic_at = [round(float(x), 3) for x in agent.elastic] if elastic else None
        ticket = None
        t_sel = time.monotonic()
        if engine is not None:
            # select + reserve_decision (our own transfer in flight, as the connector's executors
            # count it, docs/selector.md): select_us includes the reservation (a few us)
            ticket = engine.open("n0", "n2", nbytes)
        t_sel = time.monotonic() - t_sel
        decision = ticket.decision if ticket is not None else None
        try:
            if ticket is not None and decision is None:  # open() swallows selector errors: the lab must not
                raise RuntimeError(f"{label}: no path decision n0 -> n2 for {nbytes} bytes (selector failed)")
            legs = self._legs(policy, xid, nbytes, decision)
            # leg j runs subpath sub_of[j] (_legs skips empty subpaths): its reservation is that one
            sub_of = [i for i, sp in enumerate(decision.subpaths) if sp.nbytes > 0] if decision is not None else []
            if adaptive:
                # both adaptive policies' NodeAgents stand for one host's: each counts the other's
                # transfers as our own traffic, not as foreign load that later "yields"
                other = (self.agent if agent is self.agent_el else self.agent_el,)
                for leg in legs:
                    leg.others = other
            if not elastic:
                self.stop_probe()
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
                for i, leg in enumerate(legs):
                    if not leg.finished or leg.t_end is None:
                        busy |= leg.step(now, agent, per_chunk)
                    if leg.finished and ticket is not None:
                        # the links are free; a leg that takes over bytes again (rebalance) runs
                        # unreserved, and releasing twice is a no-op (release_leg pops the token)
                        ticket.release_leg(sub_of[i])
                if self.probe is not None or elastic:
                    busy |= self.step_probe(now, elastic)
                if adaptive and len(legs) > 1 and rebalance(legs, now):
                    busy = True
                    for leg in legs:  # a leg that took over bytes is not finished any more
                        if leg.todo:
                            leg.t_end = None
                self._tr(now)
                if all(l.finished for l in legs):
                    break
                if not busy:
                    time.sleep(POLL_S)
            t1 = max(l.t_end for l in legs)
            for i, l in enumerate(legs):
                secs = max(l.t_end - l.t_start, 1e-6)
                if ticket is not None:
                    # the leg's end in the engine's books; with report="leg" its one feedback report
                    # (relays=0 and the leg's own links, as the per-chunk reports; the bytes it
                    # delivered, including any it took over from its sibling)
                    ticket.leg_done(sub_of[i], l.done_bytes, secs, report=report == "leg", links=l.links, relays=0)
                elif report == "leg" and l.done_bytes:  # a fixed-route policy: no decision, no engine
                    agent.report_transfer(l.links, l.done_bytes, secs)
        finally:
            if ticket is not None:
                ticket.close()  # whatever is still reserved (a failed leg), and the engine's record
        self._tr(time.monotonic(), force=True)
        done = sum(l.done_bytes for l in legs)
        out = {"xid": xid, "policy": label, "nbytes": nbytes, "delivered": done, "complete": done == nbytes,
               "t0": t0, "t1": t1, "seconds": t1 - t0, "crc": crc, "select_us": round(t_sel * 1e6, 1),
               "util_at_decision": util_at,
               "legs": [{"kind": l.kind, "off": l.off, "nbytes": l.nbytes, "done": l.done_bytes,
                         "stolen": l.stolen_bytes, "seconds": round(l.t_end - l.t_start, 6)} for l in legs]}
        if elastic:
            out["elastic_at_decision"] = elastic_at
            out["elastic_est"] = [round(float(x), 3) for x in agent.elastic_est]
            out["probes"], self.probes = self.probes, []
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
        last_elastic = False
        while True:
            # between elastic-sharing transfers a running probe keeps going (UCX over TCP needs
            # polling); it never starts or posts during another policy's transfers
            if s.probe is not None and last_elastic:
                s.step_probe(time.monotonic(), True)
                m = ch.poll(POLL_S)
                if m is None:
                    continue
            else:
                m = ch.recv()
            op = m.get("op")
            if op == "quit":
                return 0
            try:
                if op == "xfer":
                    last_elastic = m["policy"] == "adaptive-elastic"
                    dl = m.get("deadline")
                    ch.send(**s.transfer(int(m["xid"]), m["policy"], int(m["nbytes"]),
                                         float(dl) if dl is not None else None, m.get("report")))
                elif op == "trace":
                    t0 = float(m.get("since", 0.0))
                    ch.send(trace=[r for r in s.trace if r[0] >= t0])
                    s.trace = [r for r in s.trace if r[0] >= time.monotonic() - 1.0]
                elif op == "state":
                    el = s.agent_el
                    ch.send(util=[float(x) for x in s.agent.util], samples=s.agent.samples,
                            feedback=s.agent.feedback_count, snapshot=s.agent.snapshot(),
                            elastic={"est": el.elastic_est.tolist(), "applied": el.elastic.tolist(),
                                     "in_flight": el.in_flight, "evidence": el.elastic_evidence,
                                     "probe_running": s.probe is not None})
                elif op == "clear":
                    s.stop_probe()
                    s.agent.clear()
                    s.agent_el.clear()
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
