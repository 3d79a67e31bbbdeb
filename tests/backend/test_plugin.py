"""Registration through the real entry point, the factory's delegation/refusal rules, scheduler hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")

import ffcache_env as E  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _republish_defaults():
    yield
    E.publish_server_args()  # later tests expect the default published arguments


def ctx_for(params, **kw):
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.runtime_context import get_context

    fields = dict(server_args=get_context().server_args if hasattr(get_context(), "server_args") else None,
                  params=params, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
                  disable_radix_cache=False, tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    fields.update(kw)
    return TreeCacheBuildContext(**fields)


@pytest.fixture
def flexflow_config(tmp_path, monkeypatch):
    path = tmp_path / "ff.yaml"
    path.write_text("topology: {source: mock, mock: single}\nmonitor: {source: mock}\n"
                    "host_tier: {capacity_tokens: 256, pin_memory: never}\n")
    monkeypatch.setenv("FLEXFLOW_CONFIG", str(path))
    return path


def build(params_kw=None, **ctx_kw):
    from sglang.srt.mem_cache.registry import create_tree_cache

    from flexflow_sglang.backend.plugin import register
    register()
    _, _, _, params = E.make_pools(params_kw=params_kw)
    cache = create_tree_cache(ctx_for(params, **ctx_kw))
    return cache


def test_entry_point_declared():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "flexflow"]
    assert eps and eps[0].value == "flexflow_sglang.backend.plugin:register"


def test_load_plugins_registers_backend_and_hooks():
    """A fresh interpreter, as a spawned scheduler is: SGLang's loader finds and runs the entry point."""
    code = textwrap.dedent("""
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.mem_cache.registry import registered_radix_cache_backends
        load_plugins(); load_plugins()
        from flexflow_sglang.backend import plugin
        plugin.register()  # idempotent: a duplicate registration would raise
        assert "flexflow" in registered_radix_cache_backends(), registered_radix_cache_backends()
        assert plugin.TICK_TARGET in HookRegistry._patched and plugin.WEIGHT_UPDATE_TARGET in HookRegistry._patched
        assert plugin.ARRIVAL_TARGET in HookRegistry._patched and plugin.ADMIT_TARGET in HookRegistry._patched
        from sglang.srt.managers.scheduler import Scheduler
        assert Scheduler._process_hicache_events is not None
        print("OK")
    """)
    env = dict(os.environ, SGLANG_PLUGINS="flexflow")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_factory_builds_flexflow_cache(flexflow_config):
    from flexflow_sglang.backend.cache import FlexFlowRadixCache
    cache = build()
    try:
        assert isinstance(cache, FlexFlowRadixCache) and cache.is_flexflow
        assert cache.connector.host.capacity_pages == 256
        assert cache.cache_controller is None
    finally:
        cache.release_host_resources()


def test_factory_delegates_when_radix_cache_disabled(flexflow_config, caplog):
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    with caplog.at_level("INFO", logger="flexflow_sglang.backend.plugin"):
        cache = build(disable_radix_cache=True)
    assert isinstance(cache, UnifiedRadixCache)
    assert "delegating" in caplog.text and "disabled" in caplog.text


@pytest.fixture
def default_factory(monkeypatch):
    """Stand-in for SGLang's default chain (imported by the factory at call time)."""
    import sglang.srt.mem_cache.registry as reg
    calls = []
    monkeypatch.setattr(reg, "default_radix_cache_factory", lambda ctx: calls.append(ctx) or "default")
    return calls


@pytest.mark.parametrize("kw,why", [(dict(is_dsa=True), "sparse"), (dict(is_hybrid_swa=True), "sliding"),
                                    (dict(is_hybrid_ssm=True), "Mamba")])
def test_factory_delegates_for_models(flexflow_config, default_factory, caplog, kw, why):
    from flexflow_sglang.backend import plugin
    _, _, _, params = E.make_pools()
    with caplog.at_level("INFO", logger="flexflow_sglang.backend.plugin"):
        assert plugin.build_tree_cache(ctx_for(params, **kw)) == "default"
    assert len(default_factory) == 1 and why in caplog.text


def test_factory_serves_pipeline_parallelism(flexflow_config, default_factory):
    """PP > 1 is served (issue 17): each stage builds FlexFlowRadixCache over its own layers, and
    its connector's key fingerprint names the stage, so stages never share keys."""
    from flexflow_sglang.backend import plugin
    from flexflow_sglang.backend.cache import FlexFlowRadixCache
    seeds = []
    for rank in (0, 1):
        _, _, _, params = E.make_pools(params_kw=dict(pp_size=2, pp_rank=rank))
        cache = plugin.build_tree_cache(ctx_for(params))
        try:
            assert isinstance(cache, FlexFlowRadixCache) and not default_factory
            seeds.append(cache.connector.namespace_seed())
        finally:
            cache.release_host_resources()
    assert seeds[0] != seeds[1]


def test_factory_delegates_for_unsupported_pool(flexflow_config, default_factory, caplog):
    from flexflow_sglang.backend import plugin
    _, _, _, params = E.make_pools()

    class OddPool:
        pass
    params.token_to_kv_pool_allocator = type("A", (), {"get_kvcache": lambda self: OddPool()})()
    with caplog.at_level("INFO", logger="flexflow_sglang.backend.plugin"):
        assert plugin.build_tree_cache(ctx_for(params)) == "default"
    assert "OddPool" in caplog.text


def test_factory_delegates_when_host_tier_disabled(tmp_path, monkeypatch):
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    path = tmp_path / "off.yaml"
    path.write_text("topology: {source: mock}\nmonitor: {source: mock}\nhost_tier: {enabled: false}\n")
    monkeypatch.setenv("FLEXFLOW_CONFIG", str(path))
    assert isinstance(build(), UnifiedRadixCache)


@pytest.mark.parametrize("published,ctx_kw,flag", [
    ({}, dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(enable_hierarchical_cache=True), {}, "--enable-hierarchical-cache"),
    (dict(hicache_storage_backend="file"), {}, "--hicache-storage-backend"),
    (dict(enable_lmcache=True), {}, "--enable-lmcache"),
    (dict(enable_flexkv=True), {}, "--enable-flexkv"),
    (dict(enable_session_radix_cache=True), {}, "--enable-session-radix-cache"),
    (dict(radix_eviction_policy="tlru"), {}, "tlru"),
])
def test_factory_refuses_conflicting_flags(flexflow_config, published, ctx_kw, flag):
    E.publish_server_args(**published)
    with pytest.raises(ValueError, match="flexflow") as err:
        build(**ctx_kw)
    assert flag in str(err.value)


def test_refusal_wins_over_delegation(flexflow_config):
    with pytest.raises(ValueError, match="hierarchical"):
        build(enable_hierarchical_cache=True, disable_radix_cache=True)


def test_tick_and_weight_update_hooks():
    from flexflow_sglang.backend.plugin import _clear_host_after_weight_update, _flexflow_tick
    env = E.make_env()
    try:
        ids = list(range(30))
        E.serve(env, "a", ids)

        class Sched:
            tree_cache = env.tree
        polls = []
        env.tree.poll = lambda: polls.append(1)
        assert _flexflow_tick(Sched()) is None and polls == [1]
        assert _flexflow_tick(type("Other", (), {"tree_cache": object()})()) is None

        class Manager:
            scheduler = Sched()
        del env.tree.poll
        assert env.connector.lookup(env.connector.page_keys(ids)) == len(ids)
        assert _clear_host_after_weight_update(Manager()) is None
        assert env.connector.lookup(env.connector.page_keys(ids)) == 0
    finally:
        env.close()
