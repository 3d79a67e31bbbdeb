"""The protocol deeper KV tiers (storage, remote; flexflow_sglang/tiers/) implement for the connector.

A page is the KV of `page_size` tokens over all layers, K and V, in the connector's host layout:
one row of `pages_u8[n, page_nbytes]` (uint8). Keys are the connector's chained page keys
(bytes), so a key names a whole prefix, and "leading pages" of a key list form a prefix.

The connector consults tiers in list order after the host tier on lookup, promotes what a tier
returns into the host tier, and spills host-tier LRU evictions into the first tier.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class KVTier(Protocol):
    """A tier below host memory. Implementations verify their own data: `get_many_into` counts only
    pages it loaded *and* verified, and a corrupt page ends the leading run."""

    #: short tier name used in metrics and logs ("storage", "remote", ...)
    name: str
    #: topology node the tier's bytes live on (e.g. "nvme0"), or None
    node: "str | None"

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys the tier holds."""
        ...

    def put_many(self, keys: Sequence[bytes], pages_u8: torch.Tensor) -> int:
        """Store `pages_u8[i]` under `keys[i]`; returns how many leading pages were stored."""
        ...

    def get_many_into(self, keys: Sequence[bytes], out_u8: torch.Tensor) -> int:
        """Fill `out_u8[i]` with the page of `keys[i]`; returns leading pages loaded and verified."""
        ...

    def discard(self, keys: Sequence[bytes]) -> None:
        """Forget these keys (missing keys are ignored)."""
        ...

    def stats(self) -> dict:
        """Counters for metrics (pages held, bytes, hits, ...)."""
        ...

    def close(self) -> None:
        """Release resources; idempotent."""
        ...


class InMemoryTier:
    """Reference KVTier: pages in a dict, optional LRU capacity. For tests and as a template."""

    def __init__(self, name: str = "memory", node: "str | None" = None, capacity_pages: "int | None" = None):
        from collections import OrderedDict

        self.name = name
        self.node = node
        self.capacity_pages = capacity_pages
        self.pages: "OrderedDict[bytes, torch.Tensor]" = OrderedDict()
        self.puts = self.gets = 0
        self.closed = False

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def put_many(self, keys: Sequence[bytes], pages_u8: torch.Tensor) -> int:
        for k, row in zip(keys, pages_u8):
            self.pages[k] = row.clone()
            self.pages.move_to_end(k)
        while self.capacity_pages is not None and len(self.pages) > self.capacity_pages:
            self.pages.popitem(last=False)
        self.puts += len(keys)
        return len(keys)

    def get_many_into(self, keys: Sequence[bytes], out_u8: torch.Tensor) -> int:
        n = 0
        for k, row in zip(keys, out_u8):
            page = self.pages.get(k)
            if page is None:
                break
            row.copy_(page)
            n += 1
        self.gets += n
        return n

    def discard(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.pages.pop(k, None)

    def clear(self) -> None:
        self.pages.clear()

    def stats(self) -> dict:
        return {"pages": len(self.pages), "puts": self.puts, "gets": self.gets}

    def close(self) -> None:
        self.closed = True
        self.pages.clear()
