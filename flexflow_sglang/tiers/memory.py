"""InMemoryTier: the reference KVTier. Pages in a dict, optional LRU capacity; for tests, as a
template for a new tier, and as the registered tier `memory` (options: capacity_pages)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError
from .base import KVTier, as_pages


class InMemoryTier(KVTier):
    """Pages (numpy copies of the rows) under their keys in process memory; `capacity_pages` bounds
    how many are held (least recently stored go first), None: unbounded."""

    def __init__(self, name: str = "memory", node: Optional[str] = None, capacity_pages: Optional[int] = None):
        self.name = name
        self.node = node
        self.capacity_pages = capacity_pages
        self.pages: "OrderedDict[bytes, np.ndarray]" = OrderedDict()
        self.puts = self.gets = 0
        self.closed = False
        self._lock = threading.Lock()

    def _leading(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return self._leading(keys)

    def put_many(self, keys: Sequence[bytes], pages) -> int:
        rows = as_pages(pages, len(keys))
        with self._lock:
            if self.closed:
                return 0
            for i, k in enumerate(keys):
                self.pages[k] = rows[i].copy()
                self.pages.move_to_end(k)
            while self.capacity_pages is not None and len(self.pages) > self.capacity_pages:
                self.pages.popitem(last=False)
            self.puts += len(keys)
            return self._leading(keys)

    def get_many_into(self, keys: Sequence[bytes], out) -> int:
        rows = as_pages(out, len(keys), writable=True, what="out")
        n = 0
        with self._lock:
            for i, k in enumerate(keys):
                page = self.pages.get(k)
                if page is None or page.shape[0] != rows.shape[1]:
                    break
                rows[i] = page
                n += 1
            self.gets += n
        return n

    def discard(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self.pages.pop(k, None)

    def clear(self) -> None:
        with self._lock:
            self.pages.clear()

    def stats(self) -> dict:
        with self._lock:
            return {"pages": len(self.pages), "puts": self.puts, "gets": self.gets,
                    "bytes": sum(p.nbytes for p in self.pages.values()), "backend": "memory"}

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.pages.clear()


def memory_factory(ctx: Any, options: Mapping[str, Any]) -> InMemoryTier:
    """The registered tier `memory`: options `capacity_pages` (positive int or null) and `node`."""
    unknown = sorted(set(options) - {"capacity_pages", "node"})
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} (valid options: ['capacity_pages', 'node'])")
    cap = options.get("capacity_pages")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
        raise ConfigError(f"capacity_pages = {cap!r}: must be a positive integer or null")
    node = options.get("node")
    if node is not None and (not isinstance(node, str) or not node):
        raise ConfigError(f"node = {node!r}: must be a topology node name or null")
    return InMemoryTier("memory", node=node, capacity_pages=cap)
