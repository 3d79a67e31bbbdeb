"""The KV connector: host tier, deeper-tier hook points, and path-selected transfer executors.

    FlexFlowConnector   owns the tiers, a PathSelector + NodeAgent, and the TransferExecutor
    LoadResult          what FlexFlowConnector.load returns (ok, pages from host / deeper tiers)
    HostTier            preallocated host pool of KV pages, LRU, per-page checksums
    KVTier              interface of the deeper tiers, InMemoryTier a reference one: both live in
                        flexflow_sglang/tiers/ and are re-exported here
    KVLayout            how a SGLang KV pool maps onto host pages
"""

from ..tiers.base import KVTier
from ..tiers.memory import InMemoryTier
from .connector import FlexFlowConnector, LoadResult, StoreHandle
from .executors import TransferExecutor
from .host_tier import HostTier
from .layout import KVLayout, supported_pool

__all__ = ["FlexFlowConnector", "LoadResult", "StoreHandle", "TransferExecutor", "HostTier", "KVLayout", "KVTier",
           "InMemoryTier", "supported_pool"]
