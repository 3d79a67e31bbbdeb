"""The topology graph: devices (GPU, CPU/host memory, NIC, storage, switch) joined by links.

A link is full duplex; `capacity_gbps` is the bandwidth of ONE direction in GB/s (bytes, not bits).
Utilisation is tracked per link (the busier direction), which is what a QoS threshold protects.

Candidate paths between two endpoints are enumerated once per (src, dst) pair and cached:
- Direct: the shortest paths through transit nodes only (switches, NICs), e.g. GPU-NVLink-GPU,
  GPU-PCIe-CPU, GPU-PCIe-NIC-RDMA-NIC-GPU. Several rails may qualify; the first is the default
  ("always direct") route, the one a plain transport would use.
- NVLinkRelay: direct(src, g) + direct(g, dst) through another GPU g of the src or dst node.
- CrossNodeRelay: through an endpoint (host memory or GPU) of a third node.
- StorageRelay: write to a storage node reachable from both ends, read it back from there.
SplitPath decisions are built by the selector from link-disjoint pairs of the above.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import TopologyError


class NodeKind(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"  # a host-memory domain (socket / NUMA node)
    NIC = "nic"
    STORAGE = "storage"
    SWITCH = "switch"  # NVSwitch, PCIe switch, network switch


class LinkType(str, enum.Enum):
    NVLINK = "nvlink"
    NVSWITCH = "nvswitch"  # a GPU's port into an NVSwitch fabric
    PCIE = "pcie"
    RDMA = "rdma"
    ETHERNET = "ethernet"
    C2C = "c2c"  # NVLink-C2C / host interconnect (Grace-Hopper) or intra-host memcpy


class PathType(str, enum.Enum):
    Direct = "Direct"
    NVLinkRelay = "NVLinkRelay"
    CrossNodeRelay = "CrossNodeRelay"
    SplitPath = "SplitPath"
    StorageRelay = "StorageRelay"


#: integer codes shared with the compiled core (csrc/selector_core.pxd)
PATH_TYPE_CODES = {PathType.Direct: 0, PathType.NVLinkRelay: 1, PathType.CrossNodeRelay: 2,
                   PathType.SplitPath: 3, PathType.StorageRelay: 4}
PATH_TYPE_BY_CODE = {v: k for k, v in PATH_TYPE_CODES.items()}

# Which SelectorConfig threshold protects a link. "cnic" = PCIe shared with compute NIC traffic,
# "snic" = anything touching storage (storage NIC / NVMe).
QOS_CLASSES = ("nvlink", "rdma", "cnic", "snic")
_DEFAULT_QOS_CLASS = {LinkType.NVLINK: "nvlink", LinkType.NVSWITCH: "nvlink", LinkType.C2C: "nvlink",
                      LinkType.RDMA: "rdma", LinkType.ETHERNET: "rdma", LinkType.PCIE: "cnic"}

ENDPOINT_KINDS = (NodeKind.GPU, NodeKind.CPU, NodeKind.STORAGE)
# CPUs are transit too: their root complex forwards PCIe peer traffic and bounce-buffers storage I/O.
TRANSIT_KINDS = (NodeKind.SWITCH, NodeKind.NIC, NodeKind.CPU)


@dataclass(frozen=True)
class Node:
    name: str
    kind: NodeKind
    host: str = "node0"  # the machine this device belongs to
    index: int = 0  # device index on its host (GPU ordinal, NIC ordinal, ...)
    attrs: Dict[str, object] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Link:
    id: int
    a: str
    b: str
    type: LinkType
    capacity_gbps: float  # GB/s, one direction
    latency_us: float
    qos_class: str
    #: where the NodeAgent reads this link's load: {"sysfs_net": "eth0"}, {"sysfs_ib": "mlx5_0/1"},
    #: {"nvml_nvlink": [gpu_index, link_index]}, {"nvml_pcie": gpu_index}; empty = feedback only
    counter: Dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def other(self, name: str) -> str:
        return self.b if name == self.a else self.a


@dataclass(frozen=True)
class Path:
    """One candidate route. `links` are link ids in order; `nodes` the node sequence."""
    type: PathType
    nodes: Tuple[str, ...]
    links: Tuple[int, ...]
    relays: Tuple[str, ...] = ()  # endpoints that store-and-forward (empty for Direct)

    @property
    def hops(self) -> int:
        return len(self.links)


class Topology:
    """Graph of devices and links. Build with add_node/add_link, a mock factory, from_yaml, or discover()."""

    MAX_DIRECT_RAILS = 8

    def __init__(self, name: str = "custom", source: str = "manual") -> None:
        self.name = name
        self.source = source  # "manual" | "mock:<name>" | "yaml:<path>" | "discovered"
        self.nodes: Dict[str, Node] = {}
        self.links: List[Link] = []
        self._adj: Dict[str, List[int]] = {}
        self._pair_links: Dict[frozenset, List[int]] = {}
        self._path_cache: Dict[tuple, Tuple[Path, ...]] = {}
        self._direct_cache: Dict[Tuple[str, str], List[Path]] = {}

    # ----------------------------------------------------------------- building
    def add_node(self, name: str, kind, host: str = "node0", index: int = 0, **attrs) -> Node:
        if not name or not isinstance(name, str):
            raise TopologyError(f"node name must be a non-empty string, got {name!r}")
        if name in self.nodes:
            raise TopologyError(f"duplicate node {name!r}")
        try:
            kind = NodeKind(kind)
        except ValueError:
            raise TopologyError(f"node {name!r}: kind {kind!r} is not one of "
                                f"{[k.value for k in NodeKind]}") from None
        node = Node(name, kind, host, index, dict(attrs))
        self.nodes[name] = node
        self._adj[name] = []
        self._invalidate()
        return node

    def add_link(self, a: str, b: str, type, capacity_gbps: float, latency_us: float = 1.0,
                 qos_class: Optional[str] = None, counter: Optional[dict] = None) -> Link:
        for end in (a, b):
            if end not in self.nodes:
                raise TopologyError(f"link {a}-{b}: unknown node {end!r}")
        if a == b:
            raise TopologyError(f"link {a}-{b}: a link needs two different nodes")
        try:
            type = LinkType(type)
        except ValueError:
            raise TopologyError(f"link {a}-{b}: type {type!r} is not one of "
                                f"{[t.value for t in LinkType]}") from None
        if not (capacity_gbps > 0):
            raise TopologyError(f"link {a}-{b}: capacity_gbps must be > 0, got {capacity_gbps!r}")
        if latency_us < 0:
            raise TopologyError(f"link {a}-{b}: latency_us must be >= 0, got {latency_us!r}")
        if qos_class is None:
            touches_storage = NodeKind.STORAGE in (self.nodes[a].kind, self.nodes[b].kind)
            qos_class = "snic" if touches_storage else _DEFAULT_QOS_CLASS[type]
        if qos_class not in QOS_CLASSES:
            raise TopologyError(f"link {a}-{b}: qos_class {qos_class!r} is not one of {list(QOS_CLASSES)}")
        link = Link(len(self.links), a, b, type, float(capacity_gbps), float(latency_us), qos_class,
                    dict(counter or {}))
        self.links.append(link)
        self._adj[a].append(link.id)
        self._adj[b].append(link.id)
        self._pair_links.setdefault(frozenset((a, b)), []).append(link.id)
        self._invalidate()
        return link

    def _invalidate(self) -> None:
        self._path_cache.clear()
        self._direct_cache.clear()

    # ----------------------------------------------------------------- queries
    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise TopologyError(f"unknown node {name!r}; known nodes: {sorted(self.nodes)}") from None

    def links_between(self, a: str, b: str) -> List[Link]:
        return [self.links[i] for i in self._pair_links.get(frozenset((a, b)), [])]

    def nodes_of_kind(self, kind: NodeKind, host: Optional[str] = None) -> List[Node]:
        kind = NodeKind(kind)
        return [n for n in self.nodes.values() if n.kind == kind and (host is None or n.host == host)]

    @property
    def hosts(self) -> List[str]:
        return sorted({n.host for n in self.nodes.values()})

    def gpu(self, index: int, host: Optional[str] = None) -> Node:
        for n in self.nodes_of_kind(NodeKind.GPU, host):
            if n.index == index:
                return n
        raise TopologyError(f"no GPU with index {index} on host {host or '(any)'}")

    def host_memory(self, host: Optional[str] = None, near: Optional[str] = None) -> Node:
        """The CPU (host-memory) node of `host`, preferring the one linked to `near`."""
        cpus = self.nodes_of_kind(NodeKind.CPU, host)
        if not cpus:
            raise TopologyError(f"no CPU/host-memory node on host {host or '(any)'}")
        if near is not None:
            best = min(cpus, key=lambda c: (self._direct_paths(near, c.name)[0].hops
                                            if self._direct_paths(near, c.name) else 99, c.name))
            return best
        return cpus[0]

    # ----------------------------------------------------------------- paths
    def _transit_ok(self, name: str, src: str, dst: str) -> bool:
        if name in (src, dst):
            return True
        node = self.nodes[name]
        if node.kind == NodeKind.CPU:
            # a root complex forwards for its own host; another host's memory is a relay, not transit
            return node.host in (self.nodes[src].host, self.nodes[dst].host)
        return node.kind in TRANSIT_KINDS

    def _direct_paths(self, src: str, dst: str) -> List[Path]:
        """Shortest transit-only paths src->dst (up to MAX_DIRECT_RAILS, min hops and min hops + 1)."""
        key = (src, dst)
        cached = self._direct_cache.get(key)
        if cached is not None:
            return cached
        # BFS distances from dst through transit nodes, then DFS forward along shrinking distance
        # (plus one detour step) to collect rails deterministically.
        dist = {dst: 0}
        q = deque([dst])
        while q:
            u = q.popleft()
            for lid in self._adj[u]:
                v = self.links[lid].other(u)
                if v not in dist and self._transit_ok(v, src, dst):
                    dist[v] = dist[u] + 1
                    if v != src:
                        q.append(v)
        out: List[Path] = []
        if src in dist and src != dst:
            best = dist[src]
            limit = best + 1
            stack: List[Tuple[str, Tuple[str, ...], Tuple[int, ...]]] = [(src, (src,), ())]
            results: List[Tuple[Tuple[str, ...], Tuple[int, ...]]] = []
            while stack:
                u, nodes, links = stack.pop()
                if u == dst:
                    results.append((nodes, links))
                    continue
                if len(links) >= limit:
                    continue
                for lid in sorted(self._adj[u], reverse=True):
                    v = self.links[lid].other(u)
                    if v in nodes or v not in dist or not self._transit_ok(v, src, dst):
                        continue
                    if len(links) + 1 + dist[v] > limit:
                        continue
                    stack.append((v, nodes + (v,), links + (lid,)))
            # order: fewest hops, then widest bottleneck, then lowest link ids (stable, deterministic)
            results.sort(key=lambda r: (len(r[1]), -min(self.links[i].capacity_gbps for i in r[1]), r[1]))
            for nodes, links in results[: self.MAX_DIRECT_RAILS]:
                out.append(Path(PathType.Direct, nodes, links))
        self._direct_cache[key] = out
        return out

    def enumerate_paths(self, src: str, dst: str, *, max_relays: int = 1,
                        allow_storage: bool = True) -> Tuple[Path, ...]:
        """All candidate single paths src->dst, deterministic order: direct rails first, then relays.

        A relay path is the best direct path to the relay followed by the best direct path on to dst,
        and must not reuse a link (a relay that doubles back over the congested link is pointless).
        """
        self.node(src), self.node(dst)
        if src == dst:
            raise TopologyError(f"source and destination are the same node {src!r}")
        key = (src, dst, max_relays, allow_storage)  # the options change the answer: part of the key
        cached = self._path_cache.get(key)
        if cached is not None:
            return cached
        paths: List[Path] = list(self._direct_paths(src, dst))
        if max_relays >= 1:
            s_host, d_host = self.nodes[src].host, self.nodes[dst].host
            for relay in sorted(self.nodes.values(), key=lambda n: (n.host, n.kind.value, n.index, n.name)):
                if relay.name in (src, dst) or relay.kind not in ENDPOINT_KINDS:
                    continue
                if relay.kind == NodeKind.STORAGE:
                    # a relay through an endpoint's own disk shares that endpoint's links: only
                    # storage reached over its own fabric (flexFlow's SNIC) can bypass congestion
                    if not allow_storage or relay.host in (s_host, d_host):
                        continue
                    ptype = PathType.StorageRelay
                elif relay.host in (s_host, d_host):
                    if relay.kind != NodeKind.GPU:
                        continue  # bouncing through the same host's memory is not a relay
                    ptype = PathType.NVLinkRelay
                else:
                    ptype = PathType.CrossNodeRelay
                first, second = self._direct_paths(src, relay.name), self._direct_paths(relay.name, dst)
                if not first or not second:
                    continue
                a, b = first[0], second[0]
                # links are full duplex: the relay may send back out over the link it received on
                # (an NVSwitch port, a storage uplink), but no link may carry both legs one way
                directed = self._directed(a) + self._directed(b)
                if len(set(directed)) != len(directed):
                    continue
                # switches may appear in both legs (they forward both ways); links may not
                nodes = a.nodes + b.nodes[1:]
                paths.append(Path(ptype, nodes, a.links + b.links, (relay.name,)))
        result = tuple(paths)
        self._path_cache[key] = result
        return result

    @staticmethod
    def _directed(p: Path) -> List[Tuple[int, str]]:
        return [(lid, p.nodes[i]) for i, lid in enumerate(p.links)]

    @staticmethod
    def link_disjoint(p: Path, q: Path) -> bool:
        return not (set(p.links) & set(q.links))

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "nodes": [{"name": n.name, "kind": n.kind.value, "host": n.host, "index": n.index,
                       **({"attrs": dict(n.attrs)} if n.attrs else {})} for n in self.nodes.values()],
            "links": [{"a": l.a, "b": l.b, "type": l.type.value, "capacity_gbps": l.capacity_gbps,
                       "latency_us": l.latency_us, "qos_class": l.qos_class,
                       **({"counter": dict(l.counter)} if l.counter else {})} for l in self.links],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "dict") -> "Topology":
        if not isinstance(data, dict):
            raise TopologyError(f"{source}: a topology must be a mapping with 'nodes' and 'links'")
        unknown = set(data) - {"name", "nodes", "links"}
        if unknown:
            raise TopologyError(f"{source}: unknown key(s) {sorted(unknown)}; valid keys: ['links', 'name', 'nodes']")
        topo = cls(str(data.get("name", "custom")), source)
        for i, n in enumerate(data.get("nodes") or []):
            if not isinstance(n, dict) or "name" not in n or "kind" not in n:
                raise TopologyError(f"{source}: nodes[{i}] needs 'name' and 'kind', got {n!r}")
            extra = set(n) - {"name", "kind", "host", "index", "attrs"}
            if extra:
                raise TopologyError(f"{source}: nodes[{i}] ({n['name']}): unknown key(s) {sorted(extra)}")
            topo.add_node(n["name"], n["kind"], n.get("host", "node0"), int(n.get("index", 0)),
                          **dict(n.get("attrs") or {}))
        for i, l in enumerate(data.get("links") or []):
            if not isinstance(l, dict) or not {"a", "b", "type", "capacity_gbps"} <= set(l):
                raise TopologyError(f"{source}: links[{i}] needs 'a', 'b', 'type', 'capacity_gbps', got {l!r}")
            extra = set(l) - {"a", "b", "type", "capacity_gbps", "latency_us", "qos_class", "counter"}
            if extra:
                raise TopologyError(f"{source}: links[{i}] ({l['a']}-{l['b']}): unknown key(s) {sorted(extra)}")
            topo.add_link(l["a"], l["b"], l["type"], float(l["capacity_gbps"]), float(l.get("latency_us", 1.0)),
                          l.get("qos_class"), l.get("counter"))
        if not topo.nodes:
            raise TopologyError(f"{source}: topology has no nodes")
        return topo

    @classmethod
    def from_yaml(cls, path) -> "Topology":
        import yaml
        try:
            with open(path, "r", encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise TopologyError(f"cannot read topology file {path}: {e}") from None
        except yaml.YAMLError as e:
            raise TopologyError(f"topology file {path} is not valid YAML: {e}") from None
        if isinstance(data, dict) and "topology" in data and "nodes" not in data:
            data = data["topology"]
        return cls.from_dict(data, source=f"yaml:{path}")

    def summary(self) -> str:
        kinds: Dict[str, int] = {}
        for n in self.nodes.values():
            kinds[n.kind.value] = kinds.get(n.kind.value, 0) + 1
        parts = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        return f"{self.name} ({self.source}): {parts}, {len(self.links)} links"

    def __repr__(self) -> str:
        return f"<Topology {self.summary()}>"

    # mock factories and discovery are attached in topology/__init__.py
