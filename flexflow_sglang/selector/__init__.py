"""flexFlow path selection: PathSelector over a compiled scoring core (csrc/) or its Python twin."""

from .cost_model import pack_params
from .selector import PathSelector, selector_backend
from .types import PathDecision, PathType, SelectorConfig, SubPath, TransferRequest

__all__ = ["PathSelector", "PathDecision", "PathType", "SelectorConfig", "SubPath", "TransferRequest",
           "selector_backend", "pack_params"]
