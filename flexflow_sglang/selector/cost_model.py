"""The transfer cost model of the path selector, in one place (docs/selector.md, "Scoring").

What lives here, and who reads it:
- the relay pipeline model's constants: a store-and-forward relay adds one pipeline chunk
  (`min(bytes, chunk)`, `SelectorConfig.relay_chunk_bytes`, default RELAY_CHUNK_BYTES) at the path's
  bandwidth plus a fixed hand-off RELAY_OVERHEAD_US; the scoring constants (bandwidth floor, TTFT
  factors, split search bounds). SelectorConfig, the NodeAgent and the simulator take their defaults
  from here;
- the layout of the parameter vector the scoring core reads (`P_*`, PARAM_NAMES, pack_params) and of
  the result tuple it returns (CoreResult, `R_*`). The Python twin (_core_py.py) imports them; the
  compiled core (csrc/flexflow_sglang/_selector_core.pxd/.pyx) keeps its own typed constants for the
  hot loop and `tests/selector/test_cost_model.py` checks they equal these;
- the formulas that are used outside the core: relay_fill_s / fixed_latency_s (the part of a
  transfer's time that is not bandwidth: the NodeAgent's feedback discounts it, the simulator adds
  it to a relayed flow's completion) and path_time_us (the core's single-path estimate, the reference
  the tests check the core and split legs against). The core computes the same terms inline on its
  arrays (no call per candidate).

Pure Python plus numpy: imports neither torch nor SGLang nor any other module of the package
(tests/packaging/test_import_graph.py), so the monitor and the simulator import it without a cycle.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Tuple

import numpy as np

# ----------------------------------------------------------------------------- constants
#: default chunk of a store-and-forward relay (SelectorConfig.relay_chunk_bytes, the NodeAgent's
#: relay_chunk_bytes until a selector sets it, the simulator's SimParams.relay_chunk_bytes)
RELAY_CHUNK_BYTES = 4 << 20
#: fixed cost of one relay hand-off (buffer swap, notification), microseconds
RELAY_OVERHEAD_US = 5.0
#: a link's available bandwidth is floored at this fraction of its capacity
MIN_AVAIL_FRAC = 0.01
#: TTFT-sensitive requests: the hop penalty is multiplied by this, the latency weight by the other
TTFT_HOP_FACTOR = 4.0
TTFT_LAT_FACTOR = 2.0
#: the split search: first legs among this many widest feasible candidates; at most this many legs
SPLIT_TOP = 8
MAX_SPLIT_CAP = 8

# ----------------------------------------------------------------------------- parameter vector
#: the SelectorConfig field behind each entry of the params array, in index order
PARAM_NAMES = ("w_bandwidth", "w_queue_delay", "w_hops", "w_qos_risk", "w_latency", "relay_benefit_margin",
               "split_benefit_margin", "enable_split_path", "max_split_paths", "relay_chunk_bytes",
               "relay_overhead_us")
(P_W_BW, P_W_Q, P_W_HOPS, P_W_QOS, P_W_LAT, P_RELAY_MARGIN, P_SPLIT_MARGIN, P_ENABLE_SPLIT,
 P_MAX_SPLIT, P_RELAY_CHUNK, P_RELAY_OVERHEAD_US) = range(len(PARAM_NAMES))
P_NPARAMS = len(PARAM_NAMES)


def pack_params(cfg) -> np.ndarray:
    """The float64 params array the scoring core reads, from a SelectorConfig (PARAM_NAMES order;
    booleans as 1.0 / 0.0). The relay hand-off is the model's constant, not a knob."""
    return np.array([RELAY_OVERHEAD_US if name == "relay_overhead_us" else float(getattr(cfg, name))
                     for name in PARAM_NAMES], dtype=np.float64)


def param_layout() -> dict:
    """{'P_W_BW': 0, ...}: the index constants by name (compared with the compiled core's)."""
    return {k: v for k, v in globals().items() if k.startswith("P_") and isinstance(v, int)}


# ----------------------------------------------------------------------------- result tuple
class CoreResult(NamedTuple):
    """The layout of the scoring core's result. The compiled core returns a plain tuple in this
    order (no NamedTuple construction in the hot path); PathDecision reads it through the R_*
    indices below, `CoreResult._make(raw)` gives the named view."""
    kind: int  # path type code of the choice (topology.graph.PATH_TYPE_CODES; 3 = split)
    indices: Tuple[int, ...]  # candidate index per leg
    shares: Tuple[int, ...]  # bytes per leg, summing exactly to the request's bytes
    est_bw_gbps: float
    est_time_us: float
    qos_violation: bool
    reason: int  # selector.types.REASONS code
    aux_link: int  # the link that explains the reason (rejected / worst), -1 if none
    aux_path: int  # the relay that was not taken (reason 5) or the least-bad path (4), -1 if none
    gain: float  # relative gain of the relay or split over what it replaced
    cost: float  # the cost the choice won with (microseconds, weighted)
    # aux_link's utilisation when the choice was made: the reason quotes it, and the agent's live
    # array has moved on by the time anyone reads the reason (0.0 when aux_link is -1)
    aux_util: float


(R_KIND, R_INDICES, R_SHARES, R_EST_BW, R_EST_TIME, R_QOS_VIOLATION, R_REASON, R_AUX_LINK, R_AUX_PATH,
 R_GAIN, R_COST, R_AUX_UTIL) = range(len(CoreResult._fields))


# ----------------------------------------------------------------------------- formulas
def relay_fill_s(relays: int, nbytes: int, rate_bps: float, chunk_bytes: int = RELAY_CHUNK_BYTES,
                 overhead_us: float = RELAY_OVERHEAD_US) -> float:
    """Seconds `relays` store-and-forward relays add to a transfer of `nbytes` moving at `rate_bps`
    (bytes/s): per relay one pipeline chunk of min(nbytes, chunk_bytes) plus the hand-off."""
    return relays * (min(nbytes, chunk_bytes) / rate_bps + overhead_us * 1e-6)


def fixed_latency_s(link_latency_us: Iterable[float], relays: int, nbytes: int, rate_bps: float,
                    chunk_bytes: int = RELAY_CHUNK_BYTES, overhead_us: float = RELAY_OVERHEAD_US) -> float:
    """Seconds of a path's transfer time that say nothing about its bandwidth: the summed link
    latencies plus the relay pipeline fill (relay_fill_s)."""
    return sum(link_latency_us) * 1e-6 + relay_fill_s(relays, nbytes, rate_bps, chunk_bytes, overhead_us)


def path_time_us(nbytes: float, bw_gbps: float, latency_us: float, relays: int = 0, queue_us: float = 0.0,
                 chunk_bytes: int = RELAY_CHUNK_BYTES, overhead_us: float = RELAY_OVERHEAD_US) -> float:
    """The selector's single-path estimate, microseconds: transfer at `bw_gbps` (GB/s = 1000
    bytes/us), link latencies, per relay one pipeline chunk and the hand-off, queueing. Same
    operations as the core's `s_est` (t_x + t_l + q), so equal to it for the same inputs; a split
    leg's predicted finish is this for its own share."""
    rate = bw_gbps * 1000.0
    chunk = nbytes if nbytes < chunk_bytes else chunk_bytes
    return nbytes / rate + (latency_us + relays * (chunk / rate + overhead_us)) + queue_us
