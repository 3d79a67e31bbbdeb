"""The remote tier's client-side records: one `Peer` per configured tier server, the pinned
LOOKUP_OK answers of one read, and the registered staging buffers transfers run through."""
from __future__ import annotations

import select
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .trust import FrameAuth
from .wire import parse_hostport


class Peer:
    """One configured tier server as this client sees it: address, control connection, the
    server's NIXL identity, health (down until, why), relay capability and counters. The tier and
    its Router (tiers/routing.py) read and update these fields; only the tier opens connections."""

    def __init__(self, addr: str):
        self.addr = addr
        self.host, self.port = parse_hostport(addr)
        self.sock: Optional[socket.socket] = None
        self.auth: Optional[FrameAuth] = None  # shared-secret state of this connection
        self.agent_name: Optional[str] = None  # the server's NIXL agent
        self.md: Optional[bytes] = None
        self.loaded_gen = -1                   # our agent generation that has its metadata
        self.page_nbytes: Optional[int] = None
        self.node: Optional[str] = None
        self.down_until = 0.0
        self.down_reason = ""
        self.relay_cap: Optional[int] = None   # HELLO_OK "relay" (None: not said, e.g. an older server)
        self.relay_unsup_until = 0.0           # answered ERROR to a RELAY_* request: direct until then
        self.c = dict(timeouts=0, failures=0, down_events=0, bytes_read=0, bytes_written=0,
                      pages_read=0, pages_written=0)
        self.bw_gbps = 0.0  # EWMA of the observed data-phase bandwidth

    def up(self, now: float) -> bool:
        return now >= self.down_until

    @property
    def connected(self) -> bool:
        """A control connection is open (it may still turn out stale: see `stale`)."""
        return self.sock is not None

    def note_bandwidth(self, gbps: float) -> None:
        """Fold one observed data-phase bandwidth into the EWMA `bw_gbps` (the first one is taken as is)."""
        self.bw_gbps = 0.7 * self.bw_gbps + 0.3 * gbps if self.bw_gbps else gbps

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
        self.auth = None

    def stale(self) -> bool:
        """The server closed this idle connection (idle deadline, room for a new client), or sent
        something unasked: reconnect instead of failing the next request on it."""
        if self.sock is None:
            return False
        try:
            r, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(r)  # readable while no request is outstanding: EOF, or an ERROR before closing


@dataclass
class _Pinned:
    """What the owners' pinned LOOKUP_OKs said, per pid: leading keys held, the lease that pins
    them, their buffer addresses, writer page hashes and (shared-secret mode) page MACs."""
    counts: Dict[int, int] = field(default_factory=dict)
    leases: Dict[int, int] = field(default_factory=dict)
    addrs: Dict[int, List[int]] = field(default_factory=dict)
    sums: Dict[int, List[int]] = field(default_factory=dict)
    macs: Dict[int, List[bytes]] = field(default_factory=dict)


class StagingBuffer:
    """A registered staging buffer; `users` counts parked transfers still using it."""
    __slots__ = ("arr", "reg", "users")

    def __init__(self, arr: np.ndarray, reg):
        self.arr, self.reg, self.users = arr, reg, 0
