"""Path-selector routing for the remote tier: Direct, CrossNodeRelay and SplitPath execution.

`RemoteTier(..., selector=sel, local_node="n0", peer_nodes={"host:port": "n2", ...})` hands every
get/put batch to `Router`. Per owning peer the router asks `sel.select(TransferRequest(src, dst,
pages * page_nbytes))` (get: owner -> local_node; put: local_node -> owner) and executes the
decision's legs:

* Direct: LOOKUP/PUT at the owner, NIXL READ/WRITE from/to the owner (as without a selector).
* CrossNodeRelay: the first intermediate node of the leg that maps to a configured peer (an owner
  or a relay-only peer) is the relay. Get: RELAY_GET to the relay (it pulls from the owner into
  temporary slots), READ from the relay, RELEASE. Put: RELAY_PUT to the relay, WRITE to it,
  COMMIT (the relay checks the page hashes and forwards to the owner before answering). A leg is cut into
  chunks of `relay_chunk_bytes` (the selector's relay model) and every chunk request is sent at
  once: the relay pulls chunk i+1 while the client reads chunk i (gets); puts keep one WRITE in
  flight per relay, so chunk i is forwarded while chunk i+1 is written.
* SplitPath: the owner's rows are cut in proportion to the legs' bytes, each leg executed as
  above, all legs concurrently. StorageRelay and NVLinkRelay have no executor here (a tier server
  is not a storage relay, and a GPU bounce does not apply to host-tier rows): `RemoteTier.route_with`
  hands the router a selector that never returns them (`PathSelector.without(*UNEXECUTED_TYPES)`).

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

from ..topology.graph import PathType
from .base import page_digests
from .wire import Frame, MsgType, WireError, int_list, pack_keys, read_frame, write_frame

log = logging.getLogger("flexflow_sglang.tiers.remote")

# An item's progress (_Item.state): awaiting its reply, transfer postable, transfer posted,
# awaiting COMMIT_OK (puts), done; or failed (a miss for its rows).
_FAILED, _REPLY, _READY, _XFER, _COMMIT, _DONE = -1, 0, 1, 2, 3, 4

#: path types the router cannot carry out; its selector is built without them (RemoteTier.route_with)
UNEXECUTED_TYPES = frozenset({PathType.StorageRelay, PathType.NVLinkRelay})

_ROUTE_COUNTER = {"Direct": "direct", "CrossNodeRelay": "relay", "SplitPath": "split"}  # stats route_*


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
    """One request on a peer's control channel (a relayed leg is cut into one item per chunk) and
    the NIXL transfer it leads to."""
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
    wrows: List[int] = field(default_factory=list)  # rows transferred (get: the pages found; put: those to write)
    handle: object = None
    posted: str = "PROC"   # what posting the transfer returned
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


def _leading_run(mask: np.ndarray) -> int:
    """Length of the leading run of True in `mask` (the prefix a call can count)."""
    k = 0
    while k < len(mask) and mask[k]:
        k += 1
    return k


class Router:
    """Plans and runs the legs of a RemoteTier's get/put batches (module docstring). It keeps what
    outlives one call (the selector, the transfer engine, peer nodes, cached direct routes, the
    legs of the last call); one `_RoutedBatch` per call does the work. It uses only the tier's
    public interface (RemoteTier's class docstring), under the tier's lock."""

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
        """Peer `pid`'s topology node (configured, else from its HELLO_OK); None outside the topology."""
        p = self.t.peer(pid)
        n = self.peer_nodes.get(p.addr) or p.node
        return n if n in self.sel.topology.nodes else None

    def direct_links(self, src: str, dst: str) -> Tuple[int, ...]:
        """Links of the direct route src -> dst (cached); () when the selector knows none."""
        key = (src, dst)
        if key not in self._direct_links:
            from ..selector.types import TransferRequest
            try:
                self._direct_links[key] = tuple(self.sel.always_direct(TransferRequest(src, dst, 1)).subpaths[0].links)
            except Exception as e:  # any selector (or a stub) may lack the route: the leg runs without feedback
                log.debug("remote tier: no direct route %s -> %s (%r); leg not reported", src, dst, e)
                self._direct_links[key] = ()
        return self._direct_links[key]

    def relay_usable(self, pid: int, now: float) -> bool:
        p = self.t.peer(pid)
        return p.up(now) and p.relay_cap != 0 and now >= p.relay_unsup_until

    def _relay_pid(self, nodes, owner: int, now: float) -> Optional[int]:
        """The first usable peer on an intermediate node of a relay path (only one hop is executed)."""
        for node in nodes[1:-1]:
            for pid in self.t.peer_ids():
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
            legs += self._plan_owner(op, pid, idx, P, now, tickets)
        return legs

    def _plan_owner(self, op: str, pid: int, idx: List[int], P: int, now: float, tickets: list) -> List[Leg]:
        """The legs that move owner `pid`'s rows `idx`: one per subpath that gets rows."""
        own = self.node_of(pid)
        if own is None or own == self.local:
            return [Leg(pid, pid, list(idx), (), 0, "Direct", "none", "owner not in the topology")]
        src, dst = (own, self.local) if op == "get" else (self.local, own)
        tk = self.engine.open(src, dst, len(idx) * P)
        tickets.append(tk)
        if tk.decision is None:
            log.debug("remote tier: no decision for %s -> %s", src, dst)
            return [Leg(pid, pid, list(idx), self.direct_links(src, dst), 0, "Direct", "none", "no decision",
                        ticket=tk)]
        subs = tk.subpaths
        chosen = tk.decision.chosen_type.value
        self.t.c["route_" + _ROUTE_COUNTER.get(chosen, "other")] += 1
        legs, pos = [], 0
        for i, (sub, cnt) in enumerate(zip(subs, _shares(len(idx), [s.nbytes for s in subs]))):
            if cnt:  # the first rows go to the first subpath
                legs.append(self._subpath_leg(pid, list(idx[pos:pos + cnt]), tk, i, sub, chosen, (src, dst), now, P))
                pos += cnt
        return legs

    def _subpath_leg(self, pid: int, rows: List[int], tk, i: int, sub, chosen: str, ends: Tuple[str, str],
                     now: float, P: int) -> Leg:
        """Subpath `sub` (number i of ticket `tk`) as a leg: a relay through a usable peer, else
        direct (and then its reservation moves to the direct links it really uses)."""
        typ = sub.type.value
        if typ == "CrossNodeRelay":
            r = self._relay_pid(sub.nodes, pid, now)
            if r is not None:
                return Leg(pid, r, rows, tuple(sub.links), 1, typ, chosen, ticket=tk, sub=i)
            note = "no usable relay peer"
            self.t.c["relay_fallbacks"] += 1
        else:
            note = "" if typ == "Direct" else f"{typ} run as Direct"
        links = tuple(sub.links) if typ == "Direct" else self.direct_links(*ends)
        if links != tuple(sub.links):  # runs direct: hold the links it really uses
            tk.reroute(i, links, len(rows) * P)
        return Leg(pid, pid, rows, links, 0, typ, chosen, note, ticket=tk, sub=i)

    # ------------------------------------------------------------------ execution
    def get(self, keys: List[bytes], out: np.ndarray, owners: List[int], groups: Dict[int, List[int]], P: int) -> int:
        return self._run("get", keys, out, groups, P)

    def put(self, keys: List[bytes], pages: np.ndarray, owners: List[int], groups: Dict[int, List[int]], P: int) -> int:
        return self._run("put", keys, pages, groups, P)

    def _run(self, op: str, keys: List[bytes], data: np.ndarray, groups: Dict[int, List[int]], P: int) -> int:
        tickets: list = []
        try:
            return _RoutedBatch(self, op, keys, data, P).run(groups, tickets)
        finally:
            for tk in tickets:  # whatever is still reserved (a failure before the report)
                tk.close("remote:")


class _RoutedBatch:
    """One routed get/put batch, from its legs to its result.

    The legs are cut into items (a relayed leg into one per chunk), each a request on its peer's
    control channel. An item goes REPLY -> READY (the reply named buffer addresses) -> XFER (its
    NIXL transfer is posted; one per peer at a time) -> DONE, a put's through COMMIT; a failure
    sets FAILED, a miss for its rows. Every peer progresses in one select loop, and every reply and
    transfer has the tier's timeout: a slow peer or relay costs a miss, never a hang."""

    def __init__(self, router: Router, op: str, keys: List[bytes], data: np.ndarray, P: int):
        self.r, self.t = router, router.t
        self.op, self.keys, self.data, self.P = op, keys, data, P  # data: a get's `out`, a put's pages
        self.n = len(keys)
        self.timeout = self.t.timeout_s
        self.xop = "READ" if op == "get" else "WRITE"
        self.legs: List[Leg] = []
        self.items: List[_Item] = []
        self.fallbacks: Dict[int, Leg] = {}    # id(relayed leg) -> the direct leg that took over rows of it
        self.sums: Optional[List[int]] = None  # put: the pages' 64-bit hashes
        self.st = None                         # the tier's StagingBuffer, taken in _prepare
        self.stage: Optional[np.ndarray] = None  # its first n rows: row i stages key i
        self.present = np.zeros(self.n, dtype=bool)  # put: held by the owner afterwards
        self.pend: Dict[int, deque] = {}       # pid -> items awaiting a reply, in send order
        self.last_rx: Dict[int, float] = {}    # pid -> its last reply (the next reply's deadline runs from it)
        self.ready: Dict[int, deque] = {}      # pid -> items whose transfer can be posted
        self.inflight: Dict[int, _Item] = {}   # pid -> its posted transfer
        self.live: List[_Item] = []            # posted transfers not yet ended or parked
        self.t0 = 0.0                          # legs are timed from here (feedback to the NodeAgent)

    def run(self, groups: Dict[int, List[int]], tickets: list) -> int:
        self._prepare(groups, tickets)
        try:
            for it in self.items:
                self._send_request(it)
            while self._step():
                pass
        finally:
            for it in self.live:  # only on an exception: park what still runs
                self.t.park(it.handle, self.st, it.pid, counted=False)
        t1 = time.monotonic()
        good = self._finish_get(t1) if self.op == "get" else self._finish_put(t1)
        self._report()
        return good

    def _step(self) -> bool:
        """One round of the event loop; False once nothing is outstanding."""
        self._expire_replies(time.monotonic())
        self._post_ready()
        if self.live:
            self._poll()
        socks = {self.t.peer(pid).sock: pid for pid, q in self.pend.items() if q and self.t.peer(pid).connected}
        busy = bool(self.live) or any(self.ready.values())
        if not socks and not busy:
            return False
        wait = 0.001 if busy else 0.02  # a posted transfer is polled, not waited for
        if socks:
            self._read_replies(socks, wait)
        else:
            time.sleep(wait)
        return True

    # ------------------------------------------------------------------ before the clock starts
    def _prepare(self, groups: Dict[int, List[int]], tickets: list) -> None:
        """Plan the legs, connect their peers, cut the items, take the staging buffer: whatever
        pays setup happens here, before the legs' clock starts; legs that still paid it are cold."""
        t, P = self.t, self.P
        start = time.monotonic()
        self._learn_peer_nodes(start)
        self.legs = self.r.plan(self.op, groups, P, tickets)
        cold = {pid for pid in t.peer_ids() if t.first_contact(pid)}
        t.connect(sorted({leg.via for leg in self.legs}), P, start + self.timeout)
        self._run_disabled_relays_direct()
        self._connect_fallback_owners()
        self._cut_items()
        if self.op == "put":
            self.sums = page_digests(self.data, self.n)
        self.st = t.acquire_stage(self.n * P)  # creates the NIXL agent on first use: before the clock starts
        self.stage = self.st.arr[:self.n * P].reshape(self.n, P)
        cold |= {pid for pid in t.peer_ids() if not t.has_metadata(pid)}  # loaded at the first transfer
        for leg in self.legs:
            leg.cold = leg.via in cold
        self.t0 = time.monotonic()

    def _learn_peer_nodes(self, now: float) -> None:
        """Peers whose topology node is not configured say it in their HELLO_OK: connect them
        before planning (once: the node is kept across reconnects)."""
        unknown = []
        for pid in self.t.peer_ids():
            p = self.t.peer(pid)
            if p.addr not in self.r.peer_nodes and p.node is None and not p.connected and p.up(now):
                unknown.append(pid)
        if unknown:
            self.t.connect(unknown, self.P, now + self.timeout)

    def _run_disabled_relays_direct(self) -> None:
        """A relay whose HELLO_OK said "relay": 0 (--no-relay) is never asked: its rows go direct."""
        for leg in list(self.legs):
            p = self.t.peer(leg.via)
            if leg.relays and p.connected and p.relay_cap == 0:
                f = self._fallback(leg, "relay disabled on that server")
                f.rows, leg.rows = f.rows + leg.rows, []

    def _connect_fallback_owners(self) -> None:
        """Fallback legs go to owners that the plan may not have connected."""
        t = self.t
        missing = sorted({leg.via for leg in self.legs
                          if leg.rows and not t.peer(leg.via).connected and t.peer(leg.via).up(time.monotonic())})
        if missing:
            t.connect(missing, self.P, time.monotonic() + self.timeout)

    def _cut_items(self) -> None:
        """Relayed legs first, so their relays' pulls from the owners overlap the rest; a relayed
        leg in chunks of relay_chunk_bytes (the relay pulls chunk i+1 while we read chunk i)."""
        per = max(1, self.r.chunk_bytes // self.P)
        for leg in sorted(self.legs, key=lambda leg: -leg.relays):
            if not leg.rows or not self.t.peer(leg.via).connected:
                continue
            step = per if leg.relays else len(leg.rows)
            for c in range(0, len(leg.rows), step):
                self.items.append(_Item(leg, leg.via, leg.rows[c:c + step], bool(leg.relays)))

    def _fallback(self, leg: Leg, why: str) -> Leg:
        """The direct leg (owner <-> us) that takes over rows a relay of `leg` cannot carry; one
        per relayed leg, created on first use."""
        f = self.fallbacks.get(id(leg))
        if f is None:
            r = self.r
            own = r.node_of(leg.owner)
            links = ()
            if own is not None:
                links = r.direct_links(own, r.local) if self.op == "get" else r.direct_links(r.local, own)
            f = self.fallbacks[id(leg)] = Leg(leg.owner, leg.owner, [], links, 0, leg.planned, leg.decision, why,
                                              ticket=leg.ticket)
            self.legs.append(f)
            self.t.c["relay_fallbacks"] += 1
        return f

    # ------------------------------------------------------------------ control channel
    def _request(self, it: _Item) -> Tuple[MsgType, dict, bytes]:
        """The first request of an item: LOOKUP(pin) / PUT at the owner, RELAY_GET / RELAY_PUT at a relay."""
        klen, blob = pack_keys([self.keys[i] for i in it.rows])
        body = {"klen": klen, "n": len(it.rows)}
        if self.op == "put":
            body["sums"] = [self.sums[i] for i in it.rows]
        if it.relay:
            body.update(owner=self.t.peer(it.leg.owner).addr, owner_node=self.r.node_of(it.leg.owner),
                        timeout_ms=self.t.timeout_s * 1000.0)
            return (MsgType.RELAY_GET if self.op == "get" else MsgType.RELAY_PUT), body, blob
        if self.op == "get":
            body["pin"] = True
            return MsgType.LOOKUP, body, blob
        return MsgType.PUT, body, blob

    def _send_request(self, it: _Item) -> None:
        it.state = _REPLY
        self._send(it, *self._request(it))

    def _send(self, it: _Item, mtype: MsgType, body: dict, blob: bytes) -> bool:
        """Send a frame for `it`, which then awaits its reply; a failed send fails its peer."""
        p = self.t.peer(it.pid)
        if not p.connected:
            it.state = _FAILED
            return False
        try:
            write_frame(p.sock, mtype, body, blob, deadline=time.monotonic() + self.timeout)
        except TimeoutError:
            self._fail_peer(it.pid, "control channel send timed out", True)
            it.state = _FAILED
            return False
        except (OSError, WireError) as e:
            self._fail_peer(it.pid, f"control channel: {e}")
            it.state = _FAILED
            return False
        it.sent = time.monotonic()
        self.pend.setdefault(it.pid, deque()).append(it)
        return True

    def _fail_peer(self, pid: int, reason: Optional[str], timed_out: bool = False) -> None:
        """Mark `pid` down (unless `reason` is None: already done) and fail what waits on it."""
        if reason is not None:
            self.t.mark_down(pid, reason, timeout=timed_out)
        for it in list(self.pend.pop(pid, ())) + list(self.ready.pop(pid, ())):
            it.state = _FAILED
        cur = self.inflight.get(pid)
        if cur is not None:
            cur.state = _FAILED  # its handle stays in `live` until it ends or is parked

    def _expire_replies(self, now: float) -> None:
        """A reply is due timeout after its request, or after the previous reply on that channel
        (a relay answers its chunks one after another)."""
        for pid, q in list(self.pend.items()):
            if q and now > max(q[0].sent, self.last_rx.get(pid, 0.0)) + self.timeout:
                self._fail_peer(pid, "control channel timed out", True)

    def _read_replies(self, socks: Dict[object, int], wait: float) -> None:
        try:
            r, _, _ = select.select(list(socks), [], [], wait)
        except (OSError, ValueError):
            r = list(socks)  # a closed socket: read_frame reports it
        for s in r:
            pid = socks[s]
            if self.pend.get(pid):
                self._on_frame(pid)

    def _read_frame(self, pid: int) -> Optional[Frame]:
        try:
            return read_frame(self.t.peer(pid).sock, time.monotonic() + self.timeout)
        except TimeoutError:
            self._fail_peer(pid, "control channel timed out", True)
        except (OSError, WireError) as e:
            self._fail_peer(pid, f"control channel: {e}")
        return None

    def _on_frame(self, pid: int) -> None:
        """Take the reply to the oldest request outstanding on `pid`'s channel."""
        it = self.pend[pid][0]
        f = self._read_frame(pid)
        if f is None:
            return
        self.pend[pid].popleft()
        now = time.monotonic()
        self.last_rx[pid] = now
        if f.type == MsgType.ERROR and it.relay and it.state == _REPLY:
            self._relay_unsupported(pid, it, str(f.body.get("error")))
            return
        if f.type != self._expected_reply(it):
            msg = f.body.get("error") if f.type == MsgType.ERROR else f"unexpected {f.type.name}"
            it.state = _FAILED
            self._fail_peer(pid, f"server: {msg}")
            return
        if it.relay:
            self._note_relay_reply(pid, it, f)
        try:
            self._take_reply(it, f, now)
        except WireError as e:
            it.state = _FAILED
            self._fail_peer(pid, f"bad {f.type.name}: {e}")

    def _expected_reply(self, it: _Item) -> MsgType:
        if it.state == _COMMIT:
            return MsgType.COMMIT_OK
        if self.op == "get":
            return MsgType.RELAY_GET_OK if it.relay else MsgType.LOOKUP_OK
        return MsgType.RELAY_PUT_OK if it.relay else MsgType.PUT_OK

    def _note_relay_reply(self, pid: int, it: _Item, f: Frame) -> None:
        if f.body.get("cold"):  # the relay connected to the owner first: no bandwidth sample
            it.leg.cold = True
        if f.body.get("error"):  # e.g. the owner is unreachable from the relay: its rows are a miss
            self.t.c["relay_failures"] += 1
            log.warning("remote tier: relay %s: %s", self.t.peer(pid).addr, f.body.get("error"))

    def _take_reply(self, it: _Item, f: Frame, now: float) -> None:
        """Apply a well-typed reply to `it` (WireError: its body is malformed)."""
        if it.state == _COMMIT:
            self._take_commit_ok(it, f, now)
            return
        if self.op == "get":
            self._take_lookup_ok(it, f)
        else:
            self._take_put_ok(it, f)
        if it.wrows:
            it.state = _READY
            self.ready.setdefault(it.pid, deque()).append(it)
        else:
            it.state = _DONE

    def _take_lookup_ok(self, it: _Item, f: Frame) -> None:
        """LOOKUP_OK / RELAY_GET_OK: the leading `count` rows are pinned at `addrs`, with their page hashes."""
        c = f.body.get("count")
        c = max(0, min(len(it.rows), c)) if isinstance(c, int) else 0
        it.addrs, it.sums = int_list(f.body, "addrs")[:c], int_list(f.body, "sums")[:c]
        if len(it.addrs) < c or len(it.sums) < c:
            raise WireError("lists are short")
        it.count, it.lease = c, f.body.get("lease") or 0
        it.wrows = it.rows[:c]

    def _take_put_ok(self, it: _Item, f: Frame) -> None:
        """PUT_OK / RELAY_PUT_OK: per row 1 have, 0 write (to the next address), -1 skip; the rows
        to write are copied to staging now."""
        status = int_list(f.body, "status", len(it.rows))
        it.addrs = int_list(f.body, "addrs")
        it.wrows = [r for r, s_ in zip(it.rows, status) if s_ == 0]
        if len(it.wrows) != len(it.addrs):
            raise WireError("address count")
        for r, s_ in zip(it.rows, status):
            if s_ == 1:
                self.present[r] = True
        it.lease = f.body.get("lease") or 0
        for r in it.wrows:
            self.stage[r] = self.data[r]

    def _take_commit_ok(self, it: _Item, f: Frame, now: float) -> None:
        stored = int_list(f.body, "stored")
        for r, s_ in zip(it.wrows, stored):
            if s_:
                self.present[r] = True
                it.leg.nbytes += self.P
        it.leg.t_end = now
        it.state = _DONE

    def _relay_unsupported(self, pid: int, it: _Item, msg: str) -> None:
        """`pid` answered a RELAY_* request with ERROR: a server that predates relaying (it closes
        after its ERROR). It is not asked to relay for retry_after_s, but not marked down; the
        requests that were waiting on it are sent again, direct."""
        t = self.t
        p = t.peer(pid)
        p.relay_unsup_until = time.monotonic() + t.retry_after_s
        t.c["relay_unsupported"] += 1
        log.warning("remote tier: peer %s does not relay (%s); direct for %.0f s", p.addr, msg, t.retry_after_s)
        taken = [it] + list(self.pend.pop(pid, ()))
        p.close()  # a server that predates RELAY_* closes after its ERROR; reconnect lazily
        redo = []
        for x in taken:
            if x.state != _REPLY:
                x.state = _FAILED  # it awaited COMMIT_OK on the channel just closed: a miss
            else:
                redo.append(self._direct_item(x))
        need = sorted({x.pid for x in redo if not t.peer(x.pid).connected})
        if need:
            t.connect(need, self.P, time.monotonic() + self.timeout)
        for x in redo:
            self.items.append(x)
            self._send_request(x)

    def _direct_item(self, x: _Item) -> _Item:
        """`x` again, direct: a relayed item's rows move to its owner's fallback leg."""
        if not x.relay:
            return _Item(x.leg, x.pid, x.rows, False)
        f = self._fallback(x.leg, "relay unsupported")
        f.rows = sorted(f.rows + x.rows)
        moved = set(x.rows)
        x.leg.rows = [r for r in x.leg.rows if r not in moved]
        return _Item(f, f.via, x.rows, False)

    # ------------------------------------------------------------------ data transfers
    def _post_ready(self) -> None:
        for pid, q in list(self.ready.items()):
            if q and pid not in self.inflight:  # one transfer per peer at a time
                self._post(q.popleft())

    def _post(self, it: _Item) -> None:
        t, pid = self.t, it.pid
        h = t.init_transfer(self.xop, pid, self.st, it.wrows, it.addrs, self.P)
        if h is None:  # the tier marked the peer down
            self._fail_peer(pid, None)
            it.state = _FAILED
            return
        it.handle, it.state = h, _XFER
        it.xdeadline = time.monotonic() + self.timeout
        self.inflight[pid] = it
        self.live.append(it)
        it.posted = t.post_transfer(h)
        agent = self.r.agent
        if agent is not None and it.leg.links:
            try:  # our bytes, reported before they hit the wire: sampled counters subtract them
                agent.report_progress(it.leg.links, len(it.wrows) * self.P)
            except Exception as e:  # feedback is advisory: a failing NodeAgent never fails a transfer
                log.debug("report_progress: %r", e)

    def _poll(self) -> None:
        now = time.monotonic()
        for it in list(self.live):
            self._poll_one(it, now)

    def _poll_one(self, it: _Item, now: float) -> None:
        state = it.posted
        if state == "PROC":
            state = self.t.transfer_state(it.handle)
        if state == "PROC":
            if now >= it.xdeadline:
                self._park_timed_out(it)
            return
        self.t.release_transfer(it.handle)
        self._retire(it)
        if it.state == _FAILED:  # its peer failed meanwhile: a miss
            return
        if state != "DONE":
            it.state = _FAILED
            self._fail_peer(it.pid, f"NIXL {self.xop} failed")
            return
        it.xfer_ok = True
        if self.op == "get":
            it.leg.t_end = now
            it.state = _DONE
        else:  # the owner (or the relay, after forwarding) stores the pages at COMMIT
            it.state = _COMMIT
            self._send(it, MsgType.COMMIT, {"lease": it.lease, "ok": [1] * len(it.wrows)}, b"")

    def _park_timed_out(self, it: _Item) -> None:
        self.t.park(it.handle, self.st, it.pid)  # still running: never release or free under it
        self._retire(it)
        it.state = _FAILED
        self._fail_peer(it.pid, f"NIXL {self.xop} timed out after {self.timeout * 1000:.0f} ms", True)

    def _retire(self, it: _Item) -> None:
        self.live.remove(it)
        if self.inflight.get(it.pid) is it:
            del self.inflight[it.pid]

    # ------------------------------------------------------------------ results
    def _finish_get(self, t1: float) -> int:
        """Verify the staged pages, copy the verified leading run to `out`, RELEASE the leases
        (with the pages that failed, which the server drops) and count."""
        t, P, n = self.t, self.P, self.n
        okrow, drops = self._verify_staged()
        good = _leading_run(okrow)
        if good:
            np.copyto(self.data[:good], self.stage[:good])
        t.release_stage(self.st)
        t.reap_parked()
        for it in self.items:
            if it.xfer_ok:
                self._count_item_read(it, okrow, good)
            if it.lease:
                t.send_oneway(it.pid, MsgType.RELEASE, {"lease": it.lease, "drop": drops.get(id(it), [])})
        dt = max(t1 - self.t0, 1e-9)
        if good:
            t.c["read_s"] += dt
            t.c["bytes_read"] += good * P
            t.last_bandwidth_gbps = good * P / dt / 1e9
        t.c["hits"] += good
        t.c["misses"] += n - good
        return good

    def _verify_staged(self) -> Tuple[np.ndarray, Dict[int, List[int]]]:
        """(row verified, id(item) -> indices of its pages that failed their page hash)."""
        okrow = np.zeros(self.n, dtype=bool)
        drops: Dict[int, List[int]] = {}
        for it in self.items:
            if not it.xfer_ok:
                continue
            got = page_digests(self.stage, len(it.wrows), it.wrows)
            for j, r in enumerate(it.wrows):
                if got[j] == it.sums[j]:
                    okrow[r] = True
                else:
                    self.t.c["corrupt_dropped"] += 1
                    drops.setdefault(id(it), []).append(j)
                    log.warning("remote tier: page from %s failed its checksum; dropped", self.t.peer(it.pid).addr)
        return okrow, drops

    def _count_item_read(self, it: _Item, okrow: np.ndarray, good: int) -> None:
        P = self.P
        it.leg.nbytes += int(okrow[it.wrows].sum()) * P
        p = self.t.peer(it.pid)
        nb = sum(1 for r in it.wrows if r < good) * P
        p.c["bytes_read"] += nb
        p.c["pages_read"] += nb // P
        if it.relay:
            self.t.c["relay_pages_read"] += nb // P

    def _finish_put(self, t1: float) -> int:
        """Count what the owners stored; returns the leading keys they hold."""
        t, P = self.t, self.P
        t.release_stage(self.st)
        t.reap_parked()
        wrote = 0
        for it in self.items:
            if it.state == _DONE and it.xfer_ok:
                k = int(self.present[it.wrows].sum())
                wrote += k
                p = t.peer(it.pid)
                p.c["bytes_written"] += k * P
                p.c["pages_written"] += k
                if it.relay:
                    t.c["relay_pages_written"] += k
        if wrote:
            t.c["write_s"] += max(t1 - self.t0, 1e-9)
            t.c["bytes_written"] += wrote * P
            t.c["pages_written"] += wrote
        return _leading_run(self.present)

    def _report(self) -> None:
        """Release and report each leg on its ticket (a cold leg's time is mostly setup: not a
        bandwidth sample); record the legs in the router's `last`."""
        t = self.t
        last = self.r.last = []
        for leg in self.legs:
            secs = leg.t_end - self.t0 if leg.t_end else 0.0
            if leg.ticket is not None:  # release the leg, report it (bytes already went to report_progress)
                leg.ticket.leg_done(leg.sub, leg.nbytes, max(secs, 0.0), links=leg.links, relays=leg.relays,
                                    progress_reported=True, report=bool(leg.nbytes and secs > 0 and not leg.cold))
            if leg.relays and leg.nbytes and secs > 0:
                t.peer(leg.via).note_bandwidth(leg.nbytes / secs / 1e9)
            last.append({
                "op": self.op, "owner": t.peer(leg.owner).addr,
                "via": t.peer(leg.via).addr if leg.relays else None,
                "type": "CrossNodeRelay" if leg.relays else "Direct", "planned": leg.planned,
                "decision": leg.decision, "note": leg.note, "pages": len(leg.rows), "bytes": leg.nbytes,
                "seconds": round(secs, 6), "links": list(leg.links), "cold": leg.cold})
