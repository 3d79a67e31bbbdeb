"""Max-min fair bandwidth sharing (progressive filling / water-filling) with per-flow demand caps.

Every flow crosses a set of resources (directed links); a flow's rate is capped by its demand
(inf for bulk KV transfers, a constant for background inference traffic). Progressive filling
raises the rate of every unfrozen flow at the same pace until either a resource saturates (its
flows freeze) or a flow reaches its demand (it freezes). The result is the unique max-min fair
allocation: no flow's rate can grow without shrinking the rate of a flow that has no more.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: relative tolerance: a resource with less than REL_TOL * capacity left counts as saturated
REL_TOL = 1e-9


def max_min_rates(flow_res: Sequence[Sequence[int]], demand, cap) -> np.ndarray:
    """Rates (same unit as `cap`) of the max-min fair allocation.

    flow_res: per flow, the resource indices it crosses (non-empty, no duplicates).
    demand:   per flow, the most it wants (np.inf for an elastic flow).
    cap:      per resource, the capacity.
    """
    n = len(flow_res)
    if n == 0:
        return np.zeros(0)
    lens = np.fromiter((len(r) for r in flow_res), dtype=np.int64, count=n)
    idx = np.concatenate([np.asarray(r, dtype=np.int64) for r in flow_res])
    return max_min_csr(idx, lens, demand, cap)


def max_min_csr(idx: np.ndarray, lens: np.ndarray, demand, cap) -> np.ndarray:
    """Same as `max_min_rates` with the flows' resources given flat: flow i crosses
    idx[sum(lens[:i]) : sum(lens[:i+1])]."""
    n = len(lens)
    cap = np.asarray(cap, dtype=np.float64)
    demand = np.asarray(demand, dtype=np.float64)
    if n == 0:
        return np.zeros(0)
    if len(demand) != n:
        raise ValueError(f"max_min_rates: {n} flows but {len(demand)} demands")
    if (lens <= 0).any():
        raise ValueError("max_min_rates: every flow must cross at least one resource")
    owner = np.repeat(np.arange(n), lens)
    offsets = np.zeros(n, dtype=np.int64)
    offsets[1:] = np.cumsum(lens)[:-1]
    n_res = len(cap)
    rates = np.zeros(n)
    rem = cap.copy()
    tol_res = cap * REL_TOL
    frozen = demand <= 0.0
    finite = np.isfinite(demand)
    dtol = np.maximum(np.where(finite, demand, 1.0), 1.0) * REL_TOL
    for _ in range(n + 1):
        active = ~frozen
        if not active.any():
            break
        cnt = np.bincount(idx[active[owner]], minlength=n_res)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cnt > 0, rem / np.maximum(cnt, 1), np.inf)
        per_flow = np.minimum.reduceat(share[idx], offsets)
        head = demand - rates
        x = min(float(per_flow[active].min()), float(head[active].min()))
        if x < 0.0:
            x = 0.0
        rates[active] += x
        rem -= x * cnt
        sat = rem <= tol_res
        touches_sat = np.maximum.reduceat(sat[idx], offsets)
        done = finite & ((demand - rates) <= dtol)
        frozen = frozen | (active & (touches_sat | done))
    return rates
