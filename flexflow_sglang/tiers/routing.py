"""Path-selector routing for the remote tier: Direct, CrossNodeRelay and SplitPath execution.

`RemoteTier(..., selector=sel, local_node="n0", peer_nodes={"host:port": "n2", ...})` hands every
get/put batch to `Router`. Per owning peer the router asks `sel.select(TransferRequest(src, dst,
pages * page_nbytes))` (get: owner -> local_node; put: local_node -> owner) and executes the
decision's legs:

* Direct: LOOKUP/PUT at the owner, NIXL READ/WRITE from/to the owner (as without a selector).
* CrossNodeRelay: the first intermediate node of the leg that maps to a configured peer (an owner
  or a relay-only peer) is the relay. Get: RELAY_GET to the relay (it pulls from the owner into
  temporary slots), READ from the relay, RELEASE. Put: RELAY_PUT to the relay, WRITE to it,
  COMMIT (the relay checks the CRCs and forwards to the owner before answering). A leg is cut into
  chunks of `relay_chunk_bytes` (the selector's relay model) and every chunk request is sent at
  once: the relay pulls chunk i+1 while the client reads chunk i (gets); puts keep one WRITE in
  flight per relay, so chunk i is forwarded while chunk i+1 is written.
* SplitPath: the owner's rows are cut in proportion to the legs' bytes, each leg executed as
  above, all legs concurrently. Other leg types (StorageRelay, NVLinkRelay) run as Direct.

A relay whose server predates RELAY_* answers ERROR (and closes): the relay is marked unsupported
for retry_after_s and the affected rows go direct in the same call. A relay that fails (timeout,
owner unreachable from the relay, relay down) is a miss for its rows, never a hang: every reply
and every transfer has the tier's timeout_ms, as for direct peers. Each completed leg is reported
to the selector's NodeAgent: `report_transfer(leg links, bytes, seconds, relays=0|1)`, except
"cold" legs (first contact: connection, NIXL metadata/endpoint, the relay's own first connection to
the owner), whose time is mostly setup and would read as a congested link. Every transfer's bytes
go to `report_progress` when it is posted, so the sampled link counters (which see our traffic
before the leg ends) do not take our own bytes for foreign load. Selecting, reserving, releasing
and reporting are the transfer engine's (flexflow_sglang/transfer/engine.py): per owner one
`TransferEngine.open` ticket (select + reserve each subpath for the decision's estimated time; a
relay that runs direct moves its reservation to the direct links), `leg_done` per leg, `close`
when the call returns; so a concurrent get/put sees those links as partly busy, and a failed
reservation never fails the call. This module carries out the legs.
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from .base import page_checksums, post_xfer
from .wire import MsgType, WireError, int_list, pack_keys, read_frame, write_frame

log = logging.getLogger("flexflow_sglang.tiers.remote")

_FAILED, _REPLY, _READY, _XFER, _COMMIT, _DONE = -1, 0, 1, 2, 3, 4


@dataclass(eq=False)
class Leg:
    owner: int                # peer that owns the keys
    via: int                  # peer the data moves from/to (== owner for Direct)
    rows: List[int]           # indices into the call's keys
    links: Tuple[int, ...]    # topology links of the route actually taken (reported to the agent)
    relays: int               # 0 Direct, 1 CrossNodeRelay
    planned: str              # the leg's path type in the decision
    decision: str             # the decision's chosen type
    note: str = ""            # why a planned relay ran direct
    nbytes: int = 0           # bytes moved (gets: verified)
    t_end: float = 0.0
    cold: bool = False        # paid first-contact setup (connect, NIXL metadata/endpoint, relay's client)
    ticket: object = None     # the transfer engine's Ticket of the owner's decision (reservations, reports)
    sub: int = -1             # the decision's subpath this leg carries out (-1: a fallback leg)


@dataclass(eq=False)
class _Item:
    leg: Leg
    pid: int
    rows: List[int]
    relay: bool
    state: int = _REPLY
    sent: float = 0.0
    lease: int = 0
    count: int = 0
    addrs: List[int] = field(default_factory=list)
    sums: List[int] = field(default_factory=list)
    wrows: List[int] = field(default_factory=list)  # put: rows written
    handle: object = None
    posted: str = "PROC"   # what transfer() returned
    xdeadline: float = 0.0
    xfer_ok: bool = False


def _shares(n: int, weights: List[int]) -> List[int]:
    """n rows cut in proportion to weights (largest remainder)."""
    tot = float(sum(weights)) or 1.0
    raw = [n * w / tot for w in weights]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[:n - sum(out)]:
        out[i] += 1
    return out


class Router:
    def __init__(self, tier, selector, local_node: str, peer_nodes: Optional[Dict[str, str]] = None,
                 relay_chunk_bytes: Optional[int] = None, engine=None):
        self.t = tier
        self.sel = selector
        self.local = local_node
        self.peer_nodes = dict(peer_nodes or {})
        self.agent = getattr(selector, "agent", None)
        if engine is None:  # select -> reserve -> release -> report live in the transfer engine
            from ..transfer import TransferEngine
            engine = TransferEngine(selector, self.agent)
        self.engine = engine
        cfg = getattr(selector, "config", None)
        self.chunk_bytes = int(relay_chunk_bytes or getattr(cfg, "relay_chunk_bytes", 4 << 20))
        self.last: List[dict] = []
        self._direct_links: Dict[Tuple[str, str], Tuple[int, ...]] = {}

    # ------------------------------------------------------------------ planning
    def node_of(self, pid: int) -> Optional[str]:
        p = self.t._peers[pid]
        n = self.peer_nodes.get(p.addr) or p.node
        return n if n in self.sel.topology.nodes else None

    def _direct(self, src: str, dst: str) -> Tuple[int, ...]:
        key = (src, dst)
        if key not in self._direct_links:
            from ..selector.types import TransferRequest
            try:
                self._direct_links[key] = tuple(self.sel.always_direct(TransferRequest(src, dst, 1)).subpaths[0].links)
            except Exception:  # no direct route known: feedback-less leg
                self._direct_links[key] = ()
        return self._direct_links[key]

    def relay_usable(self, pid: int, now: float) -> bool:
        p = self.t._peers[pid]
        return p.up(now) and p.relay_cap != 0 and now >= p.relay_unsup_until

    def _relay_pid(self, nodes, owner: int, now: float) -> Optional[int]:
        for node in nodes[1:-1]:
            for pid in range(len(self.t._peers)):
                if pid != owner and self.node_of(pid) == node and self.relay_usable(pid, now):
                    return pid
        return None

    def plan(self, op: str, groups: Dict[int, List[int]], P: int, tickets: Optional[list] = None) -> List[Leg]:
        """The legs of a get/put. Per owner the transfer engine selects and reserves
        (`TransferEngine.open`); its tickets are appended to `tickets` (the caller closes them)."""
        legs: List[Leg] = []
        now = time.monotonic()
        tickets = [] if tickets is None else tickets
        for pid, idx in groups.items():
            own = self.node_of(pid)
            if own is None or own == self.local:
                legs.append(Leg(pid, pid, list(idx), (), 0, "Direct", "none", "owner not in the topology"))
                continue
            src, dst = (own, self.local) if op == "get" else (self.local, own)
            tk = self.engine.open(src, dst, len(idx) * P)
            tickets.append(tk)
            if tk.decision is None:
                log.debug("remote tier: no decision for %s -> %s", src, dst)
                legs.append(Leg(pid, pid, list(idx), self._direct(src, dst), 0, "Direct", "none", "no decision",
                                ticket=tk))
                continue
            subs = tk.subpaths
            chosen = tk.decision.chosen_type.value
            self.t.c["route_" + {"Direct": "direct", "CrossNodeRelay": "relay", "SplitPath": "split"}.get(chosen, "other")] += 1
            pos = 0
            for i, (sub, cnt) in enumerate(zip(subs, _shares(len(idx), [s.nbytes for s in subs]))):
                if not cnt:
                    continue
                rows, pos = list(idx[pos:pos + cnt]), pos + cnt
                typ = sub.type.value
                if typ == "CrossNodeRelay":
                    r = self._relay_pid(sub.nodes, pid, now)
                    if r is not None:
                        legs.append(Leg(pid, r, rows, tuple(sub.links), 1, typ, chosen, ticket=tk, sub=i))
                        continue
                    note = "no usable relay peer"
                    self.t.c["relay_fallbacks"] += 1
                else:
                    note = "" if typ == "Direct" else f"{typ} run as Direct"
                links = tuple(sub.links) if typ == "Direct" else self._direct(src, dst)
                if links != tuple(sub.links):  # runs direct: hold the links it really uses
                    tk.reroute(i, links, cnt * P)
                legs.append(Leg(pid, pid, rows, links, 0, typ, chosen, note, ticket=tk, sub=i))
        return legs

    # ------------------------------------------------------------------ execution
    def get(self, keys: List[bytes], out: np.ndarray, owners: List[int], groups: Dict[int, List[int]], P: int) -> int:
        return self._run("get", keys, out, groups, P)

    def put(self, keys: List[bytes], pages: np.ndarray, owners: List[int], groups: Dict[int, List[int]], P: int) -> int:
        return self._run("put", keys, pages, groups, P)

    def _request(self, op: str, it: _Item, keys: List[bytes], sums: Optional[List[int]]):
        t = self.t
        klen, blob = pack_keys([keys[i] for i in it.rows])
        body = {"klen": klen, "n": len(it.rows)}
        if op == "put":
            body["sums"] = [sums[i] for i in it.rows]
        if it.relay:
            body.update(owner=t._peers[it.leg.owner].addr, owner_node=self.node_of(it.leg.owner),
                        timeout_ms=t.timeout_s * 1000.0)
            return (MsgType.RELAY_GET if op == "get" else MsgType.RELAY_PUT), body, blob
        if op == "get":
            body["pin"] = True
            return MsgType.LOOKUP, body, blob
        return MsgType.PUT, body, blob

    def _run(self, op: str, keys: List[bytes], data: np.ndarray, groups: Dict[int, List[int]], P: int) -> int:
        tickets: list = []
        try:
            return self._run_legs(op, keys, data, groups, P, tickets)
        finally:
            for tk in tickets:  # whatever is still reserved (a failure before the report)
                tk.close("remote:")

    def _run_legs(self, op: str, keys: List[bytes], data: np.ndarray, groups: Dict[int, List[int]], P: int,
                  tickets: list) -> int:
        t = self.t
        n = len(keys)
        m0 = time.monotonic()
        timeout = t.timeout_s
        # peers whose topology node is not configured: learn it from their HELLO_OK (once)
        unknown = [pid for pid, p in enumerate(t._peers)
                   if p.addr not in self.peer_nodes and p.node is None and p.sock is None and p.up(m0)]
        if unknown:
            t._connect(unknown, P, m0 + timeout)
        legs = self.plan(op, groups, P, tickets)
        fresh = {pid for pid, p in enumerate(t._peers) if p.sock is None or p.loaded_gen != t._gen}
        t._connect(sorted({l.via for l in legs}), P, m0 + timeout)
        fb: Dict[int, Leg] = {}  # id(leg) -> its direct fallback leg

        def fallback(leg: Leg, why: str) -> Leg:
            f = fb.get(id(leg))
            if f is None:
                own = self.node_of(leg.owner)
                links = ()
                if own is not None:
                    links = self._direct(own, self.local) if op == "get" else self._direct(self.local, own)
                f = fb[id(leg)] = Leg(leg.owner, leg.owner, [], links, 0, leg.planned, leg.decision, why,
                                      ticket=leg.ticket)
                legs.append(f)
                t.c["relay_fallbacks"] += 1
            return f

        # relays that said "relay": 0 in HELLO_OK run direct
        for leg in list(legs):
            if leg.relays and t._peers[leg.via].sock is not None and t._peers[leg.via].relay_cap == 0:
                f = fallback(leg, "relay disabled on that server")
                f.rows, leg.rows = f.rows + leg.rows, []
        missing = sorted({l.via for l in legs if l.rows and t._peers[l.via].sock is None and t._peers[l.via].up(time.monotonic())})
        if missing:
            t._connect(missing, P, time.monotonic() + timeout)

        items: List[_Item] = []
        per = max(1, self.chunk_bytes // P)
        for leg in sorted(legs, key=lambda l: -l.relays):  # relay requests first: the pulls overlap the rest
            if not leg.rows or t._peers[leg.via].sock is None:
                continue
            step = per if leg.relays else len(leg.rows)
            for c in range(0, len(leg.rows), step):
                items.append(_Item(leg, leg.via, leg.rows[c:c + step], bool(leg.relays)))

        sums = page_checksums(data, n) if op == "put" else None
        st = t._get_stage(n * P)  # creates the NIXL agent on first use: before the clock starts
        stage = st.arr[:n * P].reshape(n, P)
        fresh |= {pid for pid, p in enumerate(t._peers) if p.loaded_gen != t._gen}
        for leg in legs:
            leg.cold = leg.via in fresh
        m0 = time.monotonic()  # legs are timed from here (feedback to the NodeAgent)
        present = np.zeros(n, dtype=bool)  # put: held by the owner afterwards
        pend: Dict[int, deque] = {}
        last_rx: Dict[int, float] = {}
        ready: Dict[int, deque] = {}
        inflight: Dict[int, _Item] = {}
        live: List[_Item] = []
        xop = "READ" if op == "get" else "WRITE"

        def fail_pid(pid: int, reason: Optional[str], timeout_: bool = False) -> None:
            if reason is not None:
                t._mark_down(pid, reason, timeout=timeout_)
            for it in list(pend.pop(pid, ())) + list(ready.pop(pid, ())):
                it.state = _FAILED
            cur = inflight.get(pid)
            if cur is not None:
                cur.state = _FAILED  # its handle stays in `live` until it ends or is parked

        def send(it: _Item, t_, body, blob) -> bool:
            p = t._peers[it.pid]
            if p.sock is None:
                it.state = _FAILED
                return False
            try:
                write_frame(p.sock, t_, body, blob, deadline=time.monotonic() + timeout)
            except TimeoutError:
                fail_pid(it.pid, "control channel send timed out", True)
                it.state = _FAILED
                return False
            except (OSError, WireError) as e:
                fail_pid(it.pid, f"control channel: {e}")
                it.state = _FAILED
                return False
            it.sent = time.monotonic()
            pend.setdefault(it.pid, deque()).append(it)
            return True

        def send_first(it: _Item) -> None:
            it.state = _REPLY
            send(it, *self._request(op, it, keys, sums))

        def unsupported(pid: int, it: _Item, msg: str) -> None:
            p = t._peers[pid]
            p.relay_unsup_until = time.monotonic() + t.retry_after_s
            t.c["relay_unsupported"] += 1
            log.warning("remote tier: peer %s does not relay (%s); direct for %.0f s", p.addr, msg, t.retry_after_s)
            taken = [it] + list(pend.pop(pid, ()))
            p.close()  # a server that predates RELAY_* closes after its ERROR; reconnect lazily
            redo = []
            for x in taken:
                if x.state != _REPLY:
                    x.state = _FAILED
                elif x.relay:
                    f = fallback(x.leg, "relay unsupported")
                    f.rows = sorted(f.rows + x.rows)
                    moved = set(x.rows)
                    x.leg.rows = [r for r in x.leg.rows if r not in moved]
                    redo.append(_Item(f, f.via, x.rows, False))
                else:
                    redo.append(_Item(x.leg, x.pid, x.rows, False))
            need = sorted({x.pid for x in redo if t._peers[x.pid].sock is None})
            if need:
                t._connect(need, P, time.monotonic() + timeout)
            for x in redo:
                items.append(x)
                send_first(x)

        def on_frame(pid: int) -> None:
            p = t._peers[pid]
            it = pend[pid][0]
            try:
                f = read_frame(p.sock, time.monotonic() + timeout)
            except TimeoutError:
                fail_pid(pid, "control channel timed out", True)
                return
            except (OSError, WireError) as e:
                fail_pid(pid, f"control channel: {e}")
                return
            pend[pid].popleft()
            now = time.monotonic()
            last_rx[pid] = now
            if f.type == MsgType.ERROR and it.relay and it.state == _REPLY:
                unsupported(pid, it, str(f.body.get("error")))
                return
            if it.state == _COMMIT:
                expect = MsgType.COMMIT_OK
            elif op == "get":
                expect = MsgType.RELAY_GET_OK if it.relay else MsgType.LOOKUP_OK
            else:
                expect = MsgType.RELAY_PUT_OK if it.relay else MsgType.PUT_OK
            if f.type != expect:
                msg = f.body.get("error") if f.type == MsgType.ERROR else f"unexpected {f.type.name}"
                it.state = _FAILED
                fail_pid(pid, f"server: {msg}")
                return
            if it.relay and f.body.get("cold"):
                it.leg.cold = True
            if it.relay and f.body.get("error"):
                t.c["relay_failures"] += 1
                log.warning("remote tier: relay %s: %s", p.addr, f.body.get("error"))
            try:
                if it.state == _COMMIT:
                    stored = int_list(f.body, "stored")
                    for r, s_ in zip(it.wrows, stored):
                        if s_:
                            present[r] = True
                            it.leg.nbytes += P
                    it.leg.t_end = now
                    it.state = _DONE
                    return
                if op == "get":
                    c = f.body.get("count")
                    c = max(0, min(len(it.rows), c)) if isinstance(c, int) else 0
                    it.addrs, it.sums = int_list(f.body, "addrs")[:c], int_list(f.body, "sums")[:c]
                    if len(it.addrs) < c or len(it.sums) < c:
                        raise WireError("lists are short")
                    it.count, it.lease = c, f.body.get("lease") or 0
                    it.wrows = it.rows[:c]
                else:
                    status = int_list(f.body, "status", len(it.rows))
                    it.addrs = int_list(f.body, "addrs")
                    it.wrows = [r for r, s_ in zip(it.rows, status) if s_ == 0]
                    if len(it.wrows) != len(it.addrs):
                        raise WireError("address count")
                    for r, s_ in zip(it.rows, status):
                        if s_ == 1:
                            present[r] = True
                    it.lease = f.body.get("lease") or 0
                    for r in it.wrows:
                        stage[r] = data[r]
            except WireError as e:
                it.state = _FAILED
                fail_pid(pid, f"bad {f.type.name}: {e}")
                return
            if it.wrows:
                it.state = _READY
                ready.setdefault(pid, deque()).append(it)
            else:
                it.state = _DONE

        def post(it: _Item) -> None:
            pid = it.pid
            if not t._load_md(pid):
                fail_pid(pid, None)
                it.state = _FAILED
                return
            a = t._ensure_agent()
            base = st.arr.ctypes.data
            try:
                loc = a.get_xfer_descs(np.array([(base + r * P, P, 0) for r in it.wrows], dtype=np.uint64), "DRAM")
                rem = a.get_xfer_descs(np.array([(ad, P, 0) for ad in it.addrs], dtype=np.uint64), "DRAM")
                h = a.initialize_xfer(xop, loc, rem, t._peers[pid].agent_name)
            except Exception as e:
                it.state = _FAILED
                fail_pid(pid, f"NIXL {xop} setup: {e!r}")
                return
            it.handle, it.state = h, _XFER
            it.xdeadline = time.monotonic() + timeout
            inflight[pid] = it
            live.append(it)
            it.posted = post_xfer(a, h)
            if self.agent is not None and it.leg.links:
                try:  # our bytes, reported before they hit the wire: sampled counters subtract them
                    self.agent.report_progress(it.leg.links, len(it.wrows) * P)
                except Exception as e:
                    log.debug("report_progress: %r", e)

        def poll() -> None:
            a = t._agent
            now = time.monotonic()
            for it in list(live):
                state = it.posted
                if state == "PROC":
                    try:
                        state = a.check_xfer_state(it.handle)
                    except Exception:
                        state = "ERR"
                if state == "PROC":
                    if now < it.xdeadline:
                        continue
                    st.users += 1  # still running: park it, never release or free under it
                    t._parked.append((it.handle, st, it.pid))
                    t.c["parked_transfers"] += 1
                    live.remove(it)
                    if inflight.get(it.pid) is it:
                        del inflight[it.pid]
                    it.state = _FAILED
                    fail_pid(it.pid, f"NIXL {xop} timed out after {timeout * 1000:.0f} ms", True)
                    continue
                try:
                    it.handle.release()
                except Exception as e:
                    log.debug("release_xfer_handle: %r", e)
                live.remove(it)
                if inflight.get(it.pid) is it:
                    del inflight[it.pid]
                if it.state == _FAILED:
                    continue
                if state != "DONE":
                    it.state = _FAILED
                    fail_pid(it.pid, f"NIXL {xop} failed")
                    continue
                it.xfer_ok = True
                if op == "get":
                    it.leg.t_end = now
                    it.state = _DONE
                else:
                    it.state = _COMMIT
                    send(it, MsgType.COMMIT, {"lease": it.lease, "ok": [1] * len(it.wrows)}, b"")

        try:
            for it in items:
                send_first(it)
            while True:
                now = time.monotonic()
                for pid, q in list(pend.items()):
                    if q and now > max(q[0].sent, last_rx.get(pid, 0.0)) + timeout:
                        fail_pid(pid, "control channel timed out", True)
                for pid, q in list(ready.items()):
                    if q and pid not in inflight:
                        post(q.popleft())
                if live:
                    poll()
                socks = {t._peers[pid].sock: pid for pid, q in pend.items() if q and t._peers[pid].sock is not None}
                if not socks and not live and not any(ready.values()):
                    break
                wait = 0.001 if (live or any(ready.values())) else 0.02
                if socks:
                    try:
                        r, _, _ = select.select(list(socks), [], [], wait)
                    except (OSError, ValueError):
                        r = list(socks)  # a closed socket: read_frame reports it
                    for s in r:
                        pid = socks[s]
                        if pend.get(pid):
                            on_frame(pid)
                else:
                    time.sleep(wait)
        finally:
            for it in live:  # only on an exception: park what still runs
                st.users += 1
                t._parked.append((it.handle, st, it.pid))
        t1 = time.monotonic()

        if op == "get":
            good = self._finish_get(items, stage, out_=data, P=P, n=n, st=st, t0=m0, t1=t1)
        else:
            good = self._finish_put(items, present, n, P, st, m0, t1)
        self._report(op, legs, m0, P)
        return good

    def _finish_get(self, items, stage, out_, P, n, st, t0, t1) -> int:
        t = self.t
        okrow = np.zeros(n, dtype=bool)
        drops: Dict[int, List[int]] = {}
        for it in items:
            if not it.xfer_ok:
                continue
            got = page_checksums(stage, len(it.wrows), it.wrows)
            for j, r in enumerate(it.wrows):
                if got[j] == (it.sums[j] & 0xFFFFFFFF):
                    okrow[r] = True
                else:
                    t.c["corrupt_dropped"] += 1
                    drops.setdefault(id(it), []).append(j)
                    log.warning("remote tier: page from %s failed its checksum; dropped", t._peers[it.pid].addr)
        good = 0
        while good < n and okrow[good]:
            good += 1
        if good:
            np.copyto(out_[:good], stage[:good])
        t._return_stage(st)
        t._reap_parked()
        for it in items:
            if it.xfer_ok:
                ok = int(okrow[it.wrows].sum())
                it.leg.nbytes += ok * P
                p = t._peers[it.pid]
                nb = sum(1 for r in it.wrows if r < good) * P
                p.c["bytes_read"] += nb
                p.c["pages_read"] += nb // P
                if it.relay:
                    t.c["relay_pages_read"] += nb // P
            if it.lease:
                t._send_oneway(it.pid, MsgType.RELEASE, {"lease": it.lease, "drop": drops.get(id(it), [])})
        dt = max(t1 - t0, 1e-9)
        if good:
            t.c["read_s"] += dt
            t.c["bytes_read"] += good * P
            t._last_bw = good * P / dt / 1e9
        t.c["hits"] += good
        t.c["misses"] += n - good
        return good

    def _finish_put(self, items, present, n, P, st, t0, t1) -> int:
        t = self.t
        t._return_stage(st)
        t._reap_parked()
        wrote = 0
        for it in items:
            if it.state == _DONE and it.xfer_ok:
                k = int(present[it.wrows].sum())
                wrote += k
                p = t._peers[it.pid]
                p.c["bytes_written"] += k * P
                p.c["pages_written"] += k
                if it.relay:
                    t.c["relay_pages_written"] += k
        if wrote:
            t.c["write_s"] += max(t1 - t0, 1e-9)
            t.c["bytes_written"] += wrote * P
            t.c["pages_written"] += wrote
        k = 0
        while k < n and present[k]:
            k += 1
        return k

    def _report(self, op: str, legs: List[Leg], t0: float, P: int) -> None:
        t = self.t
        self.last = []
        for leg in legs:
            secs = leg.t_end - t0 if leg.t_end else 0.0
            if leg.ticket is not None:  # release the leg, report it (bytes already went to report_progress)
                leg.ticket.leg_done(leg.sub, leg.nbytes, max(secs, 0.0), links=leg.links, relays=leg.relays,
                                    progress_reported=True, report=bool(leg.nbytes and secs > 0 and not leg.cold))
            if leg.relays and leg.nbytes and secs > 0:
                p = t._peers[leg.via]
                p.bw_gbps = 0.7 * p.bw_gbps + 0.3 * leg.nbytes / secs / 1e9 if p.bw_gbps else leg.nbytes / secs / 1e9
            self.last.append({
                "op": op, "owner": t._peers[leg.owner].addr,
                "via": t._peers[leg.via].addr if leg.relays else None,
                "type": "CrossNodeRelay" if leg.relays else "Direct", "planned": leg.planned,
                "decision": leg.decision, "note": leg.note, "pages": len(leg.rows), "bytes": leg.nbytes,
                "seconds": round(secs, 6), "links": list(leg.links), "cold": leg.cold})
