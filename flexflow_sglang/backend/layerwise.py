"""Layer-wise load-back: a host hit is copied into the device pool layer by layer while the forward
pass runs, and layer i's attention waits only for layer i's KV (issue 15, item 1).

SGLang's KV pools call `layer_transfer_counter.wait_until(layer_id - start_layer)` inside
`get_key_buffer` / `get_value_buffer` when a counter is registered
(`MHATokenToKVPool.register_layer_transfer_counter`). SGLang's own counter (`LayerDoneCounter`,
managers/cache_controller.py) waits on CUDA events; on a CPU pool this module's `LayerLoader` is the
counter: a worker thread copies each queued load one layer at a time (the compiled scatter kernel
releases the GIL, so the copy runs beside the forward's torch ops) and publishes, per layer, the
sequence number of the last load finished through that layer.

What keeps a token right:
- Everything that can make a load a miss is decided before the batch runs, on the scheduler thread:
  the pages are present, their checksums verified (one compiled read), the ranks agree (the cache's
  all-agree), and the host pages are pinned so that nothing overwrites them while the worker reads.
  Only then is the copy queued. A miss frees the slots exactly as the synchronous load does.
- If the worker's copy of a layer fails anyway (an exception, e.g. a bug), the consumer that waits
  for that layer re-copies it on its own thread through the torch twin before it reads the layer
  (`layerwise_retries` counts it); only if that fails too does the forward raise, loudly. A wait
  longer than `timeout_s` raises too: never a silent wrong token, never a hang.
- Readers of device KV outside the forward (stores, eviction, flush, KV dumps) call `finish()`
  first. The loaded slots sit in the tree under the request's lock until the forward has read them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Deque, Dict, List, Optional

import numpy as np
import torch

from ..connector.copy_kernels import PageCopier

logger = logging.getLogger(__name__)

#: a forward waits at most this long for one layer before it raises (the worker is wedged)
DEFAULT_TIMEOUT_S = 60.0
#: test hook (real-server failure-path test): "copy_fail_layer=N" makes the worker's copy of layer N
#: raise for every load, so the consumer-side retry path runs on the real server
FAULTS_ENV = "FLEXFLOW_TEST_FAULTS"


class LayerLoadError(RuntimeError):
    """A layer's KV could not be put in place before the forward read it."""


class _LoadJob:
    __slots__ = ("seq", "host", "host_pages", "dev_pages", "pins", "failed_layers", "done", "extra")

    def __init__(self, seq: int, host: torch.Tensor, host_pages: np.ndarray, dev_pages: torch.Tensor, pins):
        self.seq, self.host, self.host_pages, self.dev_pages, self.pins = seq, host, host_pages, dev_pages, pins
        self.failed_layers: set = set()
        self.done = False
        self.extra = None  # what a subclass's _prepare attaches (the CUDA loader: its stream fences)


class LayerLoader:
    """Queue of layer-wise loads plus SGLang's layer-transfer-counter interface."""

    needs_copy_kernels = True  # the worker copies with the compiled kernels (CPU pools)

    def __init__(self, copier: PageCopier, *, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1):
        self.copier = copier
        self.layer_num = copier.layout.layer_num
        self.timeout_s = float(timeout_s)
        self.threads = max(1, int(threads))  # the forward owns the cores: one copy thread by default
        self._cv = threading.Condition()
        self._queue: Deque[_LoadJob] = deque()
        self._jobs: Deque[_LoadJob] = deque()  # submitted, not yet settled (scheduler thread only)
        self._submitted = 0
        self._done: List[int] = [0] * self.layer_num  # per layer: seq of the last load through it
        self._failed = 0  # layers the worker failed to copy and no consumer has redone yet
        self._closed = False
        self.m: Dict[str, int] = {"layerwise_loads": 0, "layerwise_pages": 0, "layerwise_waits": 0,
                                  "layerwise_retries": 0}
        self._fail_layer = _fault_layer()
        # SGLang reads these on a registered counter (LayerDoneCounter's attributes)
        self.consumer_index = -1
        self._thread = threading.Thread(target=self._run, name="flexflow-layer-loader", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- scheduler thread
    def submit(self, host: torch.Tensor, host_pages, dev_pages: torch.Tensor, pins=None) -> int:
        """Queue a load of host rows `host_pages` into device pages `dev_pages` (already verified and
        pinned; `pins` is what `settle` hands back to the caller's unpin). Returns its sequence."""
        if self._closed:
            raise LayerLoadError("layer loader is closed")
        hp = np.ascontiguousarray(np.asarray(host_pages, dtype=np.int64))
        with self._cv:  # _jobs is read by the forward's thread too (overlap scheduling)
            self._submitted += 1
            job = _LoadJob(self._submitted, host, hp, dev_pages, pins)
            self._prepare(job)
            self._queue.append(job)
            self._jobs.append(job)
            self._cv.notify_all()
        self.m["layerwise_loads"] += 1
        self.m["layerwise_pages"] += len(hp)
        return job.seq

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def finish(self, wait: bool = True) -> List[object]:
        """Wait until every queued load is complete (retrying failed layers here) and return the
        pins of the loads it settles, oldest first, for the caller to release. `wait` False (the
        scheduler's per-tick poll): settle only if nothing is left to wait for, else return []."""
        if not self._jobs:
            return []
        if not wait and (min(self._done) < self._submitted or self._failed):
            return []
        for layer in range(self.layer_num):
            self.wait_until(layer)
        with self._cv:
            out = [j.pins for j in self._jobs]
            self._jobs.clear()
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    # ----------------------------------------------------------------- SGLang's counter interface
    def wait_until(self, layer: int) -> None:
        """Return once every load queued so far has layer `layer` in place (the KV pool calls this
        before handing a layer's buffers to attention)."""
        target = self._submitted
        if self._done[layer] >= target and not self._failed:  # the common case: nothing in flight
            return
        self.m["layerwise_waits"] += 1
        with self._cv:
            if not self._cv.wait_for(lambda: self._done[layer] >= target or self._closed, self.timeout_s):
                raise LayerLoadError(f"layer {layer}: KV load not complete after {self.timeout_s:.0f} s "
                                     f"(loader thread alive: {self._thread.is_alive()})")
            if self._done[layer] < target:
                raise LayerLoadError(f"layer {layer}: layer loader closed with loads in flight")
            failed = [j for j in self._jobs if j.seq <= target and layer in j.failed_layers]
        for job in failed:  # the worker's copy raised: put this layer in place here, by the twin
            self._copy_layer(job, layer, twin=True)
            with self._cv:
                if layer in job.failed_layers:
                    job.failed_layers.discard(layer)
                    self._failed -= 1
            self.m["layerwise_retries"] += 1

    def update_producer(self) -> int:  # LayerDoneCounter parity (GPU overlap bookkeeping): unused
        return 0

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def reset(self) -> None:
        return None

    # ----------------------------------------------------------------- subclass hooks
    def _prepare(self, job: _LoadJob) -> None:
        """Scheduler thread, at submit, under the loader's lock (CPU: nothing to prepare)."""

    def _on_start(self) -> None:
        """Worker thread, once before its first load."""

    def _layer_copied(self, layer: int) -> None:
        """Worker thread: every queued load's copy of `layer` is done (CPU) or enqueued (CUDA)."""

    # ----------------------------------------------------------------- worker thread
    def _run(self) -> None:
        self._on_start()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                group = list(self._queue)  # every load queued so far: one layer at a time across all
                self._queue.clear()
            last = group[-1].seq
            for layer in range(self.layer_num):
                for job in group:
                    try:
                        if self._fail_layer == layer:
                            raise RuntimeError(f"{FAULTS_ENV}: injected copy failure at layer {layer}")
                        self._copy_layer(job, layer, twin=False)
                    except Exception:  # noqa: BLE001 - the consumer retries this layer before reading it
                        logger.exception("flexflow: layer %d of a %d-page load failed in the loader thread; "
                                         "the forward re-copies it", layer, len(job.host_pages))
                        with self._cv:
                            job.failed_layers.add(layer)
                            self._failed += 1
                self._layer_copied(layer)
                with self._cv:
                    self._done[layer] = last
                    self._cv.notify_all()

    def _copy_layer(self, job: _LoadJob, layer: int, *, twin: bool) -> None:
        if twin:
            self.copier.scatter_layer_twin(job.host, job.host_pages, job.dev_pages, layer)
        else:
            self.copier.scatter_layer(job.host, job.host_pages, job.dev_pages, layer, threads=self.threads)


def _fault_layer() -> Optional[int]:
    spec = os.environ.get(FAULTS_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        if name == "copy_fail_layer":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: copy_fail_layer={value!r} is not a layer number") from None
    return None
