"""FlexFlowConnector: the one object the radix cache talks to for KV outside the device pool.

It owns the host tier, the deeper tiers (KVTier list, possibly empty, built by name through the
tier registry: tiers/registry.py), a PathSelector with its NodeAgent, and the TransferExecutor.
The cache decides what to look up, load and store; the connector moves the bytes and reports
failures as results (a LoadResult with ok False, a failed handle), never as exceptions across the
scheduler loop.

Keys: `page_keys` chains a 32-byte blake2b per full page over the whole prefix, seeded with the
model/layout fingerprint and the request namespace (extra_key, cache_salt), so a key names the KV
of one page *given everything before it*, on this rank's shard of this model.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from ..config import FlexFlowConfig, build_topology, load_config
from ..errors import ConfigError
from ..tiers.base import KVTier, no_wait_lookups
from ..tiers.registry import TierContext, create_tier
from ..transfer import Job, engine_from_config
from ..transfer.legs import tier_get
from .executors import TransferExecutor
from .fetch_cost import FetchCost
from .host_tier import HostTier
from .layout import KVLayout
from .model_identity import weights_digest
from .prefetch import JOB_KINDS as PREFETCH_JOB_KINDS
from .prefetch import PREFETCH_PIECE_BYTES, PrefetchHandle, Prefetcher
from .staging import StagingPool
from .write_back import WriteBack

logger = logging.getLogger(__name__)

KEY_BYTES = 32  # blake2b digest; the deeper tiers expect 32-byte keys
#: host tier pages are never fewer than this, whatever the configured capacity
MIN_HOST_PAGES = 4


def _token_bytes(token_ids) -> bytes:
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        return token_ids.tobytes()
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to(torch.int64).cpu().numpy().tobytes()
    return array("q", token_ids).tobytes()


@dataclass
class StoreHandle:
    """What `store` returns. `done` turns True once the host copy is complete (or failed);
    the device slots must stay valid until then. `ok` says whether every page is now held."""
    pages: int
    done: bool = False
    ok: bool = False
    stored_pages: int = 0
    _work: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class LoadResult:
    """What `load` returns. `ok`: every page is in the device slots (all or nothing: on a failure no
    device slot was written). `pages` = pages asked for; of those, `host_pages` came from the host
    tier and `deep_pages` from a deeper tier read by this load (0 unless ok). Truthy iff `ok`."""
    ok: bool
    pages: int = 0
    host_pages: int = 0
    deep_pages: int = 0

    def __bool__(self) -> bool:
        return self.ok


class FlexFlowConnector:
    def __init__(self, layout: KVLayout, config: Optional[FlexFlowConfig] = None, *,
                 fingerprint: Optional[Mapping[str, Any]] = None, tiers: Sequence[KVTier] = (),
                 topology=None, agent=None, device_index: int = 0, defer_stores: bool = False,
                 start_agent: bool = True):
        from ..monitor import NodeAgent
        from ..selector import PathSelector, PathType

        tiers = list(tiers)
        for t in tiers:
            if not isinstance(t, KVTier):
                raise TypeError(f"deeper tiers must be KVTier instances (flexflow_sglang.tiers.KVTier), "
                                f"got {type(t).__name__}")
        self.config = config if config is not None else load_config()
        hc = self.config.host_tier
        self.layout = layout
        self.page_size = layout.page_size
        self.write_policy = hc.write_policy
        # stores wait in a queue until poll() when deferred (tests; the async shape CUDA will use)
        self.defer_stores = defer_stores
        self._closed = False

        self.topology = topology if topology is not None else build_topology(self.config)
        gpus = self.topology.nodes_of_kind("gpu")
        if not gpus:
            raise ConfigError(f"topology {self.topology.name!r} has no GPU node to stand for the device KV pool; "
                              "use topology.source: mock (e.g. mock: single) on machines without GPUs")
        dev = next((g for g in gpus if g.index == device_index), gpus[0])
        self.device_node = dev.name
        self.host_node = self.topology.host_memory(host=dev.host, near=dev.name).name
        self._own_agent = agent is None
        if agent is None:
            mc = self.config.monitor
            agent = NodeAgent(self.topology, mc.sample_interval_ms, source=mc.source, sysfs_root=mc.sysfs_root,
                              feedback_half_life_ms=mc.feedback_half_life_ms, elastic_share=mc.elastic_share,
                              elastic_probe_s=mc.elastic_probe_s)
            if start_agent:
                agent.start()
        self.agent = agent
        # device <-> host moves have no storage-relay executor (executors.py): never offered here
        self.selector = PathSelector(self.topology, agent, self.config.selector, impl=self.config.selector_impl,
                                     exclude_types=(PathType.StorageRelay,))
        # the one transfer engine: routes every move, runs deep-tier I/O on its workers
        tc = self.config.transfer
        self.engine = engine_from_config(self.selector, agent, tc, ttft_sensitive=self.config.selector.ttft_sensitive)
        self.load_timeout_s = tc.load_timeout_ms / 1000.0
        self.fetch_cost = FetchCost(tc.recompute_tokens_per_s, layout.page_size, layout.page_nbytes,
                                    lambda node, nbytes: self.engine.estimate_s(node, self.host_node, nbytes))
        self.prefetch_policy = tc.prefetch_policy if self.engine.is_async else "off"
        # deep reads and write-back pieces reuse staging buffers (no page faults on every read)
        piece = min(PREFETCH_PIECE_BYTES, tc.queue_bytes // 4)
        self.staging = StagingPool(layout.page_words, layout.word_dtype, tc.queue_bytes,
                                   min_pages=max(1, piece // layout.page_nbytes))
        self._gen = 0  # bumped by clear(): results of jobs started before it are stale
        self._reaping = False
        #: where settling a finished job reports its time on the owner's thread (the cache sets its
        #: SchedClock here: `settle_<kind>` shows which kind of job costs the scheduler thread)
        self.clock = None
        self.executor = TransferExecutor(layout, self.selector, agent, self.device_node, self.host_node,
                                         ttft_sensitive=self.config.selector.ttft_sensitive, engine=self.engine)

        cap_pages = self._capacity_pages(hc, layout)
        pin = hc.pin_memory == "always" or (hc.pin_memory == "auto" and torch.cuda.is_available()
                                           and layout.device.type == "cuda")
        self.tiers: List[KVTier] = tiers
        self._route_remote_tiers()

        self._fingerprint = dict(fingerprint or {})
        self._fingerprint.setdefault("layout", layout.describe())
        self._fingerprint.setdefault("page_size", layout.page_size)
        # remote_tier.keyed_page_keys (issue 14): the chain's seed keyed with the tier secret, so
        # whoever sees keys cannot confirm a guessed prefix; key b"" is the plain (default) chain
        from ..tiers.trust import load_secret, page_key_secret
        rt = self.config.remote_tier
        kkey = page_key_secret(load_secret(rt.secret_file)) if rt.keyed_page_keys else b""
        self._seed = hashlib.blake2b(repr(sorted(self._fingerprint.items())).encode(), digest_size=KEY_BYTES,
                                     key=kkey).digest()
        self.host = self._build_host(hc, cap_pages, pin)
        self._queue: Deque[StoreHandle] = deque()
        self._m: Dict[str, int] = {k: 0 for k in (
            "lookups", "lookup_pages_host", "lookup_pages_deep", "loads", "load_failures", "pages_loaded",
            "pages_loaded_host", "pages_loaded_deep", "stores", "store_failures", "pages_stored", "pages_deduplicated",
            "pages_spilled", "spill_failures", "checksum_failures", "stores_cancelled", "pages_written_through",
            "write_through_failures", "write_through_dropped", "spills_dropped", "pages_spill_dropped",
            "fetch_timeouts", "fetch_dropped", "prefetches", "prefetch_pages", "prefetch_dropped",
            "prefetch_failures", "prefetch_discarded", "prefetch_capped", "deep_pages_recompute_cheaper",
            "write_through_copied", "store_pages_short", "spills_skipped_held", "write_through_skipped_held",
            "promote_inline")}
        # write-through pins at most a quarter of the host tier; a backlog beyond it copies its rows
        self.write_back = WriteBack(self, cap_pages // 4)
        self.prefetcher = Prefetcher(self)
        self._hits_by_tier: Dict[str, int] = {"host": 0}
        logger.info("flexflow: config %s; topology %s; selector core %s; host tier %d pages (%.1f MiB%s) on %s, "
                    "policy %s, checksums %s; deeper tiers %s; device node %s; %s",
                    self.config.path or "<defaults>", self.topology.summary(), self.selector.impl, cap_pages,
                    cap_pages * layout.page_nbytes / 2**20, ", pinned" if pin else "", self.host_node,
                    self.write_policy, "on" if hc.verify_checksums else "off",
                    ", ".join(_describe_tier(t) for t in self.tiers) or "none", self.device_node, layout.describe())

    def _build_host(self, hc, cap_pages: int, pin: bool):
        """host_tier.shared (issue 17): one shared-memory tier per node for every process with this
        key seed (model, layout, shard, stage); a tier that cannot attach (permissions, geometry)
        falls back to a private one with a warning."""
        args = (self.layout.page_words, self.layout.word_dtype, cap_pages)
        kw = dict(node=self.host_node, verify_checksums=hc.verify_checksums, pin_memory=pin)
        if getattr(hc, "shared", False):
            from .shared_host_tier import SharedHostTier
            try:
                return SharedHostTier(*args, fingerprint=self._seed.hex(), **kw)
            except (OSError, ValueError, RuntimeError) as e:
                logger.warning("flexflow: shared host tier unavailable (%s); using a private host tier", e)
        return HostTier(*args, **kw)

    def _route_remote_tiers(self) -> None:
        """Remote tiers follow the selector in serving: every get/put batch is planned per owner
        (Direct, CrossNodeRelay through a third tier server, Split) by tiers/routing.py, whose
        tickets come from this connector's transfer engine. The local node is
        remote_tier.local_node, else the host-memory node; owners whose node (HELLO_OK, the tier
        server's --node) is not in the topology are reached directly."""
        local = self.config.remote_tier.local_node or self.host_node
        for tier in self.tiers:
            if not tier.can_route or tier.routes_itself:
                continue
            if local not in self.topology.nodes:
                logger.warning("flexflow: remote_tier.local_node %r is not a node of topology %s; the remote "
                               "tier is not routed", local, self.topology.name)
                continue
            try:
                tier.route_with(self.selector, local, engine=self.engine)
            except Exception as e:  # noqa: BLE001 - unrouted still serves
                logger.warning("flexflow: remote tier routing disabled: %s", e)

    @staticmethod
    def _capacity_pages(hc, layout: KVLayout) -> int:
        if hc.capacity_tokens is not None:
            pages = hc.capacity_tokens // layout.page_size
        else:
            pages = int(hc.capacity_gb * (1 << 30)) // layout.page_nbytes
        return max(MIN_HOST_PAGES, pages)

    # ----------------------------------------------------------------- construction from SGLang
    @classmethod
    def from_sglang(cls, params, ctx=None, config: Optional[FlexFlowConfig] = None, parallel=None,
                    **kw) -> "FlexFlowConnector":
        """Build from CacheInitParams (+ the TreeCacheBuildContext when a server builds it, and the
        scheduler's published parallel layout, `attn_tp_rank`/`attn_tp_size`, which backend/ reads
        from SGLang: the connector itself never imports SGLang)."""
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        layout = KVLayout.from_pool(kvcache, params.page_size)
        fp = {"dtype": str(layout.store_dtype), "layers": layout.layer_num, "rows": layout.row_shapes,
              "start_layer": getattr(kvcache, "start_layer", 0), "pp_rank": params.pp_rank, "pp_size": params.pp_size,
              "attn_cp_rank": params.attn_cp_rank, "attn_cp_size": params.attn_cp_size}
        device_index = layout.device.index or 0
        if ctx is not None:
            sa = ctx.server_args
            fp.update(model=getattr(sa, "model_path", None), revision=getattr(sa, "revision", None),
                      tp_rank=ctx.tp_rank, tp_size=ctx.tp_size)
            # the same path and revision may hold other weights later (a checkpoint saved over
            # in place): sampled weight content and quantisation decide the keys too
            fp.update(weights=weights_digest(fp["model"], fp["revision"]),
                      quantization=getattr(sa, "quantization", None))
            if parallel is not None:  # None: no published layout (tests); tp_rank already names the shard
                # the KV shard is named by the attention-TP rank: data-parallel attention replicas
                # (different global tp_rank, same shard) must share keys, different shards never
                fp.update(attn_tp_rank=parallel.attn_tp_rank, attn_tp_size=parallel.attn_tp_size)
                fp.pop("tp_rank", None)
                fp.pop("tp_size", None)
            runner = getattr(ctx.tp_worker, "model_runner", None)
            gpu_id = getattr(runner, "gpu_id", None)
            if isinstance(gpu_id, int):
                device_index = gpu_id
        cfg = config if config is not None else load_config()
        if "tiers" not in kw:
            rank_dir = f"rank{ctx.tp_rank}" if ctx is not None else "rank0"
            kw["tiers"] = build_deeper_tiers(cfg, fp, layout.page_nbytes, rank_dir)
        conn = cls(layout, cfg, fingerprint=fp, device_index=device_index, **kw)
        if ctx is not None and layout.device.type == "cuda":
            runner = getattr(ctx.tp_worker, "model_runner", None)
            conn.executor.wait_stream = getattr(runner, "forward_stream", None)
        return conn

    # ----------------------------------------------------------------- keys
    def namespace_seed(self, extra_key=None, cache_salt=None, bigram: bool = False) -> bytes:
        ns = repr((extra_key, cache_salt or None, bool(bigram))).encode()
        return hashlib.blake2b(self._seed + ns, digest_size=KEY_BYTES).digest()

    def chain_keys(self, prev: bytes, token_ids, num_pages: int, bigram: bool = False) -> List[bytes]:
        """`num_pages` chained keys after `prev` over `token_ids` (page j = tokens [j*ps, (j+1)*ps),
        plus the next token for EAGLE bigram keys)."""
        ps = self.page_size
        raw = _token_bytes(token_ids)
        step, extra = ps * 8, 8 if bigram else 0
        if len(raw) < num_pages * step + extra:
            raise ValueError(f"{len(raw) // 8} tokens cannot make {num_pages} pages of {ps}")
        out = []
        h = prev
        blake = hashlib.blake2b
        for j in range(num_pages):
            h = blake(h + raw[j * step:(j + 1) * step + extra], digest_size=KEY_BYTES).digest()
            out.append(h)
        return out

    def page_keys(self, token_ids, extra_key=None, cache_salt=None, *, bigram: bool = False) -> List[bytes]:
        """One key per full page of `token_ids` (the whole prefix from position 0)."""
        n = len(token_ids) - (1 if bigram else 0)
        return self.chain_keys(self.namespace_seed(extra_key, cache_salt, bigram), token_ids,
                               max(0, n) // self.page_size, bigram)

    # ----------------------------------------------------------------- lookup / load
    def lookup(self, keys: Sequence[bytes], deep: bool = True) -> int:
        """Leading pages of `keys` available in the host tier or, page by page, the deeper tiers.
        (Host LRU evicts a prefix's oldest pages first, so a prefix often starts in a deeper tier
        and continues in host memory.) `deep=False`: the host tier only (a request whose deep
        pages a prefetch brings into host memory: no deep-tier round trip on the scheduler thread)."""
        self._m["lookups"] += 1
        total = len(keys)
        n = self.host.contains_prefix(keys)
        in_host = n
        while deep and n < total and self.tiers:
            m = 0
            for tier in self.fetch_cost.order(self.tiers, total - n):
                try:
                    with no_wait_lookups():  # the scheduler thread asks: a busy tier is a miss, no wait
                        m = tier.contains_prefix(keys[n:])
                except Exception:  # noqa: BLE001 - a broken tier is a miss
                    logger.exception("flexflow: tier %s lookup failed", tier.name)
                    m = 0
                if m > 0:
                    break
            if m <= 0:
                break
            if not self.fetch_cost.worth_fetching(tier.name, tier.node, m):
                self._m["deep_pages_recompute_cheaper"] += m  # SGLang prefills them sooner
                break
            self._m["lookup_pages_deep"] += m
            n += m
            more = self.host.contains_prefix(keys[n:])
            in_host += more
            n += more
        self._m["lookup_pages_host"] += in_host
        return n

    def load(self, keys: Sequence[bytes], device_slots: torch.Tensor, *, fresh_slots: bool = False) -> LoadResult:
        """Fill the device pool at `device_slots` (len(keys) * page_size page-aligned slots) with the
        pages of `keys`: all or nothing, checksums verified, complete when this returns. A failure
        (missing page, checksum mismatch, copy error) returns a result with ok False; on success it
        says how many pages came from the host and the deeper tiers.
        `fresh_slots`: the caller just allocated the slots and frees them on a failure, so the copy
        may verify as it goes (one pass) and leave garbage behind on a mismatch. Otherwise (slots
        holding the request's own valid KV, host_adopt) pages are verified first and a failure
        writes no device slot."""
        n = len(keys)
        if n == 0:
            return LoadResult(True)
        self._m["loads"] += 1
        try:
            dev_pages = self._device_pages(device_slots, n)
            host_pages = self.host.pages_of(keys)
            in_host = [i for i, p in enumerate(host_pages) if p is not None]
            deep_idx = [i for i, p in enumerate(host_pages) if p is None]
            host_pages = [host_pages[i] for i in in_host]
            staging = None
            if deep_idx:
                staging = self._fetch_deep([keys[i] for i in deep_idx])
                if staging is None:
                    return self._load_failed(n, "page missing from every tier")
            if host_pages and fresh_slots and self._fused_load():
                # one pass: copy and verify together; a mismatch leaves only our fresh slots written
                bad = self.executor.scatter_verified(self.host.words, host_pages, _pick(dev_pages, in_host, n),
                                                     self.host.stored_sums(host_pages))
                if bad >= 0:
                    self.host.note_checksum_failure()
            else:
                bad = self.host.first_bad_page(host_pages)
                if bad < 0 and host_pages:
                    self.executor.host_to_device(self.host.words, host_pages, _pick(dev_pages, in_host, n))
            if bad >= 0:
                self._m["checksum_failures"] += 1
                self.host.discard([keys[in_host[bad]]])
                return self._load_failed(n, f"checksum mismatch on host page {host_pages[bad]}")
            if host_pages:
                self.host.touch([keys[i] for i in in_host])
                changed = self.host.first_changed(host_pages)  # shared tier: rewritten during the copy
                if changed >= 0:
                    return self._load_failed(n, f"host page {host_pages[changed]} was replaced during the copy")
            if deep_idx:
                self.executor.host_to_device(staging, list(range(len(deep_idx))), _pick(dev_pages, deep_idx, n))
                self.prefetcher.promote([keys[i] for i in deep_idx], staging)
        except Exception as e:  # noqa: BLE001 - reported as a miss
            logger.exception("flexflow: load of %d pages failed", n)
            return self._load_failed(n, str(e))
        nh, deep = len(host_pages), len(deep_idx)
        self._m["pages_loaded"] += n
        self._m["pages_loaded_host"] += nh
        self._m["pages_loaded_deep"] += deep
        self._hits_by_tier["host"] += nh
        return LoadResult(True, n, nh, deep)

    def begin_layerwise_load(self, keys: Sequence[bytes], device_slots: torch.Tensor, copy_kernels: bool = True):
        """First half of a layer-wise load (backend/layerwise.py): everything that can make the load a
        miss, done now: every page in the host tier, checksums verified (one compiled read), pages
        touched and pinned so that nothing overwrites them while the copy runs. Returns
        (result, work): work = (host words, host pages, device pages) to queue for the layer copy,
        then `end_layerwise_load(host pages)` once it is complete. (None, None): not eligible here
        (a page in a deeper tier, a shared host tier, no compiled kernels where the loader copies
        with them: `copy_kernels`; the CUDA loader does not): use `load`."""
        n = len(keys)
        h = self.host
        if n == 0 or not getattr(h, "fused_hash", False):
            return None, None
        if copy_kernels and (self.executor.copier is None or not self.executor.fused(h.words, False)):
            return None, None
        host_pages = h.pages_of(keys)
        if any(p is None for p in host_pages):
            return None, None
        self._m["loads"] += 1
        try:
            dev_pages = self._device_pages(device_slots, n)
            bad = h.first_bad_page(host_pages)
        except Exception as e:  # noqa: BLE001 - reported as a miss
            logger.exception("flexflow: layer-wise load of %d pages failed", n)
            return self._load_failed(n, str(e)), None
        if bad >= 0:
            self._m["checksum_failures"] += 1
            h.discard([keys[bad]])
            return self._load_failed(n, f"checksum mismatch on host page {host_pages[bad]}"), None
        h.touch(keys)
        h.pin(host_pages)
        self._m["pages_loaded"] += n
        self._m["pages_loaded_host"] += n
        self._hits_by_tier["host"] += n
        return LoadResult(True, n, n, 0), (h.words, host_pages, dev_pages)

    def end_layerwise_load(self, host_pages: Sequence[int]) -> None:
        """The layer copy out of `host_pages` is complete (or was never queued): unpin them."""
        if not self._closed:
            self.host.unpin(host_pages)

    def _fused_store(self) -> bool:
        """The store's copy also takes the page hashes the host tier commits (one read, not two)."""
        h = self.host
        return h.verify_checksums and getattr(h, "fused_hash", False) and self.executor.fused(h.words, True)

    def _fused_load(self) -> bool:
        """The load verifies inside its copy (checksums on) or copies with the kernels (off)."""
        h = self.host
        return getattr(h, "fused_hash", False) and self.executor.fused(h.words, h.verify_checksums)

    def _load_failed(self, n: int, why: str) -> LoadResult:
        self._m["load_failures"] += 1
        logger.warning("flexflow: host load failed (%s); treated as a cache miss", why)
        return LoadResult(False, n)

    def _fetch_deep(self, keys: Sequence[bytes]) -> Optional[torch.Tensor]:
        """Pages of `keys` from the deeper tiers into a page-major staging tensor (all, or None).
        An engine job; the load-back waits at most `transfer.load_timeout_ms` for it (async)."""
        if not self.tiers:
            return None
        job = Job("fetch", lambda j: self._read_deep(keys, len(keys)), nbytes=len(keys) * self.layout.page_nbytes)
        if not self.engine.submit(job):
            self._m["fetch_dropped"] += 1
            return None
        if not job.wait(self.load_timeout_s):
            job.abandoned = True  # it finishes on its own; its staging is dropped
            self._m["fetch_timeouts"] += 1
            logger.warning("flexflow: deep-tier fetch of %d pages exceeded %.0f ms; treated as a miss",
                           len(keys), self.load_timeout_s * 1e3)
            return None
        if not job.ok or job.result is None:
            return None
        got, staging, hits = job.result
        self._count_hits(hits)
        return staging if got == len(keys) else None

    def _read_deep(self, keys: Sequence[bytes], n: int):
        """(pages got, staging, {tier: pages}): the leading `n` pages of `keys` from whichever deeper
        tier holds each run. Engine worker (or inline in sync mode); touches only its staging."""
        staging = self.staging.take(n)
        u8 = staging.view(torch.uint8)
        got, hits = 0, {}
        while got < n:
            m = 0
            for tier in self.fetch_cost.order(self.tiers, n - got):
                t0 = time.perf_counter()
                try:
                    m = tier_get(self.engine, tier, self.host_node, keys[got:n], u8[got:n])
                except Exception:  # noqa: BLE001
                    logger.exception("flexflow: tier %s read failed", tier.name)
                    m = 0
                if m > 0:
                    self.fetch_cost.observe(tier.name, m * self.layout.page_nbytes, time.perf_counter() - t0)
                    hits[tier.name] = hits.get(tier.name, 0) + m
                    break
            if m <= 0:
                break
            got += m
        return got, staging, hits

    def _count_hits(self, hits: Mapping[str, int]) -> None:
        for name, m in hits.items():
            self._hits_by_tier[name] = self._hits_by_tier.get(name, 0) + m

    # ----------------------------------------------------------------- store
    def store(self, keys: Sequence[bytes], device_slots: torch.Tensor) -> StoreHandle:
        """Copy the device pages at `device_slots` into the host tier under `keys` (pages already held
        are only refreshed). The slots must stay valid until the handle is done (see `poll`)."""
        h = StoreHandle(pages=len(keys))
        if self._closed or not keys:
            h.done, h.ok = True, not keys
            return h
        self._m["stores"] += 1
        try:
            dev_pages = self._device_pages(device_slots, len(keys))
        except Exception as e:  # noqa: BLE001
            self._store_failed(h, str(e))
            return h
        found = self.host.pages_of(keys)
        missing = [i for i, p in enumerate(found) if p is None]
        if len(missing) < len(keys):  # refresh the pages already held (the usual store has none)
            self.host.touch([k for k, p in zip(keys, found) if p is not None])
        self._m["pages_deduplicated"] += len(keys) - len(missing)
        if not missing:
            h.done = h.ok = True
            return h
        mkeys = [keys[i] for i in missing]
        # protect: the tier builds its set only when it has to evict (after a 128 MiB copy
        # the cache is cold, and hashing 1,024 keys into a set nobody reads cost ~0.1 ms)
        pages, evicted = self.host.reserve(len(mkeys), protect=keys)
        self.write_back.spill(evicted)
        complete = len(pages) == len(mkeys)
        if not complete:  # the tier is full of protected pages: store what fits, in key order
            self._m["store_pages_short"] += len(mkeys) - len(pages)
            mkeys, missing = mkeys[:len(pages)], missing[:len(pages)]
        if len(missing) == len(dev_pages):  # the usual store: every page new, no gather of the ids
            src = dev_pages
        else:
            src = dev_pages.index_select(0, torch.as_tensor(missing, dtype=torch.long, device=dev_pages.device))
        if len(pages) > 1 and src.device.type == "cpu":
            # any of the reserved rows will do for any page: hand them out in the device pages'
            # order, so the copy kernels (which walk device pages ascending) also write the host
            # rows ascending (page 1, kv128k volume: store 0.67x -> 0.74x of copy_, ad hoc A/B)
            rows = np.empty(len(pages), dtype=np.int64)
            rows[np.argsort(src.numpy(), kind="stable")] = np.sort(np.asarray(pages, dtype=np.int64))
            pages = rows.tolist()
        h._work = (mkeys, pages, src, complete)
        if self.defer_stores:
            self._queue.append(h)
        else:
            self._run_store(h)
        return h

    def _run_store(self, h: StoreHandle) -> None:
        mkeys, pages, dev_pages, complete = h._work
        h._work = None
        sums = None
        try:
            if pages and self._fused_store():
                sums = self.executor.gather_hashed(dev_pages, self.host.words, pages)
            elif pages:
                self.executor.device_to_host(dev_pages, self.host.words, pages)
        except Exception as e:  # noqa: BLE001
            logger.exception("flexflow: store of %d pages failed", len(pages))
            self.host.release(pages)
            self._store_failed(h, str(e))
            return
        if sums is not None:
            self.host.commit(mkeys, pages, sums=sums)
        else:
            self.host.commit(mkeys, pages)
        self._m["pages_stored"] += len(pages)
        h.stored_pages = len(pages)
        h.done, h.ok = True, complete
        if pages:
            self.write_back.write_through(mkeys, pages)

    def _store_failed(self, h: StoreHandle, why: str) -> None:
        self._m["store_failures"] += 1
        logger.warning("flexflow: host store failed (%s); the pages stay device-only", why)
        h.done, h.ok = True, False

    # ----------------------------------------------------------------- prefetch
    def prefetch(self, keys: Optional[Sequence[bytes]] = None, *, chain=None) -> PrefetchHandle:
        """Fetch, in the background, the leading pages of `keys` the deeper tiers hold into the
        host tier (keys: a request's pages past its host hit). Poll until `handle.done`.
        `chain=(prev, tokens, pages, bigram)` instead of keys: the worker hashes the pages itself,
        in growing chunks, and stops at the first one no deeper tier holds (a miss costs the
        scheduler thread no hashing). The work itself: connector/prefetch.py."""
        return self.prefetcher.start(keys, chain)

    def deep_tiers_may_hold(self, key: bytes) -> bool:
        """Could a deeper tier hold the page `key`? Answered from the tiers' local state, no I/O
        (the scheduler thread asks before it starts a prefetch and holds a request for it). False
        only when every tier can tell and none holds it: a request whose next page is new KV (a
        fresh prompt, a new user turn) is then scheduled at once instead of waiting for a worker
        to find nothing. A tier that cannot tell cheaply (remote) answers maybe."""
        for t in self.tiers:
            try:
                held = t.holds_locally([key])
            except Exception:  # noqa: BLE001 - unsure: let the prefetch look
                return True
            if held is None or held[0]:
                return True
        return False

    def prefetch_worth(self, pages: int) -> bool:
        """Is fetching `pages` deep pages estimated faster than prefilling them again? The same rule
        as the inline lookup (FetchCost, opt-in with `transfer.recompute_tokens_per_s`), asked by the
        scheduler thread before it starts a prefetch and holds a request for it: a hold for KV that
        arrives after the forward could have computed it only delays the request. The cheapest tier
        decides; True when the rule is off or nothing was measured yet (its first read measures it)."""
        return self.fetch_cost.worth_fetching_from(self.tiers, pages)

    def land_arrived(self) -> int:
        """A queued request's prefetch budget ran out: settle the pieces that landed and run their
        promotions here, on the owner's thread, instead of waiting for a worker (a few ms per
        32 MiB piece), so the request is admitted with them. Returns the promotions run here."""
        if self._closed:
            return 0
        self._reap()  # delivered pieces -> reserved pages, promotion jobs queued
        n = self.engine.run_urgent("prefetch")
        if n:
            self._m["promote_inline"] += n
            self._reap()  # commit them
        return n

    # ----------------------------------------------------------------- engine jobs
    def _submit(self, job: Job) -> bool:
        ok = self.engine.submit(job)
        if ok and not self.engine.is_async:
            self._reap()  # inline job: settle it now (unpin, count)
        return ok

    def _reap(self) -> int:
        """Settle finished engine jobs on this (the owner's) thread: unpin, count, commit
        prefetched pages. Re-entrant calls (a commit that spills) return at once."""
        if self._reaping:
            return 0
        self._reaping = True
        n = 0
        try:
            while True:
                jobs = self.engine.poll()
                if not jobs:
                    return n
                for job in jobs:
                    n += 1
                    t0 = time.perf_counter()
                    try:
                        self._settle(job)
                    except Exception:  # noqa: BLE001 - bookkeeping of one job must not stop the rest
                        logger.exception("flexflow: settling a %s job failed", job.kind)
                    if self.clock is not None:
                        self.clock.add("settle_" + job.kind, time.perf_counter() - t0)
        finally:
            self._reaping = False

    def _settle(self, job: Job) -> None:
        if job.kind in ("write_through", "spill"):
            self.write_back.settle(job)
        elif job.kind in PREFETCH_JOB_KINDS:
            self.prefetcher.settle(job)
        # "fetch": consumed (or abandoned) by the waiting load

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait for every queued and running engine job and settle them (tests, shutdown paths)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = self.engine.drain(left)
            before = self.engine.c["submitted"]
            self._reap()  # settling may queue a follow-up job (a prefetch's promote): drain that too
            if not ok or self.engine.c["submitted"] == before:
                return ok

    # ----------------------------------------------------------------- async bookkeeping
    def poll(self) -> int:
        """Advance queued stores and settle finished engine jobs; returns how many stores completed."""
        n = 0
        while self._queue:
            self._run_store(self._queue.popleft())
            n += 1
        self._reap()
        return n

    def reset(self) -> None:
        """Cancel queued stores (their slots are about to be reused) and keep the held pages."""
        while self._queue:
            h = self._queue.popleft()
            mkeys, pages, _, _ = h._work
            h._work = None
            self.host.release(pages)
            h.done, h.ok = True, False
            self._m["stores_cancelled"] += 1

    def clear(self) -> None:
        """Forget every held page in every tier (e.g. after a weight update: the KV is stale) and
        rotate the page-key seed, so a tier that keeps its pages can no longer serve them here.
        Queued jobs are cancelled and running ones awaited (bounded by the tiers' own timeouts),
        so no stale page lands in a tier after it was cleared."""
        self.reset()
        self._gen += 1
        # Storage, remote and external stores may not be emptied (another server's copies live
        # there too, or the tier cannot enumerate): new keys from now on, so no page stored before
        # the clear can be found again by this process. Every rank clears on the same weight update.
        self._seed = hashlib.blake2b(self._seed + b"cleared", digest_size=KEY_BYTES).digest()
        self.engine.cancel_queued()
        if not self.engine.drain(timeout=30.0):
            logger.warning("flexflow: transfer jobs still running while the tiers are cleared")
        self._reap()
        self.host.clear()
        for tier in self.tiers:
            try:
                tier.clear()
            except Exception:  # noqa: BLE001
                logger.exception("flexflow: clearing tier %s failed", tier.name)

    def close(self) -> None:
        """Idempotent: cancel queued work, stop the agent, close tiers, drop the host buffer."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        self.engine.close()
        self._reap()
        if self._own_agent:
            self.agent.stop()
        for tier in self.tiers:
            _close_tier(tier)
        self.host.close()
        self.staging.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------- helpers
    def _device_pages(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        """Page ids of `n` whole, page-aligned pages of device slots (raises if they are not)."""
        ps = self.page_size
        slots = torch.as_tensor(slots).to(torch.long)
        if slots.numel() != n * ps:
            raise ValueError(f"{slots.numel()} device slots for {n} pages of {ps} tokens")
        if ps == 1:
            pages = slots
        else:
            grid = slots.view(n, ps)
            pages = torch.div(grid[:, 0], ps, rounding_mode="floor")
            expect = pages.unsqueeze(1) * ps + torch.arange(ps, device=slots.device)
            if not torch.equal(grid, expect):
                raise ValueError("device slots are not whole page-aligned pages")
        if n:
            lo, hi = torch.aminmax(pages)  # one pass
            if int(lo) < 0 or int(hi) >= self.layout.num_device_pages:
                raise ValueError("device slot outside the KV pool")
        return pages

    def metrics(self) -> Dict[str, Any]:
        m = dict(self._m)
        ps, pb = self.page_size, self.layout.page_nbytes
        m.update(
            tokens_loaded=m["pages_loaded"] * ps, bytes_loaded=m["pages_loaded"] * pb,
            tokens_stored=m["pages_stored"] * ps, bytes_stored=m["pages_stored"] * pb,
            hits_by_tier={k: v * ps for k, v in self._hits_by_tier.items()},  # tokens loaded per tier
            bandwidth_by_path_type=self.executor.bandwidth_by_type(),
            host_tier=self.host.stats(),
            deeper_tiers={t.name: _safe_stats(t) for t in self.tiers},
            queued_stores=len(self._queue),
            transfer=self.engine.stats(), prefetch_policy=self.prefetch_policy, staging=self.staging.stats(),
            page_size=ps, page_nbytes=pb, device_node=self.device_node, host_node=self.host_node,
            selector_impl=self.selector.impl,
        )
        return m


def _pick(pages: torch.Tensor, idx: List[int], n: int) -> torch.Tensor:
    if len(idx) == n:
        return pages
    return pages.index_select(0, torch.as_tensor(idx, dtype=torch.long, device=pages.device))


def _safe_stats(tier) -> dict:
    try:
        return dict(tier.stats())
    except Exception:  # noqa: BLE001
        return {"error": "stats unavailable"}


def build_deeper_tiers(cfg: FlexFlowConfig, fingerprint: dict, page_nbytes: int,
                       rank_dir: str = "rank0") -> List[KVTier]:
    """The deep tiers the config names, below the host tier, in this order: `storage_tier`,
    `remote_tier` (with peers), `hicache_storage`, then `extra_tiers`; each is built by name through the tier registry
    (tiers/registry.py: the section or the entry's options, a TierContext with the fingerprint, page
    size and rank directory) and gets the section's or entry's `write_through`.

    A tier that cannot start (directory locked by another process, NIXL missing, no peer reachable,
    an unknown name, a factory that fails or a name another tier already has) is logged in one line
    and left out: the server still serves, with fewer tiers."""
    ctx = TierContext(fingerprint=dict(fingerprint), fingerprint_text=TierContext.fingerprint_text_of(fingerprint),
                      page_nbytes=page_nbytes, rank_dir=rank_dir)
    specs = []  # (name, options, write_through, factory)
    if cfg.storage_tier.enabled:
        specs.append(("storage", asdict(cfg.storage_tier), cfg.storage_tier.write_through, None))
    if cfg.remote_tier.enabled and cfg.remote_tier.peers:
        specs.append(("remote", asdict(cfg.remote_tier), cfg.remote_tier.write_through, None))
    if cfg.hicache_storage.enabled:  # SGLang's HiCache backends: registered by backend/plugin.py (SGLang glue)
        specs.append(("hicache_storage", asdict(cfg.hicache_storage), cfg.hicache_storage.write_through, None))
    specs += [(e.name, e.options, e.write_through, e.factory) for e in cfg.extra_tiers]
    out: List[KVTier] = []
    for name, options, write_through, factory in specs:
        try:
            tier = create_tier(name, ctx, MappingProxyType(dict(options)), factory=factory)
        except Exception as e:  # noqa: BLE001 - a tier failing to start must not stop serving
            logger.warning("flexflow: deep tier %r left out, serving without it: %s", name, e)
            continue
        if any(t.name == tier.name for t in out):
            logger.warning("flexflow: deep tier %r left out, serving without it: another deep tier is named "
                           "%r (metrics and hit counts are per name)", name, tier.name)
            _close_tier(tier)
            continue
        tier.write_through = write_through
        out.append(tier)
    return out


def _close_tier(tier: KVTier) -> None:
    try:
        tier.close()
    except Exception:  # noqa: BLE001
        logger.exception("flexflow: closing tier %s failed", tier.name)


def _describe_tier(tier) -> str:
    try:
        st = tier.stats()
    except Exception:  # noqa: BLE001
        st = {}
    extra = [f"{k}={st[k]}" for k in ("backend", "path", "capacity_bytes", "peers") if k in st]
    return f"{tier.name}({', '.join(extra)})" if extra else tier.name
