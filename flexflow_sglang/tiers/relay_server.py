"""CrossNodeRelay on the tier server (RELAY_GET / RELAY_PUT, and COMMIT of a relay lease).

A client that routes around a congested link asks this server to pull pages from their owner (or
forward them to it). The server is then itself a RemoteTier client of the owner (one per owner
address, created on first use or at start for --relay-peers, NIXL agent of its own) and stages the
pages in temporary slots of its buffer: never indexed, freed when the lease ends. Mixed into
TierServer (tier_server.py), whose slots, leases and lock it uses.
"""
from __future__ import annotations

import logging
import time
from typing import List

import numpy as np

from .base import page_digests
from .wire import Frame, MsgType, WireError, int_list, parse_hostport, unpack_keys

log = logging.getLogger("flexflow_sglang.tiers.server")


class _RelayRefused(Exception):
    """A relay request this server will not or cannot serve (answered in the OK frame's "error")."""


class RelayMixin:
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
        return t.first_contact(0)

    def _relay_warmup(self) -> None:
        """Create the relay clients of --relay-peers (NIXL agent ~0.5 s each) before they are needed."""
        for addr in self.relay_peers.values():
            if self._stop.is_set():
                return
            try:
                t = self._relay_tier(addr)
                with t.lock:
                    t.ensure_agent()
            except Exception as e:  # NIXL/UCX errors share no base class; the client is then made on first use
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
                with t.lock:
                    t.timeout_s = timeout_s
                    cold = self._relay_cold(t)
                    got = t.get_many_into(keys[:m], out)
                    peer = t.peer(0)
                    if got < m and not peer.up(time.monotonic()):
                        err = f"owner {addr}: {peer.down_reason}"
                pull_s = time.perf_counter() - t0
                if got and not contiguous:
                    for j in range(got):
                        self.pages[slots[j]] = out[j]
            elif keys:
                err = "relay buffer full"
            sums = page_digests(self.pages, got, slots[:got]) if got else []
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
                lease.sums = [x & 0xFFFFFFFFFFFFFFFF for x in sums[:len(slots)]]
                lease.owner, lease.timeout_s = addr, self._relay_timeout(f.body)
                lease_id = lease.id
            base, P = self.buf.ctypes.data, self.page_nbytes
            return (MsgType.RELAY_PUT_OK, {"lease": lease_id, "status": [0] * len(slots) + [-1] * (len(keys) - len(slots)),
                                           "addrs": [base + s * P for s in slots]}, b"")

    def _relay_commit(self, f: Frame, conn: int):
        """COMMIT of a relay_put lease: check the writer's page hashes, forward to the owner. None: the
        lease is not a relay lease of this connection (the plain COMMIT handles it)."""
        with self.lock:
            lease = self._lease_of(f.body.get("lease"), conn, ("relay_put",))
            if lease is None:
                return None
            ok = int_list(f.body, "ok", len(lease.slots))
            self.leases.pop(lease.id, None)  # ours now: expiry must not free the slots under us
        n = len(lease.slots)
        stored, err, fwd_s, cold = [0] * n, None, 0.0, False
        try:
            rows = [j for j in range(n) if ok[j]]
            got = page_digests(self.pages, len(rows), [lease.slots[j] for j in rows]) if rows else []
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
            with t.lock:
                t.timeout_s = lease.timeout_s
                cold = self._relay_cold(t)
                k = t.put_many([lease.keys[j] for j in good], pages)
                peer = t.peer(0)
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

