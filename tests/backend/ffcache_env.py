"""Real SGLang 0.5.23 pools + FlexFlowRadixCache on CPU, and a `serve()` that walks a request through
admission, load-back, allocation, a fake forward and release exactly as the scheduler does.

The fake forward writes KV that is a pure function of the token prefix (position i gets values
derived from a rolling hash of tokens[:i+1]), so any KV read back from the tree can be checked
byte for byte against what a recomputation would have written.
"""

from __future__ import annotations

import os
import sys
from array import array
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

_STATE = {"published": False}
MASK61 = (1 << 61) - 1


def publish_server_args(**fields) -> None:
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = dict(model_path="dummy", device="cpu", radix_cache_backend="flexflow")
    args.update(fields)
    publish(ServerArgs(**args), role="test", ranks=SpawnRanks(world_rank=0))
    _STATE["published"] = True


def ensure_published() -> None:
    if not _STATE["published"]:
        publish_server_args()


def test_config(page_size: int = 1, host_tokens: Optional[int] = None, policy: str = "write_through",
                verify: bool = True, layerwise: bool = True):
    from flexflow_sglang.config import config_from_dict

    host = {"capacity_tokens": host_tokens or 4096, "write_policy": policy, "verify_checksums": verify,
            "pin_memory": "never", "layerwise_load": layerwise}
    return config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                             "host_tier": host}, "<test>")


def prefix_hashes(ids: Sequence[int]) -> torch.Tensor:
    out, h = [], 7
    for t in ids:
        h = (h * 1000003 + int(t) + 1) & MASK61
        out.append(h)
    return torch.tensor(out, dtype=torch.int64)


def expected_rows(ids: Sequence[int], layer: int, which: int, row_shape, dtype) -> torch.Tensor:
    """KV rows a 'forward' writes for positions 0..len(ids)-1 of buffer (layer, which)."""
    h = prefix_hashes(ids)
    n_el = 1
    for d in row_shape:
        n_el *= d
    mult = torch.arange(1, n_el + 1, dtype=torch.int64) * (2 * layer + which + 3)
    vals = ((h[:, None] * mult[None, :]) % 2039).to(torch.float32) / 64.0 - 16.0  # exact in fp16/bf16
    return vals.view(len(ids), *row_shape).to(dtype)


@dataclass
class Env:
    tree: object
    kv: object
    alloc: object
    req_pool: object
    size: int
    page_size: int
    connector: object

    def buffers(self):
        kv = self.kv
        if hasattr(kv, "k_buffer"):
            return [(k, v) for k, v in zip(kv.k_buffer, kv.v_buffer)]
        return [(b,) for b in kv.kv_buffer]

    def write_kv(self, ids: Sequence[int], slots: torch.Tensor, start: int) -> None:
        """Fake forward: positions start.. of `ids` land in `slots`."""
        for layer, bufs in enumerate(self.buffers()):
            for which, buf in enumerate(bufs):
                rows = expected_rows(ids, layer, which, buf.shape[1:], buf.dtype)[start:]
                buf[slots.long()] = rows

    def check_kv(self, ids: Sequence[int], slots: torch.Tensor) -> bool:
        counter = getattr(self.kv, "layer_transfer_counter", None)
        for layer, bufs in enumerate(self.buffers()):
            if counter is not None:  # as the pool's get_key_buffer does before attention reads a layer
                counter.wait_until(layer - getattr(self.kv, "start_layer", 0))
            for which, buf in enumerate(bufs):
                exp = expected_rows(ids, layer, which, buf.shape[1:], buf.dtype)[: len(slots)]
                if not torch.equal(buf[slots.long()], exp):
                    return False
        return True

    def idle_ok(self) -> bool:
        return self.alloc.available_size() + self.tree.evictable_size() + self.tree.protected_size() == self.size

    def close(self) -> None:
        self.tree.release_host_resources()


def make_pools(page_size: int = 1, size: int = 64, layers: int = 2, heads: int = 2, head_dim: int = 4,
               dtype=torch.float32, mla: bool = False, params_kw=None, max_context_len: int = 256,
               req_slots: int = 8):
    """(kv pool, allocator, req_to_token pool, CacheInitParams) on CPU."""
    ensure_published()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    req_pool = ReqToTokenPool(size=req_slots, max_context_len=max_context_len, device="cpu",
                              enable_memory_saver=False)
    if mla:
        kv = MLATokenToKVPool(size=size, page_size=page_size, dtype=dtype, kv_lora_rank=head_dim,
                              qk_rope_head_dim=4, layer_num=layers, device="cpu", enable_memory_saver=False)
    else:
        kv = MHATokenToKVPool(size=size, page_size=page_size, dtype=dtype, head_num=heads, head_dim=head_dim,
                              layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size=size, dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size=size, page_size=page_size, dtype=dtype, device="cpu", kvcache=kv,
                                            need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
                             page_size=page_size, **(params_kw or {}))
    return kv, alloc, req_pool, params


def make_env(page_size: int = 1, size: int = 64, host_tokens: Optional[int] = None, policy: str = "write_through",
             verify: bool = True, defer_stores: bool = False, tiers=(), layerwise: bool = True, **pool_kw) -> Env:
    from flexflow_sglang.backend.cache import FlexFlowRadixCache
    from flexflow_sglang.connector import FlexFlowConnector, KVLayout

    kv, alloc, req_pool, params = make_pools(page_size=page_size, size=size, **pool_kw)
    cfg = test_config(page_size, host_tokens, policy, verify, layerwise)
    conn = FlexFlowConnector(KVLayout.from_pool(kv, page_size), cfg, fingerprint={"test": True}, tiers=tiers,
                             defer_stores=defer_stores, start_agent=False)
    tree = FlexFlowRadixCache(params, connector=conn)
    return Env(tree, kv, alloc, req_pool, size, page_size, conn)


@dataclass
class Served:
    rid: str
    prefix_len: int
    host_hit: int
    loaded: int
    kv_ok: bool
    cached_device: int
    storage_hit: int = 0


def serve(env: Env, rid: str, ids: List[int], check_idle: bool = True, extra_key=None, req=None) -> Served:
    """One request through match -> load-back -> lock -> alloc -> forward -> release_kv_cache."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    tree = env.tree
    if req is None:  # (a request already queued, e.g. through the prefetch hooks, is passed in)
        req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=1), extra_key=extra_key)
    req.init_next_round_input(tree)  # match_prefix(req=req)
    device_prefix = req.prefix_len
    host_hit = req.host_hit_length
    loaded = 0
    if req.needs_host_load_back():
        out = tree.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                     host_hit_length=req.host_hit_length, req=req))
        assert out is not None
        n, node = out
        assert n in (0, req.host_hit_length), (n, req.host_hit_length)
        req.host_loaded_length, req.last_node = n, node
        req.prefix_len += n
        req.kv.cache_protected_len = req.prefix_len
        loaded = n
    req.lock = tree.lock(req.last_node)
    (row,) = env.req_pool.alloc([req])
    need = len(ids) - req.prefix_len
    ps = env.page_size
    alloc_n = -(-need // ps) * ps  # whole pages (the paged allocator floors)
    new = env.alloc.alloc(alloc_n)
    if new is None:
        tree.evict(__import__("sglang.srt.mem_cache.base_prefix_cache", fromlist=["EvictParams"]).EvictParams(
            num_tokens=alloc_n - env.alloc.available_size()))
        new = env.alloc.alloc(alloc_n)
    assert new is not None, "test pool too small"
    prefix = tree.prefix_device_indices(req)
    kv_ok = env.check_kv(ids, prefix)  # device + loaded prefix must equal recomputation
    env.write_kv(ids, new[:need], req.prefix_len)
    env.req_pool.write((row, slice(0, len(ids))), torch.cat([prefix, new[:need]]).to(torch.int32))
    # like alloc_extend: the last page may be partly used; lengths count tokens, and the release
    # frees the whole page that holds the row's tail
    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = len(ids)
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, tree, checkpoint=True)
    if check_idle:
        assert env.idle_ok(), (env.alloc.available_size(), tree.evictable_size(), tree.protected_size(), env.size)
    return Served(rid, req.prefix_len, host_hit, loaded, kv_ok, device_prefix, req.storage_hit_length)


def fail_moves(monkeypatch, executor, direction: str, message: str) -> None:
    """Make every copy of `executor` in `direction` ("d2h" store, "h2d" load) raise `message`: the
    executor's common `_move`, so the fused kernels and the torch path both fail."""
    real = executor._move

    def boom(d, *a, **k):
        if d == direction:
            raise RuntimeError(message)
        return real(d, *a, **k)
    monkeypatch.setattr(executor, "_move", boom)
