"""Layer-wise load-back (backend/layerwise.py): a host hit is queued for a per-layer copy and the KV
pool's layer-transfer counter makes each layer's reader wait for that layer only."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from flexflow_sglang.backend.layerwise import LayerLoader, LayerLoadError  # noqa: E402
from flexflow_sglang.connector.copy_kernels import PageCopier, kernels_available  # noqa: E402
from flexflow_sglang.connector.layout import KVLayout  # noqa: E402

from ffcache_env import serve  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="compiled copy kernels not built")


def _evict_all(env):
    """Evict the device tree and scribble over the pool: a load that skipped a layer cannot pass
    on the bytes the evicted request left behind in reused slots."""
    env.tree.evict(EvictParams(num_tokens=10**9))
    assert env.tree.evictable_size() == 0
    for bufs in env.buffers():
        for b in bufs:
            b.fill_(-7)


@pytest.mark.parametrize("ps", [1, 4])
def test_host_hit_is_loaded_layer_by_layer_and_byte_exact(envs, ps):
    env = envs(page_size=ps)
    assert env.kv.layer_transfer_counter is env.tree._layers  # registered on the pool
    ids = list(range(30, 30 + 8 * ps))
    serve(env, "a", ids)
    _evict_all(env)
    b = serve(env, "b", ids + [1] * ps)
    assert b.loaded == 8 * ps and b.kv_ok  # check_kv reads each layer after the pool's wait_until
    m = env.tree.metrics()
    assert m["layerwise_load_backs"] == 1 and m["layerwise_pages"] == 8
    env.tree.poll()  # settles the finished load: its host pages are unpinned
    assert env.connector.host.pinned_pages == 0 and not env.tree._layers.busy
    assert env.idle_ok()


def test_off_keeps_the_whole_load_in_init_load_back(envs):
    env = envs(layerwise=False)
    assert env.tree._layers is None and getattr(env.kv, "layer_transfer_counter", None) is None
    ids = list(range(40, 56))
    serve(env, "a", ids)
    _evict_all(env)
    b = serve(env, "b", ids + [1])
    assert b.loaded == 16 and b.kv_ok and "layerwise_load_backs" not in env.tree.metrics() or \
        env.tree.metrics().get("layerwise_load_backs", 0) == 0


def test_a_failed_layer_copy_is_redone_before_the_layer_is_read(envs, monkeypatch):
    env = envs(page_size=2)
    loader = env.tree._layers
    real = loader.copier.scatter_layer

    def flaky(host, host_pages, dev_pages, layer, threads=1):
        if layer == 1:
            raise RuntimeError("injected copy failure")
        return real(host, host_pages, dev_pages, layer, threads=threads)
    monkeypatch.setattr(loader.copier, "scatter_layer", flaky)
    ids = list(range(60, 76))
    serve(env, "a", ids)
    _evict_all(env)
    b = serve(env, "b", ids + [1, 1])
    assert b.loaded == 16 and b.kv_ok  # the consumer re-copied layer 1 through the twin
    assert env.tree.metrics()["layerwise_retries"] == 1


def test_checksum_mismatch_is_a_miss_before_anything_is_queued(envs):
    env = envs()
    ids = list(range(90, 110))
    serve(env, "a", ids)
    _evict_all(env)
    conn = env.connector
    conn.host.words[conn.host.page_of(conn.page_keys(ids)[5]), 3] += 1
    b = serve(env, "b", ids + [1])
    assert b.host_hit > 0 and b.loaded == 0 and b.kv_ok
    m = env.tree.metrics()
    assert m["load_back_failures"] == 1 and m["layerwise_loads"] == 0
    assert conn.host.pinned_pages == 0 and env.idle_ok()


# ------------------------------------------------------------------ the counter on its own
def _layout(layers=4, slots=64):
    bufs = [(torch.zeros(slots, 2, 8), torch.zeros(slots, 2, 8)) for _ in range(layers)]
    return KVLayout.from_buffers(bufs, 1), bufs


class _GatedCopier(PageCopier):
    """Copies a layer only once the test opens that layer's gate."""

    def __init__(self, layout):
        super().__init__(layout)
        self.gates = [threading.Event() for _ in range(layout.layer_num)]
        self.copied = []

    def scatter_layer(self, host, host_pages, dev_pages, layer, threads=1):
        assert self.gates[layer].wait(10)
        super().scatter_layer(host, host_pages, dev_pages, layer, threads)
        self.copied.append(layer)


def test_wait_until_waits_for_its_layer_only():
    layout, bufs = _layout()
    cp = _GatedCopier(layout)
    loader = LayerLoader(cp, timeout_s=10)
    try:
        host = torch.arange(3 * layout.page_words, dtype=layout.word_dtype).reshape(3, -1)
        loader.submit(host, [0, 1, 2], torch.tensor([5, 6, 7]))
        assert loader._done[0] < 1  # nothing copied before the gate opens
        cp.gates[0].set()
        loader.wait_until(0)
        assert cp.copied == [0]  # layer 0 is in place; layer 1 has not been touched
        seg = layout.seg_words[0]
        assert torch.equal(layout.dev_pages[0][0][5:8], host[:, :seg])
        for g in cp.gates:
            g.set()
        assert loader.finish() == [None]
        assert cp.copied == [0, 1, 2, 3]
        o = layout.segment_offsets()[3][1]
        assert torch.equal(layout.dev_pages[3][1][5:8], host[:, o:o + seg])
    finally:
        for g in cp.gates:
            g.set()
        loader.close()


def test_a_wedged_copy_raises_instead_of_hanging():
    layout, _ = _layout(layers=2)
    cp = _GatedCopier(layout)
    loader = LayerLoader(cp, timeout_s=0.3)
    try:
        host = torch.zeros(1, layout.page_words, dtype=layout.word_dtype)
        loader.submit(host, [0], torch.tensor([1]))
        t0 = time.perf_counter()
        with pytest.raises(LayerLoadError, match="layer 0"):
            loader.wait_until(0)
        assert time.perf_counter() - t0 < 5
    finally:
        for g in cp.gates:
            g.set()
        loader.close()


def test_scatter_layer_matches_the_twin():
    layout, bufs = _layout(layers=3, slots=32)
    cp = PageCopier(layout)
    g = torch.Generator().manual_seed(1)
    host = torch.randint(-2**40, 2**40, (6, layout.page_words), generator=g, dtype=torch.int64).to(layout.word_dtype)
    dev = torch.tensor([9, 3, 17, 4])
    pages = np.array([5, 0, 2, 3])
    for layer in range(3):
        cp.scatter_layer(host, pages, dev, layer)
    got = [b.clone() for pair in bufs for b in pair]
    for pair in bufs:
        for b in pair:
            b.zero_()
    for layer in range(3):
        cp.scatter_layer_twin(host, pages, dev, layer)
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - random words are NaNs as floats: compare bytes
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, [b for pair in bufs for b in pair]))
    assert all(bits(a).abs().sum() > 0 for a in got)
