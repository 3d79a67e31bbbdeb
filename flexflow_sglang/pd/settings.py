"""$FLEXFLOW_CONFIG as the PD code sees it, read and validated once per process (schedulers build
KV managers once; the hooks ask on every call)."""

from __future__ import annotations

import threading
from typing import Optional

from ..config import FlexFlowConfig, PDConfig, load_config

_lock = threading.Lock()
_cached: Optional[FlexFlowConfig] = None


def flexflow_settings(reload: bool = False) -> FlexFlowConfig:
    """The whole validated config; a bad file raises ConfigError naming key and value (start-up fails)."""
    global _cached
    with _lock:
        if _cached is None or reload:
            cfg = load_config()
            from .rails import check_rail_names
            check_rail_names(cfg.pd.rails)
            _cached = cfg
        return _cached


def pd_settings(reload: bool = False) -> PDConfig:
    """The `pd:` section."""
    return flexflow_settings(reload).pd
