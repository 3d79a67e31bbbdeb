"""Value rules of the flexflow config: one checker for the YAML loader (config.py) and for Python
callers that build a SelectorConfig directly (selector/types.py). A leaf module, so that neither of
those imports the other."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from .errors import ConfigError

# ------------------------------------------------------------------ value rules
_SELECTOR_RULES = {
    "w_bandwidth": ("weight", None), "w_queue_delay": ("weight", None), "w_hops": ("weight", None),
    "w_qos_risk": ("weight", None), "w_latency": ("weight", None),
    "nvlink_util_threshold": ("threshold", None), "rdma_util_threshold": ("threshold", None),
    "cnic_util_threshold": ("threshold", None), "snic_util_threshold": ("threshold", None),
    "relay_benefit_margin": ("margin", None), "split_benefit_margin": ("margin", None),
    "enable_split_path": ("bool", None), "ttft_sensitive": ("bool", None),
    "max_split_paths": ("int_range", (1, 8)),
    "relay_chunk_bytes": ("int_range", (4096, 1 << 34)),
}


MAX_NUMBER = 1e15  # no knob needs more; 1e300 or .inf would overflow where the value is used
#: upper bounds of keys whose sane range is far below MAX_NUMBER (the error names the range)
_MAX = {"host_tier.capacity_gb": 1 << 16, "storage_tier.capacity_gb": 1 << 24,
        "remote_tier.timeout_ms": 3_600_000, "remote_tier.retry_after_s": 86_400,
        "monitor.sample_interval_ms": 3_600_000, "monitor.feedback_half_life_ms": 86_400_000,
        "monitor.elastic_probe_s": 86_400, "pd.rail_gbps": 1e5, "pd.rail_latency_us": 1e7}


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _check(kind: str, arg, value, key: str) -> Optional[str]:
    isnum = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isnum:
        hi = _MAX.get(key, MAX_NUMBER)
        if not math.isfinite(value) or abs(value) > hi:
            lim = int(hi) if float(hi).is_integer() and hi < 1e16 else hi
            return f"{key} = {_short(value)}: must be a finite number with magnitude <= {lim}"
    if kind == "hostport_list":
        from .tiers.wire import parse_hostport
        if not isinstance(value, (list, tuple)):
            return f"{key} = {_short(value)}: must be a list of host:port strings"
        for v in value:
            try:
                parse_hostport(v)
            except ValueError:
                return f"{key}: {_short(v)} is not host:port (port 0..65535), e.g. 10.0.0.2:7300"
        return None
    if kind == "hostport":
        from .tiers.wire import parse_hostport
        try:
            parse_hostport(value)
        except ValueError:
            return f"{key} = {_short(value)}: must be host:port (port 0..65535), e.g. 127.0.0.1:7300"
        return None
    if kind == "weight":
        if not isnum or not value >= 0 or value != value:
            return f"{key} = {value!r}: must be a number >= 0"
    elif kind == "unit":
        if not isnum or not (0 <= value <= 1):
            return f"{key} = {value!r}: must be a number in [0, 1]"
    elif kind == "threshold":
        if not isnum or not (0 < value <= 1):
            return f"{key} = {value!r}: must be a number in (0, 1]"
    elif kind == "margin":
        if not isnum or not value >= 0:
            return f"{key} = {value!r}: must be a number >= 0"
    elif kind == "positive":
        if not isnum or not value > 0:
            return f"{key} = {value!r}: must be a number > 0"
    elif kind == "nonneg":
        if not isnum or not value >= 0:
            return f"{key} = {value!r}: must be a number >= 0"
    elif kind == "bool":
        if not isinstance(value, bool):
            return f"{key} = {value!r}: must be true or false"
    elif kind == "int_range":
        lo, hi = arg
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            return f"{key} = {value!r}: must be an integer in [{lo}, {hi}]"
    elif kind == "choice":
        if value not in arg:
            return f"{key} = {value!r}: must be one of {list(arg)}"
    elif kind == "str":
        if not isinstance(value, str) or not value:
            return f"{key} = {value!r}: must be a non-empty string"
    elif kind == "opt_str":
        if value is not None and (not isinstance(value, str) or not value):
            return f"{key} = {value!r}: must be a non-empty string or null"
    elif kind == "opt_positive":
        if value is not None and (not isnum or not value > 0):
            return f"{key} = {value!r}: must be a number > 0 or null"
    elif kind == "opt_int_pos":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            return f"{key} = {value!r}: must be a positive integer or null"
    elif kind == "str_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            return f"{key} = {value!r}: must be a list of non-empty strings"
    return None


def validate_selector_values(values: Dict[str, Any], where: str = "selector") -> None:
    errs = [e for k, v in values.items() if k in _SELECTOR_RULES
            for e in [_check(*_SELECTOR_RULES[k], v, f"{where}.{k}")] if e]
    if errs:
        raise ConfigError("invalid configuration: " + "; ".join(errs))
