"""Link-load monitoring (the NodeAgent and its counter sources: NVML, sysfs, mock) and the export of
flexflow's counters on SGLang's Prometheus endpoint (prometheus.py, used by backend/ and pd/)."""

from .node_agent import NodeAgent
from .sources import LinkLoadSource, NVMLSource, SysfsInfinibandSource, SysfsNetSource, make_sources

__all__ = ["NodeAgent", "LinkLoadSource", "NVMLSource", "SysfsNetSource", "SysfsInfinibandSource", "make_sources"]
