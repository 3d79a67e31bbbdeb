"""The KV connector: host tier, deeper-tier hook points, and path-selected transfer executors.

    FlexFlowConnector   owns the tiers, a PathSelector + NodeAgent, and the TransferExecutor
    HostTier            preallocated host pool of KV pages, LRU, per-page checksums
    KVTier              protocol for deeper tiers (flexflow_sglang/tiers/); InMemoryTier a reference one
    KVLayout            how a SGLang KV pool maps onto host pages
"""

from .connector import FlexFlowConnector, StoreHandle
from .executors import TransferExecutor
from .host_tier import HostTier
from .layout import KVLayout, supported_pool
from .tiers import InMemoryTier, KVTier

__all__ = ["FlexFlowConnector", "StoreHandle", "TransferExecutor", "HostTier", "KVLayout", "KVTier",
           "InMemoryTier", "supported_pool"]
