"""Tier server: holds KV pages in a NIXL-registered host buffer (optionally backed by a storage
tier) and serves them to peers' RemoteTier clients.

    python -m flexflow_sglang.tiers.tier_server --listen 127.0.0.1:PORT --capacity-gb X \
        [--storage-path DIR] [--page-nbytes N] [--ready-file F]

Control channel: TCP, frames of flexflow_sglang.tiers.wire, one thread per connection. Data: the
client is the NIXL (UCX) initiator: it READs pinned slots and WRITEs into slots this server
allocated; the server only registers its buffer, hands out its agent metadata and keeps the UCX
worker progressing (1 ms polls while any lease is open, 20 ms otherwise).

Slots: the buffer is cut into slots of one page size, fixed by --page-nbytes or by the first
HELLO; a client with another page size gets an ERROR. LRU eviction over unpinned slots. Leases
(pins of a LOOKUP, reservations of a PUT) end with RELEASE/COMMIT, when the connection closes, or
after --lease-ttl-s. Binds 127.0.0.1 unless --listen says otherwise.

CrossNodeRelay (RELAY_GET / RELAY_PUT): a client that routes around a congested link asks this
server to pull pages from their owner (or forward them to it). The server is then itself a
RemoteTier client of the owner (one per owner address, created on first use, NIXL agent of its own)
and stages the pages in temporary slots of its buffer: never indexed, freed when the lease ends.
`--relay-peers NODE=host:port,...` gives the owners' addresses as seen from this server (and, when
set, is the list of owners it will relay for); `--no-relay` answers relay requests with ERROR.
"""
from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import numpy as np

from .base import make_agent, page_checksum, page_checksums, unique_agent_name
from .wire import (MAX_BLOB, RELAY_TYPES, Frame, MsgType, WireError, int_list, parse_hostport,
                   read_frame, unpack_keys, write_frame)

log = logging.getLogger("flexflow_sglang.tiers.server")
_GIB = 1 << 30


@dataclass
class _Lease:
    id: int
    kind: str  # "get" | "put"
    slots: List[int]
    expires: float
    conn: int
    keys: List[bytes] = field(default_factory=list)
    sums: List[int] = field(default_factory=list)
    owner: str = ""         # relay_put: where COMMIT forwards the pages
    timeout_s: float = 0.0  # relay_put: the forward's timeout


class _RelayRefused(Exception):
    """A relay request this server will not or cannot serve (answered in the OK frame's "error")."""


class TierServer:
    def __init__(self, listen: str = "127.0.0.1:0", capacity_bytes: int = _GIB,
                 page_nbytes: Optional[int] = None, storage_path: Optional[str] = None,
                 storage_capacity_gb: float = 10.0, lease_ttl_s: float = 30.0,
                 verify_puts: bool = False, node: Optional[str] = None, max_conns: int = 64,
                 max_blob: int = MAX_BLOB, relay: bool = True, relay_peers: Optional[Dict[str, str]] = None,
                 relay_retry_after_s: float = 10.0):
        host, port = parse_hostport(listen)
        self.capacity = int(capacity_bytes)
        if self.capacity <= 0:
            raise ValueError("tier server capacity must be > 0")
        self.lease_ttl_s = lease_ttl_s
        self.verify_puts = verify_puts
        self.node = node or socket.gethostname()
        self.max_conns = max_conns
        self.max_blob = max_blob
        self.storage_path = storage_path
        self.storage_capacity_gb = storage_capacity_gb
        self.storage = None
        self.relay = bool(relay)
        self.relay_peers = dict(relay_peers or {})  # owner node -> host:port as seen from here
        for a in self.relay_peers.values():
            parse_hostport(a)
        self.relay_retry_after_s = float(relay_retry_after_s)
        self._relay_tiers: Dict[str, object] = {}  # owner address -> RemoteTier (our client of it)
        self._relay_lock = threading.Lock()

        self._mm = mmap.mmap(-1, self.capacity)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.agent = make_agent(unique_agent_name("fftier"), ["UCX"])
        self._reg = self.agent.register_memory([(self.buf.ctypes.data, self.capacity, 0, "")], "DRAM")
        self.md = self.agent.get_agent_metadata()

        self.lock = threading.RLock()
        self.page_nbytes: Optional[int] = None
        self.index: "OrderedDict[bytes, int]" = OrderedDict()
        self.leases: Dict[int, _Lease] = {}
        self._next_lease = 1
        self._stop = threading.Event()
        self._conns: Dict[int, socket.socket] = {}
        self._threads: List[threading.Thread] = []
        self.c = dict(connections=0, lookups=0, lookup_pages=0, puts=0, pages_stored=0, pages_have=0,
                      pages_skipped=0, evictions=0, leases_expired=0, promoted=0, verify_failures=0,
                      discarded=0, errors=0, storage_writes=0, relay_gets=0, relay_pages_out=0,
                      relay_puts=0, relay_pages_fwd=0, relay_failures=0)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        if not page_nbytes and storage_path:  # restarted with pages on disk: serve them at once
            from .storage import StorageTier
            page_nbytes = StorageTier.peek_page_nbytes(storage_path)
        if page_nbytes:
            self._setup_slots(int(page_nbytes))

    # ------------------------------------------------------------------ slots
    def _setup_slots(self, P: int) -> None:
        if P <= 0:
            raise WireError("page_nbytes must be > 0")
        n = self.capacity // P
        if n == 0:
            raise WireError(f"capacity {self.capacity} holds no page of {P} bytes")
        self.page_nbytes = P
        self.nslots = n
        self.pages = self.buf[: n * P].reshape(n, P)
        self.free = deque(range(n))
        self.slot_key: List[Optional[bytes]] = [None] * n
        self.slot_sum = [0] * n
        self.pins = [0] * n
        self.doomed: Set[int] = set()
        self.reserved: Dict[bytes, int] = {}
        if self.storage_path:
            from .storage import StorageTier
            self.storage = StorageTier(self.storage_path, capacity_gb=self.storage_capacity_gb,
                                       fingerprint="flexflow-tier-server", page_nbytes=P, node=self.node)
        log.info("tier server %s: %d slots of %d bytes", self.address, n, P)

    def _alloc(self, protect) -> Optional[int]:
        if self.free:
            return self.free.popleft()
        for k, s in self.index.items():  # LRU first
            if self.pins[s] == 0 and k not in protect:
                del self.index[k]
                self.slot_key[s] = None
                self.c["evictions"] += 1
                return s
        return None

    def _free(self, s: int) -> None:
        self.slot_key[s] = None
        self.pins[s] = 0
        self.doomed.discard(s)
        self.free.append(s)

    def _unpin(self, s: int) -> None:
        self.pins[s] -= 1
        if self.pins[s] <= 0:
            self.pins[s] = 0
            if s in self.doomed:
                self._free(s)

    def _drop_key(self, k: bytes) -> bool:
        s = self.index.pop(k, None)
        if s is None:
            return False
        if self.pins[s] > 0:
            self.slot_key[s] = None
            self.doomed.add(s)
        else:
            self._free(s)
        return True

    def _end_lease(self, lease: _Lease, committed: Optional[List[int]] = None) -> None:
        self.leases.pop(lease.id, None)
        if lease.kind == "get":
            for s in lease.slots:
                self._unpin(s)
        elif lease.kind == "relay_put":  # temporary slots, never indexed
            for s in lease.slots:
                self._free(s)
        else:
            for j, s in enumerate(lease.slots):
                self.reserved.pop(lease.keys[j], None)
                if not (committed and committed[j]):
                    self._free(s)

    def _new_lease(self, kind: str, slots: List[int], conn: int) -> _Lease:
        lease = _Lease(self._next_lease, kind, slots, time.monotonic() + self.lease_ttl_s, conn)
        self._next_lease += 1
        self.leases[lease.id] = lease
        return lease

    # ------------------------------------------------------------------ handlers
    def _need_slots(self) -> None:
        if self.page_nbytes is None:
            raise WireError("HELLO with page_nbytes first")

    def _hello(self, f: Frame):
        P = f.body.get("page_nbytes", 0)
        if not isinstance(P, int) or P < 0:
            raise WireError("HELLO page_nbytes must be an integer >= 0 (0: any)")
        with self.lock:
            if self.page_nbytes is None and P:
                self._setup_slots(P)
            elif P and P != self.page_nbytes:
                raise WireError(f"page_nbytes mismatch: this server uses {self.page_nbytes}, client {P}")
            return (MsgType.HELLO_OK, {"agent": self.agent.name, "page_nbytes": self.page_nbytes or 0,
                                       "slots": getattr(self, "nslots", 0), "node": self.node,
                                       "relay": int(self.relay)}, self.md)

    def _promote(self, keys: List[bytes], protect) -> List[int]:
        """Load leading `keys` from the storage tier into slots (lock held)."""
        got: List[int] = []
        if self.storage is None or not keys:
            return got
        m = self.storage.contains_prefix(keys)
        for k in keys[:m]:
            s = self._alloc(protect)
            if s is None:
                break
            if self.storage.get_many_into([k], self.pages[s:s + 1]) != 1:
                self._free(s)
                break
            self.index[k] = s
            self.slot_key[s] = k
            self.slot_sum[s] = page_checksum(self.pages[s])
            self.c["promoted"] += 1
            got.append(s)
        return got

    def _lookup(self, f: Frame, conn: int):
        keys = unpack_keys(f.body, f.blob)
        pin = bool(f.body.get("pin", False))
        with self.lock:
            self.c["lookups"] += 1
            if self.page_nbytes is None:  # nothing stored yet
                return (MsgType.LOOKUP_OK, {"count": 0, "lease": 0, "addrs": [], "sums": []}, b"")
            slots: List[int] = []
            for k in keys:
                s = self.index.get(k)
                if s is None:
                    break
                slots.append(s)
            if len(slots) < len(keys):
                slots += self._promote(keys[len(slots):], set(keys))
            for k in keys[:len(slots)]:
                self.index.move_to_end(k)
            self.c["lookup_pages"] += len(slots)
            lease_id = 0
            if pin and slots:
                for s in slots:
                    self.pins[s] += 1
                lease_id = self._new_lease("get", slots, conn).id
            base, P = self.buf.ctypes.data, self.page_nbytes
            return (MsgType.LOOKUP_OK, {"count": len(slots), "lease": lease_id,
                                        "addrs": [base + s * P for s in slots] if pin else [],
                                        "sums": [self.slot_sum[s] for s in slots] if pin else []}, b"")

    def _release(self, f: Frame) -> None:
        lid = f.body.get("lease")
        drop = f.body.get("drop") or []
        with self.lock:
            lease = self.leases.get(lid) if isinstance(lid, int) else None
            if lease is None or lease.kind != "get":
                return
            for i in drop:
                if isinstance(i, int) and 0 <= i < len(lease.slots):
                    k = self.slot_key[lease.slots[i]]
                    if k is not None and self.index.get(k) == lease.slots[i]:
                        self._drop_key(k)
                        self.c["discarded"] += 1
            self._end_lease(lease)

    def _put(self, f: Frame, conn: int):
        keys = unpack_keys(f.body, f.blob)
        sums = int_list(f.body, "sums", len(keys))
        with self.lock:
            self._need_slots()
            self.c["puts"] += 1
            protect = set(keys)
            status, addrs, slots, lkeys, lsums = [], [], [], [], []
            mine: Set[bytes] = set()
            full = False
            base, P = self.buf.ctypes.data, self.page_nbytes
            for k, sm in zip(keys, sums):
                if k in self.index:
                    self.index.move_to_end(k)
                    status.append(1)
                    self.c["pages_have"] += 1
                    continue
                busy = k in self.reserved or k in mine  # another writer, or a duplicate key
                s = None if (full or busy) else self._alloc(protect)
                if s is None:
                    full = full or not busy
                    status.append(-1)
                    self.c["pages_skipped"] += 1
                    continue
                mine.add(k)
                status.append(0)
                addrs.append(base + s * P)
                slots.append(s)
                lkeys.append(k)
                lsums.append(sm & 0xFFFFFFFF)
            lease_id = 0
            if slots:
                lease = self._new_lease("put", slots, conn)
                lease.keys, lease.sums = lkeys, lsums
                for k in lkeys:
                    self.reserved[k] = lease.id
                lease_id = lease.id
            return (MsgType.PUT_OK, {"lease": lease_id, "status": status, "addrs": addrs}, b"")

    def _commit(self, f: Frame):
        lid = f.body.get("lease")
        with self.lock:
            lease = self.leases.get(lid) if isinstance(lid, int) else None
            if lease is None or lease.kind != "put":
                return (MsgType.COMMIT_OK, {"stored": []}, b""), None
            ok = int_list(f.body, "ok", len(lease.slots))
            stored = []
            for j, s in enumerate(lease.slots):
                good = bool(ok[j])
                if good and self.verify_puts and page_checksum(self.pages[s]) != lease.sums[j]:
                    self.c["verify_failures"] += 1
                    good = False
                stored.append(1 if good else 0)
            self._end_lease(lease, committed=stored)
            wt_keys, wt_slots = [], []
            for j, s in enumerate(lease.slots):
                if stored[j]:
                    k = lease.keys[j]
                    old = self.index.get(k)
                    if old is not None:  # raced with another writer: keep the older copy
                        self._free(s)
                        continue
                    self.index[k] = s
                    self.slot_key[s] = k
                    self.slot_sum[s] = lease.sums[j]
                    self.c["pages_stored"] += 1
                    if self.storage is not None:
                        self.pins[s] += 1
                        wt_keys.append(k)
                        wt_slots.append(s)
        after = (lambda: self._write_through(wt_keys, wt_slots)) if wt_keys else None
        return (MsgType.COMMIT_OK, {"stored": stored}, b""), after

    def _write_through(self, keys: List[bytes], slots: List[int]) -> None:
        try:
            self.storage.put_many(keys, np.stack([self.pages[s] for s in slots]))
            self.c["storage_writes"] += len(keys)
        except Exception as e:
            log.warning("tier server: storage write-through failed: %r", e)
        finally:
            with self.lock:
                for s in slots:
                    self._unpin(s)

    def _discard(self, f: Frame):
        keys = unpack_keys(f.body, f.blob)
        n = 0
        with self.lock:
            if self.page_nbytes is not None:
                for k in keys:
                    n += self._drop_key(k)
                self.c["discarded"] += n
            if self.storage is not None:
                self.storage.discard(keys)
        return (MsgType.DISCARD_OK, {"dropped": n}, b"")

    # ------------------------------------------------------------------ CrossNodeRelay
    def _relay_target(self, body: dict) -> str:
        node, addr = body.get("owner_node"), body.get("owner")
        if self.relay_peers:
            if isinstance(node, str) and node in self.relay_peers:
                return self.relay_peers[node]
            if addr in self.relay_peers.values():
                return addr
            raise _RelayRefused(f"owner {node or addr!r} is not in this server's --relay-peers")
        if not isinstance(addr, str):
            raise WireError("relay request without 'owner'")
        try:
            parse_hostport(addr)
        except ValueError as e:
            raise WireError(str(e)) from None
        return addr

    @staticmethod
    def _relay_timeout(body: dict) -> float:
        """Half the client's timeout per phase (control, data), so the relay answers before the
        client's own deadline for this request passes."""
        t = body.get("timeout_ms", 2000)
        t = 2000.0 if not isinstance(t, (int, float)) or isinstance(t, bool) else float(t)
        return min(60.0, max(0.05, t / 2000.0))

    def _relay_tier(self, addr: str):
        with self._relay_lock:
            t = self._relay_tiers.get(addr)
            if t is None:
                from .remote import RemoteTier
                t = RemoteTier([addr], retry_after_s=self.relay_retry_after_s, node=self.node,
                               client_name="ffrelay")
                self._relay_tiers[addr] = t
            return t

    @staticmethod
    def _relay_cold(t) -> bool:
        """The relay's client of the owner has to connect / load metadata first (lock held): the
        client then does not take this request's time as a bandwidth measurement."""
        p = t._peers[0]
        return t._agent is None or p.sock is None or p.loaded_gen != t._gen

    def _relay_warmup(self) -> None:
        """Create the relay clients of --relay-peers (NIXL agent ~0.5 s each) before they are needed."""
        for addr in self.relay_peers.values():
            if self._stop.is_set():
                return
            try:
                t = self._relay_tier(addr)
                with t._lock:
                    t._ensure_agent()
            except Exception as e:
                log.warning("tier server: relay client for %s: %r", addr, e)

    def _alloc_temp(self, n: int) -> List[int]:
        """Up to n unindexed slots (lock held); they belong to the caller until freed or leased."""
        slots: List[int] = []
        for _ in range(n):
            s = self._alloc(())
            if s is None:
                break
            slots.append(s)
        return slots

    def _relay_get(self, f: Frame, conn: int):
        keys = unpack_keys(f.body, f.blob)
        with self.lock:
            self._need_slots()
            P = self.page_nbytes
            self.c["relay_gets"] += 1
        empty = {"count": 0, "lease": 0, "addrs": [], "sums": [], "pull_s": 0.0}
        try:
            addr = self._relay_target(f.body)
        except _RelayRefused as e:
            self.c["relay_failures"] += 1
            return (MsgType.RELAY_GET_OK, dict(empty, error=str(e)), b"")
        timeout_s = self._relay_timeout(f.body)
        with self.lock:
            slots = self._alloc_temp(len(keys))
        got, err, pull_s, leased, cold = 0, None, 0.0, False, False
        try:
            m = len(slots)
            if m:
                t = self._relay_tier(addr)
                contiguous = slots == list(range(slots[0], slots[0] + m))
                out = self.pages[slots[0]:slots[0] + m] if contiguous else np.empty((m, P), dtype=np.uint8)
                t0 = time.perf_counter()
                with t._lock:
                    t.timeout_s = timeout_s
                    cold = self._relay_cold(t)
                    got = t.get_many_into(keys[:m], out)
                    peer = t._peers[0]
                    if got < m and not peer.up(time.monotonic()):
                        err = f"owner {addr}: {peer.down_reason}"
                pull_s = time.perf_counter() - t0
                if got and not contiguous:
                    for j in range(got):
                        self.pages[slots[j]] = out[j]
            elif keys:
                err = "relay buffer full"
            sums = page_checksums(self.pages, got, slots[:got]) if got else []
            with self.lock:
                for s in slots[got:]:
                    self._free(s)
                lease_id = 0
                if got:
                    for s in slots[:got]:  # pinned once; the lease's end unpins and frees them
                        self.pins[s] = 1
                        self.doomed.add(s)
                    lease_id = self._new_lease("get", slots[:got], conn).id
                leased = True
                self.c["relay_pages_out"] += got
                if err:
                    self.c["relay_failures"] += 1
            base = self.buf.ctypes.data
            body = {"count": got, "lease": lease_id, "addrs": [base + s * P for s in slots[:got]],
                    "sums": sums, "pull_s": pull_s}
            if cold:
                body["cold"] = 1
            if err:
                body["error"] = err
            return (MsgType.RELAY_GET_OK, body, b"")
        finally:
            if not leased:
                with self.lock:
                    for s in slots:
                        self._free(s)

    def _relay_put(self, f: Frame, conn: int):
        keys = unpack_keys(f.body, f.blob)
        sums = int_list(f.body, "sums", len(keys))
        with self.lock:
            self._need_slots()
            self.c["relay_puts"] += 1
        try:
            addr = self._relay_target(f.body)
        except _RelayRefused as e:
            self.c["relay_failures"] += 1
            return (MsgType.RELAY_PUT_OK, {"lease": 0, "status": [-1] * len(keys), "addrs": [],
                                           "error": str(e)}, b"")
        with self.lock:
            slots = self._alloc_temp(len(keys))
            lease_id = 0
            if slots:
                lease = self._new_lease("relay_put", slots, conn)
                lease.keys = keys[:len(slots)]
                lease.sums = [x & 0xFFFFFFFF for x in sums[:len(slots)]]
                lease.owner, lease.timeout_s = addr, self._relay_timeout(f.body)
                lease_id = lease.id
            base, P = self.buf.ctypes.data, self.page_nbytes
            return (MsgType.RELAY_PUT_OK, {"lease": lease_id, "status": [0] * len(slots) + [-1] * (len(keys) - len(slots)),
                                           "addrs": [base + s * P for s in slots]}, b"")

    def _relay_commit(self, f: Frame):
        """COMMIT of a relay_put lease: check the writer's CRCs, forward to the owner. None: the
        lease is not a relay lease (the plain COMMIT handles it)."""
        lid = f.body.get("lease")
        with self.lock:
            lease = self.leases.get(lid) if isinstance(lid, int) else None
            if lease is None or lease.kind != "relay_put":
                return None
            ok = int_list(f.body, "ok", len(lease.slots))
            self.leases.pop(lease.id, None)  # ours now: expiry must not free the slots under us
        n = len(lease.slots)
        stored, err, fwd_s, cold = [0] * n, None, 0.0, False
        try:
            rows = [j for j in range(n) if ok[j]]
            got = page_checksums(self.pages, len(rows), [lease.slots[j] for j in rows]) if rows else []
            good = [j for j, g in zip(rows, got) if g == lease.sums[j]]
            self.c["verify_failures"] += len(rows) - len(good)
            pages = np.stack([self.pages[lease.slots[j]] for j in good]) if good else None
        finally:
            with self.lock:
                for s in lease.slots:
                    self._free(s)
        if good:
            t = self._relay_tier(lease.owner)
            t0 = time.perf_counter()
            with t._lock:
                t.timeout_s = lease.timeout_s
                cold = self._relay_cold(t)
                k = t.put_many([lease.keys[j] for j in good], pages)
                peer = t._peers[0]
                if k < len(good) and not peer.up(time.monotonic()):
                    err = f"owner {lease.owner}: {peer.down_reason}"
            fwd_s = time.perf_counter() - t0
            for j in good[:k]:
                stored[j] = 1
            self.c["relay_pages_fwd"] += k
            if err:
                self.c["relay_failures"] += 1
        body = {"stored": stored, "fwd_s": fwd_s}
        if cold:
            body["cold"] = 1
        if err:
            body["error"] = err
        return (MsgType.COMMIT_OK, body, b"")

    def stats(self) -> dict:
        with self.lock:
            d = dict(self.c)
            d.update(address=self.address, node=self.node, page_nbytes=self.page_nbytes, relay=self.relay,
                     slots=getattr(self, "nslots", 0), used_slots=len(self.index),
                     free_slots=len(self.free) if self.page_nbytes else 0, leases=len(self.leases))
            if self.storage is not None:
                d["storage"] = {k: v for k, v in self.storage.stats().items()
                                if isinstance(v, (int, float, str, bool))}
            return d

    def _handle(self, f: Frame, conn: int):
        t = f.type
        if t == MsgType.HELLO:
            return self._hello(f), None
        if t == MsgType.LOOKUP:
            return self._lookup(f, conn), None
        if t == MsgType.RELEASE:
            self._release(f)
            return None, None
        if t == MsgType.PUT:
            return self._put(f, conn), None
        if t == MsgType.COMMIT:
            r = self._relay_commit(f)
            return (r, None) if r is not None else self._commit(f)
        if t in RELAY_TYPES:
            if not self.relay:
                raise WireError(f"relay disabled on this server ({t.name})")
            return (self._relay_get(f, conn) if t == MsgType.RELAY_GET else self._relay_put(f, conn)), None
        if t == MsgType.DISCARD:
            return self._discard(f), None
        if t == MsgType.STATS:
            return (MsgType.STATS_OK, self.stats(), b""), None
        if t == MsgType.PING:
            return (MsgType.PONG, {}, b""), None
        raise WireError(f"unexpected message {t.name}")

    def _serve_conn(self, conn: socket.socket, cid: int) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set():
                try:
                    f = read_frame(conn, None, self.max_blob)
                except WireError as e:  # framing is lost: answer once, then close
                    self.c["errors"] += 1
                    log.warning("tier server: bad frame from connection %d: %s", cid, e)
                    try:
                        write_frame(conn, MsgType.ERROR, {"error": str(e)}, deadline=time.monotonic() + 1)
                    except Exception:
                        pass
                    return
                except (ConnectionError, TimeoutError, OSError):
                    return
                after = None
                try:
                    reply, after = self._handle(f, cid)
                except WireError as e:  # the frame was read whole: the stream is still in sync
                    self.c["errors"] += 1
                    reply = (MsgType.ERROR, {"error": str(e)}, b"")
                except Exception as e:
                    self.c["errors"] += 1
                    log.exception("tier server: error handling %s", f.type.name)
                    reply = (MsgType.ERROR, {"error": f"internal: {type(e).__name__}"}, b"")
                if reply is not None:
                    write_frame(conn, reply[0], reply[1], reply[2], max_blob=self.max_blob)
                if after is not None:
                    after()
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            with self.lock:
                for lease in [l for l in self.leases.values() if l.conn == cid]:
                    self._end_lease(lease)
                self._conns.pop(cid, None)
            try:
                conn.close()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        cid = 0
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            with self.lock:
                if len(self._conns) >= self.max_conns:
                    conn.close()
                    continue
                cid += 1
                self._conns[cid] = conn
                self.c["connections"] += 1
            th = threading.Thread(target=self._serve_conn, args=(conn, cid), daemon=True,
                                  name=f"fftier-conn{cid}")
            th.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [th]

    def serve_forever(self) -> None:
        """Runs until stop(): accepts in a thread; this thread progresses NIXL and expires leases."""
        acc = threading.Thread(target=self._accept_loop, daemon=True, name="fftier-accept")
        acc.start()
        if self.relay and self.relay_peers:
            threading.Thread(target=self._relay_warmup, daemon=True, name="fftier-relay-warmup").start()
        next_expiry = 0.0
        try:
            while not self._stop.is_set():
                try:
                    self.agent.get_new_notifs()  # progresses the UCX worker (needed over TCP)
                except Exception as e:  # pragma: no cover
                    log.debug("get_new_notifs: %r", e)
                now = time.monotonic()
                if now >= next_expiry:
                    next_expiry = now + 0.05
                    with self.lock:
                        for lease in [l for l in self.leases.values() if l.expires < now]:
                            self.c["leases_expired"] += 1
                            self._end_lease(lease)
                self._stop.wait(0.001 if self.leases else 0.02)
        finally:
            self._shutdown()

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        with self.lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass
        if self.storage is not None:
            self.storage.close()
        with self._relay_lock:
            tiers, self._relay_tiers = list(self._relay_tiers.values()), {}
        for t in tiers:
            try:
                t.close()
            except Exception:
                pass


def _parse_relay_peers(s: Optional[str]) -> Dict[str, str]:
    out = {}
    for item in (s or "").split(","):
        if item.strip():
            node, sep, addr = item.strip().partition("=")
            if not sep or not node:
                raise ValueError(f"--relay-peers expects NODE=host:port[,...], got {item!r}")
            parse_hostport(addr)
            out[node] = addr
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow tier-server", description=__doc__.split("\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port (default 127.0.0.1:0)")
    ap.add_argument("--capacity-gb", type=float, default=1.0, help="host buffer size in GiB")
    ap.add_argument("--page-nbytes", type=int, default=None, help="slot size (default: first client's)")
    ap.add_argument("--storage-path", default=None, help="back the buffer with a storage tier here")
    ap.add_argument("--storage-capacity-gb", type=float, default=10.0)
    ap.add_argument("--lease-ttl-s", type=float, default=30.0)
    ap.add_argument("--verify-puts", action="store_true", help="CRC-check written pages at COMMIT")
    ap.add_argument("--node", default=None, help="topology node name reported to clients")
    ap.add_argument("--no-relay", action="store_true", help="refuse RELAY_GET/RELAY_PUT (ERROR)")
    ap.add_argument("--relay-peers", default=None,
                    help="NODE=host:port,...: owners' addresses as seen from here (and the only owners relayed for)")
    ap.add_argument("--relay-retry-after-s", type=float, default=10.0)
    ap.add_argument("--ready-file", default=None, help="write {'listen': host:port, 'pid'} here when ready")
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    srv = TierServer(a.listen, int(a.capacity_gb * _GIB), a.page_nbytes, a.storage_path,
                     a.storage_capacity_gb, a.lease_ttl_s, a.verify_puts, a.node,
                     relay=not a.no_relay, relay_peers=_parse_relay_peers(a.relay_peers),
                     relay_retry_after_s=a.relay_retry_after_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: srv.stop())
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"listen": srv.address, "pid": os.getpid(), "node": srv.node}, fh)
        os.replace(tmp, a.ready_file)
    print(f"READY {srv.address}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
