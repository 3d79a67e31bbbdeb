"""remote_tier.keyed_page_keys: the connector's page keys depend on the secret, so whoever sees keys
(and knows the model fingerprint) cannot confirm a guessed prompt prefix; off, keys are unchanged."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from flexflow_sglang.config import config_from_dict  # noqa: E402
from flexflow_sglang.connector import FlexFlowConnector, KVLayout  # noqa: E402


def keys_with(monkeypatch, secret, keyed):
    if secret:
        monkeypatch.setenv("FLEXFLOW_TIER_SECRET", secret)
    else:
        monkeypatch.delenv("FLEXFLOW_TIER_SECRET", raising=False)
    monkeypatch.delenv("FLEXFLOW_TIER_SECRET_FILE", raising=False)
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": 64, "pin_memory": "never"},
                            "remote_tier": {"keyed_page_keys": keyed}}, "<test>")
    kv = MHATokenToKVPool(size=64, page_size=4, dtype=torch.float16, head_num=1, head_dim=4, layer_num=1,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    c = FlexFlowConnector(KVLayout.from_pool(kv, 4), cfg, fingerprint={"model": "m"}, start_agent=False)
    try:
        return c.page_keys(list(range(16)))
    finally:
        c.close()


def test_keyed_page_keys(monkeypatch):
    plain = keys_with(monkeypatch, None, False)
    assert keys_with(monkeypatch, "a secret of sixteen+ bytes", False) == plain  # off: unchanged
    k1 = keys_with(monkeypatch, "a secret of sixteen+ bytes", True)
    k2 = keys_with(monkeypatch, "another secret, 16+ bytes", True)
    assert len(k1) == len(plain) == 4 and k1 != plain and k2 != k1
    assert not set(k1) & set(plain) and not set(k1) & set(k2)
    assert keys_with(monkeypatch, "a secret of sixteen+ bytes", True) == k1  # same secret: shared pages
