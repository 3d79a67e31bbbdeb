"""Link-load monitoring: the NodeAgent and its counter sources (NVML, sysfs, mock)."""

from .node_agent import NodeAgent
from .sources import LinkLoadSource, NVMLSource, SysfsInfinibandSource, SysfsNetSource, make_sources

__all__ = ["NodeAgent", "LinkLoadSource", "NVMLSource", "SysfsNetSource", "SysfsInfinibandSource", "make_sources"]
