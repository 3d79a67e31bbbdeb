"""FlexFlowRadixCache: SGLang's RadixCache with a host tier behind it, reached through the connector.

The device tree is RadixCache's, unchanged. What this subclass adds, in SGLang's vocabulary:
- match_prefix(req=...) reports `host_hit_length`: whole pages beyond the device prefix that the
  connector holds, within the key's limit, MIN-agreed across the scheduling ranks;
- init_load_back materialises them: lock the anchor, evict the shortfall, allocate, load all or
  nothing, insert under the anchor, unlock. A failed or corrupt load is a miss: (0, anchor), and
  every slot it allocated is freed;
- checkpoint of a finished request stores its tree-owned KV (write_through), or evict stores the
  victims before freeing them (on_evict); host copies outlive device eviction and flush_cache.

Invariants kept: no KV slot is held outside the tree when idle; every lock this class takes is
released exactly once (or forgotten on reset); values that steer scheduling are rank-agreed.
"""

from __future__ import annotations

import heapq
import logging
import time
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from . import kv_dump
from .host_adopt import adopt_host_pages
from .rank_sync import RankSync, describe
from .sched_clock import SchedClock, timed

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from ..connector import FlexFlowConnector

logger = logging.getLogger(__name__)

#: per-request suffix-key memos kept at most (requests drop theirs in on_release)
MAX_KEY_MEMOS = 512
#: match_prefix hashes and looks up pages beyond the device prefix in chunks that grow by 4x, so a
#: miss costs one small chunk of hashing, not the whole prompt
LOOKUP_CHUNK_PAGES = 16
#: longest sleep of SGLang's idle scheduler loop while a queued request waits for its prefetch
#: (idle_wait): woken earlier by any finished or submitted engine job
IDLE_WAIT_S = 0.005

class _HostHit:
    """What match_prefix promised for one request attempt; consumed by init_load_back."""
    __slots__ = ("anchor", "device_len", "hit_len", "keys", "tokens", "extra_key", "cache_salt", "bigram")

    def __init__(self, anchor, device_len, hit_len, keys, tokens, extra_key, cache_salt, bigram):
        self.anchor, self.device_len, self.hit_len, self.keys = anchor, device_len, hit_len, keys
        self.tokens, self.extra_key, self.cache_salt, self.bigram = tokens, extra_key, cache_salt, bigram


class _Prefetch:
    """A queued request's background prefetch (transfer engine): `ready` once the ranks agreed
    the request may be scheduled (policy), `handle` the connector's PrefetchHandle (or None)."""
    __slots__ = ("handle", "ready", "deadline", "lock", "lock_tokens")

    def __init__(self, ready: bool):
        self.handle, self.ready, self.deadline = None, ready, float("inf")
        self.lock, self.lock_tokens = None, 0  # device node the prefetched pages continue (locked)


class _KeyMemo:
    """Keys of one request's pages past its device prefix: chained from `prev` (the key ending the
    anchor's path), starting at page `first`, over the token snapshot `tokens`."""
    __slots__ = ("prev", "first", "tokens", "keys")

    def __init__(self, prev, first, tokens, keys):
        self.prev, self.first, self.tokens, self.keys = prev, first, tokens, keys


def _as_array(tokens) -> array:
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens
    return array("q", tokens)


class FlexFlowRadixCache(RadixCache):
    is_flexflow = True

    def __init__(self, params, *, ctx=None, connector: "Optional[FlexFlowConnector]" = None, config=None):
        # RadixCache.__init__ ends with self.reset(): everything reset() reads must exist first
        self._sched = SchedClock()  # time held on the scheduler thread, per hook
        self.connector = None
        self._layers = None  # LayerLoader (layer-wise load-back), set once the connector exists
        self.write_policy = "write_through"
        self._host_hits: Dict[CacheRequestHandle, _HostHit] = {}
        self._key_memo: "OrderedDict[CacheRequestHandle, _KeyMemo]" = OrderedDict()
        self._inflight: Deque[Tuple[Any, Any]] = deque()  # (StoreHandle, TreeLock), issue order
        # per queued request, in arrival order (identical on every rank): prefetch on arrival
        self._prefetch: "OrderedDict[CacheRequestHandle, _Prefetch]" = OrderedDict()
        self._prefetch_by_key: Dict[bytes, Any] = {}  # first deep page key -> in-flight PrefetchHandle
        self._prefetch_lock_tokens = 0  # device tokens locked for pending prefetches (bounded)
        self._released = False
        self._prom = None
        self._dump_kv = kv_dump.dump_dir() is not None
        self._dumped: set = set()
        self._dump_rank = getattr(ctx, "tp_rank", 0) if ctx is not None else 0
        self._m: Dict[str, int] = {k: 0 for k in (
            "host_hit_matches", "load_backs", "load_back_tokens", "load_back_failures", "load_back_stale",
            "storage_hit_tokens", "stores_issued", "on_evict_stores", "agreements", "adopted_pages", "adopt_failures", "prefetches_issued", "prefetches_shared", "prefetches_skipped_absent", "prefetches_skipped_recompute_cheaper",
            "prefetch_holds", "prefetch_timeouts", "prefetch_ready", "layerwise_load_backs", "idle_waits")}
        super().__init__(params)
        self.rank_sync = RankSync.from_params(params)
        if connector is None:
            from ..connector import FlexFlowConnector
            connector = FlexFlowConnector.from_sglang(params, ctx=ctx, config=config, parallel=_published_parallel())
        if connector.page_size != self.page_size:
            raise ValueError(f"connector page size {connector.page_size} != tree page size {self.page_size}")
        self.connector = connector
        connector.clock = self._sched
        self.write_policy = connector.write_policy
        # PP (issue 17): stage 0 pins the later stages' pages before deciding a host hit (pp_stages)
        self._pp = None
        if getattr(params, "pp_size", 1) > 1 and getattr(params, "pp_cache_group", None) is not None:
            from .pp_stages import PipelinePeers
            self._pp = PipelinePeers(self, params)
        self._prom = None
        if getattr(params, "enable_metrics", False):  # SGLang's --enable-metrics: export on /metrics
            try:
                from ..monitor.prometheus import maybe_exporter
                self._prom = maybe_exporter(True, getattr(ctx, "tp_rank", 0) if ctx is not None else 0)
            except Exception:  # noqa: BLE001 - metrics never block serving
                logger.exception("flexflow: Prometheus exporter unavailable")
        self._layers = self._layer_loader(params)
        logger.info("FlexFlowRadixCache: page size %d, write policy %s, rank agreement: %s, layer-wise load: %s",
                    self.page_size, self.write_policy, describe(self.rank_sync),
                    "on" if self._layers is not None else "off")

    def _layer_loader(self, params):
        """A layer loader registered as the KV pool's layer-transfer counter, where layer-wise
        load-back applies (config host_tier.layerwise_load; private host tier, no PP: a later stage's
        load follows stage 0's pins), else None. CPU pool: `LayerLoader` (compiled kernels on a
        worker thread); CUDA pool: `StreamLayerLoader` (side stream, one event per layer)."""
        conn = self.connector
        if not conn.config.host_tier.layerwise_load or self._pp is not None or _pd_mode():
            return None  # PD prefill may send a device prefix before the forward waits for its layers
        ex = conn.executor
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        if (not getattr(conn.host, "fused_hash", False)
                or not hasattr(kv, "register_layer_transfer_counter")
                or getattr(kv, "layer_transfer_counter", None) is not None):
            return None
        if ex.layout.device.type == "cuda":
            from ..connector.copy_kernels import PageCopier
            from .layerwise_cuda import StreamLayerLoader
            loader = StreamLayerLoader(PageCopier(ex.layout), forward_stream=lambda: ex.wait_stream)
        elif ex.copier is not None:
            from .layerwise import LayerLoader
            loader = LayerLoader(ex.copier)
        else:
            return None
        kv.register_layer_transfer_counter(loader)
        return loader

    def _settle_layer_loads(self, wait: bool = True) -> None:
        """Settle queued layer-wise loads (device KV is about to be read or reused outside the
        forward) and unpin their host pages. `wait` False: only if none is left to wait for."""
        if self._layers is not None and self._layers.busy:
            for pages in self._layers.finish(wait):
                self.connector.end_layerwise_load(pages)

    # ================================================================= lifecycle
    def reset(self):
        conn = getattr(self, "connector", None)
        if getattr(self, "_layers", None) is not None:
            self._settle_layer_loads()  # flush reuses every slot: the copies into them end first
        if conn is not None and not conn.closed:
            try:
                if self.write_policy == "on_evict":
                    self._store_tree()  # flush_cache drops the whole device tree: keep it on the host
                conn.poll()  # queued stores read tree slots that are about to be reused: finish them
            except Exception:  # noqa: BLE001 - a failed backup must not block a flush
                logger.exception("flexflow: backing up the tree before reset failed")
            conn.reset()
        super().reset()
        # the old tree is gone: its locks are forgotten, never released
        self._inflight.clear()
        for ent in self._prefetch.values():  # flush: a prefetch still in flight ends as a miss
            if ent.handle is not None:
                ent.handle.cancel()
        self._prefetch.clear()
        self._prefetch_by_key.clear()
        self._prefetch_lock_tokens = 0
        self._host_hits.clear()
        self._key_memo.clear()

    def release_host_resources(self) -> None:
        if self._released:
            return
        self._released = True
        if self._layers is not None:
            self._settle_layer_loads()
            self._layers.close()
        if self._pp is not None:
            self._pp.close()
        if self.connector is not None:
            self.connector.close()
        self.rank_sync.close()

    def invalidate_host_tiers(self, reason: str = "") -> None:
        """Drop every host/deeper copy (their KV is stale, e.g. after a weight update)."""
        if self.connector is not None and not self.connector.closed:
            logger.info("flexflow: clearing host tiers%s", f" ({reason})" if reason else "")
            self.connector.poll()
            self._drain()
            self.connector.clear()
            self._key_memo.clear()  # keys computed with the seed clear() just rotated

    # ================================================================= match / load back
    @timed("match_prefix")
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        res = super().match_prefix(params)
        req = params.req
        if req is None or self.connector is None or self.disable or self.connector.closed:
            return res
        if self._dump_kv and res.device_prefix_len > 0:
            self._dump("device", req, params.key.raw_token_ids(),
                       self.path_device_indices(res.last_device_node)[: res.device_prefix_len])
        handle = req.cache_request_handle
        self._host_hits.pop(handle, None)
        key = params.key
        ps = self.page_size
        total_pages = len(key) // ps  # len() honours the key's limit and bigram view
        dev = res.device_prefix_len
        if total_pages * ps <= dev:  # identical on every rank: no agreement needed
            return res
        bigram = key.is_bigram
        raw = _as_array(key.raw_token_ids())
        anchor = res.best_match_node
        prev = self._chain_end(anchor, key.extra_key, key.cache_salt, bigram)
        first = dev // ps
        # hash and look up lazily: stop at the first page no tier holds
        hit_pages, end, chunk = 0, first, LOOKUP_CHUNK_PAGES
        keys: List[bytes] = []
        while end < total_pages:
            stop = min(total_pages, end + chunk)
            keys = self._suffix_keys(handle, prev, raw, first, stop, bigram)
            # a request with a prefetch gets its deep pages through the host tier (no deep lookup here)
            m = self.connector.lookup(keys[end - first:], deep=handle not in self._prefetch)
            hit_pages += m
            if end + m < stop:
                break
            end, chunk = stop, chunk * 4
        if self.rank_sync.active:
            self._m["agreements"] += 1
            hit_pages = self.rank_sync.agree_min([hit_pages])[0]
            if hit_pages > len(keys):  # a later PP stage takes stage 0's count (its pages are pinned then)
                keys = self._suffix_keys(handle, prev, raw, first, first + hit_pages, bigram)
        if hit_pages <= 0:
            return res
        hit = hit_pages * ps
        tokens = raw[: dev + hit + (1 if bigram else 0)]  # snapshot: the request's array keeps growing
        self._host_hits[handle] = _HostHit(anchor, dev, hit, keys[:hit_pages], tokens, key.extra_key,
                                           key.cache_salt, bigram)
        self._m["host_hit_matches"] += 1
        return res._replace(host_hit_length=hit)

    @timed("init_load_back")
    def init_load_back(self, params: InitLoadBackParams) -> Optional[Tuple[int, Any]]:
        anchor = params.best_match_node
        n = params.host_hit_length
        req = params.req
        if n <= 0 or req is None or self.connector is None:
            return 0, anchor
        hit = self._host_hits.pop(req.cache_request_handle, None)
        if not self._attached(anchor):
            return None  # the tree changed under the match: re-match next step (same on every rank)
        if (hit is None or hit.anchor is not anchor or hit.hit_len != n
                or len(self.path_device_indices(anchor)) != hit.device_len):
            self._m["load_back_stale"] += 1
            return 0, anchor
        alloc = self.token_to_kv_pool_allocator
        lock = self.lock(anchor)  # eviction below must not take the anchor or its ancestors
        slots = work = None
        pp = self._pp
        # PP stage 0: the later stages' pages, checked and pinned before anything is allocated
        pinned = pp.pin_for_load(hit) if pp is not None and pp.is_first else None
        try:
            ok = pp is None or not pp.is_first or pinned is not None
            if ok:
                short = n - alloc.available_size()
                if short > 0:
                    self.evict(EvictParams(num_tokens=short))
                slots = alloc.alloc(n)
                ok = slots is not None and slots.numel() == n
            loaded = work = None
            if ok and self._layers is not None:  # verified and pinned now, copied during the forward
                loaded, work = self.connector.begin_layerwise_load(
                    hit.keys, slots, copy_kernels=self._layers.needs_copy_kernels)
            if ok and loaded is None:
                loaded = self.connector.load(hit.keys, slots, fresh_slots=True)
            own_ok = ok = loaded is not None and loaded.ok
            # pages from a deeper tier: read inline now, or brought into host memory by the prefetch
            deep_pages = loaded.deep_pages + self._prefetched_pages(req, n) if ok else 0
            if self.rank_sync.active:
                self._m["agreements"] += 1
                ok = self.rank_sync.agree_all(ok)
            if pp is not None and not pp.is_first and ok:
                self._release_stage_pins(hit.keys)  # stage 0 pinned them for this load
                if not own_ok:  # pinned and checksummed by stage 0: only a copy error gets here
                    raise RuntimeError(f"PP stage {pp.rank}: loading {n} host tokens stage 0 pinned failed")
            if work is not None and not ok:  # another rank missed: nothing was queued, unpin
                self.connector.end_layerwise_load(work[1])
                work = None
            if not ok:
                if pinned:
                    pp.release(pinned)
                if slots is not None:
                    alloc.free(slots)
                    slots = None
                self._m["load_back_failures"] += 1
                return 0, anchor
            key = RadixKey(hit.tokens, hit.extra_key, is_bigram=hit.bigram, cache_salt=hit.cache_salt)
            value = torch.cat([self.path_device_indices(anchor), slots.to(torch.int64)])
            result = self.insert(InsertParams(key=key[: hit.device_len + n], value=value,
                                              priority=getattr(req, "priority", None) or 0))
            dup = max(0, result.prefix_len - hit.device_len)
            if work is not None:  # queue the copy of the pages the tree took from us (never a freed slot)
                words, host_pages, dev_pages = work
                k = dup // self.page_size
                if k:
                    self.connector.end_layerwise_load(host_pages[:k])
                if k < len(host_pages):
                    self._layers.submit(words, host_pages[k:], dev_pages[k:], pins=host_pages[k:])
                    self._m["layerwise_load_backs"] += 1
                work = None
            if dup:  # the tree already had part of it: free our copies
                alloc.free(slots[:dup])
            slots = None
            if deep_pages:
                req.storage_hit_length = deep_pages * self.page_size
                self._m["storage_hit_tokens"] += deep_pages * self.page_size
            self._m["load_backs"] += 1
            self._m["load_back_tokens"] += n
            if self._dump_kv:
                self._dump("loaded", req, hit.tokens, self.path_device_indices(result.last_device_node),
                           host_tokens=n)
            return n, result.last_device_node
        except Exception:
            if work is not None:
                self.connector.end_layerwise_load(work[1])
            if slots is not None:
                alloc.free(slots)
            raise
        finally:
            self.unlock(lock)

    def _release_stage_pins(self, keys) -> None:
        host = self.connector.host
        pages = [p for p in (host.page_of(k) for k in keys) if p is not None]
        unpin = getattr(host, "unpin_foreign", None)
        if unpin is not None:
            unpin(pages)

    def _dump(self, kind: str, req, tokens, slots, **extra) -> None:
        """FLEXFLOW_KV_DUMP_DIR diagnostic (kv_dump): once per request, kind and length."""
        self._settle_layer_loads()  # the dump reads device slots a queued load may still write
        n = len(slots)
        tag = (req.rid, kind, n)
        if tag in self._dumped:
            return
        self._dumped.add(tag)
        kv_dump.write_record(kind, list(tokens[:n]), slots, self.token_to_kv_pool_allocator.get_kvcache(),
                             rank=self._dump_rank, rid=str(req.rid), **extra)

    def _attached(self, node: TreeNode) -> bool:
        while node is not self.root_node:
            parent = node.parent
            if parent is None or node.evicted or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = parent
        return True

    # ================================================================= store side
    @timed("checkpoint")
    def checkpoint(self, req: "Req", *, up_to: int):
        if (self.connector is not None and not self.disable and not self.connector.closed
                and self.connector.config.host_tier.canonical_on_insert):
            # pages the host tier holds past the tree's match are the canonical KV (host_adopt)
            adopt_host_pages(self, req, up_to)
        super().checkpoint(req, up_to=up_to)
        if (self.connector is None or self.disable or self.write_policy != "write_through"
                or not req.finished() or self.connector.closed):
            return
        npages = req.kv.cache_protected_len // self.page_size
        if npages <= 0:
            return
        keys = self._path_keys(req.last_node)[:npages]  # cached per node: only new nodes are hashed
        slots = self.path_device_indices(req.last_node)[: npages * self.page_size]
        self._store(keys, slots, req.last_node)

    def _store(self, keys: List[bytes], slots: torch.Tensor, node: TreeNode) -> None:
        self._settle_layer_loads()  # the store reads device slots (normally complete: after a forward)
        handle = self.connector.store(keys, slots)
        self._m["stores_issued"] += 1
        if self.connector.defer_stores:
            # the copy reads these slots later: keep them out of eviction until it is acknowledged
            self._inflight.append((handle, self.lock(node)))

    @timed("evict")
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        if self.connector is None or self.connector.closed:
            return super().evict(params)
        self.poll()
        if self.write_policy != "on_evict":
            return super().evict(params)
        # RadixCache.evict, with the frees deferred until the victims are on the host
        start = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(x), x) for x in self.evictable_leaves]
        heapq.heapify(heap)
        victims: List[TreeNode] = []
        keys: List[bytes] = []
        num = 0
        while num < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            keys.extend(self._node_page_keys(x))  # before the leaf leaves the tree
            victims.append(x)
            num += len(x.value)
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
            self.kv_events.record_remove(x)
        if victims:
            slots = torch.cat([x.value for x in victims])
            try:
                self.connector.store(keys, slots)
                self.connector.poll()  # the copy must be complete before the slots are freed
                self._m["on_evict_stores"] += 1
            except Exception:  # noqa: BLE001 - the pages just become device-only misses
                logger.exception("flexflow: on-evict store failed")
            for x in victims:
                self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
        self.update_eviction_metrics(num, start)
        return EvictResult(num_tokens_evicted=num)

    def _store_tree(self) -> None:
        """Store every node of the device tree (on_evict policy, before reset drops it)."""
        keys: List[bytes] = []
        values = []
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            if x.evicted:
                continue
            keys.extend(self._node_page_keys(x))
            values.append(x.value)
            stack.extend(x.children.values())
        if values:
            self.connector.store(keys, torch.cat(values))

    # ================================================================= polling
    def poll(self) -> None:
        """Advance queued transfers and release the locks of acknowledged stores (rank-agreed)."""
        if self.connector is None or self.connector.closed:
            return
        self._settle_layer_loads(wait=False)  # after a forward: complete, this only unpins; never waits
        self.connector.poll()
        self._drain()
        if self._prom is not None:
            self._export_metrics()

    @timed("tick")
    def tick(self) -> None:
        """The per-step scheduler tick (plugin hook): poll, then agree which queued requests'
        prefetches are ready. Only here, never from evict() or other call sites: the agreement is
        a collective and the tick is the one point every rank reaches in the same order."""
        self.poll()
        if self._prefetch and self.connector is not None and not self.connector.closed:
            self._prefetch_tick()

    @timed("metrics_export")
    def _export_metrics(self) -> None:
        if self._prom.due():  # throttled: the dict is only built when it is exported
            self._prom.update(self._prom_metrics())

    def _prom_metrics(self) -> Dict[str, Any]:
        m = self.connector.metrics()
        m["cache"] = {k: v for k, v in self._m.items()}
        m["cache"]["inflight_stores"] = len(self._inflight)
        m["cache"]["sched"] = self._sched.snapshot()
        if self._layers is not None:
            m["cache"].update(self._layers.m)
        return m

    def _drain(self) -> None:
        if not self._inflight:  # same length on every rank: stores are issued at identical points
            return
        done = 0
        for h, _ in self._inflight:
            if not h.done:
                break
            done += 1
        if self.rank_sync.active:
            self._m["agreements"] += 1
            done = self.rank_sync.agree_min([done])[0]
        for _ in range(done):
            _, lock = self._inflight.popleft()
            self.unlock(lock)

    def flush_pending_backups(self) -> None:
        self.poll()

    def check_hicache_events(self) -> None:
        self.poll()

    def ready_to_load_host_cache(self) -> None:
        return None  # loads are complete when init_load_back returns

    def has_unlanded_loads(self) -> bool:
        return False

    # ================================================================= prefetch on arrival
    @timed("prefetch_on_arrival")
    def prefetch_on_arrival(self, req: "Req") -> None:
        """A request was queued (Scheduler._prefetch_kvcache, plugin hook): start fetching the
        deep-tier pages past its device + host hit into the host tier, so that its load-back is
        a host hit. Scheduler thread, every rank, arrival order: the entry is made on every rank
        whatever happens next, so the per-tick agreement sees the same list everywhere."""
        conn = self.connector
        if (conn is None or conn.closed or self.disable or conn.prefetch_policy == "off" or not conn.tiers
                or self.is_eagle):
            return
        handle = req.cache_request_handle
        self._forget(handle)  # a retracted request queued again: replace its state
        ent = self._prefetch[handle] = _Prefetch(ready=conn.prefetch_policy == "best_effort")
        try:
            self._start_prefetch(req, handle, ent)
        except Exception:  # noqa: BLE001 - a failed prefetch is a miss; the entry stays (rank agreement)
            logger.exception("flexflow: prefetch on arrival failed")

    def _start_prefetch(self, req: "Req", handle, ent: _Prefetch) -> None:
        conn, ps = self.connector, self.page_size
        ids = req.origin_input_ids + req.output_ids
        key = RadixKey(_as_array(ids), req.extra_key, limit=req._compute_max_prefix_len(len(ids)),
                       cache_salt=req.cache_salt)
        res = self.match_prefix(MatchPrefixParams(key=key))  # device only (req=None): no lookup, no collective
        dev, total = res.device_prefix_len, len(key) // ps
        if total * ps <= dev:
            return
        raw = _as_array(key.raw_token_ids())
        prev = self._chain_end(res.best_match_node, key.extra_key, key.cache_salt, False)
        first = dev // ps
        # the host hit, hashed lazily as match_prefix does (memoised: the coming match reuses it)
        hit, end, chunk, keys = 0, first, LOOKUP_CHUNK_PAGES, []
        while end < total:
            stop = min(total, end + chunk)
            keys = self._suffix_keys(handle, prev, raw, first, stop, False)
            m = conn.host.contains_prefix(keys[end - first:])
            hit += m
            if end + m < stop:
                break
            end, chunk = stop, chunk * 4
        start = first + hit
        if start >= total:
            return
        chain_prev = keys[hit - 1] if hit else prev
        # Requests queued together often share a prefix (a system prompt, a conversation): one fetch
        # serves them all. The key of the first page to fetch names the whole prefix up to it (keys
        # are chained), so a request whose first deep page is the same as an in-flight prefetch's
        # waits on that one instead of reading the same pages again.
        first_key = conn.chain_keys(chain_prev, raw[start * ps:(start + 1) * ps], 1, False)[0]
        shared = self._prefetch_by_key.get(first_key)
        if shared is None and not conn.deep_tiers_may_hold(first_key):
            self._m["prefetches_skipped_absent"] += 1  # nothing deeper: no job, no hold
            return
        if shared is None and not conn.prefetch_worth(total - start):
            # estimated slower than the prefill: no job, no hold; the match after it is host-only
            # (this entry exists), so SGLang recomputes those tokens, as the inline rule would
            self._m["prefetches_skipped_recompute_cheaper"] += 1
            return
        if shared is not None and not shared.done and not shared.cancelled:
            ent.handle = shared.share()
            self._m["prefetches_shared"] += 1
        else:
            ent.handle = conn.prefetch(chain=(chain_prev, raw[start * ps:total * ps], total - start, False))
            if not ent.handle.done:
                self._prefetch_by_key[first_key] = ent.handle
        tc = conn.config.transfer
        ent.deadline = time.monotonic() + tc.prefetch_timeout_base_s + \
            tc.prefetch_timeout_per_ki_token_s * (total - start) * ps / 1024.0
        self._m["prefetches_issued"] += 1
        if not ent.ready and not ent.handle.done:
            self._lock_device_prefix(ent, res.last_device_node, dev)

    def _lock_device_prefix(self, ent: _Prefetch, node, tokens: int) -> None:
        """Keep the device prefix the prefetched pages continue in the tree until the request may
        be scheduled: the pages land in the host tier behind it, and if the other requests' KV
        evicted it meanwhile (a multi-turn history evicted by the turns of other conversations),
        they would be unreachable - a match starts at the root - and the request would recompute
        everything (measured: 0 of 16,511 prefetched pages used). HiCache protects the node its
        prefetch continues for the same reason. Bounded to a quarter of the device pool, so that
        queued requests can never lock what running ones need; past it the prefetch goes unlocked."""
        if node is None or node is self.root_node or tokens <= 0:
            return
        cap = getattr(self.token_to_kv_pool_allocator, "size", 0) // 4
        if self._prefetch_lock_tokens + tokens > cap:
            return
        self.inc_lock_ref(node)
        ent.lock, ent.lock_tokens = node, tokens
        self._prefetch_lock_tokens += tokens

    def _unlock_device_prefix(self, ent: _Prefetch) -> None:
        if ent.lock is not None:
            self.dec_lock_ref(ent.lock)
            self._prefetch_lock_tokens -= ent.lock_tokens
            ent.lock, ent.lock_tokens = None, 0

    @timed("prefetch_agreement")
    def _prefetch_tick(self) -> None:
        """Per scheduler tick (after the connector settled finished jobs): a pending request
        becomes ready when its prefetch ended or (timeout policy) its budget ran out, MIN-agreed
        across ranks so that every rank holds or admits it in the same step."""
        if self._prefetch_by_key:  # settled fetches can no longer be shared
            for k in [k for k, h in self._prefetch_by_key.items() if h.done or h.cancelled]:
                del self._prefetch_by_key[k]
        pend = [e for e in self._prefetch.values() if not e.ready]
        if not pend:
            return
        now = time.monotonic()
        timeout = self.connector.prefetch_policy == "timeout"
        if timeout and any(e.handle is not None and not e.handle.done and now >= e.deadline for e in pend):
            # a budget ran out: promote the pieces that did arrive now, on this thread, so that the
            # request is admitted with them. Their promotion jobs wait for a worker, and this thread
            # settles jobs only between forwards: after another request's 1 s prefill, a budget
            # often ran out with every page read and none promoted (kv128k multi-turn).
            self.connector.land_arrived()
        local = [1 if (e.handle is None or e.handle.done or (timeout and now >= e.deadline)) else 0 for e in pend]
        if self.rank_sync.active:
            self._m["agreements"] += 1
            local = self.rank_sync.agree_min(local)
        for e, r in zip(pend, local):
            if r:
                e.ready = True
                self._unlock_device_prefix(e)  # admission matches (and locks) it from here on
                self._m["prefetch_ready"] += 1
                if e.handle is not None and not e.handle.done:
                    self._m["prefetch_timeouts"] += 1

    def idle_wait(self, scheduler) -> None:
        """Scheduler.on_idle (plugin hook): SGLang found no batch to run. While a queued request
        is held for its prefetch, SGLang's loop would spin straight back, holding the GIL: the
        workers reading that prefetch then wait up to the interpreter's switch interval (5 ms)
        after every system call, so a prefetch of many files crawled (kv128k multi-turn: 130 MB
        in 430-630 ms with the server idle, 55 ms when it ran beside a forward). Sleep on the
        engine until a job finishes or is submitted, at most IDLE_WAIT_S: nothing is decoding
        (no batch), and a new request waits at most that long to be received."""
        conn = self.connector
        if conn is None or conn.closed or not self._prefetch:
            return
        rb = getattr(scheduler, "running_batch", None)
        if rb is not None and not rb.is_empty():
            return
        if any(not e.ready and e.handle is not None and not e.handle.done for e in self._prefetch.values()):
            self._m["idle_waits"] += 1
            conn.engine.wait_for_progress(IDLE_WAIT_S)

    def _prefetched_pages(self, req: "Req", n: int) -> int:
        """Pages of this load-back that its prefetch brought from a deeper tier (reported to
        SGLang as storage hits, as the inline path does)."""
        ent = self._prefetch.get(req.cache_request_handle)
        h = ent.handle if ent is not None else None
        return min(n // self.page_size, h.pages) if h is not None and h.done else 0

    def prefetch_holds(self, req: "Req") -> bool:
        """True while the request must stay queued for its prefetch (PrefillAdder.add_one_req hook)."""
        ent = self._prefetch.get(req.cache_request_handle)
        if ent is None or ent.ready:
            return False
        self._m["prefetch_holds"] += 1
        return True

    # ================================================================= per-request state
    @timed("on_release")
    def on_release(self, req: "Req", *, checkpointed: bool) -> None:
        self._forget(req.cache_request_handle)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self._forget(handle)

    def _forget(self, handle: CacheRequestHandle) -> None:
        ent = self._prefetch.pop(handle, None)
        if ent is not None:
            self._unlock_device_prefix(ent)
        if ent is not None and ent.handle is not None:
            ent.handle.cancel()  # aborted or finished: a fetch still queued skips its I/O
        self._host_hits.pop(handle, None)
        self._key_memo.pop(handle, None)

    # ================================================================= keys
    def _node_page_keys(self, node: TreeNode) -> List[bytes]:
        """Page keys of `node`'s own pages, cached on the node (`_ff_keys`, split with it). A node's
        tokens and ancestors never change, so its keys are computed once per node lifetime."""
        keys = getattr(node, "_ff_keys", None)
        if keys is not None:
            return keys
        path = []
        x = node
        while x is not self.root_node and getattr(x, "_ff_keys", None) is None:
            path.append(x)
            x = x.parent
        bigram = node.key.is_bigram
        conn = self.connector
        prev = x._ff_keys[-1] if x is not self.root_node else \
            conn.namespace_seed(node.key.extra_key, node.key.cache_salt, bigram)
        for y in reversed(path):
            raw = y.key.token_ids[: len(y.key) + (1 if bigram else 0)]
            ks = conn.chain_keys(prev, raw, len(y.key) // self.page_size, bigram)
            y._ff_keys = ks
            if ks:
                prev = ks[-1]
        return node._ff_keys

    def _path_keys(self, node: TreeNode) -> List[bytes]:
        nodes = []
        while node is not self.root_node:
            nodes.append(node)
            node = node.parent
        keys: List[bytes] = []
        for x in reversed(nodes):
            keys.extend(self._node_page_keys(x))
        return keys

    def _chain_end(self, node: TreeNode, extra_key, cache_salt, bigram: bool) -> bytes:
        """The key ending the path to `node` (the namespace seed at the root)."""
        if node is self.root_node:
            return self.connector.namespace_seed(extra_key, cache_salt, bigram)
        return self._node_page_keys(node)[-1]

    def _split_node(self, key, child, split_len):
        new_node = super()._split_node(key, child, split_len)
        keys = getattr(child, "_ff_keys", None)
        if keys is not None:  # the parent part takes the leading pages' keys
            k = split_len // self.page_size
            new_node._ff_keys, child._ff_keys = keys[:k], keys[k:]
        return new_node

    def _suffix_keys(self, handle, prev: bytes, raw: array, first: int, end: int, bigram: bool) -> List[bytes]:
        """Keys of pages [first, end) of `raw`, chained from `prev`; memoised per request attempt and
        extended when asked for more (the same request is matched several times per step)."""
        ps = self.page_size
        extra = 1 if bigram else 0
        lo = first * ps
        want = end - first
        memo = self._key_memo.get(handle)
        if memo is not None and memo.prev == prev and memo.first == first \
                and raw[lo:lo + len(memo.tokens)] == memo.tokens:
            have = len(memo.keys)
            if have < want:
                more = self.connector.chain_keys(memo.keys[-1] if have else prev,
                                                 raw[lo + have * ps:lo + want * ps + extra], want - have, bigram)
                memo.keys = memo.keys + more
                memo.tokens = raw[lo:lo + want * ps + extra]
            self._key_memo.move_to_end(handle)
            return memo.keys[:want]
        keys = self.connector.chain_keys(prev, raw[lo:lo + want * ps + extra], want, bigram)
        self._key_memo[handle] = _KeyMemo(prev, first, raw[lo:lo + want * ps + extra], keys)
        while len(self._key_memo) > MAX_KEY_MEMOS:
            self._key_memo.popitem(last=False)
        return keys

    # ================================================================= metrics
    def metrics(self) -> Dict[str, Any]:
        m: Dict[str, Any] = dict(self._m)
        m["inflight_stores"] = len(self._inflight)
        m["sched"] = self._sched.snapshot()
        m["pending_prefetches"] = sum(1 for e in self._prefetch.values() if not e.ready)
        if self._layers is not None:
            m.update(self._layers.m)
        if self.connector is not None and not self.connector.closed:
            m["connector"] = self.connector.metrics()
        return m


def _pd_mode() -> bool:
    """Whether this server runs as a PD prefill or decode instance."""
    try:
        from sglang.srt.runtime_context import get_disagg
        return get_disagg().disaggregation_mode not in (None, "null")
    except Exception:  # noqa: BLE001 - no disaggregation section published (unit tests)
        return False


def _published_parallel():
    """The scheduler's parallel layout (attention-TP rank and size) if SGLang published one, else None."""
    try:
        from sglang.srt.runtime_context import get_parallel
        par = get_parallel()
        return par if hasattr(par, "attn_tp_rank") and hasattr(par, "attn_tp_size") else None
    except Exception:  # noqa: BLE001 - no published context (unit tests build caches without a scheduler)
        return None
