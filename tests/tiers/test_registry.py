"""The deep-tier registry (tiers/registry.py) and the connector building its deep tiers through it:
register / create, lazy "module:callable", duplicates, unknown names, failing factories, and a tier
declared only in the config (`extra_tiers` with a factory) that serves write-through and loads."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from flexflow_sglang.config import config_from_dict
from flexflow_sglang.errors import ConfigError
from flexflow_sglang.tiers import InMemoryTier, KVTier, StorageTier
from flexflow_sglang.tiers.registry import TierContext, create_tier, register_tier, registered_tiers

CTX = TierContext(fingerprint={"model": "m"}, fingerprint_text="[('model', 'm')]", page_nbytes=16, rank_dir="rank0")


def uniq(prefix="t"):
    """A tier name no other test registered (the registry is per process)."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def write_module(tmp_path, monkeypatch, body: str) -> str:
    """A fresh importable module in tmp_path (on sys.path); returns its name."""
    name = uniq("fftiermod")
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


# ------------------------------------------------------------------------------------ the ABC
def test_kvtier_is_one_abstract_base_class():
    import flexflow_sglang.connector as conn_pkg
    from flexflow_sglang.tiers.remote import RemoteTier
    assert conn_pkg.KVTier is KVTier and conn_pkg.InMemoryTier is InMemoryTier  # re-exports, not copies
    assert not os.path.exists(os.path.join(os.path.dirname(conn_pkg.__file__), "tiers.py"))
    for cls in (StorageTier, RemoteTier, InMemoryTier):
        assert issubclass(cls, KVTier), cls

    class Half(KVTier):
        def contains_prefix(self, keys):
            return 0
    with pytest.raises(TypeError, match="abstract"):
        Half()
    t = InMemoryTier()
    assert not t.can_route and not t.routes_itself and t.route_with(None, "cpu0") is False
    assert RemoteTier(["127.0.0.1:9"]).can_route  # overrides route_with


def test_routed_remote_tier_selector_never_returns_a_type_it_cannot_execute():
    """Issue 13 item 4: the remote tier's router has no StorageRelay / NVLinkRelay executor, so the
    selector it routes with is told not to return them (it shares the connector's agent)."""
    from flexflow_sglang import NodeAgent, PathSelector, PathType
    from flexflow_sglang.tiers.remote import RemoteTier
    from flexflow_sglang.tiers.routing import UNEXECUTED_TYPES
    from flexflow_sglang.topology import make_mock
    topo = make_mock("cluster2x8x4")
    agent = NodeAgent(topo, source="mock")
    sel = PathSelector(topo, agent)
    t = RemoteTier(["127.0.0.1:9"])
    try:
        assert t.route_with(sel, "n0.cpu0") is True
        rsel = t._router.sel
        assert rsel is not sel and rsel.agent is agent and UNEXECUTED_TYPES <= rsel.exclude_types
        assert PathType.CrossNodeRelay not in rsel.exclude_types and PathType.SplitPath not in rsel.exclude_types
        assert not sel.exclude_types  # the caller's selector is left as it was
    finally:
        t.close()


def test_in_memory_tier_rows_are_uint8_pages():
    t = InMemoryTier(capacity_pages=2)
    keys = [bytes([i]) * 32 for i in range(3)]
    pages = np.arange(48, dtype=np.uint8).reshape(3, 16)
    assert t.put_many(keys[:2], pages[:2]) == 2
    assert t.put_many(keys[2:], pages[2:]) == 1 and t.contains_prefix(keys) == 0  # LRU dropped keys[0]
    out = np.zeros((2, 16), np.uint8)
    assert t.get_many_into(keys[1:], out) == 2 and np.array_equal(out, pages[1:])
    with pytest.raises(ValueError, match="uint8"):
        t.put_many(keys[:1], pages.astype(np.int16))


# ------------------------------------------------------------------------------------ registry
def test_register_and_create_passes_context_and_options():
    name, seen = uniq(), []

    def factory(ctx, options):
        seen.append((ctx, dict(options)))
        return InMemoryTier("", node=options["node"])

    register_tier(name, factory)
    assert name in registered_tiers() and {"storage", "remote", "memory"} <= set(registered_tiers())
    t = create_tier(name, CTX, {"node": "nvme0"})
    assert isinstance(t, InMemoryTier) and t.node == "nvme0"
    assert t.name == name  # an empty name is filled in with the registered one
    assert seen == [(CTX, {"node": "nvme0"})]


def test_module_callable_is_imported_lazily(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, """
        from flexflow_sglang.tiers import InMemoryTier
        class Maker:
            @staticmethod
            def build(ctx, options):
                return InMemoryTier("lazy", capacity_pages=options["capacity_pages"])
    """)
    name = uniq()
    register_tier(name, f"{mod}:Maker.build")
    assert mod not in sys.modules  # registering does not import
    t = create_tier(name, CTX, {"capacity_pages": 3})
    assert mod in sys.modules and t.name == "lazy" and t.capacity_pages == 3


def test_duplicate_name_refused_unless_replace():
    name = uniq()

    def f1(ctx, options):
        return InMemoryTier("one")

    def f2(ctx, options):
        return InMemoryTier("two")

    register_tier(name, f1)
    register_tier(name, f1)  # the same factory again: a no-op
    with pytest.raises(ConfigError, match=f"{name}.*already registered.*replace"):
        register_tier(name, f2)
    assert create_tier(name, CTX, {}).name == "one"
    register_tier(name, f2, replace=True)
    assert create_tier(name, CTX, {}).name == "two"
    with pytest.raises(ConfigError, match="already registered"):
        register_tier("storage", f1)  # built-ins too


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError) as ei:
        create_tier("nosuch_tier", CTX, {})
    msg = str(ei.value)
    assert "'nosuch_tier'" in msg and all(f"'{n}'" in msg for n in ("memory", "remote", "storage"))


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("os.path:no_such_attr", "has no attribute 'no_such_attr'"),
    ("os:sep", "not a callable"),
    ("not a spec", "module.path:callable"),
])
def test_bad_factory_specs(spec, needle):
    with pytest.raises(ConfigError) as ei:
        create_tier("mine", CTX, {}, factory=spec)
    assert "'mine'" in str(ei.value) and needle in str(ei.value)


def test_factory_that_raises_or_returns_no_tier():
    class NotATier:
        closed = False

        def close(self):
            self.closed = True

    made = []

    def boom(ctx, options):
        raise RuntimeError("disk on fire")

    def wrong(ctx, options):
        made.append(NotATier())
        return made[-1]

    with pytest.raises(ConfigError, match="tier 'b' could not start: RuntimeError: disk on fire"):
        create_tier("b", CTX, {}, factory=boom)
    with pytest.raises(ConfigError, match="tier 'w'.*returned a NotATier, not a KVTier"):
        create_tier("w", CTX, {}, factory=wrong)
    assert made[0].closed  # a refused object is closed, not leaked


def test_builtin_memory_and_storage(tmp_path):
    t = create_tier("memory", CTX, {"capacity_pages": 4, "node": "nvme0"})
    assert isinstance(t, InMemoryTier) and (t.name, t.capacity_pages, t.node) == ("memory", 4, "nvme0")
    with pytest.raises(ConfigError, match="tier 'memory'.*capacity_pages = 0"):
        create_tier("memory", CTX, {"capacity_pages": 0})
    with pytest.raises(ConfigError, match="tier 'memory'.*unknown option.*'size'"):
        create_tier("memory", CTX, {"size": 4})
    # storage: the storage_tier keys, checked by the config's rules; one directory per fingerprint and rank
    with pytest.raises(ConfigError, match="tier 'storage'.*storage_tier.capacity_gb"):
        create_tier("storage", CTX, {"path": str(tmp_path / "kv"), "capacity_gb": -1})
    s = create_tier("storage", CTX, {"path": str(tmp_path / "kv"), "capacity_gb": 0.01})
    try:
        assert isinstance(s, StorageTier) and s.node == "nvme0" and s.fingerprint == CTX.fingerprint_text
        parent, leaf = os.path.split(s.path)
        assert leaf == "rank0" and os.path.dirname(parent) == str(tmp_path / "kv")
        assert all(os.stat(d).st_mode & 0o777 == 0o700 for d in (tmp_path / "kv", parent, s.path))
    finally:
        s.close()


# ------------------------------------------------------------------------------------ the connector
torch = pytest.importorskip("torch")


def make_kv(ps=1, size=64):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    kv = MHATokenToKVPool(size=size, page_size=ps, dtype=torch.float16, head_num=2, head_dim=8, layer_num=2,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    g = torch.Generator().manual_seed(5)
    for b in kv.k_buffer + kv.v_buffer:
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return kv


def connector_from_sglang(kv, data: dict):
    """FlexFlowConnector.from_sglang, the serving path: it builds the deep tiers from the config."""
    from flexflow_sglang.connector import FlexFlowConnector
    base = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
            "host_tier": {"capacity_tokens": 32, "pin_memory": "never"}}
    cfg = config_from_dict({**base, **data}, "<test>")
    params = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv), page_size=1,
                             pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    return FlexFlowConnector.from_sglang(params, config=cfg, start_agent=False)


def kv_rows(kv, slots):
    return [b[slots].clone() for b in kv.k_buffer + kv.v_buffer]


TIER_MODULE = """
    from flexflow_sglang.tiers import InMemoryTier

    class RecordingTier(InMemoryTier):
        pass

    def make_tier(ctx, options):
        t = RecordingTier(options.get("label", "mine"), node=options.get("node"))
        t.ctx, t.options = ctx, dict(options)
        return t

    def broken(ctx, options):
        raise OSError("mount gone")
"""


def test_config_declared_tier_gets_write_through_and_serves_a_load(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, TIER_MODULE)
    kv = make_kv()
    c = connector_from_sglang(kv, {"extra_tiers": [{"name": "mine", "factory": f"{mod}:make_tier",
                                                    "options": {"label": "mine", "node": "nvme0"}}]})
    try:
        (tier,) = c.tiers
        assert type(tier).__name__ == "RecordingTier" and tier.write_through
        assert tier.options == {"label": "mine", "node": "nvme0"}
        assert tier.ctx.page_nbytes == c.layout.page_nbytes and tier.ctx.rank_dir == "rank0"
        assert tier.ctx.fingerprint["layers"] == 2 and "layers" in tier.ctx.fingerprint_text
        keys = c.page_keys(list(range(100, 108)))
        src = torch.arange(8, 16)
        want = kv_rows(kv, src)
        assert c.store(keys, src).ok and c.drain(5)
        assert tier.puts == 8 and tier.contains_prefix(keys) == 8  # write-through reached the tier
        host_rows = c.host.words[torch.tensor([c.host.page_of(k) for k in keys])].view(torch.uint8)
        assert torch.equal(torch.stack([torch.from_numpy(tier.pages[k]) for k in keys]), host_rows)
        c.host.discard(keys)  # only the extra tier holds them now
        assert c.lookup(keys, deep=False) == 0 and c.lookup(keys) == 8
        dst = torch.arange(30, 38)
        r = c.load(keys, dst)
        assert r.ok and (r.host_pages, r.deep_pages) == (0, 8) and tier.gets == 8
        assert all(torch.equal(a, b) for a, b in zip(kv_rows(kv, dst), want))
        assert c.metrics()["hits_by_tier"]["mine"] == 8
    finally:
        c.close()
    assert tier.closed


def test_a_tier_that_cannot_start_is_logged_once_and_left_out(tmp_path, monkeypatch, caplog):
    mod = write_module(tmp_path, monkeypatch, TIER_MODULE)
    kv = make_kv()
    with caplog.at_level(logging.WARNING, logger="flexflow_sglang"):
        c = connector_from_sglang(kv, {"extra_tiers": [
            {"name": "flaky", "factory": f"{mod}:broken"},
            {"name": "typo_tier"},
            {"name": "mine", "factory": f"{mod}:make_tier", "write_through": False}]})
    try:
        lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert len(lines) == 2, lines
        assert "'flaky'" in lines[0] and "OSError: mount gone" in lines[0]
        assert "'typo_tier'" in lines[1] and "registered tiers" in lines[1]
        assert [t.name for t in c.tiers] == ["mine"] and not c.tiers[0].write_through
        keys = c.page_keys(list(range(10, 14)))
        assert c.store(keys, torch.arange(4, 8)).ok and c.drain(5)
        assert c.tiers[0].puts == 0  # write_through: false
        assert c.load(keys, torch.arange(40, 44)).ok  # still serving from the host tier
    finally:
        c.close()


def test_deep_tiers_in_config_order(tmp_path, monkeypatch):
    mod = write_module(tmp_path, monkeypatch, TIER_MODULE)
    kv = make_kv()
    c = connector_from_sglang(kv, {
        "storage_tier": {"enabled": True, "path": str(tmp_path / "kv"), "capacity_gb": 0.01},
        "remote_tier": {"enabled": True, "peers": ["127.0.0.1:9"], "timeout_ms": 200},  # nothing listens
        "extra_tiers": [{"name": "memory", "options": {"capacity_pages": 8}},
                        {"name": "dup", "factory": f"{mod}:make_tier", "options": {"label": "memory"}}]})
    try:
        assert [t.name for t in c.tiers] == ["storage", "remote", "memory"]  # "dup" reuses a name: left out
        assert [type(t).__name__ for t in c.tiers] == ["SlabStorageTier", "RemoteTier", "InMemoryTier"]  # the default layout
        assert c.tiers[0].write_through and c.tiers[1].write_through and c.tiers[2].write_through
        assert c.tiers[1].routes_itself  # the connector routed the remote tier, as before
    finally:
        c.close()


def test_connector_refuses_a_tier_that_is_not_a_kvtier():
    from flexflow_sglang.connector import FlexFlowConnector, KVLayout
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"}},
                           "<test>")
    with pytest.raises(TypeError, match="KVTier"):
        FlexFlowConnector(KVLayout.from_pool(make_kv(), 1), cfg, tiers=[object()], start_agent=False)
