"""Rails between a prefill and a decode instance, and the selector that splits KV over them.

A *rail* is one network device of the prefill host (a NIC port, a veth, ``lo`` in tests) that the
PD sender can push KV through with its own NIXL UCX agent. The topology is deliberately small:

    prefill --pcie-- rail0 --net(rail0)-- decode
            --pcie-- rail1 --net(rail1)--

so the PathSelector's candidates are one Direct path per rail plus link-disjoint splits. The
network link of each rail is read by the NodeAgent from ``/sys/class/net/<dev>/statistics`` (or the
InfiniBand port counters), and every finished KV chunk feeds back its observed bandwidth, so a rail
loaded by somebody else's traffic (inference collectives, another tenant) is avoided or given a
smaller share, and QoS thresholds keep KV off rails that are already near saturation.

Relay through a third node is not offered here: the decode instance is the only peer the PD
sender knows, and SGLang's bootstrap gives no relay endpoint (docs/pd.md).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..monitor import NodeAgent
from ..selector import PathSelector, SelectorConfig
from ..selector.types import PathType
from ..topology import LinkType, NodeKind, Topology
from ..transfer import Ticket, TransferEngine

logger = logging.getLogger(__name__)

_DEVICE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}$")
SRC, DST = "prefill", "decode"


def check_rail_names(rails: Sequence[str], key: str = "pd.rails") -> None:
    """Device names become sysfs paths and UCX device lists: plain interface names only."""
    for i, dev in enumerate(rails):
        if not isinstance(dev, str) or not _DEVICE_RE.match(dev) or dev in (".", ".."):
            raise ConfigError(f"{key}[{i}] = {dev!r}: not a network device name (letters, digits, _ . : @ -)")


FALLBACK_RAIL_GBPS = 12.5


def rail_capacity_gbps(dev: str, configured_gbps: Optional[float], sysfs_root: str = "/sys") -> Tuple[float, str]:
    """(GB/s, where it came from): pd.rail_gbps when set (a shaped or shared NIC: its speed is not
    what KV gets), else the device's sysfs speed (Mbit/s), else FALLBACK_RAIL_GBPS."""
    if configured_gbps is not None:
        return float(configured_gbps), "pd.rail_gbps"
    path = os.path.join(sysfs_root, "class", "net", dev, "speed")
    try:
        with open(path, "r") as f:
            mbit = float(f.read().strip())
        if mbit > 0:
            return mbit / 8000.0, path
    except (OSError, ValueError):
        pass
    return FALLBACK_RAIL_GBPS, "fallback (no sysfs speed)"


def _counter_for(dev: str, sysfs_root: str) -> dict:
    if os.path.isdir(os.path.join(sysfs_root, "class", "net", dev)):
        return {"sysfs_net": dev}
    if os.path.isdir(os.path.join(sysfs_root, "class", "infiniband", dev)):
        return {"sysfs_ib": f"{dev}/1"}
    return {}


def build_rail_topology(rails: Sequence[str], default_gbps: Optional[float], latency_us: float = 20.0,
                        sysfs_root: str = "/sys",
                        capacities: Optional[Sequence[float]] = None) -> Topology:
    """prefill -> rail_i -> decode for every rail; capacities from sysfs unless given."""
    check_rail_names(rails)
    if not rails:
        raise ConfigError("pd.rails is empty: nothing to route over")
    topo = Topology(f"pd-rails{len(rails)}", "pd:rails")
    topo.add_node(SRC, NodeKind.CPU, SRC, 0)
    topo.add_node(DST, NodeKind.CPU, DST, 0)
    for i, dev in enumerate(rails):
        gbps = float(capacities[i]) if capacities is not None else rail_capacity_gbps(dev, default_gbps, sysfs_root)[0]
        nic = f"rail{i}"
        topo.add_node(nic, NodeKind.NIC, SRC, i, device=dev)
        # the host side of a rail is never the bottleneck here: model it as a wide, idle PCIe hop
        topo.add_link(SRC, nic, LinkType.PCIE, max(64.0, 4 * gbps), 1.0)
        topo.add_link(nic, DST, LinkType.ETHERNET, gbps, float(latency_us), counter=_counter_for(dev, sysfs_root))
    return topo


@dataclass
class RailShare:
    rail: int
    fraction: float


@dataclass
class RoutePlan:
    shares: List[RailShare]
    path_type: str  # "direct" | "split" | "fixed"
    reason: str
    qos_violation: bool = False
    #: the transfer engine's ticket for this chunk (select + reserve done; share k is subpath k);
    #: legs release and report through it (RailRouter.leg_posted / leg_done), close() ends it
    ticket: Optional[Ticket] = None


class RailRouter:
    """Chooses rails for each KV chunk; collects the chunks' observed bandwidth as feedback.

    Selecting, reserving, releasing and reporting are the transfer engine's (transfer/engine.py):
    `plan()` opens one Ticket per chunk (select + reserve every subpath for the decision's
    estimated time), `leg_posted()` marks a leg's bytes as ours on the wire, `leg_done()` releases
    and reports one leg, `finish()` releases what is left. The NIXL manager only posts and polls.

    Thread-safe: SGLang's NIXL sender runs several transfer workers, each calls plan()/leg_done().
    """

    def __init__(self, rails: Sequence[str], selector_config: SelectorConfig, policy: str = "adaptive",
                 default_gbps: Optional[float] = None, latency_us: float = 20.0, sysfs_root: str = "/sys",
                 sample_interval_ms: float = 100.0, feedback_half_life_ms: float = 500.0,
                 impl: str = "auto", start_monitor: bool = True, capacities: Optional[Sequence[float]] = None,
                 elastic_share: float = 0.0, elastic_probe_s: float = 5.0):
        if policy not in ("adaptive", "first_rail"):
            raise ConfigError(f"pd.policy = {policy!r}: RailRouter handles 'adaptive' and 'first_rail'")
        self.rails = list(rails)
        self.policy = policy
        self.topology = build_rail_topology(self.rails, default_gbps, latency_us, sysfs_root, capacities)
        self.agent = NodeAgent(self.topology, sample_interval_ms=sample_interval_ms,
                               source="sysfs" if any(l.counter for l in self.topology.links) else "mock",
                               feedback_half_life_ms=feedback_half_life_ms, sysfs_root=sysfs_root,
                               elastic_share=elastic_share, elastic_probe_s=elastic_probe_s)
        self.selector = PathSelector(self.topology, self.agent, selector_config, impl=impl)
        self.engine = TransferEngine(self.selector, self.agent, name="ff-pd")
        self._rail_of_node = {f"rail{i}": i for i in range(len(self.rails))}
        self._net_link = {i: self.topology.links_between(f"rail{i}", DST)[0].id for i in range(len(self.rails))}
        if start_monitor:
            self.agent.start()

    def close(self) -> None:
        self.agent.stop()

    def plan(self, nbytes: int) -> RoutePlan:
        """The rails for one chunk, with its ticket (reservations held until leg_done / finish).
        Raises when the selector has no route (the caller sends the chunk via SGLang's agent)."""
        if self.policy == "first_rail" or len(self.rails) == 1:
            return RoutePlan([RailShare(0, 1.0)], "fixed", "pd.policy first_rail" if self.policy == "first_rail"
                             else "one rail", ticket=self.engine.unrouted(int(nbytes)))
        t = self.engine.open(SRC, DST, max(1, int(nbytes)))
        d = t.decision
        if d is None:
            t.close()
            raise RuntimeError(f"no rail route for a {nbytes} B chunk (selector failed)")
        shares = []
        for sp in d.subpaths:
            rail = next(self._rail_of_node[n] for n in sp.nodes if n in self._rail_of_node)
            shares.append(RailShare(rail, sp.nbytes / float(nbytes) if nbytes else 1.0))
        kind = "split" if d.chosen_type == PathType.SplitPath else "direct"
        return RoutePlan(shares, kind, d.reason, bool(d.qos_violation), ticket=t)

    def _leg_links(self, ticket: Ticket, leg: int, rail: int):
        """The links a leg crosses: its subpath's when routed, else the rail's network link."""
        subs = ticket.subpaths
        if 0 <= leg < len(subs) and self._rail_of_node.get(subs[leg].nodes[1]) == rail:
            return subs[leg].links
        return (self._net_link[rail],)

    def leg_posted(self, ticket: Ticket, leg: int, rail: int, nbytes: int) -> None:
        """Leg `leg` (share index) was posted on `rail`: the sampled counters must not count its
        bytes as foreign load while it runs."""
        ticket.posted(leg, int(nbytes), links=self._leg_links(ticket, leg, rail))

    def leg_done(self, ticket: Ticket, leg: int, rail: int, nbytes: int, seconds: float, ok: bool = True) -> None:
        """A leg ended: release its reservation; a successful leg's own rate is feedback for its rail
        (a failed one reports nothing: its time says nothing about the link)."""
        if ok and rail >= 0 and nbytes > 0 and seconds > 0:
            ticket.leg_done(leg, int(nbytes), float(seconds), links=self._leg_links(ticket, leg, rail), relays=0,
                            progress_reported=True)
        else:
            ticket.release_leg(leg)

    def finish(self, ticket: Optional[Ticket]) -> None:
        """The chunk is settled (or abandoned): release whatever it still holds; idempotent."""
        if ticket is not None:
            ticket.close("pd:")

    def feedback(self, rail: int, nbytes: int, seconds: float) -> None:
        """A transfer on `rail` measured outside a plan (a probe, a test): its rate is feedback."""
        t = self.engine.unrouted(int(nbytes))
        t.leg_done(0, int(nbytes), float(seconds), links=(self._net_link[rail],), relays=0)
        t.close()

    def utilization(self) -> List[float]:
        return [float(self.agent.util[self._net_link[i]]) for i in range(len(self.rails))]


def split_by_shares(n: int, shares: Sequence[RailShare]) -> List[Tuple[int, int, int]]:
    """[(rail, start, stop)] covering range(n) in order, sized by the shares (whole items, none empty
    unless n is smaller than the number of shares)."""
    out: List[Tuple[int, int, int]] = []
    total = sum(max(0.0, s.fraction) for s in shares) or 1.0
    start, acc = 0, 0.0
    for k, s in enumerate(shares):
        acc += max(0.0, s.fraction) / total
        stop = n if k == len(shares) - 1 else min(n, int(round(acc * n)))
        if stop > start:
            out.append((s.rail, start, stop))
            start = stop
    return out
