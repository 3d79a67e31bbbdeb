"""The `pd:` section of $FLEXFLOW_CONFIG, read once per process (schedulers build KV managers once)."""

from __future__ import annotations

import threading
from typing import Optional

from ..config import PDConfig, load_config

_lock = threading.Lock()
_cached: Optional[PDConfig] = None


def pd_settings(reload: bool = False) -> PDConfig:
    """Validated PD settings; a bad file raises ConfigError naming key and value (start-up fails)."""
    global _cached
    with _lock:
        if _cached is None or reload:
            cfg = load_config().pd
            from .rails import check_rail_names
            check_rail_names(cfg.rails)
            _cached = cfg
        return _cached
