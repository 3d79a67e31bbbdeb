"""TransferExecutor: moves KV pages between the device pool and page-major host buffers, the way
flexFlow's PathSelector says.

Every move is one `TransferRequest(src, dst, bytes)`; the executor carries out the PathDecision:
- Direct: one gather (device -> host) or scatter (host -> device) over all pages;
- SplitPath: the pages divided by the subpaths' byte shares, one move per subpath (CPU: in turn;
  CUDA: one stream per subpath, joined with events);
- NVLinkRelay / CrossNodeRelay: staged through the relay GPU when this process sees it (CUDA, more
  than one device), otherwise carried out as Direct (debug log). StorageRelay has no executor for
  device <-> host moves: the connector's selector is built without it (`exclude_types`).
Selecting, reserving, running the legs, releasing and reporting each move is the transfer
engine's (flexflow_sglang/transfer/engine.py: `TransferEngine.move`, or a `Ticket` for the CUDA
split whose legs run on concurrent streams); this module only supplies the legs.

Copies on a CPU pool go through the compiled copy kernels (connector/copy_kernels.py: one nogil pass
per page, the page hash fused into it, so a store gets its checksums and a load its verification
without a second read: `gather_hashed`, `scatter_verified`). Elsewhere (CUDA pools, no build) they are
a few large torch ops: per contiguous run of host pages, one `index_select` (gather into a strided
host view) or `index_copy_` (scatter) per layer and buffer; no per-token Python loops.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ..errors import TransferError
from ..selector import PathType
from ..transfer import MoveStats, TransferEngine
from .copy_kernels import PageCopier
from .host_tier import contiguous_runs
from .layout import KVLayout

logger = logging.getLogger(__name__)

#: above this many contiguous host runs a move goes through one staging buffer (2 passes)
MAX_DIRECT_RUNS = 8
#: device-side staging on CUDA is done in chunks of this many bytes
CUDA_STAGING_BYTES = 256 << 20


class TransferExecutor:
    def __init__(self, layout: KVLayout, selector, agent, device_node: str, host_node: str,
                 ttft_sensitive: bool = False, engine: "Optional[TransferEngine]" = None):
        self.layout = layout
        # every move is routed (select, reserve, legs, release, report) by the transfer engine
        self.engine = engine if engine is not None else TransferEngine(selector, agent, ttft_sensitive=ttft_sensitive)
        self.selector = selector
        self.agent = agent
        self.device_node = device_node
        self.host_node = host_node
        self.ttft_sensitive = ttft_sensitive
        self._offsets = layout.segment_offsets()
        self._cuda = layout.device.type == "cuda"
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self.wait_stream = None  # CUDA: the forward stream copies must follow (set by the cache)
        # compiled fused copy+hash (CPU pools); None where the kernels cannot address the pool
        copier = PageCopier(layout) if layout.device.type == "cpu" else None
        self.copier = copier if copier is not None and copier.compiled else None

    def fused(self, host: torch.Tensor, with_sums: bool) -> bool:
        """Whether moves to/from `host` run through the compiled kernels (with the page hash when
        `with_sums`): the connector then skips its separate checksum pass."""
        return self.copier is not None and self.copier.usable(host, with_sums)

    # ----------------------------------------------------------------- public moves
    def device_to_host(self, dev_pages: torch.Tensor, dst: torch.Tensor, dst_pages: Sequence[int]) -> MoveStats:
        """Copy device pages `dev_pages` (LongTensor) into rows `dst_pages` of `dst[N, page_words]`."""
        return self._move("d2h", dev_pages, dst, list(dst_pages))

    def host_to_device(self, src: torch.Tensor, src_pages: Sequence[int], dev_pages: torch.Tensor) -> MoveStats:
        """Copy rows `src_pages` of `src[N, page_words]` into device pages `dev_pages`."""
        return self._move("h2d", dev_pages, src, list(src_pages))

    def gather_hashed(self, dev_pages: torch.Tensor, dst: torch.Tensor, dst_pages: Sequence[int]) -> torch.Tensor:
        """device_to_host that also returns each page's hash (int64[n], copy_kernels' hash), taken
        from the words as they are copied. Only where `fused(dst, True)`."""
        f = _Fused(len(dst_pages), want_sums=True)
        self._move("d2h", dev_pages, dst, list(dst_pages), f)
        return torch.from_numpy(f.sums)

    def scatter_verified(self, src: torch.Tensor, src_pages: Sequence[int], dev_pages: torch.Tensor,
                         expect: Optional[torch.Tensor]) -> int:
        """host_to_device that checks each page against `expect` (its stored hash) in the same pass:
        the index of the first page that differs, or -1. Every page is copied either way; on a
        mismatch the caller drops the load (its fresh slots hold nothing anyone reads yet).
        `expect` None: a plain compiled copy (-1). Only where `fused(src, expect is not None)`."""
        f = _Fused(len(src_pages), expect=None if expect is None else
                   np.ascontiguousarray(expect.cpu().numpy(), dtype=np.int64).reshape(-1))
        self._move("h2d", dev_pages, src, list(src_pages), f)
        return f.bad

    # ----------------------------------------------------------------- decision handling
    def _move(self, direction: str, dev_pages: torch.Tensor, host: torch.Tensor, host_pages: List[int],
              fused: "Optional[_Fused]" = None) -> MoveStats:
        n = len(host_pages)
        if n == 0:
            return MoveStats()
        if dev_pages.numel() != n:
            raise TransferError(f"{direction}: {dev_pages.numel()} device pages for {n} host pages")
        src, dst = (self.device_node, self.host_node) if direction == "d2h" else (self.host_node, self.device_node)
        dev_pages = dev_pages.to(self.layout.device, dtype=torch.long)
        P = self.layout.page_nbytes
        if self._cuda:
            ticket = self.engine.open(src, dst, n * P)
            try:
                legs = [(i, sub, u0, u1) for i, sub, u0, u1 in ticket.shares(n)]
                if len(legs) > 1:
                    self._run_cuda_split(direction, legs, dev_pages, host, host_pages, ticket)
                else:
                    for i, sub, u0, u1 in legs:
                        t0 = time.perf_counter()
                        self._leg(direction, sub, dev_pages[u0:u1], host, host_pages[u0:u1])
                        torch.cuda.current_stream(self.layout.device).synchronize()
                        ticket.leg_done(i, (u1 - u0) * P, time.perf_counter() - t0, report=sub is not None)
            finally:
                stats = ticket.close()
        else:
            # local copies move each leg in one piece (chunking would only add per-layer op calls)
            if fused is None and self.fused(host, False):
                fused = _Fused(n)  # a plain copy: the kernels still beat torch's per-segment ops
            if fused is not None:
                def leg(sub, u0, u1):
                    self._fused_leg(direction, fused, u0, dev_pages[u0:u1], host, host_pages[u0:u1])
            else:
                def leg(sub, u0, u1):
                    self._leg(direction, sub, dev_pages[u0:u1], host, host_pages[u0:u1])
            stats = self.engine.move(src, dst, n, P, leg, chunked=False)
        logger.debug("flexflow %s %d pages (%d B) via %s", direction, n, n * P, stats.path_type)
        return stats

    @property
    def by_type(self) -> Dict[str, Dict[str, float]]:
        return self.engine.by_type

    def _leg(self, direction: str, sub, dev_pages: torch.Tensor, host: torch.Tensor, host_pages: List[int]) -> None:
        if sub is not None and sub.type in (PathType.NVLinkRelay, PathType.CrossNodeRelay, PathType.StorageRelay):
            peer = self._relay_device(sub)
            if peer is not None:
                self._relay_leg(direction, peer, dev_pages, host, host_pages)
                return
            logger.debug("flexflow: %s via %s carried out as Direct (relay not reachable from this process)",
                         sub.type.value, "-".join(sub.nodes))
        if direction == "d2h":
            self._gather(dev_pages, host, host_pages)
        else:
            self._scatter(host, host_pages, dev_pages)

    def _fused_leg(self, direction: str, f: "_Fused", u0: int, dev_pages: torch.Tensor, host: torch.Tensor,
                   host_pages: List[int]) -> None:
        """One leg through the compiled kernels (CPU: every path type is a local copy here)."""
        if direction == "d2h":
            sums = self.copier.gather(dev_pages, host, host_pages, with_sums=f.want_sums)
            if sums is not None:
                f.sums[u0:u0 + len(host_pages)] = sums.numpy()
            return
        exp = None if f.expect is None else torch.from_numpy(f.expect[u0:u0 + len(host_pages)])
        bad = self.copier.scatter(host, host_pages, dev_pages, expect=exp)
        if bad >= 0 and (f.bad < 0 or u0 + bad < f.bad):
            f.bad = u0 + bad

    # ----------------------------------------------------------------- copies
    def _gather(self, dev_pages: torch.Tensor, dst: torch.Tensor, dst_pages: List[int]) -> None:
        if dst.device != self.layout.device:  # CUDA pool -> host: gather on the device, then one D2H per chunk
            self._staged_d2h(dev_pages, dst, dst_pages)
            return
        runs = contiguous_runs(dst_pages)
        if len(runs) > MAX_DIRECT_RUNS:
            staging = torch.empty((len(dst_pages), self.layout.page_words), dtype=dst.dtype, device=dst.device)
            self._gather_run(dev_pages, staging)
            dst.index_copy_(0, torch.as_tensor(dst_pages, dtype=torch.long, device=dst.device), staging)
            return
        for i0, i1, start in runs:
            self._gather_run(dev_pages[i0:i1], dst[start:start + (i1 - i0)])

    def _gather_run(self, dev_pages: torch.Tensor, out: torch.Tensor) -> None:
        """out[n, page_words] (row-contiguous) <- the device pages, one index_select per segment."""
        for layer, bufs in enumerate(self.layout.dev_pages):
            offs = self._offsets[layer]
            for b, view in enumerate(bufs):
                o = offs[b]
                torch.index_select(view, 0, dev_pages, out=out[:, o:o + self.layout.seg_words[b]])

    def _scatter(self, src: torch.Tensor, src_pages: List[int], dev_pages: torch.Tensor) -> None:
        if src.device != self.layout.device:
            self._staged_h2d(src, src_pages, dev_pages)
            return
        runs = contiguous_runs(src_pages)
        if len(runs) > MAX_DIRECT_RUNS:
            staging = src.index_select(0, torch.as_tensor(src_pages, dtype=torch.long, device=src.device))
            self._scatter_run(staging, dev_pages)
            return
        for i0, i1, start in runs:
            self._scatter_run(src[start:start + (i1 - i0)], dev_pages[i0:i1])

    def _scatter_run(self, rows: torch.Tensor, dev_pages: torch.Tensor) -> None:
        # Slots freshly allocated for a load are usually a few contiguous runs: plain slice copies
        # run at memcpy speed, while a scatter (index_copy_) reaches ~40 % of it on CPU.
        runs = contiguous_runs(dev_pages) if dev_pages.numel() > 1 else []
        if runs and len(runs) * 4 <= dev_pages.numel():
            for layer, bufs in enumerate(self.layout.dev_pages):
                offs = self._offsets[layer]
                for b, view in enumerate(bufs):
                    o, w = offs[b], self.layout.seg_words[b]
                    for i0, i1, start in runs:
                        view[start:start + (i1 - i0)].copy_(rows[i0:i1, o:o + w])
            return
        for layer, bufs in enumerate(self.layout.dev_pages):
            offs = self._offsets[layer]
            for b, view in enumerate(bufs):
                o = offs[b]
                view.index_copy_(0, dev_pages, rows[:, o:o + self.layout.seg_words[b]])

    # ----------------------------------------------------------------- CUDA paths (not exercised on CPU)
    def _chunks(self, n: int):
        per = max(1, CUDA_STAGING_BYTES // self.layout.page_nbytes)
        for i in range(0, n, per):
            yield i, min(n, i + per)

    def _staged_d2h(self, dev_pages: torch.Tensor, dst: torch.Tensor, dst_pages: List[int]) -> None:
        stream = torch.cuda.current_stream(self.layout.device)
        if self.wait_stream is not None:
            stream.wait_stream(self.wait_stream)  # the running forward may still write these slots
        for c0, c1 in self._chunks(len(dst_pages)):
            staging = torch.empty((c1 - c0, self.layout.page_words), dtype=dst.dtype, device=self.layout.device)
            self._gather_run(dev_pages[c0:c1], staging)
            for i0, i1, start in contiguous_runs(dst_pages[c0:c1]):
                dst[start:start + (i1 - i0)].copy_(staging[i0:i1], non_blocking=dst.is_pinned())
        stream.synchronize()

    def _staged_h2d(self, src: torch.Tensor, src_pages: List[int], dev_pages: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.layout.device)
        if self.wait_stream is not None:
            stream.wait_stream(self.wait_stream)  # reclaimed slots may still be read by the running forward
        for c0, c1 in self._chunks(len(src_pages)):
            staging = torch.empty((c1 - c0, self.layout.page_words), dtype=src.dtype, device=self.layout.device)
            for i0, i1, start in contiguous_runs(src_pages[c0:c1]):
                staging[i0:i1].copy_(src[start:start + (i1 - i0)], non_blocking=src.is_pinned())
            self._scatter_run(staging, dev_pages[c0:c1])
        stream.synchronize()  # loads are complete before init_load_back returns

    def _run_cuda_split(self, direction, legs, dev_pages, host, host_pages, ticket) -> None:
        base = torch.cuda.current_stream(self.layout.device)
        done = []
        t0 = time.perf_counter()
        for k, (i, sub, i0, i1) in enumerate(legs):
            s = self._streams.get(k)
            if s is None:
                s = self._streams[k] = torch.cuda.Stream(self.layout.device)
            s.wait_stream(base)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                start.record(s)
                self._leg(direction, sub, dev_pages[i0:i1], host, host_pages[i0:i1])
                end.record(s)
            done.append((i, i0, i1, start, end))
        for i, i0, i1, start, end in done:
            end.synchronize()
            base.wait_event(end)
            ticket.leg_done(i, (i1 - i0) * self.layout.page_nbytes, start.elapsed_time(end) / 1e3)
        ticket.stats.seconds = time.perf_counter() - t0

    def _relay_device(self, sub) -> Optional[torch.device]:
        if not self._cuda or torch.cuda.device_count() < 2:
            return None
        topo = self.selector.topology
        for name in sub.nodes[1:-1]:
            node = topo.nodes.get(name)
            if node is not None and node.kind.value == "gpu" and node.index < torch.cuda.device_count() \
                    and node.index != self.layout.device.index:
                return torch.device("cuda", node.index)
        return None

    def _relay_leg(self, direction, peer, dev_pages, host, host_pages) -> None:
        """Stage through a peer GPU: device <-> peer over NVLink, peer <-> host over its own PCIe."""
        n = len(host_pages)
        if direction == "d2h":
            staging = torch.empty((n, self.layout.page_words), dtype=host.dtype, device=self.layout.device)
            self._gather_run(dev_pages, staging)
            hop = staging.to(peer, non_blocking=True)
            for i0, i1, start in contiguous_runs(host_pages):
                host[start:start + (i1 - i0)].copy_(hop[i0:i1])
        else:
            hop = torch.empty((n, self.layout.page_words), dtype=host.dtype, device=peer)
            for i0, i1, start in contiguous_runs(host_pages):
                hop[i0:i1].copy_(host[start:start + (i1 - i0)])
            self._scatter_run(hop.to(self.layout.device), dev_pages)
        torch.cuda.synchronize(peer)

    def tier_io(self, src: Optional[str], dst: Optional[str], nbytes: int, fn):
        """Run a deeper tier's own I/O (`fn()`) as one routed, reserved and reported move over
        src -> dst (the engine's ticket); returns fn's result."""
        t = self.engine.open(src, dst, nbytes)
        t0 = time.perf_counter()
        try:
            out = fn()
        finally:
            dt = time.perf_counter() - t0
            if t.decision is not None:
                for i, sub in enumerate(t.subpaths):
                    t.leg_done(i, int(sub.nbytes), dt)
            t.close("tier:")
        return out

    def bandwidth_by_type(self) -> Dict[str, Dict[str, float]]:
        return self.engine.bandwidth_by_type()


class _Fused:
    """Per-move state of a fused copy: the hashes a gather produces, or the hashes a scatter checks
    and the first page that failed (legs fill their own slice)."""
    __slots__ = ("want_sums", "sums", "expect", "bad")

    def __init__(self, n: int, *, want_sums: bool = False, expect: Optional[np.ndarray] = None):
        self.want_sums = want_sums
        self.sums = np.zeros(n, dtype=np.int64) if want_sums else None
        self.expect = expect
        if expect is not None and len(expect) != n:
            raise TransferError(f"scatter_verified: {len(expect)} checksums for {n} pages")
        self.bad = -1
