"""PathSelector: flexFlow's path choice for one KV move, over the compiled (or twin) scoring core.

Per (src, dst) pair the candidate paths are enumerated once and flattened into typed arrays
(`_PairTable`); the NodeAgent's live link arrays are shared by every pair, so a load update is
visible to the next select() without any preparation step. select() is one dict lookup, one
call into the core and one small object.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import CompiledCoreMissing, SelectorError, TopologyError
from ..topology.graph import PATH_TYPE_CODES, Path, PathType, Topology
from .cost_model import CoreResult, pack_params
from .types import PathDecision, SelectorConfig, TransferRequest

try:  # the compiled core; the twin below is the fallback
    from .. import _selector_core as _compiled
except ImportError as _e:  # pragma: no cover - depends on the build
    _compiled = None
    _compiled_error = _e
else:
    _compiled_error = None
from . import _core_py


def selector_backend() -> str:
    """'compiled' when the Cython core is in use, else 'python'. Honours FLEXFLOW_SELECTOR_IMPL."""
    return _resolve_impl(None)[0]


def _resolve_impl(impl: Optional[str]):
    want = impl or os.environ.get("FLEXFLOW_SELECTOR_IMPL", "auto")
    require = os.environ.get("FLEXFLOW_REQUIRE_COMPILED", "0") not in ("", "0", "false", "False")
    if want not in ("auto", "compiled", "python"):
        raise ValueError(f"selector implementation {want!r}: expected 'auto', 'compiled' or 'python'")
    if want == "python":  # asked for explicitly (benchmarks, twin tests): allowed even when compiled is required
        return "python", _core_py.PairCore
    if _compiled is None:
        if require or want == "compiled":
            raise CompiledCoreMissing(
                f"the compiled selector core flexflow_sglang._selector_core is not importable ({_compiled_error}); "
                "build it with `pip install -e .` (needs Cython and a C compiler)")
        return "python", _core_py.PairCore
    return "compiled", _compiled.PairCore


class _PairTable:
    __slots__ = ("paths", "core", "arrays")

    def __init__(self, paths: Tuple[Path, ...], core, arrays):
        self.paths = paths
        self.core = core
        self.arrays = arrays  # keep the numpy buffers alive for the memoryviews


class PathSelector:
    """`PathSelector(topo, agent, cfg).select(TransferRequest(src, dst, data_bytes))` -> PathDecision.

    `agent` is a NodeAgent (or anything exposing `util` and `qdelay_us` float64 arrays indexed by
    link id); None means an idle network. `impl` forces 'compiled' or 'python' (default: auto)."""

    def __init__(self, topology: Topology, agent=None, config: Optional[SelectorConfig] = None,
                 impl: Optional[str] = None, allow_storage: bool = True, exclude_types=()):
        self.topology = topology
        self.config = config or SelectorConfig()
        self.impl, self._core_cls = _resolve_impl(impl)
        #: path types never returned (and never part of a split): an executor that cannot carry
        #: them out is served by a selector that does not offer them (see without())
        self.exclude_types = frozenset(PathType(t) for t in exclude_types)
        self.allow_storage = allow_storage and PathType.StorageRelay not in self.exclude_types
        n_links = len(topology.links)
        if agent is None:
            from ..monitor.node_agent import NodeAgent
            agent = NodeAgent(topology, source="mock")
        self.agent = agent
        if len(agent.util) != n_links:
            raise TopologyError(f"NodeAgent tracks {len(agent.util)} links but the topology has {n_links}")
        agent.relay_chunk_bytes = self.config.relay_chunk_bytes  # same pipeline model for feedback
        self._cap = np.array([l.capacity_gbps for l in topology.links], dtype=np.float64)
        self._params = pack_params(self.config)
        self._ttft_default = self.config.ttft_sensitive
        self._thr = self._thresholds()
        # the agent keeps our own in-flight reservations below these (updated in place below)
        try:
            agent.qos_thresholds = self._thr
        except AttributeError:  # a duck-typed agent without reservations
            pass
        self._tables: Dict[Tuple[str, str], _PairTable] = {}
        self._dispatch = None
        if self.impl == "compiled":  # select() as one C call; the method below is the twin's path
            self._dispatch = _compiled.Dispatch(self._table, self, PathDecision, self._ttft_default)
            self.select = self._dispatch.select

    def without(self, *types) -> "PathSelector":
        """A selector over the same topology, NodeAgent and config that never returns `types`
        (e.g. the remote tier's router, which has no StorageRelay or NVLinkRelay executor). It
        shares the agent (loads, feedback, reservations) and the agent's QoS threshold array."""
        sib = PathSelector(self.topology, self.agent, self.config, impl=self.impl, allow_storage=self.allow_storage,
                           exclude_types=self.exclude_types | {PathType(t) for t in types})
        sib._thr = self._thr
        self.agent.qos_thresholds = self._thr
        return sib

    def _thresholds(self) -> np.ndarray:
        return np.array([self.config.threshold_for(l.qos_class) for l in self.topology.links], dtype=np.float64)

    def update_config(self, config: SelectorConfig) -> None:
        """Swap knobs in place (weights, thresholds, margins); pair tables are rebuilt lazily."""
        self.config = config
        self.agent.relay_chunk_bytes = config.relay_chunk_bytes
        self._params[:] = pack_params(config)
        self._ttft_default = config.ttft_sensitive
        if self._dispatch is not None:  # the compiled Dispatch
            self._dispatch.ttft_default = config.ttft_sensitive
        self._thr[:] = self._thresholds()

    # ----------------------------------------------------------------- preparation
    def candidates(self, src: str, dst: str) -> Tuple[Path, ...]:
        return self._table(src, dst).paths

    def _table(self, src: str, dst: str) -> _PairTable:
        key = (src, dst)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self._build(src, dst)
        return t

    def _build(self, src: str, dst: str) -> _PairTable:
        try:
            paths = self.topology.enumerate_paths(src, dst, allow_storage=self.allow_storage)
        except TopologyError as e:
            raise SelectorError(str(e)) from None
        if self.exclude_types:
            paths = tuple(p for p in paths if p.type not in self.exclude_types)
        if not paths:
            raise SelectorError(f"no path from {src!r} to {dst!r} in topology {self.topology.name}")
        links = self.topology.links
        n = len(paths)
        direct_hops = min((p.hops for p in paths if p.type == PathType.Direct), default=min(p.hops for p in paths))
        ptype = np.array([PATH_TYPE_CODES[p.type] for p in paths], dtype=np.int32)
        ptr = np.zeros(n + 1, dtype=np.int32)
        for i, p in enumerate(paths):
            ptr[i + 1] = ptr[i] + len(p.links)
        plinks = np.array([l for p in paths for l in p.links], dtype=np.int32)
        fixed_lat = np.array([sum(links[l].latency_us for l in p.links) for p in paths], dtype=np.float64)
        nrelay = np.array([len(p.relays) for p in paths], dtype=np.int32)
        extra = np.array([max(0, p.hops - direct_hops) for p in paths], dtype=np.float64)
        disjoint = np.zeros(n * n, dtype=np.uint8)
        sets = [set(p.links) for p in paths]
        for i in range(n):
            for j in range(n):
                if i != j and not (sets[i] & sets[j]):
                    disjoint[i * n + j] = 1
        arrays = (ptype, ptr, plinks, fixed_lat, nrelay, extra, disjoint)
        core = self._core_cls(ptype, ptr, plinks, fixed_lat, nrelay, extra, disjoint, self._cap, self._thr,
                              self.agent.util, self.agent.qdelay_us, self._params)
        return _PairTable(paths, core, arrays)

    # ----------------------------------------------------------------- the hot path
    def select(self, request: TransferRequest) -> PathDecision:
        t = self._tables.get((request.src, request.dst))
        if t is None:
            t = self._table(request.src, request.dst)
        return t.core.decide(request, t.paths, self, self._ttft_default, PathDecision)

    def scores(self, src: str, dst: str, data_bytes: int, ttft: bool = False):
        """Diagnostics: [(path, available_gbps, est_time_us, cost, rejected)] for every candidate."""
        t = self._table(src, dst)
        return [(p, *s) for p, s in zip(t.paths, t.core.scores(float(data_bytes), bool(ttft)))]

    def always_direct(self, request: TransferRequest) -> PathDecision:
        """The default route a plain transport takes (first direct rail), scored but not chosen."""
        t = self._table(request.src, request.dst)
        i = next((k for k, p in enumerate(t.paths) if p.type == PathType.Direct), 0)
        bw, est, cost, rej = t.core.scores(float(request.data_bytes), bool(request.ttft_sensitive))[i]
        raw = CoreResult(kind=PATH_TYPE_CODES[t.paths[i].type], indices=(i,), shares=(request.data_bytes,),
                         est_bw_gbps=bw, est_time_us=est, qos_violation=rej, reason=0, aux_link=-1, aux_path=-1,
                         gain=0.0, cost=cost, aux_util=0.0)
        return PathDecision(request, t.paths, raw, self)
