"""FlexFlowRadixCache on the real SGLang 0.5.23 pools and tree (CPU): load-back, stores, eviction,
fault injection, invariants. Every served request checks that its whole prefix (device + loaded)
holds exactly the KV a recomputation writes."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from ffcache_env import fail_moves, serve  # noqa: E402


def all_nodes(tree):
    out, stack = [], list(tree.root_node.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def assert_quiescent(env):
    tree = env.tree
    assert env.idle_ok()
    assert tree.root_node.lock_ref == 1
    assert tree.protected_size() == 0
    assert all(x.lock_ref == 0 for x in all_nodes(tree))
    assert sum(len(x.value) for x in all_nodes(tree)) == tree.evictable_size()


def evict_all(env):
    env.tree.evict(EvictParams(num_tokens=10**9))
    assert env.tree.evictable_size() == 0 and env.alloc.available_size() == env.size


# ---------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("ps", [1, 4])
def test_contract_skeleton(envs, ps):
    env = envs(page_size=ps)
    ids = list(range(100, 100 + 4 * ps + 1))
    a = serve(env, "a", ids)
    assert a.prefix_len == 0 and a.kv_ok
    evict_all(env)
    b = serve(env, "b", ids + [7, 7])
    assert b.cached_device == 0 and b.host_hit == b.loaded == len(ids) // ps * ps and b.kv_ok  # whole pages
    c = serve(env, "c", ids + [7, 8])
    assert c.host_hit == 0 and c.cached_device >= b.loaded and c.kv_ok
    assert_quiescent(env)
    m = env.tree.metrics()
    assert m["load_backs"] == 1 and m["load_back_tokens"] == b.loaded
    assert m["connector"]["tokens_loaded"] == b.loaded


def test_mla_pool(envs):
    env = envs(mla=True, dtype=torch.bfloat16)
    ids = list(range(10, 30))
    serve(env, "a", ids)
    evict_all(env)
    b = serve(env, "b", ids + [1])
    assert b.loaded == len(ids) and b.kv_ok


def test_partial_device_prefix_then_host_tail(envs):
    env = envs(page_size=2, size=64)
    base = list(range(200, 220))
    serve(env, "a", base)
    serve(env, "a2", base[:10] + list(range(500, 510)))  # splits a's node at 10
    # evict the least recent leaf only (a's tail): the device keeps the stem, the host has the tail
    assert env.tree.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 10
    r = serve(env, "b", base + [1, 2])
    assert r.kv_ok and r.prefix_len == len(base)
    assert r.cached_device > 0 and r.loaded > 0 and r.cached_device + r.loaded == len(base)


@pytest.mark.parametrize("ps", [1, 2])
def test_node_key_cache_matches_page_keys_after_splits(envs, ps):
    env = envs(page_size=ps)
    a = list(range(100, 120))
    a2 = a[:10] + list(range(900, 910))
    serve(env, "a", a)
    tree, conn = env.tree, env.connector
    tree._path_keys(tree.match_prefix(MatchPrefixParams(key=RadixKey(__import__("array").array("q", a))))
                    .last_device_node)  # cache keys on the unsplit node
    serve(env, "a2", a2)  # splits it
    for ids in (a, a2, a[:10]):
        node = tree.match_prefix(MatchPrefixParams(key=RadixKey(__import__("array").array("q", ids)))).last_device_node
        assert tree._path_keys(node) == conn.page_keys(ids), ids


def test_eagle_bigram_keys(envs):
    env = envs(params_kw=dict(is_eagle=True))
    a = list(range(40, 60))
    serve(env, "a", a)
    evict_all(env)
    b = serve(env, "b", a + [1, 2])
    assert b.loaded > 0 and b.kv_ok
    assert_quiescent(env)


def test_host_hit_respects_limit_and_req_none(envs):
    env = envs()
    ids = list(range(40, 60))
    serve(env, "a", ids)
    evict_all(env)
    tree = env.tree
    before = tree.connector.metrics()["lookups"]
    res = tree.match_prefix(MatchPrefixParams(key=RadixKey(__import__("array").array("q", ids))))
    assert res.host_hit_length == 0  # req=None: never a tier lookup
    assert tree.connector.metrics()["lookups"] == before
    b = serve(env, "b", ids)  # same prompt: the key limit is len-1, the last token is recomputed
    assert b.loaded == len(ids) - 1 and b.kv_ok


def test_namespaces_do_not_mix(envs):
    env = envs()
    ids = list(range(70, 90))
    serve(env, "a", ids, extra_key="lora-1")
    evict_all(env)
    b = serve(env, "b", ids + [3], extra_key="lora-2")
    assert b.host_hit == 0 and b.kv_ok
    c = serve(env, "c", ids + [3], extra_key="lora-1")
    assert c.loaded == len(ids) and c.kv_ok


@pytest.mark.parametrize("ps,policy", [(1, "write_through"), (4, "write_through"), (1, "on_evict"),
                                       (2, "on_evict")])
def test_random_prefix_workload(envs, ps, policy):
    """Random prompts over a few shared stems, a small device pool (constant eviction): every prefix
    served (device or loaded from host) equals recomputation; invariants hold after each request."""
    rng = random.Random(1234 + ps)
    env = envs(page_size=ps, size=96, host_tokens=600, policy=policy)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(8, 30))] for _ in range(4)]
    loaded = 0
    for i in range(40):
        stem = rng.choice(stems)
        cut = rng.randrange(len(stem) // 2, len(stem) + 1)
        ids = stem[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        r = serve(env, f"r{i}", ids)
        assert r.kv_ok, f"request {i}: prefix KV differs from recomputation"
        loaded += r.loaded
        if rng.random() < 0.3:
            env.tree.evict(EvictParams(num_tokens=rng.randrange(1, 60)))
            assert env.idle_ok()
    assert loaded > 0
    assert_quiescent(env)
    m = env.tree.metrics()
    assert m["load_back_failures"] == 0 and m["connector"]["checksum_failures"] == 0
    assert m["connector"]["store_failures"] == 0 and m["connector"]["load_failures"] == 0


def test_on_evict_stores_victims_only_at_eviction(envs):
    env = envs(policy="on_evict")
    ids = list(range(300, 320))
    serve(env, "a", ids)
    assert env.tree.connector.metrics()["pages_stored"] == 0  # nothing stored at finish
    evict_all(env)
    assert env.tree.connector.metrics()["pages_stored"] == len(ids)
    b = serve(env, "b", ids + [5])
    assert b.loaded == len(ids) and b.kv_ok


def test_on_evict_stores_split_nodes_completely(envs):
    env = envs(policy="on_evict", page_size=2)
    a = list(range(100, 120))
    a2 = a[:10] + list(range(900, 910))
    serve(env, "a", a)
    serve(env, "a2", a2)  # the stem [0, 10) becomes a parent of both tails
    evict_all(env)  # children first, then the stem, in one call
    conn = env.connector
    assert conn.lookup(conn.page_keys(a)) == 10 and conn.lookup(conn.page_keys(a2)) == 10
    r = serve(env, "b", a2 + [1, 2])
    assert r.loaded == 20 and r.kv_ok


@pytest.mark.parametrize("policy", ["write_through", "on_evict"])
def test_reset_keeps_host_copies(envs, policy):
    env = envs(policy=policy)
    ids = list(range(400, 430))
    serve(env, "a", ids)
    env.tree.reset()  # Scheduler.flush_cache: tree reset, then the pools are cleared
    env.req_pool.clear()
    env.alloc.clear()
    assert env.idle_ok()
    b = serve(env, "b", ids + [1])
    assert b.loaded == len(ids) and b.kv_ok


def test_deeper_tier_hits_report_storage(envs):
    from flexflow_sglang.connector import InMemoryTier
    tier = InMemoryTier("storage")
    env = envs(host_tokens=8, tiers=[tier])
    a = list(range(10, 18))
    serve(env, "a", a)
    serve(env, "x", list(range(50, 58)))  # the 8-page host tier spills a's pages to the deeper tier
    evict_all(env)
    assert env.connector.drain(5)  # spills are transfer-engine jobs
    assert tier.puts == 8
    r = serve(env, "b", a + [1])
    assert r.loaded == len(a) and r.kv_ok and r.storage_hit == len(a)
    assert env.tree.metrics()["storage_hit_tokens"] == len(a)
    assert env.connector.metrics()["hits_by_tier"]["storage"] == len(a)
    assert_quiescent(env)


def test_invalidate_host_tiers(envs):
    env = envs()
    ids = list(range(10, 40))
    serve(env, "a", ids)
    evict_all(env)
    env.tree.invalidate_host_tiers("test")
    b = serve(env, "b", ids + [1])
    assert b.host_hit == 0 and b.kv_ok


def test_stale_promise_and_missing_request(envs):
    env = envs()
    ids = list(range(1, 21))
    serve(env, "a", ids)
    evict_all(env)
    tree = env.tree
    assert tree.init_load_back(InitLoadBackParams(best_match_node=tree.root_node, host_hit_length=4)) \
        == (0, tree.root_node)
    assert_quiescent(env)


# ---------------------------------------------------------------------------------------- fault injection
def test_store_failure_keeps_invariants(envs, monkeypatch):
    env = envs()

    fail_moves(monkeypatch, env.connector.executor, "d2h", "injected D2H failure")
    ids = list(range(50, 70))
    serve(env, "a", ids)
    evict_all(env)
    b = serve(env, "b", ids + [1])
    assert b.host_hit == 0 and b.kv_ok
    assert env.connector.metrics()["store_failures"] >= 1
    assert_quiescent(env)


@pytest.mark.parametrize("ps", [1, 4])
def test_load_failure_is_a_miss_and_frees_slots(envs, monkeypatch, ps):
    env = envs(page_size=ps, layerwise=False)  # the whole-load path (layer-wise: test_layerwise.py)
    ids = list(range(80, 80 + 6 * ps))
    serve(env, "a", ids)
    evict_all(env)

    fail_moves(monkeypatch, env.connector.executor, "h2d", "injected H2D failure")
    b = serve(env, "b", ids + [1] * ps)
    assert b.host_hit > 0 and b.loaded == 0 and b.prefix_len == 0 and b.kv_ok
    assert env.tree.metrics()["load_back_failures"] == 1
    assert_quiescent(env)


def test_checksum_mismatch_is_a_miss(envs):
    env = envs()
    ids = list(range(90, 110))
    serve(env, "a", ids)
    evict_all(env)
    conn = env.connector
    key = conn.page_keys(ids)[7]
    conn.host.words[conn.host.page_of(key), 0] ^= 1
    b = serve(env, "b", ids + [1])
    assert b.host_hit == len(ids) and b.loaded == 0 and b.kv_ok
    assert conn.metrics()["checksum_failures"] == 1
    c = serve(env, "c", ids + [2])  # the corrupt page is gone: the hit stops before it
    assert c.cached_device == len(ids)  # b recomputed and re-inserted everything
    assert_quiescent(env)


def test_host_tier_full(envs):
    env = envs(host_tokens=8)
    a = list(range(10, 30))
    serve(env, "a", a)
    evict_all(env)
    r = serve(env, "b", a + [1])
    assert r.loaded == 8 and r.kv_ok  # the leading 8 pages fit
    for i in range(5):
        serve(env, f"f{i}", [1000 + 50 * i + j for j in range(12)])
        env.tree.evict(EvictParams(num_tokens=30))
    assert_quiescent(env)
    assert env.connector.host.used_pages <= 8


def test_alloc_failure_during_load_back(envs, monkeypatch):
    env = envs()
    ids = list(range(5, 25))
    serve(env, "a", ids)
    evict_all(env)
    monkeypatch.setattr(env.alloc, "alloc", lambda n: None)
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    req = Req("b", "", array("q", ids + [1]), SamplingParams(max_new_tokens=1))
    req.init_next_round_input(env.tree)
    assert req.host_hit_length == len(ids)
    n, node = env.tree.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                         host_hit_length=req.host_hit_length, req=req))
    assert n == 0 and node is req.best_match_node
    env.tree.on_release(req, checkpointed=False)
    assert_quiescent(env)


# ---------------------------------------------------------------------------------------- async stores
def test_deferred_stores_hold_locks_until_acknowledged(envs):
    env = envs(defer_stores=True)
    tree = env.tree
    ids = list(range(600, 620))
    serve(env, "a", ids, check_idle=False)
    assert tree.protected_size() == len(ids)  # the store still reads these slots
    assert env.idle_ok()  # protected counts: no leak
    assert env.connector.lookup(env.connector.page_keys(ids)) == 0  # not yet on the host
    tree.flush_pending_backups()
    assert tree.protected_size() == 0 and env.connector.lookup(env.connector.page_keys(ids)) == len(ids)
    serve(env, "b", list(range(700, 720)), check_idle=False)
    tree.reset()  # flush with a store in flight: it is finished first, its lock forgotten
    env.req_pool.clear()
    env.alloc.clear()
    assert env.connector.lookup(env.connector.page_keys(list(range(700, 720)))) == 20
    assert_quiescent(env)
    serve(env, "c", list(range(800, 820)), check_idle=False)
    assert tree.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted == 20  # evict drains first
    assert env.connector.lookup(env.connector.page_keys(list(range(800, 820)))) == 20
    assert_quiescent(env)


def test_release_host_resources_idempotent(envs):
    env = envs()
    serve(env, "a", list(range(20)))
    env.tree.release_host_resources()
    env.tree.release_host_resources()
    assert env.connector.closed
    r = serve(env, "b", list(range(20)) + [1])  # still a plain radix cache afterwards
    assert r.kv_ok and r.host_hit == 0
