"""Export the connector's counters on SGLang's Prometheus endpoint (`--enable-metrics`).

SGLang serves /metrics from the HTTP process and collects the scheduler processes' series through
prometheus_client's multiprocess directory (PROMETHEUS_MULTIPROC_DIR, set by SGLang before the
schedulers start). Gauges created here, in a scheduler process, therefore show up there. Every
numeric leaf of `connector.metrics()` becomes `flexflow_<path>` with a `tp_rank` label; updates are
throttled so the per-batch tick stays cheap.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Dict, Iterator, Tuple

logger = logging.getLogger(__name__)

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def flatten(d, prefix: str = "") -> Iterator[Tuple[str, float]]:
    """{'hits': {'host': 3}, 'x': True} -> ('hits_host', 3.0), ('x', 1.0); non-numeric leaves skipped."""
    for k, v in (d or {}).items():
        name = _NAME_OK.sub("_", f"{prefix}_{k}" if prefix else str(k))
        if isinstance(v, dict):
            yield from flatten(v, name)
        elif isinstance(v, bool):
            yield name, 1.0 if v else 0.0
        elif isinstance(v, (int, float)):
            yield name, float(v)


class PromExporter:
    def __init__(self, labels: Dict[str, str], min_interval_s: float = 1.0, prefix: str = "flexflow"):
        from prometheus_client import Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR
        self._Gauge = Gauge
        self.labels = {k: str(v) for k, v in labels.items()}
        self.prefix = prefix
        self.min_interval_s = min_interval_s
        self._gauges: Dict[str, object] = {}
        self._last = 0.0
        self.disabled = False

    def due(self) -> bool:
        """Whether an update now would export: callers build the metrics dict only then (it walks
        every tier's counters; built on every scheduler tick it cost ~14 % of the scheduler
        thread's GIL time in the kv128k multi-turn run)."""
        return not self.disabled and time.monotonic() - self._last >= self.min_interval_s

    def update(self, metrics: dict, force: bool = False) -> None:
        if self.disabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        try:
            for name, value in flatten(metrics):
                g = self._gauges.get(name)
                if g is None:
                    g = self._gauges[name] = self._Gauge(
                        f"{self.prefix}_{name}", f"flexflow-sglang connector metric {name}",
                        labelnames=sorted(self.labels), multiprocess_mode="mostrecent")
                g.labels(**self.labels).set(value)
        except Exception as e:  # metrics must never break serving
            logger.warning("flexflow: Prometheus export disabled after error: %s", e)
            self.disabled = True


def maybe_exporter(enable_metrics: bool, tp_rank: int, dp_rank=None):
    if not enable_metrics:
        return None
    try:
        labels = {"tp_rank": tp_rank}
        if dp_rank is not None:
            labels["dp_rank"] = dp_rank
        return PromExporter(labels)
    except ImportError:
        logger.warning("flexflow: --enable-metrics set but prometheus_client is not installed")
        return None
