"""Fetch or recompute: is a run of deep-tier pages cheaper to load than to prefill again?

A prefix found in a deep tier (storage, remote, an external store) is only worth loading if the
bytes arrive before the forward pass could have recomputed those tokens. Over a congested link or a
slow store they may not: the request would wait on the fetch (up to `load_timeout_ms`) for KV it
could have computed sooner. With `transfer.recompute_tokens_per_s` set (the server's prefill
throughput, tokens per second), the connector's lookup stops at a deep run whose estimated fetch
time exceeds the time to recompute its tokens; those pages count as a miss
(`deep_pages_recompute_cheaper`) and SGLang prefills them.

The same estimates order the tiers a run is read from when several hold it (write-through copies
every page to each): the cheapest first, a tier not measured yet first of all (its first read
measures it).

The fetch estimate is the slower of two views, each used only when it exists:
* the path selector's predicted time for tier node -> host node under the NodeAgent's live link
  load (a tier without a node in the topology has none);
* the tier's own recent read bandwidth (an EWMA of what its reads delivered, bytes over seconds,
  ignored once older than `OBSERVED_TTL_S`, so one slow period does not stop fetching for good).
With neither, the pages are fetched (no evidence that recomputing is faster). The recompute time is
linear in tokens: attention's quadratic part makes long prefixes cost more per token, so the rule
errs toward fetching them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

#: a tier's observed read bandwidth older than this is ignored (a fetch re-measures it)
OBSERVED_TTL_S = 10.0
#: weight of the newest read in the observed bandwidth's moving average
EWMA_ALPHA = 0.3


class FetchCost:
    def __init__(self, recompute_tokens_per_s: float, page_size: int, page_nbytes: int,
                 estimate_s: Callable[[Optional[str], int], Optional[float]],
                 clock: Callable[[], float] = time.monotonic):
        """`estimate_s(tier_node, nbytes)`: the selector's predicted seconds to move nbytes from the
        tier's node to host memory (None when unrouted)."""
        self.tokens_per_s = float(recompute_tokens_per_s)
        self.page_size = int(page_size)
        self.page_nbytes = int(page_nbytes)
        self._estimate_s = estimate_s
        self._clock = clock
        self._lock = threading.Lock()
        self._observed: Dict[str, Tuple[float, float]] = {}  # tier name -> (bytes/s, when)

    @property
    def enabled(self) -> bool:
        return self.tokens_per_s > 0

    def observe(self, tier_name: str, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` from the tier took `seconds` (engine worker threads)."""
        if nbytes <= 0 or seconds <= 0:
            return
        bw = nbytes / seconds
        now = self._clock()
        with self._lock:
            old = self._observed.get(tier_name)
            if old is not None and now - old[1] <= OBSERVED_TTL_S:
                bw = EWMA_ALPHA * bw + (1.0 - EWMA_ALPHA) * old[0]
            self._observed[tier_name] = (bw, now)

    def fetch_s(self, tier_name: str, tier_node: Optional[str], pages: int) -> Optional[float]:
        """Estimated seconds to fetch `pages` pages from the tier (None: no evidence)."""
        nbytes = pages * self.page_nbytes
        views = []
        try:
            est = self._estimate_s(tier_node, nbytes)
        except Exception:  # noqa: BLE001 - no estimate is no evidence, not an error
            est = None
        if est is not None and est > 0:
            views.append(est)
        with self._lock:
            obs = self._observed.get(tier_name)
        if obs is not None and self._clock() - obs[1] <= OBSERVED_TTL_S and obs[0] > 0:
            views.append(nbytes / obs[0])
        return max(views) if views else None

    def order(self, tiers: Sequence, pages: int) -> List:
        """The tiers to ask for a run of `pages` pages, cheapest estimated fetch first. A tier with
        no estimate yet counts as free (optimism: its first read measures it); ties keep the
        config order. Several tiers often hold the same page (write-through to each)."""
        if len(tiers) < 2:
            return list(tiers)
        est = [self.fetch_s(t.name, t.node, pages) for t in tiers]
        idx = sorted(range(len(tiers)), key=lambda i: (est[i] or 0.0, i))
        return [tiers[i] for i in idx]

    def recompute_s(self, pages: int) -> float:
        return pages * self.page_size / self.tokens_per_s

    def worth_fetching(self, tier_name: str, tier_node: Optional[str], pages: int) -> bool:
        """False only when recomputing is enabled and known to be faster than the fetch."""
        if not self.enabled or pages <= 0:
            return True
        f = self.fetch_s(tier_name, tier_node, pages)
        return f is None or f <= self.recompute_s(pages)

    def worth_fetching_from(self, tiers: Sequence, pages: int) -> bool:
        """`worth_fetching` for the tier `order` would read first: the cheapest estimate decides,
        and a tier with no estimate yet (free, as in `order`) means fetch. Each estimate once."""
        if not self.enabled or pages <= 0 or not tiers:
            return True
        est = [self.fetch_s(t.name, t.node, pages) for t in tiers]
        return None in est or min(est) <= self.recompute_s(pages)
