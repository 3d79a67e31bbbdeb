"""Layer-wise load-back on a CUDA pool: the per-layer copies run on a side stream and each layer's
reader waits for that layer's event, as SGLang's own `LayerDoneCounter` does for HiCache (issue 15,
item 1; backend/layerwise.py is the CPU twin and owns the queue, the retries and the timeouts).

Per queued load and layer, the loader thread
1. gathers the layer's segment of each host page row into a pinned staging buffer (CPU; the host
   tier is page-major, so a layer's bytes are strided across the rows and one DMA cannot take them);
2. on the side stream: copies the staging buffer to the device (`non_blocking`: the CPU does not wait
   for the DMA) and scatters its rows into the pool's K/V page views (`index_copy_`);
3. records the layer's event on the side stream and publishes it.

`wait_until(layer)` (the KV pool calls it before attention reads a layer) waits on the CPU only until
the layer's copies are *enqueued*, then makes the caller's current stream wait for the event: the
forward thread never blocks on a DMA, and layer i's attention starts as soon as layer i has landed.

What keeps a token right, on top of the CPU loader's rules:
- The side stream first waits for the scheduler's stream and the forward stream as they were at
  submit: the slots a load writes were freed by requests whose last kernels may still read them.
- The device page index tensor is made on the scheduler's stream and `record_stream`ed onto the side
  stream, so the caching allocator cannot hand its memory out while the copies still read it. The
  pinned staging buffers are protected by torch's host allocator, which records the copy's stream.
- The host pages are unpinned once every layer has been gathered: the staging buffers hold their own
  copy of the bytes, so a host-tier eviction after that cannot change what lands on the device.
- Readers outside the forward (stores, dumps, flush) call `finish()`, which orders the caller's stream
  after the last layer's event without blocking the CPU on it.
- A layer whose gather or enqueue raised is redone by the consumer on its own stream (`layerwise_retries`).

Tested on CPU against a recording stream API with the same calls (tests/backend/test_layerwise_cuda.py);
the same tests run on torch.cuda where a GPU is present (marked `gpu`).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch

from ..connector.copy_kernels import PageCopier
from .layerwise import DEFAULT_TIMEOUT_S, LayerLoader, _LoadJob

logger = logging.getLogger(__name__)


class _Fences:
    __slots__ = ("ready", "dev", "host_idx", "waited")

    def __init__(self, ready, dev: torch.Tensor, host_idx: torch.Tensor):
        self.ready, self.dev, self.host_idx, self.waited = ready, dev, host_idx, False


class StreamLayerLoader(LayerLoader):
    """LayerLoader whose copies run on a side stream, each layer fenced by an event.

    `api`: the stream module (`torch.cuda`, or a stand-in with the same `Stream`, `Event`,
    `current_stream`, `stream` and `set_device` for CPU tests). `forward_stream`: returns the stream
    SGLang's forward runs on under overlap scheduling (None: the caller's current stream only)."""

    needs_copy_kernels = False

    def __init__(self, copier: PageCopier, *, api=None, forward_stream: Optional[Callable[[], object]] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        layout = copier.layout
        self.api = api if api is not None else torch.cuda
        self.device = layout.device
        self._forward_stream = forward_stream or (lambda: None)
        self._layer_words = sum(layout.seg_words)
        self._layer_offsets = [offs[0] for offs in layout.segment_offsets()]
        self._pin = self.device.type == "cuda"  # a non_blocking H2D needs page-locked staging
        self._side = self.api.Stream(self.device)
        self._events: List[object] = [None] * layout.layer_num
        self._cleared = 0  # seq of the last load known complete on the device (events queried)
        super().__init__(copier, timeout_s=timeout_s, threads=1)

    # ----------------------------------------------------------------- scheduler thread
    def _prepare(self, job: _LoadJob) -> None:
        dev = torch.as_tensor(job.dev_pages, dtype=torch.long).to(self.device)  # made on `cur`: fenced below
        cur = self.api.current_stream(self.device)
        ready = [self.api.Event()]
        ready[0].record(cur)
        fwd = self._forward_stream()
        if fwd is not None and fwd != cur:
            ready.append(self.api.Event())
            ready[-1].record(fwd)
        job.extra = _Fences(ready, dev, torch.from_numpy(job.host_pages))

    @property
    def busy(self) -> bool:
        """Loads to settle, or copies not yet known to have landed (the per-tick poll keeps asking
        until they have, so that forwards stop fencing on events long complete)."""
        return bool(self._jobs) or self._cleared < self._submitted

    def finish(self, wait: bool = True) -> List[object]:
        """Settle every load whose layers are all enqueued: their pins back to the caller, and the
        caller's stream ordered after the copies (no CPU wait on the device)."""
        out = super().finish(wait) if self._jobs else []
        if self._jobs:  # not settled (wait False, copies still being enqueued)
            return out
        with self._cv:  # the event is recorded before its seq is published: read them as one pair
            done, last = self._done[-1], self._events[-1]
        if last is not None and self._cleared < done:
            if last.query():  # every copy through `done` has landed: later forwards skip the fences
                self._cleared = done
            else:
                self.api.current_stream(self.device).wait_event(last)
        return out

    # ----------------------------------------------------------------- forward thread
    def wait_until(self, layer: int) -> None:
        target = self._submitted
        if self._cleared >= target:  # everything queued so far is known to be on the device
            return
        super().wait_until(layer)  # CPU side: this layer's copies enqueued (failed ones redone here)
        ev = self._events[layer]
        if ev is not None:
            self.api.current_stream(self.device).wait_event(ev)

    # ----------------------------------------------------------------- loader thread
    def _on_start(self) -> None:
        if self.device.type == "cuda":
            self.api.set_device(self.device)

    def _copy_layer(self, job: _LoadJob, layer: int, *, twin: bool) -> None:
        f: _Fences = job.extra
        if twin:  # the consumer's own stream, which already waits for everything before the load
            self.copier.scatter_layer_twin(job.host, job.host_pages, f.dev, layer)
            return
        o, w = self._layer_offsets[layer], self._layer_words
        stage = torch.empty((len(job.host_pages), w), dtype=job.host.dtype, pin_memory=self._pin)
        torch.index_select(job.host[:, o:o + w], 0, f.host_idx, out=stage)
        side = self._side
        with self.api.stream(side):
            if not f.waited:
                for ev in f.ready:
                    side.wait_event(ev)
                if f.dev.device.type == "cuda":
                    f.dev.record_stream(side)
                f.waited = True
            rows = stage.to(self.device, non_blocking=self._pin)
            c = 0
            for b, view in enumerate(self.copier.layout.dev_pages[layer]):
                sw = self.copier.layout.seg_words[b]
                view.index_copy_(0, f.dev, rows[:, c:c + sw])
                c += sw

    def _layer_copied(self, layer: int) -> None:
        ev = self.api.Event()
        ev.record(self._side)
        with self._cv:
            self._events[layer] = ev
