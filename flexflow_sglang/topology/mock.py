"""Mock topologies for machines we do not have. Figures are public per-direction bandwidths (GB/s)."""

from __future__ import annotations

from .graph import LinkType, NodeKind, Topology

NVLINK3_PAIR_GBPS = 50.0  # DGX-1 V100: 1-2 NVLink2 bricks of 25 GB/s between a GPU pair
PCIE4_GBPS = 25.0
PCIE5_GBPS = 55.0
NVSWITCH_PORT_A100 = 300.0  # 12 x NVLink3 per A100, one direction
NVSWITCH_PORT_H100 = 450.0  # 18 x NVLink4 per H100, one direction
RDMA_400G_GBPS = 48.0
NVME_GBPS = 6.5


def _add_host_io(topo: Topology, host: str, prefix: str, n_gpus: int, pcie_gbps: float,
                 n_nics: int = 0, nic_gbps: float = RDMA_400G_GBPS, storage: bool = True,
                 gpus_per_switch: int = 2) -> None:
    """CPU(s), PCIe switches shared by GPU pairs (and NICs), local NVMe: the DGX host side."""
    n_cpu = 2 if n_gpus >= 4 else 1
    for c in range(n_cpu):
        topo.add_node(f"{prefix}cpu{c}", NodeKind.CPU, host, c)
    if n_cpu == 2:  # socket interconnect (UPI / xGMI)
        topo.add_link(f"{prefix}cpu0", f"{prefix}cpu1", LinkType.C2C, 40.0, 1.0, qos_class="cnic")
    n_sw = max(1, (n_gpus + gpus_per_switch - 1) // gpus_per_switch)
    for s in range(n_sw):
        sw = f"{prefix}pcisw{s}"
        topo.add_node(sw, NodeKind.SWITCH, host, s, role="pcie")
        cpu = f"{prefix}cpu{s * n_cpu // n_sw}"
        # the switch uplink is shared by the GPUs (and NIC) below it
        topo.add_link(sw, cpu, LinkType.PCIE, pcie_gbps, 1.0)
    for g in range(n_gpus):
        topo.add_link(f"{prefix}gpu{g}", f"{prefix}pcisw{g // gpus_per_switch}", LinkType.PCIE, pcie_gbps, 1.0,
                      counter={"nvml_pcie": g})
    for k in range(n_nics):
        nic = f"{prefix}nic{k}"
        topo.add_node(nic, NodeKind.NIC, host, k)
        topo.add_link(nic, f"{prefix}pcisw{k * n_sw // n_nics}", LinkType.PCIE, pcie_gbps, 1.0)
    if storage:
        topo.add_node(f"{prefix}nvme0", NodeKind.STORAGE, host, 0)
        topo.add_link(f"{prefix}nvme0", f"{prefix}cpu0", LinkType.PCIE, NVME_GBPS, 10.0)


def make_mock_dgx(n: int = 8, nvlink_gbps: float = NVLINK3_PAIR_GBPS, pcie_gbps: float = PCIE4_GBPS,
                  full_mesh: bool = True, host: str = "node0", prefix: str = "") -> Topology:
    """Point-to-point NVLink mesh (DGX-1 style): each GPU pair has its own link, so a busy pair
    can be bypassed through a third GPU. `full_mesh=False` gives the DGX-1 hybrid cube-mesh (n=8)."""
    if n < 1:
        raise ValueError(f"make_mock_dgx: n must be >= 1, got {n}")
    topo = Topology(f"mock-dgx{n}", f"mock:dgx{n}")
    for g in range(n):
        topo.add_node(f"{prefix}gpu{g}", NodeKind.GPU, host, g)
    if full_mesh or n != 8:
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    else:  # DGX-1 hybrid cube mesh: two fully connected quads plus i <-> i+4
        pairs = [(i, j) for q in (0, 4) for i in range(q, q + 4) for j in range(i + 1, q + 4)]
        pairs += [(i, i + 4) for i in range(4)]
    for i, j in pairs:
        topo.add_link(f"{prefix}gpu{i}", f"{prefix}gpu{j}", LinkType.NVLINK, nvlink_gbps, 2.0,
                      counter={"nvml_nvlink": [i, j]})
    _add_host_io(topo, host, prefix, n, pcie_gbps)
    return topo


def make_mock_nvswitch(n: int = 8, port_gbps: float = NVSWITCH_PORT_H100, pcie_gbps: float = PCIE5_GBPS,
                       n_nics: int = 0, host: str = "node0", prefix: str = "") -> Topology:
    """NVSwitch box (DGX A100/H100 style): every GPU has one fat port into the switch, so the port,
    not a pair link, is the contended resource."""
    topo = Topology(f"mock-nvswitch{n}", f"mock:nvswitch{n}")
    topo.add_node(f"{prefix}nvswitch", NodeKind.SWITCH, host, 0, role="nvswitch")
    for g in range(n):
        topo.add_node(f"{prefix}gpu{g}", NodeKind.GPU, host, g)
        topo.add_link(f"{prefix}gpu{g}", f"{prefix}nvswitch", LinkType.NVSWITCH, port_gbps, 1.5,
                      counter={"nvml_nvlink": [g, -1]})
    _add_host_io(topo, host, prefix, n, pcie_gbps, n_nics=n_nics)
    return topo


def make_mock_dgx_a100(n: int = 4) -> Topology:
    """flexFlow's evaluation box: 4 A100 with NVLink3 between every pair (100 GB/s per pair)."""
    topo = make_mock_dgx(n, nvlink_gbps=100.0, pcie_gbps=PCIE4_GBPS)
    topo.name, topo.source = f"mock-dgx-a100-{n}", f"mock:dgx-a100-{n}"
    return topo


def make_mock_cluster(nodes: int = 2, gpus_per_node: int = 8, nics_per_node: int = 1,
                      nvswitch: bool = True, nic_gbps: float = RDMA_400G_GBPS,
                      shared_storage: bool = True) -> Topology:
    """`nodes` machines, each an NVSwitch (or mesh) box with `nics_per_node` RDMA NICs on a
    rail-optimised fabric (NIC k of every node on leaf switch k), plus optional shared storage."""
    if nodes < 1 or gpus_per_node < 1 or nics_per_node < 0:
        raise ValueError("make_mock_cluster: nodes >= 1, gpus_per_node >= 1, nics_per_node >= 0 required")
    topo = Topology(f"mock-cluster{nodes}x{gpus_per_node}x{nics_per_node}",
                    f"mock:cluster{nodes}x{gpus_per_node}x{nics_per_node}")
    for h in range(nodes):
        host, prefix = f"n{h}", f"n{h}."
        if nvswitch:
            topo.add_node(f"{prefix}nvswitch", NodeKind.SWITCH, host, 0, role="nvswitch")
        for g in range(gpus_per_node):
            topo.add_node(f"{prefix}gpu{g}", NodeKind.GPU, host, g)
            if nvswitch:
                topo.add_link(f"{prefix}gpu{g}", f"{prefix}nvswitch", LinkType.NVSWITCH, NVSWITCH_PORT_H100, 1.5)
        if not nvswitch:
            for i in range(gpus_per_node):
                for j in range(i + 1, gpus_per_node):
                    topo.add_link(f"{prefix}gpu{i}", f"{prefix}gpu{j}", LinkType.NVLINK, NVLINK3_PAIR_GBPS, 2.0)
        _add_host_io(topo, host, prefix, gpus_per_node, PCIE5_GBPS, n_nics=nics_per_node, nic_gbps=nic_gbps,
                     storage=True, gpus_per_switch=max(1, gpus_per_node // max(1, nics_per_node)))
    for k in range(nics_per_node):
        leaf = f"leaf{k}"
        topo.add_node(leaf, NodeKind.SWITCH, "fabric", k, role="rdma")
        for h in range(nodes):
            topo.add_link(f"n{h}.nic{k}", leaf, LinkType.RDMA, nic_gbps, 3.0)
    if nics_per_node > 1:  # spine so that rails can reach each other
        topo.add_node("spine", NodeKind.SWITCH, "fabric", 0, role="rdma")
        for k in range(nics_per_node):
            topo.add_link(f"leaf{k}", "spine", LinkType.RDMA, nic_gbps * nodes, 3.0)
    if shared_storage:
        # flexFlow's split of compute NICs (CNIC, GPU traffic) and storage NICs (SNIC): every node
        # reaches the shared store through its own SNIC and a storage switch, off the compute rails.
        topo.add_node("storage-switch", NodeKind.SWITCH, "storage", 0, role="storage")
        topo.add_node("shared-storage", NodeKind.STORAGE, "storage", 0)
        topo.add_link("shared-storage", "storage-switch", LinkType.ETHERNET, 12.5 * nodes, 20.0, qos_class="snic")
        for h in range(nodes):
            snic = f"n{h}.snic0"
            topo.add_node(snic, NodeKind.NIC, f"n{h}", 99, role="storage")
            topo.add_link(snic, f"n{h}.cpu0", LinkType.PCIE, PCIE5_GBPS, 1.0, qos_class="snic")
            topo.add_link(snic, "storage-switch", LinkType.ETHERNET, 12.5, 10.0, qos_class="snic")
    return topo


def make_mock_hosts(n: int = 3, link_gbps: float = 0.125, full_mesh: bool = True) -> Topology:
    """Hosts with host memory only, joined pairwise by Ethernet (the network-namespace lab:
    1 Gbit/s = 0.125 GB/s veth links). Relays go through a third host's memory."""
    topo = Topology(f"mock-hosts{n}", f"mock:hosts{n}")
    for h in range(n):
        topo.add_node(f"n{h}", NodeKind.CPU, f"n{h}", 0)
    for i in range(n):
        for j in range(i + 1, n):
            if full_mesh or j == i + 1:
                topo.add_link(f"n{i}", f"n{j}", LinkType.ETHERNET, link_gbps, 70.0)
    return topo


def make_mock_single(device_gbps: float = 10.0) -> Topology:
    """One accelerator (or, on CPU-only machines, the device KV pool) and host memory: the
    host-tier path of a single rank. On CPU the 'PCIe' link is a memcpy, hence the C2C type."""
    topo = Topology("mock-single", "mock:single")
    topo.add_node("gpu0", NodeKind.GPU, "node0", 0)
    topo.add_node("cpu0", NodeKind.CPU, "node0", 0)
    topo.add_node("nvme0", NodeKind.STORAGE, "node0", 0)
    topo.add_link("gpu0", "cpu0", LinkType.PCIE, device_gbps, 1.0, counter={"nvml_pcie": 0})
    topo.add_link("nvme0", "cpu0", LinkType.PCIE, NVME_GBPS, 10.0)
    return topo


MOCKS = {
    "single": make_mock_single,
    "dgx": make_mock_dgx,
    "dgx4": lambda: make_mock_dgx(4),
    "dgx8": lambda: make_mock_dgx(8),
    "dgx1": lambda: make_mock_dgx(8, full_mesh=False),
    "dgx-a100": make_mock_dgx_a100,
    "nvswitch": make_mock_nvswitch,
    "nvswitch8": lambda: make_mock_nvswitch(8),
    "cluster": make_mock_cluster,
    "cluster2x8": lambda: make_mock_cluster(2, 8, 1),
    "cluster2x8x4": lambda: make_mock_cluster(2, 8, 4),
    "cluster4x8x8": lambda: make_mock_cluster(4, 8, 8),
    "hosts3": lambda: make_mock_hosts(3),
}


def make_mock(name: str) -> Topology:
    try:
        factory = MOCKS[name]
    except KeyError:
        raise ValueError(f"unknown mock topology {name!r}; choose one of {sorted(MOCKS)}") from None
    return factory()
