"""Page gather (store) and scatter (load) with the page checksum fused into the copy.

`PageCopier(layout)` moves whole host pages between SGLang's per-layer K/V buffers and page rows of
a host buffer (`[N, page_words]`, KVLayout's page layout) in ONE pass over the source: the compiled
kernels (csrc/flexflow_sglang/_copy_kernels.pyx, nogil) copy each 64-bit word and mix it into the
page hash while it is in a register, so a store gets its checksums and a load its verification for
the price of the copy (issue 15: the old word sum was a second full read and missed swapped words).

The torch/numpy twin (`gather_twin`, `scatter_twin`, `page_hash`) computes the same bytes and the
same hashes; it is the fallback where the kernels do not apply (no build, CUDA pool, a segment that
is not a multiple of 8 bytes) and the reference the tests compare the kernels with.

Hash (64-bit words w_i, i = 4 b + l: block b of nb = words / 4, lane l; mod 2**64):
    A_l = sum_b w_(4b+l);  B_l = sum_b (nb - b) w_(4b+l)
    hash = sum_k mix(X_k ^ (k + 1) K),  X = (A_0..3, B_0..3),  mix(x) = y ^ (y >> 32), y = x C
A flipped bit always changes A_l; swapped or shifted words change B_l or two lane sums; the hash
then differs unless the changes cancel (~2**-64). Pages (and each segment) are multiples of 32 B.
"""

from __future__ import annotations

import glob
from typing import Optional, Sequence

import numpy as np
import torch

from ..tiers.base import hash64_twin
from .layout import KVLayout

try:
    from .. import _copy_kernels as _ck
except ImportError:  # pragma: no cover - depends on the build
    _ck = None



def kernels_available() -> bool:
    return _ck is not None


def page_hash(rows: torch.Tensor) -> torch.Tensor:
    """Twin hash of each row of a CPU `[n, page_words]` tensor -> int64[n]. Rows that are not a
    multiple of 32 bytes are hashed as if zero-padded to one (only the twin takes those). The same
    function is the storage tier's payload checksum (tiers/base.py, CHECKSUM_HASH64)."""
    b8 = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    return torch.from_numpy(hash64_twin(b8).view(np.int64).copy())


def hash_rows(words: torch.Tensor, pages: Sequence[int]) -> torch.Tensor:
    """Hash of rows `pages` of a host buffer: the compiled one-pass kernel when it applies, else the twin."""
    nb = words.shape[1] * words.element_size()
    idx = _pages_array(pages, words.shape[0], "host page")
    if _ck is not None and words.device.type == "cpu" and words.is_contiguous() and nb % 32 == 0:
        out = np.empty(len(idx), dtype=np.int64)
        _ck.hash_rows(words.data_ptr(), nb, nb, idx, out)
        return torch.from_numpy(out)
    return page_hash(words.index_select(0, torch.from_numpy(idx)))


#: below this many bytes a move runs on the calling thread (starting the OpenMP team costs more)
PARALLEL_MIN_BYTES = 4 << 20


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache sysfs reports (cpu0), or `default` where it reports none."""
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(f"{d}/size") as f:
                txt = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        digits = txt.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or default


#: a move of at least this many bytes is written with streaming (non-temporal) stores: it cannot
#: stay in the cache anyway, and a regular store first reads each destination line (three memory
#: passes instead of two). glibc's memcpy switches at 3/4 of the shared cache; the same rule here.
#: Below it, regular stores leave the bytes in cache for the forward that reads them next.
STREAMING_MIN_BYTES = max(4 << 20, _last_level_cache_bytes() * 3 // 4)


def _streaming(n_pages: int, page_nbytes: int) -> bool:
    return n_pages * page_nbytes >= STREAMING_MIN_BYTES


def _threads(n_pages: int, page_nbytes: int) -> int:
    """torch's intra-op thread count (what a plain `copy_` of the same bytes uses), one per page at
    most; 1 for small moves."""
    if n_pages * page_nbytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(torch.get_num_threads(), n_pages))


def _pages_array(pages, limit: int, what: str) -> np.ndarray:
    """int64 contiguous page indices, each in [0, limit): the kernels index raw memory with them."""
    a = pages.cpu().numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages)
    a = np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= limit):
        raise IndexError(f"{what} index out of range [0, {limit}): min {int(a.min())}, max {int(a.max())}")
    return a


def _in_slot_order(dp: np.ndarray, *arrays):
    """The kernels walk pages in ascending device-page order: SGLang's allocator hands out scattered
    slots, and in slot order the reads/writes of each layer buffer move forward through memory, so
    the page-table walks hit cached entries and the DRAM pages stay open (page 1, kv128k volume:
    a 128 MiB move ~14.5 -> ~11 ms, ad hoc A/B at 1f3ea96). -> (order or None if already sorted,
    dp and `arrays` permuted alike)."""
    if dp.size < 2 or bool((dp[1:] >= dp[:-1]).all()):
        return None, (dp, *arrays)
    order = np.argsort(dp, kind="stable")
    return order, (dp[order], *(np.ascontiguousarray(a[order]) for a in arrays))


class PageCopier:
    """Fused copy + checksum between a KVLayout's device pool and host page rows."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        views = [v for bufs in layout.dev_pages for v in bufs]  # host page order: layer-major, K then V
        es = torch.empty((), dtype=layout.word_dtype).element_size()
        self._views = views
        self._seg_ptr = np.array([v.data_ptr() for v in views], dtype=np.uint64)
        self._seg_stride = np.array([v.stride(0) * es for v in views], dtype=np.int64)
        self._seg_nbytes = np.array([v.shape[1] * es for v in views], dtype=np.int64)
        self.hashable = bool((self._seg_nbytes % 32 == 0).all())
        #: the compiled kernels apply: built, CPU pool, every view row-contiguous
        self.compiled = (_ck is not None and layout.device.type == "cpu"
                         and all(v.stride(1) == 1 for v in views))

    def usable(self, host: torch.Tensor, with_sums: bool) -> bool:
        """Whether the compiled kernels can move pages to/from `host` (checksums need 32-byte segments)."""
        return (self.compiled and (self.hashable or not with_sums) and host.device.type == "cpu"
                and host.is_contiguous() and host.shape[1] * host.element_size() == self.layout.page_nbytes)

    # ----------------------------------------------------------------- compiled
    def gather(self, dev_pages, host: torch.Tensor, host_pages: Sequence[int],
               with_sums: bool = True) -> Optional[torch.Tensor]:
        """Device pages -> host rows; returns the pages' hashes (int64[n]) when `with_sums`."""
        if not self.usable(host, with_sums):
            return self.gather_twin(dev_pages, host, host_pages, with_sums)
        dp = _pages_array(dev_pages, self.layout.num_device_pages, "device page")
        hp = _pages_array(host_pages, host.shape[0], "host page")
        if len(dp) != len(hp):
            raise ValueError(f"gather: {len(dp)} device pages for {len(hp)} host pages")
        order, (dp, hp) = _in_slot_order(dp, hp)
        sums = np.empty(len(dp), dtype=np.int64) if with_sums else None
        nb = self.layout.page_nbytes
        _ck.gather(self._seg_ptr, self._seg_stride, self._seg_nbytes, dp, host.data_ptr(), nb, hp, sums,
                   _threads(len(dp), nb), _streaming(len(dp), nb))
        if not with_sums:
            return None
        if order is not None:  # back to the caller's page order
            out = np.empty_like(sums)
            out[order] = sums
            sums = out
        return torch.from_numpy(sums)

    def scatter(self, host: torch.Tensor, host_pages: Sequence[int], dev_pages,
                expect: Optional[torch.Tensor] = None) -> int:
        """Host rows -> device pages; with `expect` (the pages' stored hashes) returns the index of
        the first page whose hash differs (-1: all match). All pages are copied either way: on a
        mismatch the caller drops the whole load (a miss), so the slots hold nothing anyone reads."""
        if not self.usable(host, expect is not None):
            return self.scatter_twin(host, host_pages, dev_pages, expect)
        dp = _pages_array(dev_pages, self.layout.num_device_pages, "device page")
        hp = _pages_array(host_pages, host.shape[0], "host page")
        if len(dp) != len(hp):
            raise ValueError(f"scatter: {len(dp)} device pages for {len(hp)} host pages")
        exp = None
        if expect is not None:
            exp = np.ascontiguousarray(expect.cpu().numpy() if isinstance(expect, torch.Tensor) else expect,
                                       dtype=np.int64).reshape(-1)
            if len(exp) != len(dp):
                raise ValueError(f"scatter: {len(exp)} checksums for {len(dp)} pages")
        order, (dp, hp, *rest) = _in_slot_order(dp, hp, *([exp] if exp is not None else []))
        if exp is not None:
            exp = rest[0]
        flags = np.zeros(len(dp), dtype=np.uint8) if exp is not None else None
        nb = self.layout.page_nbytes
        bad = int(_ck.scatter(host.data_ptr(), nb, hp, self._seg_ptr, self._seg_stride, self._seg_nbytes, dp, exp,
                              _threads(len(dp), nb), flags, _streaming(len(dp), nb)))
        if bad < 0 or order is None:
            return bad
        return int(order[np.flatnonzero(flags)].min())  # the first bad page in the caller's order

    # ----------------------------------------------------------------- one layer (layer-wise load-back)
    def _layer_tables(self, layer: int):
        nb = len(self.layout.seg_words)
        a, b = layer * nb, (layer + 1) * nb
        es = torch.empty((), dtype=self.layout.word_dtype).element_size()
        offset = self.layout.segment_offsets()[layer][0] * es  # bytes into each host row
        return self._seg_ptr[a:b], self._seg_stride[a:b], self._seg_nbytes[a:b], offset

    def scatter_layer(self, host: torch.Tensor, host_pages, dev_pages, layer: int, threads: int = 1) -> None:
        """Host rows -> device pages, layer `layer`'s segments only (no checksum: a layer-wise load
        is verified before it is queued). Falls back to the twin where the kernels do not apply."""
        if not self.usable(host, False):
            self.scatter_layer_twin(host, host_pages, dev_pages, layer)
            return
        dp = _pages_array(dev_pages, self.layout.num_device_pages, "device page")
        hp = _pages_array(host_pages, host.shape[0], "host page")
        if len(dp) != len(hp):
            raise ValueError(f"scatter_layer: {len(dp)} device pages for {len(hp)} host pages")
        ptr, stride, nbytes, offset = self._layer_tables(layer)
        _, (dp, hp) = _in_slot_order(dp, hp)
        _ck.scatter(host.data_ptr() + offset, self.layout.page_nbytes, hp, np.ascontiguousarray(ptr),
                    np.ascontiguousarray(stride), np.ascontiguousarray(nbytes), dp, None, max(1, threads), None)

    def scatter_layer_twin(self, host: torch.Tensor, host_pages, dev_pages, layer: int) -> None:
        hp = torch.as_tensor(np.asarray(host_pages, dtype=np.int64), device=host.device)
        dev = torch.as_tensor(dev_pages, dtype=torch.long).to(self.layout.device)
        o = self.layout.segment_offsets()[layer][0]
        for v in self.layout.dev_pages[layer]:
            w = v.shape[1]
            v.index_copy_(0, dev, host.index_select(0, hp)[:, o:o + w].to(self.layout.device))
            o += w

    # ----------------------------------------------------------------- torch twin
    def gather_twin(self, dev_pages, host: torch.Tensor, host_pages: Sequence[int],
                    with_sums: bool = True) -> Optional[torch.Tensor]:
        dev = torch.as_tensor(dev_pages, dtype=torch.long).to(self.layout.device)
        rows = torch.empty((dev.numel(), self.layout.page_words), dtype=self.layout.word_dtype,
                           device=self.layout.device)
        o = 0
        for v in self._views:
            w = v.shape[1]
            torch.index_select(v, 0, dev, out=rows[:, o:o + w])
            o += w
        host_rows = rows.to(host.device)
        host.index_copy_(0, torch.as_tensor(list(host_pages), dtype=torch.long, device=host.device), host_rows)
        return page_hash(host_rows.cpu()) if with_sums else None

    def scatter_twin(self, host: torch.Tensor, host_pages: Sequence[int], dev_pages,
                     expect: Optional[torch.Tensor] = None) -> int:
        rows = host.index_select(0, torch.as_tensor(list(host_pages), dtype=torch.long, device=host.device))
        dev = torch.as_tensor(dev_pages, dtype=torch.long).to(self.layout.device)
        drows = rows.to(self.layout.device)
        o = 0
        for v in self._views:
            w = v.shape[1]
            v.index_copy_(0, dev, drows[:, o:o + w])
            o += w
        if expect is None:
            return -1
        bad = (page_hash(rows.cpu()) != torch.as_tensor(expect, dtype=torch.int64).cpu()).nonzero()
        return int(bad[0]) if bad.numel() else -1
