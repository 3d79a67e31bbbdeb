"""Counter sources for the NodeAgent: NVML (NVLink / PCIe), sysfs (Ethernet, InfiniBand/RoCE).

A source maps some links (by their `counter` attribute in the topology) to byte counters and
returns per-link rates in bytes/s since its previous read. A source that cannot start (no NVML
library, no such interface) logs one line and reads nothing; it never raises into the agent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, Iterable, List, Optional, Tuple

from ..topology.graph import Topology

logger = logging.getLogger(__name__)


class LinkLoadSource:
    name = "base"

    def read_rates(self, dt: Optional[float]) -> Iterable[Tuple[int, Optional[float]]]:
        return ()

    def close(self) -> None:
        pass


class _CounterSource(LinkLoadSource):
    """Cumulative counters -> rates. Subclasses implement _read_counter(link_id) -> bytes or None."""

    def __init__(self, link_ids: List[int]):
        self.link_ids = link_ids
        self._prev: Dict[int, Tuple[float, float]] = {}

    def _read_counter(self, link_id: int) -> Optional[float]:
        raise NotImplementedError

    def read_rates(self, dt):
        now = time.monotonic()
        out = []
        for lid in self.link_ids:
            try:
                value = self._read_counter(lid)
            except (OSError, ValueError):
                value = None
            if value is None:
                continue
            prev = self._prev.get(lid)
            self._prev[lid] = (now, value)
            if prev is None or now <= prev[0] or value < prev[1]:  # first read or counter wrap/reset
                continue
            out.append((lid, (value - prev[1]) / (now - prev[0])))
        return out


class SysfsNetSource(_CounterSource):
    """/sys/class/net/<if>/statistics/{tx,rx}_bytes; the busier direction counts."""
    name = "sysfs-net"

    def __init__(self, topology: Topology, root: str = "/sys"):
        self.root = root
        self.ifaces = {l.id: str(l.counter["sysfs_net"]) for l in topology.links if "sysfs_net" in l.counter}
        super().__init__(sorted(self.ifaces))
        self._prev_dir: Dict[int, Tuple[float, float, float]] = {}

    def read_rates(self, dt):
        now = time.monotonic()
        out = []
        for lid, iface in self.ifaces.items():
            base = os.path.join(self.root, "class", "net", iface, "statistics")
            try:
                with open(os.path.join(base, "tx_bytes")) as f:
                    tx = float(f.read().strip())
                with open(os.path.join(base, "rx_bytes")) as f:
                    rx = float(f.read().strip())
            except (OSError, ValueError):
                continue
            prev = self._prev_dir.get(lid)
            self._prev_dir[lid] = (now, tx, rx)
            if prev is None or now <= prev[0] or tx < prev[1] or rx < prev[2]:
                continue
            el = now - prev[0]
            out.append((lid, max(tx - prev[1], rx - prev[2]) / el))
        return out


class SysfsInfinibandSource(_CounterSource):
    """/sys/class/infiniband/<dev>/ports/<n>/counters/port_{xmit,rcv}_data (units of 4 bytes)."""
    name = "sysfs-ib"

    def __init__(self, topology: Topology, root: str = "/sys"):
        self.root = root
        self.ports = {}
        for l in topology.links:
            spec = l.counter.get("sysfs_ib")
            if spec:
                dev, _, port = str(spec).partition("/")
                self.ports[l.id] = (dev, port or "1")
        super().__init__(sorted(self.ports))

    def _read_counter(self, link_id):
        dev, port = self.ports[link_id]
        base = os.path.join(self.root, "class", "infiniband", dev, "ports", port, "counters")
        vals = []
        for name in ("port_xmit_data", "port_rcv_data"):
            with open(os.path.join(base, name)) as f:
                vals.append(float(f.read().strip()) * 4.0)
        return max(vals)  # approximation: the larger cumulative direction


class NVMLSource(LinkLoadSource):
    """NVLink TX/RX throughput (field ids 138/139, KiB counters) and PCIe throughput (KB/s)."""
    name = "nvml"
    FI_NVLINK_TX, FI_NVLINK_RX = 138, 139

    def __init__(self, topology: Topology):
        import pynvml  # raises ImportError / NVMLError, handled by make_sources
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.nvlink = {l.id: l.counter["nvml_nvlink"] for l in topology.links if "nvml_nvlink" in l.counter}
        self.pcie = {l.id: int(l.counter["nvml_pcie"]) for l in topology.links if "nvml_pcie" in l.counter}
        self._handles: Dict[int, object] = {}
        self._prev: Dict[int, Tuple[float, float]] = {}

    def _h(self, gpu: int):
        h = self._handles.get(gpu)
        if h is None:
            h = self._handles[gpu] = self.nvml.nvmlDeviceGetHandleByIndex(int(gpu))
        return h

    def read_rates(self, dt):
        nv = self.nvml
        out = []
        now = time.monotonic()
        for lid, spec in self.nvlink.items():
            try:
                gpu = int(spec[0])
                vals = nv.nvmlDeviceGetFieldValues(self._h(gpu), [self.FI_NVLINK_TX, self.FI_NVLINK_RX])
                kib = max(float(v.value.ullVal) for v in vals if v.nvmlReturn == 0)
            except Exception:
                continue
            prev = self._prev.get(lid)
            self._prev[lid] = (now, kib)
            if prev is not None and now > prev[0] and kib >= prev[1]:
                out.append((lid, (kib - prev[1]) * 1024.0 / (now - prev[0])))
        for lid, gpu in self.pcie.items():
            try:
                tx = nv.nvmlDeviceGetPcieThroughput(self._h(gpu), nv.NVML_PCIE_UTIL_TX_BYTES)
                rx = nv.nvmlDeviceGetPcieThroughput(self._h(gpu), nv.NVML_PCIE_UTIL_RX_BYTES)
            except Exception:
                continue
            out.append((lid, max(tx, rx) * 1000.0))  # KB/s
        return out

    def close(self):
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


def make_sources(topology: Topology, mode="auto", sysfs_root: str = "/sys") -> List[LinkLoadSource]:
    """'auto': every source some link has counters for; 'mock': none (set_utilization only);
    'nvml' / 'sysfs': only that family."""
    if mode not in ("auto", "mock", "nvml", "sysfs"):
        raise ValueError(f"NodeAgent source {mode!r}: expected one of auto, mock, nvml, sysfs")
    if mode == "mock":
        return []
    out: List[LinkLoadSource] = []
    if mode in ("auto", "sysfs"):
        net = SysfsNetSource(topology, sysfs_root)
        if net.ifaces:
            out.append(net)
        ib = SysfsInfinibandSource(topology, sysfs_root)
        if ib.ports:
            out.append(ib)
    if mode in ("auto", "nvml") and any(("nvml_nvlink" in l.counter or "nvml_pcie" in l.counter)
                                        for l in topology.links):
        try:
            out.append(NVMLSource(topology))
        except Exception as e:  # NVMLError_LibraryNotFound on machines without the driver
            logger.info("NodeAgent: NVML unavailable (%s: %s); NVLink/PCIe load from transfer feedback only",
                        type(e).__name__, e)
    return out
