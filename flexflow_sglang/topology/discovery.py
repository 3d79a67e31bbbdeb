"""Discover this machine's topology from NVML (GPUs, NVLink, PCIe) and sysfs (NUMA, NICs, NVMe).

Every probe is optional: without the NVIDIA driver NVML raises NVMLError_LibraryNotFound and we log
one line and continue with sysfs only; missing sysfs directories simply contribute nothing. The
result always has at least one CPU (host memory) node.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Dict, List, Optional

from .graph import LinkType, NodeKind, Topology

logger = logging.getLogger(__name__)

NVLINK_PER_LINK_GBPS = 25.0  # NVLink 3/4: 25 GB/s per link per direction
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
DEFAULT_ETH_GBPS = 1.25  # 10 Gbit/s when the driver does not report a speed (veth, virtio)
NVME_GBPS = 6.5


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r") as f:
            return f.read().strip()
    except OSError:
        return None


def _numa_nodes(root: str) -> List[int]:
    nodes = []
    for p in glob.glob(os.path.join(root, "devices", "system", "node", "node[0-9]*")):
        m = re.search(r"node(\d+)$", p)
        if m:
            nodes.append(int(m.group(1)))
    return sorted(nodes) or [0]


def _cpu_for_numa(numa: Optional[str], cpus: List[int]) -> str:
    try:
        n = int(numa) if numa is not None else -1
    except ValueError:
        n = -1
    return f"cpu{n}" if n in cpus else f"cpu{cpus[0]}"


def _discover_gpus(topo: Topology, root: str, cpus: List[int]) -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded
        logger.info("topology discovery: NVML unavailable (%s: %s); no GPUs discovered, using sysfs only",
                    type(e).__name__, e)
        return 0
    try:
        count = pynvml.nvmlDeviceGetCount()
        bus_to_gpu: Dict[str, int] = {}
        handles = []
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            bus_to_gpu[bus.lower()[-12:]] = i
            numa = _read(os.path.join(root, "bus", "pci", "devices", bus.lower()[-12:], "numa_node"))
            topo.add_node(f"gpu{i}", NodeKind.GPU, "node0", i, bus_id=bus)
            try:
                gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)
                width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
                pcie = PCIE_LANE_GBPS.get(int(gen), 1.969) * int(width)
            except Exception:
                pcie = 25.0
            topo.add_link(f"gpu{i}", _cpu_for_numa(numa, cpus), LinkType.PCIE, pcie, 1.0, counter={"nvml_pcie": i})
        nvlinks: Dict[tuple, int] = {}
        switch_ports: Dict[int, int] = {}
        max_links = getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)
        for i, h in enumerate(handles):
            for link in range(max_links):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link).busId
                except Exception:
                    continue
                remote = (remote.decode() if isinstance(remote, bytes) else remote).lower()[-12:]
                j = bus_to_gpu.get(remote)
                if j is None:
                    switch_ports[i] = switch_ports.get(i, 0) + 1
                elif i < j:
                    nvlinks[(i, j)] = nvlinks.get((i, j), 0) + 1
        for (i, j), n in sorted(nvlinks.items()):
            topo.add_link(f"gpu{i}", f"gpu{j}", LinkType.NVLINK, n * NVLINK_PER_LINK_GBPS, 2.0,
                          counter={"nvml_nvlink": [i, j]})
        if switch_ports:
            topo.add_node("nvswitch", NodeKind.SWITCH, "node0", 0, role="nvswitch")
            for i, n in sorted(switch_ports.items()):
                topo.add_link(f"gpu{i}", "nvswitch", LinkType.NVSWITCH, n * NVLINK_PER_LINK_GBPS, 1.5,
                              counter={"nvml_nvlink": [i, -1]})
        return count
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _discover_nics(topo: Topology, root: str, cpus: List[int], include_virtual: bool) -> int:
    n = 0
    fabric = None
    for dev_path in sorted(glob.glob(os.path.join(root, "class", "infiniband", "*"))):
        dev = os.path.basename(dev_path)
        numa = _read(os.path.join(dev_path, "device", "numa_node"))
        for port_path in sorted(glob.glob(os.path.join(dev_path, "ports", "*"))):
            port = os.path.basename(port_path)
            rate = _read(os.path.join(port_path, "rate")) or ""
            m = re.match(r"([\d.]+)\s*Gb", rate)
            gbps = float(m.group(1)) / 8.0 if m else 25.0
            name = f"nic{n}"
            topo.add_node(name, NodeKind.NIC, "node0", n, device=f"{dev}/{port}")
            topo.add_link(name, _cpu_for_numa(numa, cpus), LinkType.PCIE, 2 * gbps, 1.0)
            if fabric is None:
                fabric = "rdma-fabric"
                topo.add_node(fabric, NodeKind.SWITCH, "fabric", 0, role="rdma")
            topo.add_link(name, fabric, LinkType.RDMA, gbps, 3.0, counter={"sysfs_ib": f"{dev}/{port}"})
            n += 1
    eth = None
    for if_path in sorted(glob.glob(os.path.join(root, "class", "net", "*"))):
        iface = os.path.basename(if_path)
        if iface == "lo":
            continue
        physical = os.path.exists(os.path.join(if_path, "device"))
        if not physical and not include_virtual:
            continue
        speed = _read(os.path.join(if_path, "speed"))
        try:
            gbps = float(speed) / 8000.0 if speed and int(speed) > 0 else DEFAULT_ETH_GBPS
        except ValueError:
            gbps = DEFAULT_ETH_GBPS
        numa = _read(os.path.join(if_path, "device", "numa_node"))
        name = f"nic{n}"
        topo.add_node(name, NodeKind.NIC, "node0", n, device=iface)
        topo.add_link(name, _cpu_for_numa(numa, cpus), LinkType.PCIE, max(gbps * 2, 4.0), 1.0)
        if eth is None:
            eth = "eth-fabric"
            topo.add_node(eth, NodeKind.SWITCH, "fabric", 1, role="ethernet")
        topo.add_link(name, eth, LinkType.ETHERNET, gbps, 20.0, counter={"sysfs_net": iface})
        n += 1
    return n


def _discover_storage(topo: Topology, root: str, cpus: List[int]) -> int:
    n = 0
    for blk in sorted(glob.glob(os.path.join(root, "block", "nvme*"))):
        numa = _read(os.path.join(blk, "device", "device", "numa_node")) or _read(os.path.join(blk, "device", "numa_node"))
        name = f"nvme{n}"
        topo.add_node(name, NodeKind.STORAGE, "node0", n, device=os.path.basename(blk))
        topo.add_link(name, _cpu_for_numa(numa, cpus), LinkType.PCIE, NVME_GBPS, 10.0)
        n += 1
    return n


def discover(sysfs_root: str = "/sys", use_nvml: bool = True, include_virtual_nics: bool = False) -> Topology:
    """Topology of this machine. Never raises for missing NVML/RDMA; logs what it could not see."""
    topo = Topology("discovered", "discovered")
    cpus = _numa_nodes(sysfs_root)
    for c in cpus:
        topo.add_node(f"cpu{c}", NodeKind.CPU, "node0", c)
    for a, b in zip(cpus, cpus[1:]):
        topo.add_link(f"cpu{a}", f"cpu{b}", LinkType.C2C, 40.0, 1.0, qos_class="cnic")
    n_gpu = _discover_gpus(topo, sysfs_root, cpus) if use_nvml else 0
    n_nic = _discover_nics(topo, sysfs_root, cpus, include_virtual_nics)
    n_sto = _discover_storage(topo, sysfs_root, cpus)
    if n_nic == 0:
        logger.info("topology discovery: no RDMA or physical Ethernet NIC under %s/class", sysfs_root)
    logger.info("topology discovery: %d CPU node(s), %d GPU(s), %d NIC(s), %d NVMe device(s)",
                len(cpus), n_gpu, n_nic, n_sto)
    return topo
