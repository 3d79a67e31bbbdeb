"""flexflow_sglang: a KV-cache transfer layer for SGLang with flexFlow's topology-aware path selection.

Public API (flexFlow names):
    Topology, NodeAgent, PathSelector, TransferRequest, SelectorConfig, PathDecision, PathType,
    LinkType, load_config, selector_backend
The SGLang radix-cache backend is registered through the `sglang.srt.plugins` entry point
(`--radix-cache-backend flexflow`); see flexflow_sglang.backend.
"""

__version__ = "0.1.0"

from .config import FlexFlowConfig, load_config
from .errors import (CompiledCoreMissing, ConfigError, FlexFlowError, SelectorError, TopologyError,
                     TransferError)
from .monitor import NodeAgent
from .selector import PathDecision, PathSelector, SelectorConfig, TransferRequest, selector_backend
from .topology import LinkType, NodeKind, PathType, Topology

__all__ = ["Topology", "NodeAgent", "PathSelector", "TransferRequest", "SelectorConfig", "PathDecision",
           "PathType", "LinkType", "NodeKind", "load_config", "FlexFlowConfig", "selector_backend",
           "FlexFlowError", "ConfigError", "TopologyError", "SelectorError", "TransferError",
           "CompiledCoreMissing", "__version__"]
