"""Tier server: holds KV pages in a NIXL-registered host buffer (optionally backed by a storage
tier) and serves them to peers' RemoteTier clients.

    python -m flexflow_sglang.tiers.tier_server --listen 127.0.0.1:PORT --capacity-gb X \
        [--storage-path DIR] [--page-nbytes N] [--ready-file F] [--secret-file F]

Control channel: TCP, frames of flexflow_sglang.tiers.wire, one thread per connection. Data: the
client is the NIXL (UCX) initiator: it READs pinned slots and WRITEs into slots this server
allocated; the server only registers its buffer, hands out its agent metadata and keeps the UCX
worker progressing (1 ms polls while any lease is open, 20 ms otherwise).

Slots: the buffer is cut into slots of one page size, fixed by --page-nbytes (or the page files of
--storage-path); without either, the first HELLO within MIN_PAGE_NBYTES..min(capacity, 256 MiB)
fixes it (a single-tenant convenience: a shared server should pass --page-nbytes). A client with
another page size gets an ERROR. Slot metadata lives in numpy arrays (~13 bytes per slot) plus one
index entry per stored page. LRU eviction over unpinned slots. Leases (pins of a LOOKUP,
reservations of a PUT) belong to the connection that took them: only it can COMMIT or RELEASE them;
they end then, when that connection closes, or after --lease-ttl-s. Binds 127.0.0.1 unless --listen
says otherwise.

Hostile or broken clients: a connection that sends no frame for --idle-timeout-s (--lease-ttl-s
while it holds a lease: it is moving data), or takes longer
than --frame-timeout-s for one frame once it started (slowloris), or does not read its replies, is
cut. Client frames are read with tight limits (wire.SERVER_MAX_JSON / SERVER_MAX_BLOB, at most
wire.MAX_KEYS_PER_FRAME keys), so one connection holds a bounded amount of memory (docs/tiers.md).
When --max-conns connections are open, a new one takes the place of the one idle the longest.
--secret-file (or $FLEXFLOW_TIER_SECRET): shared-secret mode (tiers/trust.py): HMAC on every frame,
a MAC stored and returned with every page; relaying is then off.

CrossNodeRelay (RELAY_GET / RELAY_PUT): a client that routes around a congested link asks this
server to pull pages from their owner (or forward them to it). The server is then itself a
RemoteTier client of the owner (one per owner address, created on first use, NIXL agent of its own)
and stages the pages in temporary slots of its buffer: never indexed, freed when the lease ends.
`--relay-peers NODE=host:port,...` gives the owners' addresses as seen from here (and, when
set, is the list of owners it will relay for); `--no-relay` answers relay requests with ERROR.
"""
from __future__ import annotations

import logging
import mmap
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import numpy as np

from .base import make_agent, page_digests, unique_agent_name
from .relay_server import RelayMixin
from .trust import MAC_LEN, NONCE_LEN, FrameAuth, PageMac
from .wire import (MAX_BLOB, RELAY_TYPES, SERVER_MAX_BLOB, SERVER_MAX_JSON, Frame, IdleTimeout, MsgType,
                   WireError, int_list, parse_hostport, read_frame, unpack_keys, write_frame)

log = logging.getLogger("flexflow_sglang.tiers.server")
_GIB = 1 << 30
MIN_PAGE_NBYTES = 64  # the tiny CPU test model has 256-byte pages (2 layers, page_size 1)
MAX_PAGE_NBYTES = 256 << 20
MAX_CAPACITY_GB = 4096.0
_KEYED = frozenset((MsgType.LOOKUP, MsgType.PUT, MsgType.DISCARD))


@dataclass
class _Lease:
    id: int
    kind: str  # "get" | "put" | "relay_put"
    slots: List[int]
    expires: float
    conn: int
    keys: List[bytes] = field(default_factory=list)
    sums: List[int] = field(default_factory=list)
    macs: List[bytes] = field(default_factory=list)
    owner: str = ""         # relay_put: where COMMIT forwards the pages
    timeout_s: float = 0.0  # relay_put: the forward's timeout


@dataclass
class _Conn:
    sock: socket.socket
    cid: int
    auth: Optional[FrameAuth] = None
    hello: bool = False        # a HELLO was answered (in shared-secret mode: session established)
    busy: bool = False         # handling a frame (never evicted then)
    last: float = field(default_factory=time.monotonic)  # end of its last frame (or accept)


class TierServer(RelayMixin):
    WORKERS = 4  # frames handled at once (each may decode 32768 keys): bounds memory beyond the read buffers

    def __init__(self, listen: str = "127.0.0.1:0", capacity_bytes: int = _GIB,
                 page_nbytes: Optional[int] = None, storage_path: Optional[str] = None,
                 storage_capacity_gb: float = 10.0, lease_ttl_s: float = 30.0,
                 verify_puts: bool = False, node: Optional[str] = None, max_conns: int = 64,
                 max_blob: int = MAX_BLOB, relay: bool = True, relay_peers: Optional[Dict[str, str]] = None,
                 relay_retry_after_s: float = 10.0, idle_timeout_s: float = 60.0,
                 frame_timeout_s: float = 10.0, secret: Optional[bytes] = None,
                 storage_read_only: bool = False, storage_fsync: bool = False, storage_layout: str = "files"):
        host, port = parse_hostport(listen)
        self.capacity = int(capacity_bytes)
        if self.capacity <= 0:
            raise ValueError("tier server capacity must be > 0")
        self.lease_ttl_s = lease_ttl_s
        self.verify_puts = verify_puts
        self.node = node or socket.gethostname()
        self.max_conns = int(max_conns)
        self.max_blob = max_blob              # outgoing frames (HELLO_OK carries the NIXL metadata)
        self.idle_timeout_s = float(idle_timeout_s)
        self.frame_timeout_s = float(frame_timeout_s)
        self.secret = secret
        self.pagemac = PageMac(secret) if secret else None
        self.storage_path = storage_path
        self.storage_capacity_gb = storage_capacity_gb
        self.storage_read_only = storage_read_only
        self.storage_fsync = storage_fsync
        if storage_layout not in ("files", "slabs"):
            raise ValueError(f"tier server storage layout must be files|slabs, got {storage_layout!r}")
        self.storage_layout = storage_layout
        self.storage = None
        self.relay = bool(relay) and not secret  # a relay would need the secret-mode client path too
        if relay and secret:
            log.info("tier server: relaying is off in shared-secret mode")
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
        self.nslots = 0
        self.index: "OrderedDict[bytes, int]" = OrderedDict()
        self.leases: Dict[int, _Lease] = {}
        self._stop = threading.Event()
        self._work = threading.BoundedSemaphore(self.WORKERS)
        self._conns: Dict[int, _Conn] = {}
        self._threads: List[threading.Thread] = []
        self.c = dict(connections=0, lookups=0, lookup_pages=0, puts=0, pages_stored=0, pages_have=0,
                      pages_skipped=0, evictions=0, leases_expired=0, promoted=0, verify_failures=0,
                      discarded=0, errors=0, storage_writes=0, relay_gets=0, relay_pages_out=0,
                      relay_puts=0, relay_pages_fwd=0, relay_failures=0, idle_cut=0, slow_cut=0,
                      conns_refused=0, conns_evicted=0, lease_denied=0, auth_failures=0)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.address = f"{'[' + host + ']' if ':' in host else host}:{self.sock.getsockname()[1]}"
        if not page_nbytes and storage_path:  # restarted with pages on disk: serve them at once
            pn = self._storage_class().peek_page_nbytes(storage_path)
            page_nbytes = (pn - MAC_LEN if self.pagemac else pn) if pn else None
        if page_nbytes:
            self._setup_slots(int(page_nbytes))

    def _storage_class(self):
        """The storage tier class of `storage_layout` (files: one file per page; slabs: slots)."""
        from .storage import StorageTier
        from .storage_slabs import SlabStorageTier
        return SlabStorageTier if self.storage_layout == "slabs" else StorageTier

    # ------------------------------------------------------------------ slots
    @property
    def max_page_nbytes(self) -> int:
        return min(self.capacity, MAX_PAGE_NBYTES)

    def _setup_slots(self, P: int) -> None:
        if not MIN_PAGE_NBYTES <= P <= self.max_page_nbytes:
            raise WireError(f"page_nbytes {P} outside {MIN_PAGE_NBYTES}..{self.max_page_nbytes}")
        n = self.capacity // P
        self.pages = self.buf[: n * P].reshape(n, P)
        # compact per-slot metadata (13 bytes a slot, 17 + 16 with page MACs); keys only for
        # occupied slots: memory follows what is stored, not what a client claims
        self._free_stack = np.arange(n - 1, -1, -1, dtype=np.int32)
        self._nfree = n
        self._is_free = np.ones(n, dtype=bool)
        self.slot_sum = np.zeros(n, dtype=np.uint64)  # each slot's 64-bit page hash (wire version 2)
        self.pins = np.zeros(n, dtype=np.int32)
        self.slot_mac = np.zeros((n, MAC_LEN), dtype=np.uint8) if self.pagemac else None
        self.slot_key: Dict[int, bytes] = {}
        self.doomed: Set[int] = set()
        self.reserved: Dict[bytes, int] = {}
        if self.storage_path:
            from .storage import StorageTierError
            try:
                self.storage = self._storage_class()(self.storage_path, capacity_gb=self.storage_capacity_gb,
                                           fingerprint="flexflow-tier-server", node=self.node,
                                           page_nbytes=P + MAC_LEN if self.pagemac else P,
                                           read_only=self.storage_read_only, fsync=self.storage_fsync)
            except (StorageTierError, OSError) as e:
                if self.page_nbytes is None and not self._conns:  # at start: main() prints one line
                    raise
                log.warning("tier server: storage tier unavailable: %s", e)
                raise WireError(f"tier server storage: {e}") from None
        self.page_nbytes = P
        self.nslots = n
        log.info("tier server %s: %d slots of %d bytes", self.address, n, P)

    @property
    def free(self) -> range:  # the count is what callers need (len(self.free))
        return range(self._nfree if self.page_nbytes else 0)

    def _alloc(self, protect) -> Optional[int]:
        if self._nfree:
            self._nfree -= 1
            s = int(self._free_stack[self._nfree])
            self._is_free[s] = False
            return s
        for k, s in self.index.items():  # LRU first
            if self.pins[s] == 0 and k not in protect:
                del self.index[k]
                self.slot_key.pop(s, None)
                self.c["evictions"] += 1
                return s
        return None

    def _free(self, s: int) -> None:
        if self._is_free[s]:
            return
        self.slot_key.pop(s, None)
        self.pins[s] = 0
        self.doomed.discard(s)
        self._is_free[s] = True
        self._free_stack[self._nfree] = s
        self._nfree += 1

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
            self.slot_key.pop(s, None)
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
        lid = 0
        while not lid or lid in self.leases:  # unguessable, and JSON-safe (< 2^53)
            lid = secrets.randbits(52)
        lease = _Lease(lid, kind, slots, time.monotonic() + self.lease_ttl_s, conn)
        self.leases[lid] = lease
        return lease

    def _lease_of(self, lid, conn: int, kinds) -> Optional[_Lease]:
        """The lease `lid` if this connection holds it (lock held). Another connection's lease is
        unknown to this one (counted in lease_denied): leases cannot be stolen or released by others."""
        lease = self.leases.get(lid) if isinstance(lid, int) and not isinstance(lid, bool) else None
        if lease is None or lease.kind not in kinds:
            return None
        if lease.conn != conn:
            self.c["lease_denied"] += 1
            return None
        return lease

    # ------------------------------------------------------------------ handlers
    def _need_slots(self) -> None:
        if self.page_nbytes is None:
            raise WireError("HELLO with page_nbytes first")

    def _hello(self, f: Frame, cs: _Conn):
        P = f.body.get("page_nbytes", 0)
        if not isinstance(P, int) or isinstance(P, bool) or P < 0:
            raise WireError("HELLO page_nbytes must be an integer >= 0 (0: any)")
        if P and not MIN_PAGE_NBYTES <= P <= self.max_page_nbytes:
            raise WireError(f"HELLO page_nbytes {P} outside {MIN_PAGE_NBYTES}..{self.max_page_nbytes}")
        body = {"agent": self.agent.name, "node": self.node, "relay": int(self.relay)}
        after = None
        if cs.auth is not None and not cs.hello:
            try:
                cnonce = bytes.fromhex(f.body.get("nonce", ""))
            except (TypeError, ValueError):
                cnonce = b""
            if len(cnonce) != NONCE_LEN:
                raise WireError(f"HELLO needs a {NONCE_LEN}-byte hex 'nonce' in shared-secret mode")
            snonce = cs.auth.nonce
            body.update(auth=1, mac=MAC_LEN, nonce=snonce.hex(), cnonce=cnonce.hex())
            after = (lambda: cs.auth.start_session(cnonce, snonce))
        with self.lock:
            if self.page_nbytes is None and P:
                self._setup_slots(P)
            elif P and P != self.page_nbytes:
                raise WireError(f"page_nbytes mismatch: this server uses {self.page_nbytes}, client {P}")
            body.update(page_nbytes=self.page_nbytes or 0, slots=self.nslots)
        cs.hello = True
        return (MsgType.HELLO_OK, body, self.md), after

    def _promote(self, keys: List[bytes], protect) -> List[int]:
        """Load leading `keys` from the storage tier into slots (lock held)."""
        got: List[int] = []
        if self.storage is None or not keys:
            return got
        m = self.storage.contains_prefix(keys)
        P = self.page_nbytes
        row = np.empty((1, P + MAC_LEN), dtype=np.uint8) if self.pagemac else None
        for k in keys[:m]:
            s = self._alloc(protect)
            if s is None:
                break
            if row is not None:  # stored as page || MAC
                ok = self.storage.get_many_into([k], row) == 1
                if ok:
                    self.pages[s] = row[0, :P]
                    self.slot_mac[s] = row[0, P:]
            else:
                ok = self.storage.get_many_into([k], self.pages[s:s + 1]) == 1
            if not ok:
                self._free(s)
                break
            self.index[k] = s
            self.slot_key[s] = k
            self.slot_sum[s] = page_digests(self.pages, 1, [s])[0]
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
            if len(slots) < len(keys) and self.storage is not None:
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
            blob = self.slot_mac[slots].tobytes() if (pin and slots and self.pagemac) else b""
            return (MsgType.LOOKUP_OK, {"count": len(slots), "lease": lease_id,
                                        "addrs": [base + s * P for s in slots] if pin else [],
                                        "sums": [int(self.slot_sum[s]) for s in slots] if pin else []}, blob)

    def _release(self, f: Frame, conn: int) -> None:
        drop = f.body.get("drop") or []
        with self.lock:
            lease = self._lease_of(f.body.get("lease"), conn, ("get",))
            if lease is None:
                return
            if isinstance(drop, list):
                for i in drop[:len(lease.slots)]:
                    if isinstance(i, int) and 0 <= i < len(lease.slots):
                        k = self.slot_key.get(lease.slots[i])
                        if k is not None and self.index.get(k) == lease.slots[i]:
                            self._drop_key(k)
                            self.c["discarded"] += 1
            self._end_lease(lease)

    def _put(self, f: Frame, conn: int):
        keys = unpack_keys(f.body, f.blob, MAC_LEN if self.pagemac else 0)
        sums = int_list(f.body, "sums", len(keys))
        macs: List[bytes] = []
        if self.pagemac:
            if f.body.get("mac") != MAC_LEN:
                raise WireError(f"PUT needs page MACs (\"mac\": {MAC_LEN}) in shared-secret mode")
            off = len(keys) * (len(keys[0]) if keys else 0)
            macs = [f.blob[off + i * MAC_LEN: off + (i + 1) * MAC_LEN] for i in range(len(keys))]
        with self.lock:
            self._need_slots()
            self.c["puts"] += 1
            protect = set(keys)
            status, addrs, slots, lkeys, lsums, lmacs = [], [], [], [], [], []
            mine: Set[bytes] = set()
            full = False
            base, P = self.buf.ctypes.data, self.page_nbytes
            for i, (k, sm) in enumerate(zip(keys, sums)):
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
                lsums.append(sm & 0xFFFFFFFFFFFFFFFF)  # a value out of range only fails its check
                if macs:
                    lmacs.append(macs[i])
            lease_id = 0
            if slots:
                lease = self._new_lease("put", slots, conn)
                lease.keys, lease.sums, lease.macs = lkeys, lsums, lmacs
                for k in lkeys:
                    self.reserved[k] = lease.id
                lease_id = lease.id
            return (MsgType.PUT_OK, {"lease": lease_id, "status": status, "addrs": addrs}, b"")

    def _commit(self, f: Frame, conn: int):
        with self.lock:
            lease = self._lease_of(f.body.get("lease"), conn, ("put",))
            if lease is None:
                return (MsgType.COMMIT_OK, {"stored": []}, b""), None
            ok = int_list(f.body, "ok", len(lease.slots))
            stored = [1 if ok[j] else 0 for j in range(len(lease.slots))]
            if self.verify_puts:  # every written page's hash in one compiled call (GIL released once)
                rows = [j for j in range(len(stored)) if stored[j]]
                got = page_digests(self.pages, len(rows), [lease.slots[j] for j in rows]) if rows else []
                for j, g in zip(rows, got):
                    s = lease.slots[j]
                    if g != lease.sums[j] or (
                            self.pagemac and self.pagemac.mac(lease.keys[j], self.pages[s]) != lease.macs[j]):
                        self.c["verify_failures"] += 1
                        stored[j] = 0
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
                    if self.pagemac:
                        self.slot_mac[s] = np.frombuffer(lease.macs[j], dtype=np.uint8)
                    self.c["pages_stored"] += 1
                    if self.storage is not None and not self.storage_read_only:
                        self.pins[s] += 1
                        wt_keys.append(k)
                        wt_slots.append(s)
        after = (lambda: self._write_through(wt_keys, wt_slots)) if wt_keys else None
        return (MsgType.COMMIT_OK, {"stored": stored}, b""), after

    def _write_through(self, keys: List[bytes], slots: List[int]) -> None:
        try:
            rows = np.stack([self.pages[s] for s in slots])
            if self.pagemac:  # the MAC travels with the page through restarts
                rows = np.concatenate([rows, self.slot_mac[slots]], axis=1)
            self.storage.put_many(keys, rows)
            self.c["storage_writes"] += len(keys)
        except Exception as e:  # best effort after COMMIT_OK was sent (OSError, NIXL errors): pages stay in memory
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

    def stats(self) -> dict:
        with self.lock:
            d = dict(self.c)
            d.update(address=self.address, node=self.node, page_nbytes=self.page_nbytes, relay=self.relay,
                     slots=self.nslots, used_slots=len(self.index), free_slots=len(self.free),
                     leases=len(self.leases), open_connections=len(self._conns), max_conns=self.max_conns,
                     idle_timeout_s=self.idle_timeout_s, frame_timeout_s=self.frame_timeout_s,
                     auth=int(self.secret is not None))
            if self.storage is not None:
                d["storage"] = {k: v for k, v in self.storage.stats().items()
                                if isinstance(v, (int, float, str, bool))}
            return d

    def _handle(self, f: Frame, cs: _Conn):
        t, conn = f.type, cs.cid
        if t == MsgType.HELLO:
            return self._hello(f, cs)
        if cs.auth is not None and not cs.hello:
            raise WireError("shared-secret mode: HELLO first")
        if t == MsgType.LOOKUP:
            return self._lookup(f, conn), None
        if t == MsgType.RELEASE:
            self._release(f, conn)
            return None, None
        if t == MsgType.PUT:
            return self._put(f, conn), None
        if t == MsgType.COMMIT:
            r = self._relay_commit(f, conn)
            return (r, None) if r is not None else self._commit(f, conn)
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

    def _warn(self, fmt: str, *args) -> None:
        """Misbehaving clients must not turn into a log flood: the first 20 warnings, then one in 1000."""
        self._warned = getattr(self, "_warned", 0) + 1
        if self._warned <= 20 or self._warned % 1000 == 0:
            log.warning(fmt + ("" if self._warned <= 20 else f" ({self._warned} such warnings so far)"), *args)

    def _send(self, cs: _Conn, mtype: MsgType, body: dict, blob: bytes = b"") -> None:
        # a client that does not read its replies cannot hold this thread past the frame timeout
        write_frame(cs.sock, mtype, body, blob, deadline=time.monotonic() + self.frame_timeout_s,
                    max_blob=self.max_blob, auth=cs.auth)

    def _serve_conn(self, cs: _Conn) -> None:
        conn, cid = cs.sock, cs.cid
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set():
                with self.lock:  # a client between PUT_OK and COMMIT (or LOOKUP and RELEASE) is
                    held = any(l.conn == cid for l in self.leases.values())  # moving data: lease TTL
                idle_s = max(self.idle_timeout_s, self.lease_ttl_s) if held else self.idle_timeout_s
                try:
                    f = read_frame(conn, None, SERVER_MAX_BLOB, auth=cs.auth, max_json=SERVER_MAX_JSON,
                                   idle_deadline=time.monotonic() + idle_s, frame_s=self.frame_timeout_s)
                except WireError as e:  # framing (or authentication) is lost: answer once, then close
                    self.c["errors"] += 1
                    if "authentica" in str(e) or "secret" in str(e):
                        self.c["auth_failures"] += 1
                    self._warn("tier server: bad frame from connection %d: %s", cid, e)
                    try:  # unauthenticated: the peer may not hold the secret, so no tag
                        write_frame(conn, MsgType.ERROR, {"error": str(e)}, deadline=time.monotonic() + 1)
                    except (OSError, WireError) as e2:  # the connection is closed next anyway
                        log.debug("tier server: ERROR to connection %d not sent: %r", cid, e2)
                    return
                except IdleTimeout:
                    self.c["idle_cut"] += 1
                    log.info("tier server: connection %d idle for %.0f s; closed", cid, self.idle_timeout_s)
                    return
                except TimeoutError:
                    self.c["slow_cut"] += 1
                    self._warn("tier server: connection %d took over %.1f s for one frame; closed",
                               cid, self.frame_timeout_s)
                    return
                except (ConnectionError, OSError):
                    return
                cs.busy = True
                after = None
                try:
                    if f.type in _KEYED:  # decoded keys and replies of at most WORKERS frames at a time
                        with self._work:
                            reply, after = self._handle(f, cs)
                    else:  # (relays wait on their owner: never behind this semaphore)
                        reply, after = self._handle(f, cs)
                except WireError as e:  # the frame was read whole: the stream is still in sync
                    self.c["errors"] += 1
                    reply = (MsgType.ERROR, {"error": str(e)}, b"")
                except Exception as e:  # a bug in one handler answers ERROR; the server keeps serving
                    self.c["errors"] += 1
                    log.exception("tier server: error handling %s", f.type.name)
                    reply = (MsgType.ERROR, {"error": f"internal: {type(e).__name__}"}, b"")
                try:
                    if reply is not None:
                        self._send(cs, *reply)
                    if after is not None:
                        after()
                except TimeoutError:
                    self.c["slow_cut"] += 1
                    self._warn("tier server: connection %d does not read its replies; closed", cid)
                    return
                finally:
                    cs.busy = False
                    cs.last = time.monotonic()
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

    def _make_room(self) -> bool:
        """All connection slots taken (lock held): cut the connection idle the longest (between
        frames for >= 1 s; one that never sent HELLO first), so silent sockets cannot lock new
        clients out. False: all are busy."""
        now = time.monotonic()
        idle = [c for c in self._conns.values() if not c.busy and now - c.last >= 1.0]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.hello, c.last))  # sockets that never said HELLO go first
        self._conns.pop(victim.cid, None)
        self.c["conns_evicted"] += 1
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and ends its leases
        except OSError:
            pass
        return True

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
                if len(self._conns) >= self.max_conns and not self._make_room():
                    self.c["conns_refused"] += 1
                    conn.close()
                    continue
                cid += 1
                cs = _Conn(conn, cid, FrameAuth(self.secret, "s") if self.secret else None)
                self._conns[cid] = cs
                self.c["connections"] += 1
            th = threading.Thread(target=self._serve_conn, args=(cs,), daemon=True, name=f"fftier-conn{cid}")
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
                except Exception as e:  # pragma: no cover  (NIXL errors share no base; next round retries)
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
            conns = [c.sock for c in self._conns.values()]
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=2)
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as e:  # NIXL errors share no base; stopping drops the agent anyway
            log.debug("tier server: deregister at stop: %r", e)
        if self.storage is not None:
            self.storage.close()
        with self._relay_lock:
            tiers, self._relay_tiers = list(self._relay_tiers.values()), {}
        for t in tiers:
            try:
                t.close()
            except Exception as e:  # one relay client failing to close must not stop the others
                log.debug("tier server: closing relay client: %r", e)


def _parse_relay_peers(s: Optional[str]) -> Dict[str, str]:
    out = {}
    for item in (s or "").split(","):
        if item.strip():
            node, sep, addr = item.strip().partition("=")
            if not sep or not node:
                raise ValueError(f"--relay-peers expects NODE=host:port[,...], got {item!r}")
            try:
                parse_hostport(addr)
            except ValueError as e:
                raise ValueError(f"--relay-peers {item!r}: {e}") from None
            out[node] = addr
    return out


if __name__ == "__main__":  # `python -m flexflow_sglang.tiers.tier_server`: flags, validation and
    # start-up live in server_cli.py, which imports this module (the library never imports its CLI)
    import runpy
    runpy.run_module("flexflow_sglang.tiers.server_cli", run_name="__main__", alter_sys=True)
