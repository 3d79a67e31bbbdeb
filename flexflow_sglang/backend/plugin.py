"""SGLang plugin entry point: registers the `flexflow` radix-cache backend and its scheduler hooks.

`register()` is the `sglang.srt.plugins` entry point (pyproject). SGLang's `load_plugins()` runs it
once in every process (launcher, each scheduler, detokenizer), so it is idempotent and cheap: SGLang
is imported inside the functions, and the connector is only built by the factory, in schedulers.

The factory, per the backend contract (docs: SGLang 0.5.23 radix-cache contract):
- raises for configurations whose scheduler paths would call into a HiCache-shaped cache
  (--enable-hierarchical-cache, --hicache-storage-backend, --enable-lmcache, --enable-flexkv) or
  that need the unified tree (--enable-session-radix-cache, --radix-eviction-policy tlru,
  --enable-streaming-session);
- delegates, with a log line saying why, to SGLang's default chain where a full-attention
  RadixCache with a host tier does not apply (radix cache disabled, SWA / SSM / DSA models, PD
  decode, KV pools the connector cannot move, host tier switched off);
- otherwise builds FlexFlowRadixCache with a connector configured from $FLEXFLOW_CONFIG. That
  includes pipeline parallelism: each stage's cache stores and loads its own layers (the key
  fingerprint names the stage and its first layer) in its own shared-memory host tier, and stage 0
  checks and pins every later stage's pages before it decides a host hit (pp_stages).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "flexflow"

TICK_TARGET = "sglang.srt.managers.scheduler.Scheduler._process_hicache_events"
#: called when a request is queued (arrival, retraction): SGLang's own storage prefetch does nothing
#: unless --hicache-storage-backend is set; flexflow starts its prefetch after it
ARRIVAL_TARGET = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"
#: per candidate request in get_new_batch_prefill; a request whose prefetch must finish first is
#: skipped (stays queued), as SGLang does for check_prefetch_progress behind enable_hicache_storage
ADMIT_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
#: SGLang found no batch to run; flexflow sleeps on its engine while a held prefetch runs (idle_wait)
IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"
WEIGHT_UPDATE_TARGET = ("sglang.srt.managers.scheduler_components.weight_updater."
                        "SchedulerWeightUpdaterManager.flush_cache_after_weight_update")

_hooks_registered = False


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:  # a duplicate registration raises ValueError
        register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    register_tiers()
    _register_hooks()
    # --attention-backend flexflow_sdpa (CPU SDPA that skips the cached prefix's queries); plain
    # servers get it too, so benchmarks compare like with like
    from .prefix_sdpa import register_attention_backend
    register_attention_backend()


def register_tiers() -> None:
    """Deep tiers that are SGLang glue (they import SGLang, so tiers/ cannot register them):
    `hicache_storage` wraps SGLang's HiCache storage backends (backend/hicache_tier.py). Lazy and
    idempotent: the module is imported when a config names the tier."""
    from ..tiers.registry import register_tier
    register_tier("hicache_storage", "flexflow_sglang.backend.hicache_tier:hicache_factory")


def _register_hooks() -> None:
    global _hooks_registered
    if _hooks_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # the closest thing to check_hicache_events for a registered backend: start of every
    # get_next_batch_to_run, on every rank, before rank-local decisions (collectives are safe)
    HookRegistry.register(TICK_TARGET, _flexflow_tick, HookType.BEFORE)
    # prefetch on arrival (transfer engine), and hold the request until the policy lets it run
    HookRegistry.register(ARRIVAL_TARGET, _flexflow_arrival, HookType.AROUND)
    HookRegistry.register(ADMIT_TARGET, _flexflow_admit, HookType.AROUND)
    HookRegistry.register(IDLE_TARGET, _flexflow_idle, HookType.AFTER)
    # new weights make every host copy stale
    HookRegistry.register(WEIGHT_UPDATE_TARGET, _clear_host_after_weight_update, HookType.BEFORE)
    # PD: KV managers of --disaggregation-transfer-backend nixl (active only with pd.enabled)
    from ..pd.hooks import register_pd_hooks
    register_pd_hooks(HookRegistry, HookType)
    _hooks_registered = True


def _flexflow_tick(scheduler, *args, **kwargs):
    tc = getattr(scheduler, "tree_cache", None)
    if getattr(tc, "is_flexflow", False):
        tc.tick()
    return None  # keep the original arguments


def _flexflow_idle(result, scheduler, *args, **kwargs):
    tc = getattr(scheduler, "tree_cache", None)
    if getattr(tc, "is_flexflow", False):
        tc.idle_wait(scheduler)
    return None  # keep the original result


def _flexflow_arrival(original, scheduler, req, *args, **kwargs):
    out = original(scheduler, req, *args, **kwargs)
    tc = getattr(scheduler, "tree_cache", None)
    if getattr(tc, "is_flexflow", False):
        tc.prefetch_on_arrival(req)  # never raises: the entry is made on every rank
    return out


def _flexflow_admit(original, adder, req, *args, **kwargs):
    tc = getattr(adder, "tree_cache", None)
    if getattr(tc, "is_flexflow", False) and tc.prefetch_holds(req):
        from sglang.srt.managers.schedule_policy import AddReqResult
        return AddReqResult.CONTINUE  # skip this one, keep looking at the queue
    return original(adder, req, *args, **kwargs)


def _clear_host_after_weight_update(manager, *args, **kwargs):
    tc = getattr(getattr(manager, "scheduler", None), "tree_cache", None)
    if getattr(tc, "is_flexflow", False):
        tc.invalidate_host_tiers("model weights updated")
    return None


def _refusal(ctx) -> str:
    """Non-empty: why this configuration cannot run with --radix-cache-backend flexflow."""
    from sglang.srt.runtime_context import get_memory, get_serving

    mem = get_memory()
    flags = []
    if ctx.enable_hierarchical_cache or getattr(mem, "enable_hierarchical_cache", False):
        flags.append("--enable-hierarchical-cache")
    if getattr(mem, "hicache_storage_backend", None):
        flags.append("--hicache-storage-backend")
    if getattr(mem, "enable_lmcache", False):
        flags.append("--enable-lmcache")
    if getattr(mem, "enable_flexkv", False):
        flags.append("--enable-flexkv")
    if flags:
        return (f"--radix-cache-backend=flexflow owns the host tier and cannot run with {', '.join(flags)}: "
                "drop those flags (flexflow's host/storage tiers are configured in $FLEXFLOW_CONFIG)")
    unified = []
    if getattr(mem, "enable_session_radix_cache", False):
        unified.append("--enable-session-radix-cache")
    if getattr(mem, "radix_eviction_policy", "lru") == "tlru":
        unified.append("--radix-eviction-policy tlru")
    try:
        if getattr(get_serving(), "enable_streaming_session", False):
            unified.append("--enable-streaming-session")
    except Exception:  # noqa: BLE001 - no serving section published (tests)
        pass
    if unified:
        return (f"--radix-cache-backend=flexflow is a RadixCache subclass; {', '.join(unified)} "
                "need SGLang's UnifiedRadixCache: drop them or drop --radix-cache-backend")
    return ""


def _delegation(ctx) -> str:
    """Non-empty: why SGLang's default cache should serve this configuration instead."""
    from sglang.srt.runtime_context import get_disagg

    from ..connector.layout import supported_pool

    if ctx.disable_radix_cache:
        return "the radix cache is disabled (--disable-radix-cache, PD decode, or the model forbids it)"
    if ctx.is_hybrid_swa:
        return "hybrid sliding-window model (SWA KV is not a full-attention prefix)"
    if ctx.is_hybrid_ssm:
        return "model with Mamba/linear-attention state"
    if ctx.is_dsa:
        return "DeepSeek sparse-attention pool (indexer pages are not moved)"
    try:
        if get_disagg().disaggregation_mode == "decode":
            return "PD decode reuses device prefixes only"
    except Exception:  # noqa: BLE001 - no disaggregation section published (tests)
        pass
    params = ctx.params
    if hasattr(params.req_to_token_pool, "req_to_c128_sidecar"):
        return "request pool with C128 sidecar pages"
    ok, why = supported_pool(params.token_to_kv_pool_allocator.get_kvcache())
    if not ok:
        return why
    return ""


def build_tree_cache(ctx):
    """The `flexflow` RadixCacheFactory (TreeCacheBuildContext -> BasePrefixCache)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    why = _refusal(ctx)
    if why:
        raise ValueError(why)
    why = _delegation(ctx)
    if why:
        logger.info("flexflow: delegating to SGLang's default radix cache: %s", why)
        return default_radix_cache_factory(ctx)

    from ..config import load_config

    cfg = load_config()
    if not cfg.host_tier.enabled:
        logger.info("flexflow: delegating to SGLang's default radix cache: host_tier.enabled is false in %s",
                    cfg.path or "the default config")
        return default_radix_cache_factory(ctx)
    logging.getLogger("flexflow_sglang").setLevel(cfg.log_level)
    if getattr(ctx.params, "pp_size", 1) > 1 and not cfg.host_tier.shared:
        # stage 0 checks and pins the later stages' pages in their shared-memory tiers (pp_stages)
        from dataclasses import replace
        cfg = replace(cfg, host_tier=replace(cfg.host_tier, shared=True))
        logger.info("flexflow: pipeline parallelism: host_tier.shared enabled (one segment per stage)")

    from .cache import FlexFlowRadixCache

    return FlexFlowRadixCache(ctx.params, ctx=ctx, config=cfg)
