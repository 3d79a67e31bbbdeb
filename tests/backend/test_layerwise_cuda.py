"""Layer-wise load-back on a side stream (backend/layerwise_cuda.py).

On CPU the loader runs against `RecordingStreams`, a stand-in with torch.cuda's stream calls that
logs every record / wait and completes a stream's work only when told to: it checks the fences (the
side stream waits for the scheduler's and the forward's streams before its first copy; a layer's
reader waits on that layer's event, never on the CPU for the DMA; `finish` orders the caller's
stream after the copies) and the bytes, through the real FlexFlowRadixCache. The same loads run on
torch.cuda where a GPU is present (marked `gpu`)."""

from __future__ import annotations

import contextlib
import itertools
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from flexflow_sglang.backend.layerwise_cuda import StreamLayerLoader  # noqa: E402
from flexflow_sglang.connector.copy_kernels import PageCopier  # noqa: E402
from flexflow_sglang.connector.layout import KVLayout  # noqa: E402

from ffcache_env import serve  # noqa: E402

_ids = itertools.count()


class _Stream:
    def __init__(self, api, name):
        self.api, self.name = api, name
        self.recorded = 0  # events recorded on this stream so far
        self.completed = 0  # how many of them the "device" has finished

    def wait_event(self, ev):
        self.api.log.append(("wait", self.name, ev.id))

    def wait_stream(self, other):
        self.api.log.append(("wait_stream", self.name, other.name))

    def synchronize(self):  # the loader must never call this: it would block the CPU on the DMA
        self.api.log.append(("synchronize", self.name))
        self.completed = self.recorded


class _Event:
    def __init__(self, api):
        self.api, self.id, self.stream, self.pos = api, next(_ids), None, 0

    def record(self, stream):
        stream.recorded += 1
        self.stream, self.pos = stream, stream.recorded
        self.api.log.append(("record", stream.name, self.id))

    def query(self):
        return self.stream is not None and self.stream.completed >= self.pos


class RecordingStreams:
    """torch.cuda's stream API, recorded (thread-safe: the loader thread and the test both call it)."""

    def __init__(self):
        self.log = []
        self._lock = threading.Lock()
        self.current = _Stream(self, "current")
        self.forward = _Stream(self, "forward")
        self.sides = []
        self._tls = threading.local()

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        s = _Stream(self, f"side{len(self.sides)}")
        self.sides.append(s)
        return s

    def Event(self):  # noqa: N802
        return _Event(self)

    def current_stream(self, device=None):
        return getattr(self._tls, "stream", None) or self.current

    @contextlib.contextmanager
    def stream(self, s):
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = s
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self._tls.stream = prev

    def set_device(self, device):
        self.log.append(("set_device", str(device)))

    def complete_all(self):
        for s in self.sides + [self.current, self.forward]:
            s.completed = s.recorded

    def entries(self, kind, stream=None):
        return [e for e in list(self.log) if e[0] == kind and (stream is None or e[1] == stream)]


def _layout(layers=3, slots=32, device="cpu"):
    bufs = [(torch.zeros(slots, 2, 8, device=device), torch.zeros(slots, 2, 8, device=device))
            for _ in range(layers)]
    return KVLayout.from_buffers(bufs, 1), bufs


def _host(layout, pages, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**20, 2**20, (pages, layout.page_words), generator=g).to(layout.word_dtype)


def _expect(layout, host, host_pages, dev_pages, layer):
    o = layout.segment_offsets()[layer]
    return [(layout.dev_pages[layer][b][dev_pages], host[host_pages][:, o[b]:o[b] + w])
            for b, w in enumerate(layout.seg_words)]


def test_fences_events_and_bytes_per_layer():
    layout, _ = _layout()
    api = RecordingStreams()
    loader = StreamLayerLoader(PageCopier(layout), api=api, forward_stream=lambda: api.forward, timeout_s=10)
    try:
        host = _host(layout, 6)
        hp, dp = np.array([4, 0, 2]), torch.tensor([9, 3, 17])
        loader.submit(host, hp, dp, pins="p")
        for layer in range(layout.layer_num):
            loader.wait_until(layer)
            for got, exp in _expect(layout, host, hp, dp, layer):
                assert torch.equal(got, exp)
        log = list(api.log)
        # at submit: the scheduler's stream and the forward stream are fenced ...
        readies = [e[2] for e in log if e[0] == "record" and e[1] in ("current", "forward")]
        assert len(readies) == 2
        side = api.sides[0].name
        # ... and the side stream waits on both before its first copy (its first "enter")
        first_enter = log.index(("enter", side))
        assert [e for e in log[:first_enter] if e[0] == "wait" and e[1] == side] == []
        side_waits = [e[2] for e in log if e[0] == "wait" and e[1] == side]
        assert side_waits == readies
        # one event per layer, recorded on the side stream in layer order
        layer_events = [e[2] for e in log if e[0] == "record" and e[1] == side]
        assert len(layer_events) == layout.layer_num
        assert [ev.id for ev in loader._events] == layer_events
        # each layer's reader (this thread's current stream) waited on that layer's event, no CPU sync
        assert [e[2] for e in log if e[0] == "wait" and e[1] == "current"] == layer_events
        assert api.entries("synchronize") == []
    finally:
        loader.close()


def test_finish_orders_the_callers_stream_and_fast_paths_once_landed():
    layout, _ = _layout(layers=2)
    api = RecordingStreams()
    loader = StreamLayerLoader(PageCopier(layout), api=api, timeout_s=10)
    try:
        host = _host(layout, 4)
        loader.submit(host, np.array([1, 2]), torch.tensor([5, 6]), pins=[1, 2])
        assert loader.finish() == [[1, 2]]  # enqueued, not landed: the pins come back (staging holds the bytes)
        last = loader._events[-1].id
        assert ("wait", "current", last) in api.log and api.entries("synchronize") == []
        assert loader._cleared == 0 and loader.busy  # settled, but not known to have landed
        n = len(api.log)
        loader.wait_until(0)  # not known landed yet: the reader still waits on the event
        assert api.log[n:] == [("wait", "current", loader._events[0].id)]
        api.complete_all()
        assert loader.finish(wait=False) == [] and loader._cleared == 1 and not loader.busy
        loader.submit(host, np.array([3]), torch.tensor([7]), pins=[3])
        for layer in range(2):
            loader.wait_until(layer)  # both layers enqueued ...
        api.complete_all()  # ... and landed
        assert loader.finish() == [[3]]
        assert loader._cleared == 2  # the last event has landed: everything through load 2
        n = len(api.log)
        for layer in range(2):
            loader.wait_until(layer)
        assert api.log[n:] == []  # nothing in flight: no fence at all
    finally:
        loader.close()


def test_poll_does_not_wait_for_a_layer_still_being_gathered(monkeypatch):
    layout, _ = _layout(layers=2)
    api = RecordingStreams()
    loader = StreamLayerLoader(PageCopier(layout), api=api, timeout_s=10)
    gate = threading.Event()
    real = loader._copy_layer

    def gated(job, layer, *, twin):
        if layer == 1 and not twin:
            assert gate.wait(10)
        real(job, layer, twin=twin)
    monkeypatch.setattr(loader, "_copy_layer", gated)
    try:
        host = _host(layout, 2)
        loader.submit(host, np.array([0]), torch.tensor([4]), pins=[0])
        loader.wait_until(0)
        assert loader.finish(wait=False) == [] and loader.busy  # layer 1 not enqueued: pins stay
        gate.set()
        assert loader.finish(wait=True) == [[0]] and not loader._jobs
    finally:
        gate.set()
        loader.close()


def test_a_failed_layer_is_redone_by_the_reader(monkeypatch):
    layout, _ = _layout(layers=3)
    api = RecordingStreams()
    loader = StreamLayerLoader(PageCopier(layout), api=api, timeout_s=10)
    real = loader._copy_layer

    def flaky(job, layer, *, twin):
        if layer == 1 and not twin:
            raise RuntimeError("injected gather failure")
        real(job, layer, twin=twin)
    monkeypatch.setattr(loader, "_copy_layer", flaky)
    try:
        host = _host(layout, 5)
        hp, dp = np.array([3, 1]), torch.tensor([11, 2])
        loader.submit(host, hp, dp)
        for layer in range(3):
            loader.wait_until(layer)
            for got, exp in _expect(layout, host, hp, dp, layer):
                assert torch.equal(got, exp)
        assert loader.m["layerwise_retries"] == 1 and loader._failed == 0
    finally:
        loader.close()


def _swap_in_stream_loader(env, api):
    """Replace the env's CPU loader with the stream loader (as the cache picks it on a CUDA pool)."""
    env.tree._layers.close()
    env.kv.layer_transfer_counter = None
    loader = StreamLayerLoader(PageCopier(env.connector.executor.layout), api=api,
                               forward_stream=lambda: api.forward, timeout_s=10)
    env.kv.register_layer_transfer_counter(loader)
    env.tree._layers = loader
    return loader


@pytest.mark.parametrize("ps", [1, 4])
def test_host_hit_through_the_cache_is_byte_exact_and_unpins(envs, ps):
    env = envs(page_size=ps)
    api = RecordingStreams()
    loader = _swap_in_stream_loader(env, api)
    ids = list(range(30, 30 + 8 * ps))
    serve(env, "a", ids)
    env.tree.evict(EvictParams(num_tokens=10**9))
    for bufs in env.buffers():
        for b in bufs:
            b.fill_(-7)  # a skipped layer cannot pass on the evicted request's bytes
    b = serve(env, "b", ids + [1] * ps)
    assert b.loaded == 8 * ps and b.kv_ok
    assert env.tree.metrics()["layerwise_load_backs"] == 1 and loader.m["layerwise_pages"] == 8
    env.tree.poll()  # settles without waiting: every layer was enqueued before the reads above
    assert env.connector.host.pinned_pages == 0 and not loader._jobs
    api.complete_all()
    env.tree.poll()  # the copies have landed: the loader goes idle, forwards stop fencing
    assert not loader.busy and loader._cleared == loader._submitted
    assert api.entries("synchronize") == [] and env.idle_ok()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_layers_land_byte_exact_behind_their_events():
    layout, _ = _layout(layers=4, slots=4096, device="cuda")
    loader = StreamLayerLoader(PageCopier(layout), timeout_s=30)
    try:
        host = _host(layout, 2048).pin_memory()
        hp = np.random.default_rng(0).permutation(2048)[:1500]
        dp = torch.randperm(4096)[:1500]
        loader.submit(host, hp, dp, pins="p")
        for layer in range(layout.layer_num):
            loader.wait_until(layer)  # the current stream waits on the event; reads below follow it
            for got, exp in _expect(layout, host, hp, dp.cuda(), layer):
                assert torch.equal(got, exp.cuda())
        assert loader.finish() == ["p"]
        torch.cuda.synchronize()
    finally:
        loader.close()
