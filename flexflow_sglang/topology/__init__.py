"""Topology graph, mock factories and NVML/sysfs discovery."""

from .graph import ENDPOINT_KINDS, Link, LinkType, Node, NodeKind, Path, PathType, Topology
from .mock import (MOCKS, make_mock, make_mock_cluster, make_mock_dgx, make_mock_dgx_a100, make_mock_hosts,
                   make_mock_nvswitch, make_mock_single)
from .discovery import discover

# mock factories and discovery as Topology class/static methods (flexFlow's API)
Topology.make_mock_dgx = staticmethod(make_mock_dgx)
Topology.make_mock_nvswitch = staticmethod(make_mock_nvswitch)
Topology.make_mock_dgx_a100 = staticmethod(make_mock_dgx_a100)
Topology.make_mock_cluster = staticmethod(make_mock_cluster)
Topology.make_mock_hosts = staticmethod(make_mock_hosts)
Topology.make_mock_single = staticmethod(make_mock_single)
Topology.make_mock = staticmethod(make_mock)
Topology.discover = staticmethod(discover)

__all__ = ["Topology", "Node", "Link", "NodeKind", "LinkType", "Path", "PathType", "ENDPOINT_KINDS", "MOCKS",
           "make_mock", "make_mock_dgx", "make_mock_nvswitch", "make_mock_dgx_a100", "make_mock_cluster",
           "make_mock_hosts", "make_mock_single", "discover"]
