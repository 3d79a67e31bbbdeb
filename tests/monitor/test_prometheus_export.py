"""PromExporter: metrics reach prometheus_client's registry; updates are throttled and `due()`
says when one would export, so the cache builds its metrics dict only then."""

from __future__ import annotations

import time

import pytest

prom = pytest.importorskip("prometheus_client")

from flexflow_sglang.monitor.prometheus import PromExporter  # noqa: E402


def _value(name, rank="0"):
    return prom.REGISTRY.get_sample_value(name, {"tp_rank": rank})


def test_update_exports_nested_counters_and_is_throttled():
    prefix = f"fftest{time.monotonic_ns()}"
    ex = PromExporter({"tp_rank": 0}, min_interval_s=0.2, prefix=prefix)
    assert ex.due()
    ex.update({"loads": 3, "host_tier": {"used_pages": 7}, "ok": True, "name": "skipped"})
    assert _value(f"{prefix}_loads") == 3.0 and _value(f"{prefix}_host_tier_used_pages") == 7.0
    assert _value(f"{prefix}_ok") == 1.0
    assert not ex.due()
    ex.update({"loads": 4})  # within the interval: dropped
    assert _value(f"{prefix}_loads") == 3.0
    time.sleep(0.25)
    assert ex.due()
    ex.update({"loads": 5})
    assert _value(f"{prefix}_loads") == 5.0


def test_the_cache_builds_its_metrics_only_when_an_export_is_due():
    from flexflow_sglang.backend.cache import FlexFlowRadixCache

    class Stub:
        def __init__(self):
            self.built = 0
            self._prom = PromExporter({"tp_rank": 0}, min_interval_s=60.0, prefix=f"fftest{time.monotonic_ns()}")
            self._sched = type("C", (), {"add": lambda *a: None})()

        def _prom_metrics(self):
            self.built += 1
            return {"x": 1}

    s = Stub()
    for _ in range(5):
        FlexFlowRadixCache._export_metrics(s)
    assert s.built == 1
