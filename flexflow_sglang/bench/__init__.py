"""Benchmarks (`flexflow bench ...`): shared helpers."""

from typing import Optional, Sequence


def nearest_rank(xs: Sequence[float], q: float, empty: Optional[float] = None) -> Optional[float]:
    """Nearest-rank percentile (q in [0, 1]) of a small sample; `empty` when there is none."""
    if not xs:
        return empty
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]
