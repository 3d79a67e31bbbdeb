"""Machines, background loads and KV workloads of the simulation study.

Every scenario moves `n_transfers` KV payloads of one size between one (src, dst) pair: within a
box GPU0 -> GPU1, across nodes n0.gpu0 -> n1.gpu0 (a prefill -> decode hand-off), arriving as a
Poisson stream after a warm-up that lets the monitor take its first samples. The background load is
placed relative to that pair's default (always-direct) route.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Tuple

import numpy as np

from flexflow_sglang.selector import SelectorConfig, TransferRequest
from flexflow_sglang.topology import make_mock, make_mock_cluster
from flexflow_sglang.topology.graph import LinkType, NodeKind, Path, PathType, Topology
from .engine import GB, BgFlow, BgGroup, Network

FABRIC = (LinkType.NVLINK, LinkType.NVSWITCH, LinkType.RDMA, LinkType.ETHERNET)


@dataclass(frozen=True)
class Machine:
    name: str
    title: str
    factory: Callable[[], Topology]
    src: str
    dst: str
    cluster: bool = False


def _cluster(nodes, nics):
    return Machine(f"cluster{nodes}x8x{nics}", f"{nodes} nodes x 8 GPU, {nics} NIC/node",
                   lambda: make_mock_cluster(nodes, 8, nics), "n0.gpu0", "n1.gpu0", True)


MACHINES: Dict[str, Machine] = {m.name: m for m in [
    Machine("dgx-a100", "4x A100 NVLink mesh (flexFlow box)", lambda: make_mock("dgx-a100"), "gpu0", "gpu1"),
    Machine("dgx8", "8-GPU NVLink mesh", lambda: make_mock("dgx8"), "gpu0", "gpu1"),
    Machine("nvswitch8", "8-GPU NVSwitch", lambda: make_mock("nvswitch8"), "gpu0", "gpu1"),
    _cluster(2, 1), _cluster(2, 4), _cluster(2, 8), _cluster(4, 1), _cluster(4, 4), _cluster(4, 8),
]}

LOADS = ("idle", "hot", "multi-hot", "tp", "burst")
#: diagnostic loads, selectable with --loads but not part of the default study
EXTRA_LOADS = ("hot-reverse",)
LOAD_TITLES = {
    "idle": "idle",
    "hot": "one hot link (85%) on the direct route",
    "multi-hot": "several hot links (85%): direct route + half the alternatives",
    "tp": "TP all-reduce rings (bursty) + PP sends across nodes",
    "burst": "hot link bursting on/off (90%, 300 ms period)",
    "hot-reverse": "the direct route's first fabric link at 85%, in the opposite direction to the transfer",
}
PAYLOADS_MIB = (1, 4, 16, 64, 256)


@dataclass(frozen=True)
class LoadParams:
    hot_frac: float = 0.85
    burst_frac: float = 0.90
    burst_period_ms: float = 300.0
    burst_duty: float = 0.5
    tp_frac: float = 0.35  # per ring direction, of the ring hop's bottleneck, while the all-reduce runs
    tp_period_ms: float = 2.0
    tp_duty: float = 0.4
    pp_frac: float = 0.25  # of each NIC, summed over the GPUs behind it, while a PP send runs
    pp_period_ms: float = 8.0
    pp_duty: float = 0.5


@dataclass(frozen=True)
class Scenario:
    machine: str
    load: str
    payload_mib: float
    n_transfers: int = 12
    gap_ms: float = 30.0
    warmup_ms: float = 250.0
    seed: int = 0
    params: LoadParams = field(default_factory=LoadParams)

    @property
    def key(self) -> str:
        return f"{self.machine}/{self.load}/{self.payload_mib:g}MiB"

    def rng(self, salt: str = "") -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32((self.key + salt).encode())])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = asdict(self.params)
        return d


def thresholds(topo: Topology, cfg: SelectorConfig) -> List[float]:
    return [cfg.threshold_for(l.qos_class) for l in topo.links]


# --------------------------------------------------------------------------- helpers
def direct_route(topo: Topology, src: str, dst: str) -> Path:
    return next(p for p in topo.enumerate_paths(src, dst) if p.type == PathType.Direct)


def fabric_hops(topo: Topology, path: Path) -> List[Tuple[int, str, str]]:
    """(link id, from, to) of the fabric links (NVLink/NVSwitch/RDMA/Ethernet) of a path, in order."""
    out = []
    for i, lid in enumerate(path.links):
        if topo.links[lid].type in FABRIC:
            out.append((lid, path.nodes[i], path.nodes[i + 1]))
    return out


def _hop_flow(net: Network, name: str, hop: Tuple[int, str, str], frac: float, group: int) -> BgFlow:
    lid, a, b = hop
    res = net.resources((a, b), (lid,))
    return BgFlow(name, (lid,), res, frac * net.topo.links[lid].capacity_gbps * GB, group)


def _path_flow(net: Network, name: str, path: Path, demand_bps: float, group: int) -> BgFlow:
    return BgFlow(name, tuple(path.links), net.resources(path.nodes, path.links), demand_bps, group)


def hot_links(topo: Topology, m: Machine, multi: bool) -> List[Tuple[int, str, str]]:
    d = direct_route(topo, m.src, m.dst)
    hops = fabric_hops(topo, d)
    if not multi:
        return hops[:1]
    if m.cluster:
        # half of the source node's NIC rails (at least rail 0): the uplinks NIC -> leaf
        host = topo.node(m.src).host
        nics = sorted(topo.nodes_of_kind(NodeKind.NIC, host), key=lambda n: n.index)
        out = []
        for nic in nics[: max(1, len(nics) // 2)]:
            for l in topo.links_between(nic.name, f"leaf{nic.index}"):
                out.append((l.id, nic.name, f"leaf{nic.index}"))
        return out
    out = list(hops)
    on_direct = set(d.links)
    relays = [p for p in topo.enumerate_paths(m.src, m.dst) if p.type == PathType.NVLinkRelay]
    for p in relays[: math.ceil(len(relays) / 2)]:
        for hop in fabric_hops(topo, p):
            if hop[0] not in on_direct and hop not in out:
                out.append(hop)
                break
    return out


# --------------------------------------------------------------------------- loads
def build_background(scn: Scenario, topo: Topology, net: Network) -> Tuple[List[BgFlow], List[BgGroup]]:
    m = MACHINES[scn.machine]
    p = scn.params
    rng = scn.rng("bg")
    flows: List[BgFlow] = []
    groups: List[BgGroup] = [BgGroup("const")]
    if scn.load == "idle":
        return flows, groups
    if scn.load in ("hot", "multi-hot"):
        for k, hop in enumerate(hot_links(topo, m, scn.load == "multi-hot")):
            flows.append(_hop_flow(net, f"hot{k}:{hop[1]}->{hop[2]}", hop, p.hot_frac, 0))
        return flows, groups
    if scn.load == "hot-reverse":
        for k, (lid, a, b) in enumerate(hot_links(topo, m, False)):
            flows.append(_hop_flow(net, f"rev{k}:{b}->{a}", (lid, b, a), p.hot_frac, 0))
        return flows, groups
    if scn.load == "burst":
        period = p.burst_period_ms / 1000.0
        groups.append(BgGroup("burst", period, p.burst_duty, float(rng.uniform(0, period))))
        for k, hop in enumerate(hot_links(topo, m, False)):
            flows.append(_hop_flow(net, f"burst{k}:{hop[1]}->{hop[2]}", hop, p.burst_frac, 1))
        return flows, groups
    if scn.load == "tp":
        # TP all-reduce: a bidirectional ring over the GPUs of every host, on/off together
        for host in topo.hosts:
            gpus = sorted(topo.nodes_of_kind(NodeKind.GPU, host), key=lambda n: n.index)
            if len(gpus) < 2:
                continue
            period = p.tp_period_ms / 1000.0
            g = len(groups)
            groups.append(BgGroup(f"tp:{host}", period, p.tp_duty, float(rng.uniform(0, period))))
            for i in range(len(gpus)):
                a, b = gpus[i].name, gpus[(i + 1) % len(gpus)].name
                for s, d in ((a, b), (b, a)):
                    path = direct_route(topo, s, d)
                    bott = min(topo.links[l].capacity_gbps for l in path.links)
                    flows.append(_path_flow(net, f"tp:{s}->{d}", path, p.tp_frac * bott * GB, g))
                if len(gpus) == 2:
                    break
        # PP: stage h on node h sends activations to node h+1, GPU g -> GPU g
        hosts = [h for h in topo.hosts if topo.nodes_of_kind(NodeKind.GPU, h)]
        if m.cluster and len(hosts) > 1:
            for h in range(len(hosts) - 1):
                period = p.pp_period_ms / 1000.0
                g = len(groups)
                groups.append(BgGroup(f"pp:{hosts[h]}", period, p.pp_duty, float(rng.uniform(0, period))))
                gpus = sorted(topo.nodes_of_kind(NodeKind.GPU, hosts[h]), key=lambda n: n.index)
                nics = max(1, len(topo.nodes_of_kind(NodeKind.NIC, hosts[h])))
                nic_gbps = min((l.capacity_gbps for l in topo.links if l.type == LinkType.RDMA), default=48.0)
                per_gpu = p.pp_frac * nic_gbps * nics / len(gpus)
                for gpu in gpus:
                    dst = f"{hosts[h + 1]}.gpu{gpu.index}"
                    path = direct_route(topo, gpu.name, dst)
                    flows.append(_path_flow(net, f"pp:{gpu.name}->{dst}", path, per_gpu * GB, g))
        return flows, groups
    raise ValueError(f"unknown load {scn.load!r}; choose one of {LOADS + EXTRA_LOADS}")


def build_requests(scn: Scenario) -> List[Tuple[float, TransferRequest]]:
    m = MACHINES[scn.machine]
    rng = scn.rng("arrivals")
    nbytes = int(scn.payload_mib * (1 << 20))
    t = scn.warmup_ms / 1000.0
    out = []
    for _ in range(scn.n_transfers):
        out.append((t, TransferRequest(m.src, m.dst, nbytes)))
        t += float(rng.exponential(scn.gap_ms / 1000.0))
    return out
