"""KVLayout: how one rank's device KV pool maps onto host pages.

A host page holds the KV of `page_size` tokens for ALL layers: for each layer, the K segment then
the V segment (MHA) or the single KV segment (MLA), each `page_size` token rows. Copies move
machine words (int64 when the rows allow it) so the byte layout never depends on the KV dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
_PLAIN_POOLS = ("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool",
                "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool")


def supported_pool(kvcache) -> Tuple[bool, str]:
    """(True, "") when the connector can move this pool's KV, else (False, why)."""
    kind = type(kvcache)
    # exactly SGLang's two plain pools (no subclass: those change the layout), named rather than
    # imported so that the connector does not depend on SGLang (docs/architecture.md, layering)
    if f"{kind.__module__}.{kind.__qualname__}" not in _PLAIN_POOLS:
        return False, f"KV pool {kind.__name__} is not a plain MHATokenToKVPool/MLATokenToKVPool"
    if getattr(kvcache, "use_hnd", False) or getattr(kvcache, "kv_cache_layout", "nhd") != "nhd":
        return False, f"KV pool layout {getattr(kvcache, 'kv_cache_layout', '?')!r} is not NHD"
    quant = getattr(kvcache, "is_quantized_kv_cache", None)
    if callable(quant) and quant():
        return False, "quantized KV cache (scale buffers are not moved)"
    if getattr(kvcache, "post_capture_active", False):
        return False, "post-capture KV backing"
    return True, ""


@dataclass(frozen=True)
class KVLayout:
    kind: str                       # "mha" | "mla"
    page_size: int                  # tokens per page
    layer_num: int
    device: torch.device
    store_dtype: torch.dtype        # dtype of the pool's buffers
    word_dtype: torch.dtype         # element type of copies and of the host pool
    seg_words: Tuple[int, ...]      # words per page segment, per buffer of a layer (K, V) or (KV,)
    page_words: int                 # words per host page (all layers)
    page_nbytes: int                # bytes per host page
    row_shapes: Tuple[Tuple[int, ...], ...]  # per buffer: token-row shape (heads, dim)
    dev_pages: Tuple[Tuple[torch.Tensor, ...], ...]  # [layer][buffer] -> (num_device_pages, seg_words) views

    @property
    def num_device_pages(self) -> int:
        return self.dev_pages[0][0].shape[0]

    def segment_offsets(self) -> List[Tuple[int, ...]]:
        """[layer][buffer] -> first word of that segment within a host page."""
        out, off = [], 0
        for _ in range(self.layer_num):
            row = []
            for w in self.seg_words:
                row.append(off)
                off += w
            out.append(tuple(row))
        return out

    def describe(self) -> str:
        return (f"{self.kind} {self.layer_num} layers x {len(self.seg_words)} buffers, page {self.page_size} tokens "
                f"= {self.page_nbytes} B, {self.store_dtype} on {self.device}")

    @classmethod
    def from_buffers(cls, layers: Sequence[Sequence[torch.Tensor]], page_size: int, kind: str = "mha") -> "KVLayout":
        """Build from per-layer buffer lists, each buffer a contiguous [slots, ...] tensor."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not layers or not layers[0]:
            raise ValueError("KVLayout needs at least one layer with one buffer")
        first = layers[0]
        nbuf = len(first)
        row_bytes = []
        for b in first:
            if not b.is_contiguous():
                raise ValueError("KV buffers must be contiguous along the slot dimension")
            row_bytes.append(b[0].numel() * b.element_size())
        word = next(w for w in _WORDS if all(rb % torch.empty((), dtype=w).element_size() == 0 for rb in row_bytes))
        wsize = torch.empty((), dtype=word).element_size()
        rows = first[0].shape[0]
        npages = rows // page_size
        dev_pages = []
        for li, bufs in enumerate(layers):
            if len(bufs) != nbuf:
                raise ValueError(f"layer {li} has {len(bufs)} buffers, layer 0 has {nbuf}")
            views = []
            for bi, b in enumerate(bufs):
                if b.shape[0] != rows or b[0].numel() * b.element_size() != row_bytes[bi] or not b.is_contiguous():
                    raise ValueError(f"layer {li} buffer {bi}: shape {tuple(b.shape)} differs from layer 0")
                flat = b.view(torch.uint8).reshape(rows, row_bytes[bi]) if b.dtype != torch.uint8 \
                    else b.reshape(rows, row_bytes[bi])
                views.append(flat.view(word)[: npages * page_size].view(npages, page_size * row_bytes[bi] // wsize))
            dev_pages.append(tuple(views))
        seg_words = tuple(page_size * rb // wsize for rb in row_bytes)
        page_words = sum(seg_words) * len(layers)
        return cls(kind=kind, page_size=page_size, layer_num=len(layers), device=first[0].device,
                   store_dtype=first[0].dtype, word_dtype=word, seg_words=seg_words, page_words=page_words,
                   page_nbytes=page_words * wsize, row_shapes=tuple(tuple(b.shape[1:]) for b in first),
                   dev_pages=tuple(dev_pages))

    @classmethod
    def from_pool(cls, kvcache, page_size: int) -> "KVLayout":
        """From a SGLang MHATokenToKVPool (K and V per layer) or MLATokenToKVPool (one KV buffer)."""
        ok, why = supported_pool(kvcache)
        if not ok:
            raise ValueError(f"flexflow connector cannot move this KV pool: {why}")
        if hasattr(kvcache, "k_buffer"):
            return cls.from_buffers([(k, v) for k, v in zip(kvcache.k_buffer, kvcache.v_buffer)], page_size, "mha")
        return cls.from_buffers([(kv,) for kv in kvcache.kv_buffer], page_size, "mla")
