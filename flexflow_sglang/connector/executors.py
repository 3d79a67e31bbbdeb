"""TransferExecutor: moves KV pages between the device pool and page-major host buffers, the way
flexFlow's PathSelector says.

Every move is one `TransferRequest(src, dst, bytes)`; the executor carries out the PathDecision:
- Direct: one gather (device -> host) or scatter (host -> device) over all pages;
- SplitPath: the pages divided by the subpaths' byte shares, one move per subpath (CPU: in turn;
  CUDA: one stream per subpath, joined with events);
- NVLinkRelay / CrossNodeRelay / StorageRelay: staged through the relay GPU when this process sees
  it (CUDA, more than one device), otherwise carried out as Direct (debug log).
Each subpath's bytes and seconds go back to the NodeAgent (`report_transfer`). While a move runs,
its legs are reserved on the agent (`reserve_decision`, released as each leg ends, or on failure),
so a concurrent move sees the links as partly busy; bookkeeping errors never fail a move.

Copies are a few large torch ops: per contiguous run of host pages, one `index_select` (gather into a
strided host view) or `index_copy_` (scatter) per layer and buffer; no per-token Python loops.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import TransferError
from ..selector import PathType, TransferRequest
from .host_tier import contiguous_runs
from .layout import KVLayout

logger = logging.getLogger(__name__)

#: above this many contiguous host runs a move goes through one staging buffer (2 passes)
MAX_DIRECT_RUNS = 8
#: device-side staging on CUDA is done in chunks of this many bytes
CUDA_STAGING_BYTES = 256 << 20


@dataclass
class MoveStats:
    nbytes: int = 0
    seconds: float = 0.0
    path_type: str = ""
    legs: List[Tuple[str, int, float]] = field(default_factory=list)  # (subpath type, bytes, seconds)


class TransferExecutor:
    def __init__(self, layout: KVLayout, selector, agent, device_node: str, host_node: str,
                 ttft_sensitive: bool = False):
        self.layout = layout
        self.selector = selector
        self.agent = agent
        self.device_node = device_node
        self.host_node = host_node
        self.ttft_sensitive = ttft_sensitive
        self._offsets = layout.segment_offsets()
        self._cuda = layout.device.type == "cuda"
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self.wait_stream = None  # CUDA: the forward stream copies must follow (set by the cache)
        # bytes and seconds per chosen path type, per direction
        self.by_type: Dict[str, Dict[str, float]] = {}

    # ----------------------------------------------------------------- public moves
    def device_to_host(self, dev_pages: torch.Tensor, dst: torch.Tensor, dst_pages: Sequence[int]) -> MoveStats:
        """Copy device pages `dev_pages` (LongTensor) into rows `dst_pages` of `dst[N, page_words]`."""
        return self._move("d2h", dev_pages, dst, list(dst_pages))

    def host_to_device(self, src: torch.Tensor, src_pages: Sequence[int], dev_pages: torch.Tensor) -> MoveStats:
        """Copy rows `src_pages` of `src[N, page_words]` into device pages `dev_pages`."""
        return self._move("h2d", dev_pages, src, list(src_pages))

    # ----------------------------------------------------------------- decision handling
    def _move(self, direction: str, dev_pages: torch.Tensor, host: torch.Tensor, host_pages: List[int]) -> MoveStats:
        n = len(host_pages)
        stats = MoveStats()
        if n == 0:
            return stats
        if dev_pages.numel() != n:
            raise TransferError(f"{direction}: {dev_pages.numel()} device pages for {n} host pages")
        nbytes = n * self.layout.page_nbytes
        src, dst = (self.device_node, self.host_node) if direction == "d2h" else (self.host_node, self.device_node)
        decision = self.selector.select(TransferRequest(src, dst, nbytes, self.ttft_sensitive))
        stats.path_type = decision.chosen_type.value
        subs = decision.subpaths
        # pages per subpath, proportional to its byte share (cumulative rounding: sums to n)
        bounds, acc, total = [0], 0, sum(s.nbytes for s in subs) or 1
        for s in subs:
            acc += s.nbytes
            bounds.append(round(acc * n / total))
        dev_pages = dev_pages.to(self.layout.device, dtype=torch.long)
        legs = [(s, bounds[i], bounds[i + 1]) for i, s in enumerate(subs) if bounds[i + 1] > bounds[i]]
        tokens = self._reserve(decision)
        try:
            if self._cuda and len(legs) > 1:
                self._run_cuda_split(direction, legs, dev_pages, host, host_pages, stats, tokens)
            else:
                for sub, i0, i1 in legs:
                    t0 = time.perf_counter()
                    self._leg(direction, sub, dev_pages[i0:i1], host, host_pages[i0:i1])
                    if self._cuda:
                        torch.cuda.current_stream(self.layout.device).synchronize()
                    self._release(tokens, sub)
                    self._account(sub, (i1 - i0) * self.layout.page_nbytes, time.perf_counter() - t0, stats)
        finally:
            self._release(tokens)
        self._record(stats.path_type, stats.nbytes, stats.seconds)
        logger.debug("flexflow %s %d pages (%d B) via %s: %s", direction, n, nbytes, stats.path_type, decision.reason)
        return stats

    def _reserve(self, decision) -> Dict:
        """Reserve the decision's legs on the agent: {subpath links: token}; {} if that fails."""
        try:
            toks = self.agent.reserve_decision(decision)
            return {tuple(s.links): t for s, t in zip(decision.subpaths, toks)}
        except Exception as e:  # noqa: BLE001 - bookkeeping must never fail a move
            logger.debug("flexflow: reserve failed: %r", e)
            return {}

    def _release(self, tokens: Dict, sub=None) -> None:
        """Release one leg's reservation (`sub`), or all that are left."""
        try:
            if sub is None:
                toks = list(tokens.values())
                tokens.clear()
            else:
                toks = [tokens.pop(tuple(sub.links), 0)]
            self.agent.release(toks)
        except Exception as e:  # noqa: BLE001
            logger.debug("flexflow: release failed: %r", e)

    def _account(self, sub, nbytes: int, seconds: float, stats: MoveStats) -> None:
        self.agent.report_transfer(sub.links, nbytes, max(seconds, 1e-9),
                                  relays=0 if sub.type.value == "Direct" else 1)
        stats.nbytes += nbytes
        stats.seconds += seconds
        stats.legs.append((sub.type.value, nbytes, seconds))

    def _record(self, path_type: str, nbytes: int, seconds: float) -> None:
        rec = self.by_type.setdefault(path_type, {"moves": 0, "bytes": 0, "seconds": 0.0})
        rec["moves"] += 1
        rec["bytes"] += nbytes
        rec["seconds"] += seconds

    def _leg(self, direction: str, sub, dev_pages: torch.Tensor, host: torch.Tensor, host_pages: List[int]) -> None:
        if sub.type in (PathType.NVLinkRelay, PathType.CrossNodeRelay, PathType.StorageRelay):
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

    def _run_cuda_split(self, direction, legs, dev_pages, host, host_pages, stats, tokens=None) -> None:
        tokens = {} if tokens is None else tokens
        base = torch.cuda.current_stream(self.layout.device)
        done = []
        t0 = time.perf_counter()
        for k, (sub, i0, i1) in enumerate(legs):
            s = self._streams.get(k)
            if s is None:
                s = self._streams[k] = torch.cuda.Stream(self.layout.device)
            s.wait_stream(base)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                start.record(s)
                self._leg(direction, sub, dev_pages[i0:i1], host, host_pages[i0:i1])
                end.record(s)
            done.append((sub, i0, i1, start, end))
        for sub, i0, i1, start, end in done:
            end.synchronize()
            base.wait_event(end)
            self._release(tokens, sub)
            self._account(sub, (i1 - i0) * self.layout.page_nbytes, start.elapsed_time(end) / 1e3, stats)
        stats.seconds = time.perf_counter() - t0

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
        """Run a deeper tier's own I/O (`fn()`), routed and accounted like a move: the selector is
        asked for src -> dst (when both are topology nodes), the elapsed time goes back to the agent
        over the chosen path's links. Returns fn's result."""
        topo = self.selector.topology
        decision = None
        if nbytes > 0 and src in topo.nodes and dst in topo.nodes and src != dst:
            try:
                decision = self.selector.select(TransferRequest(src, dst, nbytes, self.ttft_sensitive))
            except Exception:  # noqa: BLE001 - no route known: still run the I/O
                logger.debug("flexflow: no path %s -> %s for tier I/O", src, dst)
        tokens = self._reserve(decision) if decision is not None else {}
        t0 = time.perf_counter()
        try:
            out = fn()
        finally:
            self._release(tokens)
        dt = time.perf_counter() - t0
        if decision is not None:
            for sub in decision.subpaths:
                self.agent.report_transfer(sub.links, sub.nbytes, max(dt, 1e-9),
                                          relays=0 if sub.type.value == "Direct" else 1)
            self._record("tier:" + decision.chosen_type.value, nbytes, dt)
        return out

    def bandwidth_by_type(self) -> Dict[str, Dict[str, float]]:
        return {k: {"moves": v["moves"], "bytes": v["bytes"], "seconds": round(v["seconds"], 6),
                    "gbps": round(v["bytes"] / v["seconds"] / 1e9, 3) if v["seconds"] > 0 else 0.0}
                for k, v in self.by_type.items()}
