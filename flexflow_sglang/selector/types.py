"""Selector value types: SelectorConfig, TransferRequest, PathDecision (flexFlow names)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Tuple

from ..topology.graph import PATH_TYPE_BY_CODE, PATH_TYPE_CODES, Path, PathType  # noqa: F401  (re-exported)
# the core's result layout (named indices into PathDecision._raw) and the relay model's default chunk
from .cost_model import (RELAY_CHUNK_BYTES, R_COST, R_EST_BW, R_EST_TIME, R_GAIN, R_INDICES, R_KIND,
                         R_QOS_VIOLATION, R_REASON, R_SHARES, CoreResult)

_SPLIT = PATH_TYPE_CODES[PathType.SplitPath]


@dataclass(frozen=True)
class SelectorConfig:
    """flexFlow's knobs. Weights are dimensionless multipliers on the cost terms (see docs/selector.md);
    thresholds are link utilisations in (0, 1]; margins are relative gains (0.10 = 10 %)."""
    w_bandwidth: float = 1.0
    w_queue_delay: float = 0.5
    w_hops: float = 0.05
    w_qos_risk: float = 0.3
    w_latency: float = 0.5
    nvlink_util_threshold: float = 0.80
    rdma_util_threshold: float = 0.80
    cnic_util_threshold: float = 0.70
    snic_util_threshold: float = 0.85
    relay_benefit_margin: float = 0.10
    enable_split_path: bool = True
    max_split_paths: int = 2
    split_benefit_margin: float = 0.10
    ttft_sensitive: bool = False
    #: chunk size of store-and-forward relays (the pipeline fill a relay adds); match the executor's
    relay_chunk_bytes: int = RELAY_CHUNK_BYTES

    def __post_init__(self) -> None:
        from ..config_rules import validate_selector_values  # one validator for YAML and Python callers
        validate_selector_values({f.name: getattr(self, f.name) for f in fields(self)}, where="SelectorConfig")

    def threshold_for(self, qos_class: str) -> float:
        return {"nvlink": self.nvlink_util_threshold, "rdma": self.rdma_util_threshold,
                "cnic": self.cnic_util_threshold, "snic": self.snic_util_threshold}[qos_class]


@dataclass(frozen=True)
class TransferRequest:
    """Move `data_bytes` from node `src` to node `dst` (topology node names)."""
    src: str
    dst: str
    data_bytes: int
    ttft_sensitive: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.data_bytes, int) or isinstance(self.data_bytes, bool) or self.data_bytes <= 0:
            raise ValueError(f"TransferRequest.data_bytes must be a positive int, got {self.data_bytes!r}")


@dataclass(frozen=True)
class SubPath:
    """One leg of a decision: the route and the bytes it carries."""
    type: PathType
    nodes: Tuple[str, ...]
    links: Tuple[int, ...]
    nbytes: int


REASONS = {
    0: "direct path is the best candidate",
    1: "relay {via} beats direct by {gain:.0%} (margin {margin:.0%})",
    2: "direct rejected: link {link} at {util:.0%} > {qos} threshold {thr:.0%}",
    3: "split over {n} link-disjoint paths beats the best single path by {gain:.0%} (margin {margin:.0%})",
    4: "every path crosses a link above its QoS threshold ({link} at {util:.0%} > {thr:.0%}); least-bad path, QoS not met",
    5: "relay {via} gains only {gain:.0%} < margin {margin:.0%}; keeping direct",
    6: "direct rejected by QoS and no relay is within thresholds; storage relay",
}


try:  # the compiled core builds decisions without a Python __init__, its result kept as a C struct (issue 15)
    from .._selector_core import DecisionBase as _DecisionBase
except ImportError:  # pragma: no cover - depends on the build
    class _DecisionBase:
        __slots__ = ("request", "_paths", "_raw", "_sel", "_reason")

        def __init__(self, request, paths, raw, selector):
            self.request = request
            self._paths = paths  # candidate Path tuple of the (src, dst) pair
            self._raw = raw  # the core's result, laid out as cost_model.CoreResult
            self._sel = selector
            self._reason = None


class PathDecision(_DecisionBase):
    """The selector's answer. `hops` is the node sequence, or for a SplitPath a tuple of
    (node sequence, bytes) whose bytes sum exactly to the request's data_bytes.
    `estimated_bandwidth` is GB/s, `estimated_time_us` microseconds.

    Built from the core's raw result (`_raw`, laid out as cost_model.CoreResult and read through its
    R_* indices; `raw` gives the named view); everything else is derived on access so that select()
    allocates one small object."""

    # fields live in _DecisionBase: request, _paths, _raw (the core's tuple; the compiled select()
    # keeps its result as a C struct and builds the tuple on first access), _sel, _reason
    __slots__ = ()

    @property
    def chosen_type(self) -> PathType:
        return PATH_TYPE_BY_CODE[self._raw[R_KIND]]

    @property
    def estimated_bandwidth(self) -> float:
        return self._raw[R_EST_BW]

    @property
    def estimated_time_us(self) -> float:
        return self._raw[R_EST_TIME]

    @property
    def qos_violation(self) -> bool:
        return bool(self._raw[R_QOS_VIOLATION])

    @property
    def reason_code(self) -> int:
        return self._raw[R_REASON]

    @property
    def cost(self) -> float:
        return self._raw[R_COST]

    @property
    def gain(self) -> float:
        return self._raw[R_GAIN]

    @property
    def raw(self) -> CoreResult:
        """The core's result with named fields (a copy; `_raw` is what the core returned)."""
        return CoreResult._make(self._raw)

    @property
    def subpaths(self) -> Tuple[SubPath, ...]:
        return tuple(SubPath(self._paths[i].type, self._paths[i].nodes, self._paths[i].links, s)
                     for i, s in zip(self._raw[R_INDICES], self._raw[R_SHARES]))

    @property
    def hops(self):
        if self._raw[R_KIND] == _SPLIT:
            return tuple((self._paths[i].nodes, s) for i, s in zip(self._raw[R_INDICES], self._raw[R_SHARES]))
        return self._paths[self._raw[R_INDICES][0]].nodes

    @property
    def relays(self) -> Tuple[str, ...]:
        return tuple(r for i in self._raw[R_INDICES] for r in self._paths[i].relays)

    @property
    def links(self) -> Tuple[int, ...]:
        return tuple(l for i in self._raw[R_INDICES] for l in self._paths[i].links)

    @property
    def reason(self) -> str:
        if self._reason is None:
            self._reason = REASONS[self._raw[R_REASON]].format(**self._reason_args())
        return self._reason

    def _reason_args(self) -> dict:
        raw = self.raw
        code, idx = raw.reason, raw.indices
        cfg = self._sel.config
        out = {"gain": raw.gain, "margin": cfg.split_benefit_margin if code == 3 else cfg.relay_benefit_margin,
               "n": len(idx), "via": "-", "link": "-", "util": 0.0, "thr": 0.0, "qos": ""}
        relay_path = self._paths[raw.aux_path] if code == 5 else self._paths[idx[0]]
        out["via"] = ",".join(relay_path.relays) or "-"
        if raw.aux_link >= 0:
            link = self._sel.topology.links[raw.aux_link]
            out.update(link=f"{link.a}-{link.b}", util=raw.aux_util,
                       thr=cfg.threshold_for(link.qos_class), qos=link.qos_class)
        return out

    def to_dict(self) -> dict:
        split = self._raw[R_KIND] == _SPLIT
        return {
            "src": self.request.src, "dst": self.request.dst, "data_bytes": self.request.data_bytes,
            "ttft_sensitive": self.request.ttft_sensitive,
            "chosen_type": self.chosen_type.value,
            "hops": [{"nodes": list(n), "bytes": b} for n, b in self.hops] if split else list(self.hops),
            "subpaths": [{"type": s.type.value, "nodes": list(s.nodes), "bytes": s.nbytes} for s in self.subpaths],
            "estimated_bandwidth_gbps": round(self.estimated_bandwidth, 6),
            "estimated_time_us": round(self.estimated_time_us, 3),
            "qos_violation": self.qos_violation,
            "reason": self.reason,
        }

    def __repr__(self) -> str:
        return (f"PathDecision({self.chosen_type.value}, hops={self.hops}, "
                f"bw={self.estimated_bandwidth:.2f} GB/s, t={self.estimated_time_us:.1f} us, "
                f"qos_violation={self.qos_violation}, reason={self.reason!r})")
