"""HostTier: one preallocated host pool of KV pages keyed by page key, LRU over unpinned entries.

Pages are rows of `words[capacity_pages, page_words]` (see KVLayout for the row layout). A page is
in exactly one state: free, reserved (being written by a store, invisible to lookups), or
indexed (in the LRU map, visible). Only indexed pages are evicted, least recently used first.

Checksums: a position-mixing 64-bit hash of the page's words (connector/copy_kernels.py), taken
when a store commits and compared before a load reads the page. It catches host-memory corruption,
swapped words and page reuse bugs cheaply (one compiled read); it is not a cryptographic digest.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)


def contiguous_runs(ids: Sequence[int]) -> List[Tuple[int, int, int]]:
    """[(i0, i1, start)]: positions i0..i1-1 of `ids` are start, start+1, ... (vectorised: this runs
    on every store and load, over thousands of pages at page size 1)."""
    n = len(ids)
    if n == 0:
        return []
    a = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return list(zip(starts.tolist(), ends.tolist(), a[starts].tolist()))


class HostTier:
    name = "host"
    #: page hashes are copy_kernels' hash: a fused gather's sums can be committed as they are, and a
    #: load can be verified inside the copy (TransferExecutor.gather_hashed / scatter_verified)
    fused_hash = True

    def __init__(self, page_words: int, word_dtype: torch.dtype, capacity_pages: int, *, node: Optional[str] = None,
                 verify_checksums: bool = True, pin_memory: bool = False):
        if capacity_pages < 1:
            raise ValueError(f"host tier capacity must be at least one page, got {capacity_pages}")
        self.node = node
        self.page_words = page_words
        self.word_dtype = word_dtype
        self.capacity_pages = capacity_pages
        self.verify_checksums = verify_checksums
        self.pinned = bool(pin_memory)
        self.words = torch.empty((capacity_pages, page_words), dtype=word_dtype, pin_memory=self.pinned)
        self.page_nbytes = self.words.element_size() * page_words
        self._sums = torch.zeros(capacity_pages, dtype=torch.int64)
        self._sums_np = self._sums.numpy()  # same memory: numpy fancy indexing of a list is ~3x cheaper than torch's
        self._lru: "OrderedDict[bytes, int]" = OrderedDict()  # least recent first
        self._fresh = 0  # pages [_fresh, capacity) were never handed out (contiguous runs)
        self._free: List[int] = []  # recycled pages (stack)
        self.evictions = 0
        self.checksum_failures = 0
        # pages a background job still reads (write-through): never evicted, and not handed out
        # again until unpinned, even if their key is discarded or the tier cleared meanwhile
        self._pins: Dict[int, int] = {}
        self._free_on_unpin: set = set()

    # ----------------------------------------------------------------- queries
    @property
    def used_pages(self) -> int:
        return len(self._lru)

    @property
    def free_pages(self) -> int:
        return len(self._free) + self.capacity_pages - self._fresh

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        lru = self._lru
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def page_of(self, key: bytes) -> Optional[int]:
        return self._lru.get(key)

    def pages_of(self, keys: Sequence[bytes]) -> List[Optional[int]]:
        """page_of for every key (None where absent); one C-level pass, LRU order untouched."""
        return list(map(self._lru.get, keys))

    def pages_for(self, keys: Sequence[bytes]) -> List[int]:
        """Host pages of the leading present keys (marks them most recently used)."""
        out = []
        for k in keys:
            p = self._lru.get(k)
            if p is None:
                break
            self._lru.move_to_end(k)
            out.append(p)
        return out

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self._lru:
                self._lru.move_to_end(k)

    # ----------------------------------------------------------------- store side
    def reserve(self, n: int, protect: Collection[bytes] = ()) -> Tuple[List[int], List[Tuple[bytes, int]]]:
        """Take up to `n` pages for writing: free ones first, then LRU victims not in `protect`
        (any collection of keys; made a set only if a victim has to be chosen).
        Returns (pages, evicted) where evicted = [(key, page)] still holds the victim's bytes: the
        caller spills them before overwriting. Fewer than `n` pages means the tier is full of
        protected entries."""
        take = min(n, self.capacity_pages - self._fresh)
        pages = list(range(self._fresh, self._fresh + take))
        self._fresh += take
        if len(pages) < n and self._free:
            k = min(n - len(pages), len(self._free))
            recycled = self._free[-k:]
            del self._free[-k:]
            pages.extend(sorted(recycled))  # ascending: adjacent free pages become one copy run
        evicted = []
        if len(pages) < n:
            protect = protect if isinstance(protect, (set, frozenset)) else set(protect)
            for key in list(self._lru.keys()):
                if len(pages) >= n:
                    break
                if key in protect or self._lru[key] in self._pins:
                    continue
                p = self._lru.pop(key)
                evicted.append((key, p))
                pages.append(p)
            self.evictions += len(evicted)
        return pages, evicted

    def release(self, pages: Iterable[int]) -> None:
        """Give reserved pages back (a store that failed or was cancelled)."""
        self._free.extend(sorted(self._unpinned(pages), reverse=True))

    # ----------------------------------------------------------------- pins (background readers)
    def pin(self, pages: Iterable[int]) -> None:
        for p in pages:
            self._pins[p] = self._pins.get(p, 0) + 1

    def unpin(self, pages: Iterable[int]) -> None:
        for p in pages:
            c = self._pins.get(p, 0) - 1
            if c > 0:
                self._pins[p] = c
                continue
            self._pins.pop(p, None)
            if p in self._free_on_unpin:  # freed while a job still read it: free it now
                self._free_on_unpin.discard(p)
                self._free.append(p)

    @property
    def pinned_pages(self) -> int:
        return len(self._pins)

    def _unpinned(self, pages: Iterable[int]) -> List[int]:
        """The pages that may go to the free list now; pinned ones are freed when unpinned."""
        out = []
        for p in pages:
            if p in self._pins:
                self._free_on_unpin.add(p)
            else:
                out.append(p)
        return out

    def commit(self, keys: Sequence[bytes], pages: Sequence[int], sums: Optional[torch.Tensor] = None) -> None:
        """Make reserved, written pages visible under `keys` (checksummed if enabled). `sums`: the
        pages' hashes as the fused store computed them (else they are read back here)."""
        if self.verify_checksums and pages:
            if sums is None or len(sums) != len(pages):
                sums = self.page_sums(pages)
            self._sums_np[np.asarray(pages, dtype=np.int64)] = sums.numpy() if isinstance(sums, torch.Tensor) else sums
        lru = self._lru
        if lru.keys().isdisjoint(keys):  # the usual store: every key new, no page to free
            lru.update(zip(keys, pages))
            return
        for k, p in zip(keys, pages):
            old = lru.pop(k, None)
            if old is not None:  # a duplicate key: keep the fresh copy, free the old page
                self._free.extend(self._unpinned([old]))
            lru[k] = p

    def first_changed(self, pages: Sequence[int]) -> int:
        """-1: nothing else writes this process's tier, so a page cannot change between its lookup
        and the copy out (SharedHostTier checks generations here)."""
        return -1

    # ----------------------------------------------------------------- checksums
    def page_sums(self, pages: Sequence[int]) -> torch.Tensor:
        """Position-mixing 64-bit hash per page (catches flipped bits and swapped words; the
        wrapping word sum it replaced missed swaps): one compiled read per page, or its numpy twin
        (connector/copy_kernels.py, issue 15)."""
        from .copy_kernels import hash_rows
        return hash_rows(self.words, pages)

    def stored_sums(self, pages: Sequence[int]) -> Optional[torch.Tensor]:
        """The hashes taken when `pages` were committed (None: checksums are off)."""
        if not self.verify_checksums:
            return None
        return self._sums[torch.as_tensor(list(pages), dtype=torch.long)]

    def note_checksum_failure(self) -> None:
        self.checksum_failures += 1

    def first_bad_page(self, pages: Sequence[int]) -> int:
        """Index (into `pages`) of the first page whose checksum does not match, or -1."""
        if not self.verify_checksums or not pages:
            return -1
        bad = (self.page_sums(pages) != self._sums[torch.as_tensor(pages, dtype=torch.long)]).nonzero()
        if bad.numel() == 0:
            return -1
        self.checksum_failures += 1
        return int(bad[0])

    # ----------------------------------------------------------------- maintenance
    def discard(self, keys: Iterable[bytes]) -> int:
        n = 0
        for k in keys:
            p = self._lru.pop(k, None)
            if p is not None:
                self._free.extend(self._unpinned([p]))
                n += 1
        return n

    def clear(self) -> None:
        """Forget every indexed page (reserved pages stay reserved)."""
        self._free.extend(self._unpinned(self._lru.values()))
        self._free.sort(reverse=True)  # the stack hands out low pages first
        self._lru.clear()

    def stats(self) -> Dict[str, int]:
        return {"capacity_pages": self.capacity_pages, "used_pages": self.used_pages, "free_pages": self.free_pages,
                "page_nbytes": self.page_nbytes, "used_bytes": self.used_pages * self.page_nbytes,
                "capacity_bytes": self.capacity_pages * self.page_nbytes, "evictions": self.evictions,
                "checksum_failures": self.checksum_failures, "pinned": int(self.pinned),
                "pages_pinned_by_jobs": len(self._pins)}

    def close(self) -> None:
        self._lru.clear()
        self._free = []
        self._fresh = self.capacity_pages = 0
        # drop the (possibly pinned) buffer now rather than at interpreter teardown
        self.words = torch.empty((0, self.page_words), dtype=self.word_dtype)
