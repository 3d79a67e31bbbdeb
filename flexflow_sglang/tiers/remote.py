"""Remote tier: other nodes' tier servers, reached over a TCP control channel, data by NIXL UCX.

Keys are placed by rendezvous hashing over the peers (a down peer's keys go to their second
choice and come back when it returns); one call talks to all owners at once and combines their
leading counts. Every call is bounded (timeout_ms for the control round trip, another for the
data); a peer that misses a deadline or misbehaves is a miss for the call and is skipped for
retry_after_s. Transfers use this tier's registered staging buffer, never the caller's memory:
a timed-out UCX transfer cannot be cancelled (measured), so it is parked with its buffer until it
ends. Pages are checked (the 64-bit page hash, or a keyed MAC in shared-secret mode) before they count. With a
selector, routing.py executes Direct / CrossNodeRelay / Split legs. docs/tiers.md has the details
and the measurements behind each rule.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .base import (KVTier, as_pages, check_keys, lookups_must_not_wait, make_agent, page_digests, post_xfer,
                   rendezvous_rank, unique_agent_name, wait_xfers)
from .remote_peers import Peer, StagingBuffer, _Pinned
from .trust import MAC_LEN, FrameAuth, PageMac
from .wire import (MAX_KEYS_PER_FRAME, Frame, MsgType, WireError, int_list, pack_keys, read_frame,
                   write_frame)

log = logging.getLogger("flexflow_sglang.tiers.remote")


class RemoteTier(KVTier):
    """KVTier over other nodes' tier servers (module docstring: placement, failures, parking).

    Besides the tier protocol, a small interface for the Router (tiers/routing.py) and the relay
    server (tiers/relay_server.py), which drive transfers of their own through this tier's peers,
    NIXL agent and staging buffers. All of it expects `lock` to be held:
      * peers: `peer(pid)`, `peer_ids()`, `connect(pids, page_nbytes, deadline)`, `mark_down(pid,
        reason, timeout)`, `send_oneway(pid, type, body)`;
      * NIXL: `ensure_agent()`, `load_metadata(pid)`, `has_metadata(pid)`, `first_contact(pid)`,
        `init_transfer(...)` / `post_transfer(h)` / `transfer_state(h)` / `release_transfer(h)`;
      * staging: `acquire_stage(nbytes)` / `release_stage(stage)`, `park(handle, stage, pid)` for
        a transfer that outlived its deadline, `reap_parked()`;
      * counters: `c`, `last_bandwidth_gbps` (what stats() reports as bandwidth_gbps).
    """

    name = "remote"

    def __init__(self, peers: Sequence[str], timeout_ms: float = 2000.0, retry_after_s: float = 10.0,
                 node: Optional[str] = None, client_name: str = "ffremote", max_parked_mb: float = 1024.0,
                 selector=None, local_node: Optional[str] = None, peer_nodes: Optional[Dict[str, str]] = None,
                 relay_peers: Sequence[str] = (), relay_chunk_bytes: Optional[int] = None,
                 secret: Optional[bytes] = None):
        """`node`: the topology node where the bytes live (what the connector routes tier I/O to).
        Routing: `selector` (a PathSelector; its `agent` gets the per-leg feedback), `local_node`
        (this process's topology node), `peer_nodes` ({"host:port": node}; default: the node a
        server names in HELLO_OK), `relay_peers` (servers used only as relays, never owners)."""
        if isinstance(peers, str):
            peers = [x.strip() for x in peers.split(",") if x.strip()]
        if isinstance(relay_peers, str):
            relay_peers = [x.strip() for x in relay_peers.split(",") if x.strip()]
        self._peers = []
        for p in peers:
            if p not in [q.addr for q in self._peers]:
                self._peers.append(Peer(p))
        self._addrs = [p.addr for p in self._peers]  # placement is over these only
        for p in relay_peers:
            if p not in [q.addr for q in self._peers]:
                self._peers.append(Peer(p))
        self.timeout_s = float(timeout_ms) / 1000.0
        self.retry_after_s = float(retry_after_s)
        self.node = node or (self._peers[0].host if self._peers else "remote")
        self._client_name = client_name
        self.lock = threading.RLock()  # serializes every call, its NIXL calls and the interface above
        self._closed = False
        self._agent = None
        self._gen = 0
        self._loaded: set = set()
        self._idle_stage: Optional[StagingBuffer] = None
        self._parked: List[Tuple[object, "StagingBuffer", int]] = []  # (xfer handle, its staging, pid)
        self.max_parked_bytes = int(max_parked_mb * (1 << 20))
        self._before_data_phase: Optional[Callable[[str], None]] = None  # test hook
        self.c = dict(hits=0, misses=0, bytes_read=0, bytes_written=0, pages_written=0, timeouts=0,
                      peer_down=0, failures=0, corrupt_dropped=0, parked_transfers=0, agent_recycles=0,
                      read_s=0.0, write_s=0.0, lookups_busy=0)
        self.last_bandwidth_gbps = 0.0  # verified read bandwidth of the last get that hit
        self._router = None
        self._secret = secret
        self._pagemac = PageMac(secret) if secret else None
        if selector is not None:
            self.route_with(selector, local_node, peer_nodes, relay_chunk_bytes)

    def route_with(self, selector, local_node: Optional[str], peer_nodes: Optional[Dict[str, str]] = None,
                   relay_chunk_bytes: Optional[int] = None, engine=None) -> bool:
        """Route every batch with `selector` (tiers/routing.py) from now on; `engine`: the transfer
        engine whose tickets select, reserve and report (the connector's, in serving). False (and
        direct transfers) in shared-secret mode."""
        if self._secret:
            log.warning("remote tier: routing is not available in shared-secret mode; transfers go direct")
            return False
        if not local_node or local_node not in selector.topology.nodes:
            raise ValueError(f"RemoteTier: a selector needs local_node, a node of its topology (got {local_node!r})")
        from .routing import Router, UNEXECUTED_TYPES
        missing = UNEXECUTED_TYPES - getattr(selector, "exclude_types", frozenset())
        if missing and hasattr(selector, "without"):
            # the router has no executor for these: the selector must not offer them (issue 13)
            selector = selector.without(*missing)
        with self.lock:
            self._router = Router(self, selector, local_node, peer_nodes, relay_chunk_bytes, engine=engine)
            for k in ("route_direct", "route_relay", "route_split", "route_other", "relay_fallbacks",
                      "relay_unsupported", "relay_failures", "relay_pages_read", "relay_pages_written"):
                self.c.setdefault(k, 0)
        return True

    @property
    def last_routes(self) -> List[dict]:
        """Legs of the last routed get/put: owner, via, type, planned, decision, pages, bytes, seconds."""
        return list(self._router.last) if self._router is not None else []

    # ------------------------------------------------------------------ peers, agent, staging
    def node_for(self, key: bytes) -> Optional[str]:
        """The peer address that would serve `key` now (None: no peer is up)."""
        o = self._owners([key])[0]
        return self._peers[o].addr if o >= 0 else None

    def peer(self, pid: int) -> Peer:
        """Peer `pid`: an index into the configured owners, then the relay-only peers."""
        return self._peers[pid]

    def peer_ids(self) -> range:
        """Every peer's pid (owners first, then relay-only peers)."""
        return range(len(self._peers))

    def _owners(self, keys: List[bytes]) -> List[int]:
        now = time.monotonic()
        up = [p.up(now) for p in self._peers]
        out = []
        for k in keys:
            o = -1
            for i in rendezvous_rank(k, self._addrs):
                if up[i]:
                    o = i
                    break
            out.append(o)
        return out

    def mark_down(self, pid: int, reason: str, timeout: bool = False) -> None:
        """Close peer `pid` and skip it for retry_after_s (logged once per outage); `timeout`
        counts it as a missed deadline rather than a failure."""
        p = self._peers[pid]
        p.close()
        if timeout:
            p.c["timeouts"] += 1
            self.c["timeouts"] += 1
        else:
            p.c["failures"] += 1
            self.c["failures"] += 1
        if p.up(time.monotonic()):
            p.c["down_events"] += 1
            self.c["peer_down"] += 1
            log.warning("remote tier: peer %s marked down for %.1f s: %s", p.addr, self.retry_after_s, reason)
        p.down_until = time.monotonic() + self.retry_after_s
        p.down_reason = reason

    def ensure_agent(self):
        """This tier's NIXL agent, created on first use (and after a recycle: a new generation
        whose peers' metadata must be loaded again)."""
        if self._agent is None:
            self._agent = make_agent(unique_agent_name(self._client_name), ["UCX"])
            self._gen += 1
            self._loaded = set()
        return self._agent

    def _recycle_agent(self) -> None:
        """Destroy the NIXL agent (its UCX worker and endpoints die with it), then drop the staging
        buffers. Only when parked transfers pile up, and at close()."""
        if self._agent is None:
            return
        keep = [st for _, st, _ in self._parked] + [self._idle_stage]  # freed only after the agent

        def release_all(parked):  # a function: no loop variable keeps a handle alive past the agent
            for item in parked:
                self.release_transfer(item[0], "release parked transfer at agent recycle")

        release_all(self._parked)
        self._parked = []
        self._idle_stage = None
        self._agent = None  # last reference: the C++ agent (worker, endpoints) is destroyed here
        del keep
        self._loaded = set()
        self.c["agent_recycles"] += 1

    def acquire_stage(self, nbytes: int) -> StagingBuffer:
        """A registered staging buffer of at least `nbytes` (the idle one when big enough); give
        it back with release_stage. Creates the NIXL agent on first use."""
        a = self.ensure_agent()
        st = self._idle_stage
        if st is not None and st.arr.nbytes >= nbytes:
            self._idle_stage = None
            return st
        size = max(nbytes, 4 << 20, st.arr.nbytes * 2 if st is not None else 0)
        if st is not None:
            self._idle_stage = None
            self._drop_stage(st)
        arr = np.empty(size, dtype=np.uint8)
        return StagingBuffer(arr, a.register_memory([(arr.ctypes.data, size, 0, "")], "DRAM"))

    def _drop_stage(self, st: StagingBuffer) -> None:
        if self._agent is not None:
            try:
                self._agent.deregister_memory(st.reg)
            except Exception as e:  # NIXL's nixl*Error types share no base below Exception
                log.debug("deregister_memory: %r", e)  # the buffer is dropped either way

    def release_stage(self, st: StagingBuffer) -> None:
        """Give back a buffer from acquire_stage; kept for reuse unless a parked transfer still
        targets it (then the last parked transfer's end returns it)."""
        if st.users:
            return  # a parked transfer still targets it
        if self._idle_stage is None or self._idle_stage.arr.nbytes < st.arr.nbytes:
            if self._idle_stage is not None:
                self._drop_stage(self._idle_stage)
            self._idle_stage = st
        else:
            self._drop_stage(st)

    def park(self, handle, st: StagingBuffer, pid: int, counted: bool = True) -> None:
        """Keep a transfer that is still running past its deadline, with its staging buffer: it is
        never released or freed under NIXL (module docstring); reap_parked finishes it later.
        `counted`: count it in `parked_transfers` (a timeout, not an exception unwinding a call)."""
        st.users += 1
        self._parked.append((handle, st, pid))
        if counted:
            self.c["parked_transfers"] += 1

    def init_transfer(self, op: str, pid: int, st: StagingBuffer, rows: List[int], addrs: List[int], P: int):
        """A NIXL `op` ("READ" | "WRITE") between staging rows `rows` (pages of P bytes) and peer
        `pid`'s buffer addresses `addrs`, not posted yet (post_transfer). None: the peer's metadata
        or the setup failed, and the peer was marked down."""
        if not self.load_metadata(pid):
            return None
        a = self.ensure_agent()
        base = st.arr.ctypes.data
        try:
            loc = a.get_xfer_descs(np.array([(base + r * P, P, 0) for r in rows], dtype=np.uint64), "DRAM")
            rem = a.get_xfer_descs(np.array([(ad, P, 0) for ad in addrs], dtype=np.uint64), "DRAM")
            return a.initialize_xfer(op, loc, rem, self._peers[pid].agent_name)
        except Exception as e:  # NIXL's nixl*Error types share no base below Exception; mark_down logs it
            self.mark_down(pid, f"NIXL {op} setup: {e!r}")
            return None

    def post_transfer(self, handle) -> str:
        """Post a transfer from init_transfer: "PROC" (running), "DONE" or "ERR"."""
        return post_xfer(self._agent, handle)

    def transfer_state(self, handle) -> str:
        """NIXL state of a posted transfer: "PROC", "DONE" or "ERR" (also when the check fails)."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as e:  # NIXL's nixl*Error types share no base below Exception
            log.debug("check_xfer_state: %r", e)  # a transfer we cannot query has failed
            return "ERR"

    @staticmethod
    def release_transfer(handle, what: str = "release_xfer_handle") -> None:
        """Release an ended transfer's handle; failing to only leaks the handle (logged at debug)."""
        try:
            handle.release()
        except Exception as e:  # NIXL's nixl*Error types share no base below Exception
            log.debug("%s: %r", what, e)

    def reap_parked(self) -> None:
        """Finish parked (timed-out) transfers that have ended since; recycle their buffers."""
        if not self._parked or self._agent is None:
            return
        still = []
        for h, st, pid in self._parked:
            state = self.transfer_state(h)
            if state == "PROC":
                still.append((h, st, pid))
                continue
            self.release_transfer(h, "release parked transfer")
            st.users -= 1
            self.release_stage(st)
        self._parked = still
        parked_bytes = sum(st.arr.nbytes for st in {id(st): st for _, st, _ in still}.values())
        if parked_bytes > self.max_parked_bytes:
            log.warning("remote tier: %d MiB of staging held by transfers to frozen peers; destroying the "
                        "NIXL agent (a peer that resumes later may abort under UCX over TCP)",
                        parked_bytes >> 20)
            self._recycle_agent()

    def connect(self, pids: List[int], P: Optional[int], deadline: float) -> List[int]:
        """Connect + HELLO where needed (pipelined over peers). P=None: any page size (lookups
        before this process stored or loaded anything). Returns the pids usable for P; the others
        were marked down."""
        pending = []
        for pid in pids:
            p = self._peers[pid]
            if p.stale():  # reconnect; the server's agent (metadata) is unchanged
                p.close()
            if p.sock is not None and (P is None or p.page_nbytes):
                continue
            try:
                hello = {"client": self._client_name, "page_nbytes": P or 0}
                if p.sock is None:
                    left = max(0.001, deadline - time.monotonic())
                    s = socket.create_connection((p.host, p.port), timeout=left)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    p.sock = s
                    if self._secret:
                        p.auth = FrameAuth(self._secret, "c")
                        hello["nonce"] = p.auth.nonce.hex()
                write_frame(p.sock, MsgType.HELLO, hello, deadline=deadline, auth=p.auth)
                pending.append(pid)
            except TimeoutError:
                self.mark_down(pid, "connect timed out", timeout=True)
            except (OSError, WireError) as e:
                self.mark_down(pid, f"connect: {e}")
        for pid in pending:
            p = self._peers[pid]
            f = self._recv(pid, deadline, MsgType.HELLO_OK)
            if f is None:
                continue
            try:
                if p.auth is not None and p.auth.nonce:  # the HELLO that opened this connection
                    if f.body.get("cnonce") != p.auth.nonce.hex():
                        raise ValueError("HELLO_OK does not answer our nonce")
                    p.auth.start_session(p.auth.nonce, bytes.fromhex(f.body["nonce"]))
                    p.auth.nonce = b""  # the session is established: later HELLOs carry no nonce
                p.agent_name = str(f.body["agent"])
                p.page_nbytes = int(f.body["page_nbytes"]) or None
                p.node = str(f.body.get("node", p.host))
                p.relay_cap = f.body.get("relay") if isinstance(f.body.get("relay"), int) else None
                p.md = bytes(f.blob)
            except (KeyError, TypeError, ValueError):
                self.mark_down(pid, "bad HELLO_OK")
        usable = []
        for pid in pids:
            p = self._peers[pid]
            if p.sock is None:
                continue
            if P is not None and p.page_nbytes != P:
                self.mark_down(pid, f"page size {p.page_nbytes} != {P}")
                continue
            usable.append(pid)
        return usable

    def load_metadata(self, pid: int) -> bool:
        """Load peer `pid`'s NIXL metadata into our agent (once per agent generation and server
        agent). False: the peer was marked down."""
        a = self.ensure_agent()
        p = self._peers[pid]
        if p.loaded_gen == self._gen and p.agent_name in self._loaded:
            return True
        try:
            if p.agent_name in self._loaded:
                a.remove_remote_agent(p.agent_name)
                self._loaded.discard(p.agent_name)
            name = a.add_remote_agent(p.md)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != p.agent_name:
                raise WireError(f"metadata names agent {name!r}, HELLO said {p.agent_name!r}")
            self._loaded.add(name)
            p.loaded_gen = self._gen
            return True
        except Exception as e:  # NIXL's nixl*Error types or our WireError: logged by mark_down
            self.mark_down(pid, f"NIXL metadata: {e!r}")
            return False

    def has_metadata(self, pid: int) -> bool:
        """Our current NIXL agent has loaded peer `pid`'s metadata."""
        return self._agent is not None and self._peers[pid].loaded_gen == self._gen

    def first_contact(self, pid: int) -> bool:
        """A transfer with peer `pid` now pays setup first: a connection, our NIXL agent or the
        peer's metadata. Its time then says little about the link (no bandwidth feedback)."""
        return self._peers[pid].sock is None or not self.has_metadata(pid)

    def _recv(self, pid: int, deadline: float, expect: MsgType) -> Optional[Frame]:
        p = self._peers[pid]
        if p.sock is None:
            return None
        try:
            # a peer that answered in time is read even when another peer used up the deadline
            f = read_frame(p.sock, max(deadline, time.monotonic() + 0.005), auth=p.auth)
        except TimeoutError:
            self.mark_down(pid, "control channel timed out", timeout=True)
            return None
        except (OSError, WireError) as e:
            self.mark_down(pid, f"control channel: {e}")
            return None
        if f.type != expect:
            msg = f.body.get("error") if f.type == MsgType.ERROR else f"unexpected {f.type.name}"
            self.mark_down(pid, f"server: {msg}")
            return None
        return f

    def _rpc_all(self, reqs: Dict[int, Tuple[MsgType, dict, bytes]], deadline: float,
                 expect: MsgType) -> Dict[int, Frame]:
        sent = []
        for pid, (t, body, blob) in reqs.items():
            p = self._peers[pid]
            if p.sock is None:
                continue
            try:
                write_frame(p.sock, t, body, blob, deadline=deadline, auth=p.auth)
                sent.append(pid)
            except TimeoutError:
                self.mark_down(pid, "control channel send timed out", timeout=True)
            except (OSError, WireError) as e:
                self.mark_down(pid, f"control channel: {e}")
        out = {}
        for pid in sent:
            f = self._recv(pid, deadline, expect)
            if f is not None:
                out[pid] = f
        return out

    def send_oneway(self, pid: int, t: MsgType, body: dict) -> None:
        """Send a frame that is never answered (RELEASE); a send failure marks the peer down."""
        p = self._peers[pid]
        if p.sock is None:
            return
        try:
            write_frame(p.sock, t, body, deadline=time.monotonic() + self.timeout_s, auth=p.auth)
        except TimeoutError:
            self.mark_down(pid, "control channel send timed out", timeout=True)
        except (OSError, WireError) as e:
            self.mark_down(pid, f"control channel: {e}")

    def _groups(self, keys: List[bytes], stop_at_unowned: bool) -> Tuple[List[int], Dict[int, List[int]]]:
        owners = self._owners(keys)
        groups: Dict[int, List[int]] = {}
        for i, o in enumerate(owners):
            if o < 0:
                if stop_at_unowned:
                    break
                continue
            groups.setdefault(o, []).append(i)
        return owners, groups

    @staticmethod
    def _leading(n: int, owners: List[int], groups: Dict[int, List[int]], counts: Dict[int, int]) -> int:
        pos = {}
        for pid, idx in groups.items():
            for j, i in enumerate(idx):
                pos[i] = j
        k = 0
        while k < n and owners[k] >= 0 and k in pos and pos[k] < counts.get(owners[k], 0):
            k += 1
        return k

    def _transfer(self, op: str, plans: Dict[int, Tuple[List[int], List[int]]], st: StagingBuffer,
                  P: int) -> Dict[int, str]:
        """plans: pid -> (rows of the staging buffer, remote addresses). One request per peer,
        all posted, then polled up to timeout_ms. Returns pid -> "DONE" | "PROC" (timed out:
        parked with `st`) | "ERR"."""
        a = self.ensure_agent()
        handles, pids, states = [], [], {}
        if self._before_data_phase is not None:
            self._before_data_phase(op)
        for pid, (rows, addrs) in plans.items():
            h = self.init_transfer(op, pid, st, rows, addrs, P)
            if h is None:
                states[pid] = "ERR"
                continue
            handles.append(h)
            pids.append(pid)
            states[pid] = post_xfer(a, h)
        live = [i for i, pid in enumerate(pids) if states[pid] == "PROC"]
        if live:
            res = wait_xfers(a, [handles[i] for i in live], time.monotonic() + self.timeout_s)
            for i, state in zip(live, res):
                states[pids[i]] = state
        for h, pid in zip(handles, pids):
            if states[pid] == "PROC":  # still running: park it, never release or free under it
                self.park(h, st, pid)
                self.mark_down(pid, f"NIXL {op} timed out after {self.timeout_s * 1000:.0f} ms", timeout=True)
                continue
            self.release_transfer(h)
            if states[pid] == "ERR":
                self.mark_down(pid, f"NIXL {op} failed")
        return states

    # ------------------------------------------------------------------ protocol
    def contains_prefix(self, keys: List[bytes]) -> int:
        keys = check_keys(keys)[:MAX_KEYS_PER_FRAME]
        # on the scheduler thread (no_wait_lookups) a worker's transfer holding the lock is a miss now
        if not self.lock.acquire(blocking=not lookups_must_not_wait()):
            self.c["lookups_busy"] += 1
            return 0
        try:
            if self._closed or not keys or not self._peers:
                return 0
            owners, groups = self._groups(keys, stop_at_unowned=True)
            if not groups:
                return 0
            deadline = time.monotonic() + self.timeout_s
            usable = self.connect(list(groups), self._page_hint, deadline)
            rep = self._rpc_all(self._lookup_requests(keys, groups, usable, pin=False), deadline, MsgType.LOOKUP_OK)
            counts = {pid: self._count(f, len(groups[pid])) for pid, f in rep.items()}
            return self._leading(len(keys), owners, groups, counts)
        finally:
            self.lock.release()

    _page_hint: Optional[int] = None  # page size of the last put/get (None before the first)

    @staticmethod
    def _count(f: Frame, n: int) -> int:
        c = f.body.get("count")
        return max(0, min(n, c)) if isinstance(c, int) else 0

    def get_many_into(self, keys: List[bytes], out) -> int:
        keys = check_keys(keys)[:MAX_KEYS_PER_FRAME]
        if not keys:
            return 0
        out = as_pages(out, len(keys), writable=True, what="out")
        n, P = len(keys), out.shape[1]
        with self.lock:
            if self._closed or not self._peers:
                self.c["misses"] += n
                return 0
            self._page_hint = P
            self.reap_parked()
            owners, groups = self._groups(keys, stop_at_unowned=True)
            if self._router is not None and groups:
                return self._router.get(keys, out, owners, groups, P)
            pinned = self._lookup_pinned(keys, groups, P)
            k = self._leading(n, owners, groups, pinned.counts)
            good, drops = self._read_leading(keys, out, groups, pinned, k, P) if k > 0 else (0, {})
            for pid, lid in pinned.leases.items():  # unpin; the server drops pages that failed the check
                self.send_oneway(pid, MsgType.RELEASE, {"lease": lid, "drop": drops.get(pid, [])})
            self.c["hits"] += good
            self.c["misses"] += n - good
            return good

    def _lookup_requests(self, keys: List[bytes], groups: Dict[int, List[int]], pids: List[int],
                         pin: bool) -> Dict[int, Tuple[MsgType, dict, bytes]]:
        reqs = {}
        for pid in pids:
            klen, blob = pack_keys([keys[i] for i in groups[pid]])
            reqs[pid] = (MsgType.LOOKUP, {"klen": klen, "n": len(groups[pid]), "pin": pin}, blob)
        return reqs

    def _lookup_pinned(self, keys: List[bytes], groups: Dict[int, List[int]], P: int) -> "_Pinned":
        """Pinned LOOKUP at every owner (pipelined); an owner whose answer is malformed is marked
        down and counts as holding nothing."""
        deadline = time.monotonic() + self.timeout_s
        usable = self.connect(list(groups), P, deadline) if groups else []
        rep = self._rpc_all(self._lookup_requests(keys, groups, usable, pin=True), deadline, MsgType.LOOKUP_OK)
        pinned = _Pinned()
        for pid, f in rep.items():
            try:
                c, addrs, sums, macs = self._parse_pinned(f, len(groups[pid]))
            except WireError as e:
                self.mark_down(pid, f"bad LOOKUP_OK: {e}")
                continue
            pinned.counts[pid], pinned.addrs[pid], pinned.sums[pid] = c, addrs, sums
            if macs is not None:
                pinned.macs[pid] = macs
            if f.body.get("lease"):
                pinned.leases[pid] = f.body["lease"]
        return pinned

    def _parse_pinned(self, f: Frame, n: int) -> Tuple[int, List[int], List[int], Optional[List[bytes]]]:
        """(count, addresses, page hashes, page MACs or None) of a pinned LOOKUP_OK for n keys."""
        c = self._count(f, n)
        addrs = int_list(f.body, "addrs")[:c]
        sums = int_list(f.body, "sums")[:c]
        if len(addrs) < c or len(sums) < c:
            raise WireError("LOOKUP_OK lists are short")
        macs = None
        if self._pagemac is not None:
            if len(f.blob) < c * MAC_LEN:
                raise WireError("LOOKUP_OK without page MACs")
            macs = [f.blob[j * MAC_LEN:(j + 1) * MAC_LEN] for j in range(c)]
        return c, addrs, sums, macs

    def _read_leading(self, keys: List[bytes], out: np.ndarray, groups: Dict[int, List[int]], pinned: "_Pinned",
                      k: int, P: int) -> Tuple[int, Dict[int, List[int]]]:
        """READ the k leading pinned pages into staging, verify them, copy the verified leading
        run to `out`. Returns (pages copied, pid -> indices of its pages that failed the check)."""
        t0 = time.perf_counter()
        plans = {}
        for pid, idx in groups.items():
            need = sum(1 for i in idx if i < k)
            if need and pid in pinned.counts:
                plans[pid] = (idx[:need], pinned.addrs[pid][:need])
        st = self.acquire_stage(k * P)
        stage = st.arr[:k * P].reshape(k, P)
        states = self._transfer("READ", plans, st, P)
        okrow, drops = self._verify_read(keys, stage, plans, states, pinned, k)
        good = 0
        while good < k and okrow[good]:
            good += 1
        if good:
            np.copyto(out[:good], stage[:good])
        self.release_stage(st)
        self.reap_parked()  # this call progressed the worker: parked ones may be done
        self._count_read(plans, states, good, P, time.perf_counter() - t0)
        return good, drops

    def _verify_read(self, keys: List[bytes], stage: np.ndarray, plans: Dict[int, Tuple[List[int], List[int]]],
                     states: Dict[int, str], pinned: "_Pinned", k: int) -> Tuple[np.ndarray, Dict[int, List[int]]]:
        """Check every page a peer delivered against its writer's page hash (or MAC, with a secret).
        Returns (row ok, pid -> indices of its rows that failed); the first bad row ends the prefix."""
        okrow = np.zeros(k, dtype=bool)
        drops: Dict[int, List[int]] = {}
        for pid, (rows, _) in plans.items():
            if states.get(pid) != "DONE":
                continue
            if self._pagemac is not None:  # the MAC covers what the page hash would catch
                mac = self._pagemac.macs([keys[r] for r in rows], stage, rows)
                good_rows = [mac[j] == pinned.macs[pid][j] for j in range(len(rows))]
            else:
                got = page_digests(stage, len(rows), rows)
                good_rows = [got[j] == pinned.sums[pid][j] for j in range(len(rows))]
            for j, r in enumerate(rows):
                if good_rows[j]:
                    okrow[r] = True
                else:
                    self.c["corrupt_dropped"] += 1
                    drops.setdefault(pid, []).append(j)
                    log.warning("remote tier: page from %s failed its checksum; dropped", self._peers[pid].addr)
        return okrow, drops

    def _count_read(self, plans: Dict[int, Tuple[List[int], List[int]]], states: Dict[int, str], good: int,
                    P: int, dt: float) -> None:
        self.c["read_s"] += dt
        self.c["bytes_read"] += good * P
        if good and dt > 0:
            self.last_bandwidth_gbps = good * P / dt / 1e9
        for pid, (rows, _) in plans.items():
            if states.get(pid) == "DONE":
                p = self._peers[pid]
                nb = sum(1 for r in rows if r < good) * P
                p.c["bytes_read"] += nb
                p.c["pages_read"] += nb // P
                if dt > 0 and nb:
                    p.note_bandwidth(nb / dt / 1e9)

    def put_many(self, keys: List[bytes], pages) -> int:
        """Returns the number of leading keys held by the peers after the call (already present
        pages count)."""
        keys = check_keys(keys)[:MAX_KEYS_PER_FRAME]
        if not keys:
            return 0
        pages = as_pages(pages, len(keys))
        n, P = len(keys), pages.shape[1]
        with self.lock:
            if self._closed or not self._peers:
                return 0
            self._page_hint = P
            self.reap_parked()
            owners, groups = self._groups(keys, stop_at_unowned=False)
            if not groups:
                return 0
            if self._router is not None:
                return self._router.put(keys, pages, owners, groups, P)
            deadline = time.monotonic() + self.timeout_s
            usable = self.connect(list(groups), P, deadline)
            if not usable:
                return 0
            rep = self._rpc_all(self._put_requests(keys, pages, groups, usable), deadline, MsgType.PUT_OK)
            present = np.zeros(n, dtype=bool)  # held by the owner after the call
            plans, leases = self._take_put_oks(rep, groups, present)
            if plans:
                self._write_and_commit(pages, plans, leases, present, P)
            k = 0
            while k < n and present[k]:
                k += 1
            return k

    def _put_requests(self, keys: List[bytes], pages: np.ndarray, groups: Dict[int, List[int]],
                      pids: List[int]) -> Dict[int, Tuple[MsgType, dict, bytes]]:
        sums = page_digests(pages, len(keys))
        reqs = {}
        for pid in pids:
            idx = groups[pid]
            klen, blob = pack_keys([keys[i] for i in idx])
            body = {"klen": klen, "n": len(idx), "sums": [sums[i] for i in idx]}
            if self._pagemac is not None:  # the page MACs follow the keys
                body["mac"] = MAC_LEN
                blob += b"".join(self._pagemac.macs([keys[i] for i in idx], pages, idx))
            reqs[pid] = (MsgType.PUT, body, blob)
        return reqs

    def _take_put_oks(self, rep: Dict[int, Frame], groups: Dict[int, List[int]], present: np.ndarray
                      ) -> Tuple[Dict[int, Tuple[List[int], List[int]]], Dict[int, int]]:
        """Per owner's PUT_OK: rows it has (marked in `present`), rows to write and where. Returns
        (pid -> (rows, addresses), pid -> lease); an owner with a malformed answer is marked down."""
        plans, leases = {}, {}
        for pid, f in rep.items():
            idx = groups[pid]
            try:
                status = int_list(f.body, "status", len(idx))
                addrs = int_list(f.body, "addrs")
            except WireError as e:
                self.mark_down(pid, f"bad PUT_OK: {e}")
                continue
            rows = [i for i, st in zip(idx, status) if st == 0]
            if len(rows) != len(addrs):
                self.mark_down(pid, "bad PUT_OK: address count")
                continue
            for i, st in zip(idx, status):
                if st == 1:
                    present[i] = True
            if rows:
                plans[pid] = (rows, addrs)
                leases[pid] = f.body.get("lease")
        return plans, leases

    def _write_and_commit(self, pages: np.ndarray, plans: Dict[int, Tuple[List[int], List[int]]],
                          leases: Dict[int, int], present: np.ndarray, P: int) -> None:
        """WRITE the planned rows through staging, COMMIT where the write is DONE, mark what the
        owners stored in `present` and count it."""
        n = len(present)
        t0 = time.perf_counter()
        st = self.acquire_stage(n * P)
        stage = st.arr[:n * P].reshape(n, P)
        for rows, _ in plans.values():
            for r in rows:
                stage[r] = pages[r]
        states = self._transfer("WRITE", plans, st, P)
        self.release_stage(st)
        self.reap_parked()
        cdeadline = time.monotonic() + self.timeout_s
        creqs = {pid: (MsgType.COMMIT, {"lease": leases[pid], "ok": [1] * len(plans[pid][0])}, b"")
                 for pid in plans if states.get(pid) == "DONE"}
        crep = self._rpc_all(creqs, cdeadline, MsgType.COMMIT_OK)
        wrote = 0
        for pid, f in crep.items():
            try:
                stored = int_list(f.body, "stored")
            except WireError:  # a malformed COMMIT_OK: nothing counts as stored (the pages are a miss)
                stored = []
            for r, s_ in zip(plans[pid][0], stored):
                if s_:
                    present[r] = True
                    wrote += 1
            p = self._peers[pid]
            p.c["bytes_written"] += sum(1 for s_ in stored if s_) * P
            p.c["pages_written"] += sum(1 for s_ in stored if s_)
        self.c["write_s"] += time.perf_counter() - t0
        self.c["bytes_written"] += wrote * P
        self.c["pages_written"] += wrote

    def discard(self, keys: List[bytes]) -> None:
        keys = check_keys(keys)
        with self.lock:
            if self._closed or not keys or not self._peers:
                return
            owners, groups = self._groups(keys, stop_at_unowned=False)
            deadline = time.monotonic() + self.timeout_s
            usable = self.connect(list(groups), self._page_hint, deadline)
            reqs = {}
            for pid in usable:
                klen, blob = pack_keys([keys[i] for i in groups[pid]])
                reqs[pid] = (MsgType.DISCARD, {"klen": klen, "n": len(groups[pid])}, blob)
            self._rpc_all(reqs, deadline, MsgType.DISCARD_OK)

    def server_stats(self, addr: str) -> Optional[dict]:
        """STATS of one peer (for tests and `flexflow` tooling); None when it does not answer."""
        with self.lock:
            pid = [p.addr for p in self._peers].index(addr)
            p = self._peers[pid]
            deadline = time.monotonic() + self.timeout_s
            if p.sock is None:
                if not p.up(time.monotonic()):
                    return None
                self.connect([pid], None, deadline)
            rep = self._rpc_all({pid: (MsgType.STATS, {}, b"")}, deadline, MsgType.STATS_OK)
            return rep[pid].body if pid in rep else None

    def stats(self) -> dict:
        """A snapshot without `self.lock`: the lock is held for a whole routed get/put (seconds over
        a slow link) and the metrics export calls this on SGLang's scheduler thread. Counters are
        copied in one atomic dict copy each; a snapshot may lag a call in progress, never more."""
        now = time.monotonic()
        raw = dict(self.c)
        c = {k: (int(v) if k not in ("read_s", "write_s") else v) for k, v in raw.items()}
        peers = list(self._peers)
        c.update(
            name=self.name, node=self.node, backend="nixl-ucx",
            bytes=int(raw["bytes_read"] + raw["bytes_written"]),
            read_gbps=raw["bytes_read"] / raw["read_s"] / 1e9 if raw["read_s"] else 0.0,
            write_gbps=raw["bytes_written"] / raw["write_s"] / 1e9 if raw["write_s"] else 0.0,
            bandwidth_gbps=self.last_bandwidth_gbps,
            peers={p.addr: dict(dict(p.c), up=p.up(now), connected=p.sock is not None,
                                retry_in_s=max(0.0, p.down_until - now), down_reason=p.down_reason,
                                node=p.node, bw_gbps=p.bw_gbps, relay=p.relay_cap,
                                owner=p.addr in self._addrs) for p in peers},
            peers_up=sum(1 for p in peers if p.up(now)), parked_now=len(self._parked),
            closed=self._closed)
        return c

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            for p in self._peers:
                p.close()
            self.reap_parked()
            self._recycle_agent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:  # a finalizer must not raise (and may run at interpreter exit, modules half gone)
            pass
