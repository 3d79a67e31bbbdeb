"""Prefetch on arrival through the plugin hooks (Scheduler._prefetch_kvcache AROUND, the per-tick
poll, PrefillAdder.add_one_req AROUND) on the real SGLang pools and tree (CPU): policies, rank-local
clocks agreed per tick, aborts, flushes and failures ending as misses, KV checked byte for byte."""

from __future__ import annotations

import threading
import time
from array import array

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

import ffcache_env as E  # noqa: E402
from flexflow_sglang.backend import plugin  # noqa: E402
from flexflow_sglang.config import config_from_dict  # noqa: E402
from flexflow_sglang.connector import FlexFlowConnector, InMemoryTier, KVLayout  # noqa: E402


class GatedTier(InMemoryTier):
    def __init__(self):
        super().__init__(name="storage", node="nvme0")
        self.write_through = True
        self.gate = threading.Event()
        self.gate.set()
        self.pages_read = 0
        self.delay_s = 0.0

    def get_many_into(self, keys, out_u8):
        self.gate.wait(10)
        time.sleep(self.delay_s)
        got = super().get_many_into(keys, out_u8)
        self.pages_read += got
        return got


def make(policy="timeout", base=30.0, per_ki=0.0, host_tokens=256, params_kw=None, recompute_tokens_per_s=0.0):
    from flexflow_sglang.backend.cache import FlexFlowRadixCache
    kv, alloc, req_pool, params = E.make_pools(size=128, params_kw=params_kw)
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": host_tokens, "pin_memory": "never"},
                            "transfer": {"prefetch_policy": policy, "prefetch_timeout_base_s": base,
                                         "prefetch_timeout_per_ki_token_s": per_ki,
                                         "recompute_tokens_per_s": recompute_tokens_per_s}}, "<test>")
    tier = GatedTier()
    conn = FlexFlowConnector(KVLayout.from_pool(kv, 1), cfg, fingerprint={"test": True}, tiers=[tier],
                             start_agent=False)
    env = E.Env(FlexFlowRadixCache(params, connector=conn), kv, alloc, req_pool, 128, 1, conn)
    return env, tier


@pytest.fixture
def envs():
    made = []

    def _make(**kw):
        env, tier = make(**kw)
        made.append((env, tier))
        return env, tier
    yield _make
    for env, tier in made:
        tier.gate.set()
        env.close()


class Sched:
    def __init__(self, tree):
        self.tree_cache = tree


class Adder:
    def __init__(self, tree):
        self.tree_cache = tree


def only_in_tier(env, tier, ids):
    """Serve `ids` once (written through to the tier), then drop every host and device copy."""
    E.serve(env, "warm", ids)
    assert env.connector.drain(5) and tier.contains_prefix(env.connector.page_keys(ids)) == len(ids)
    env.connector.host.clear()
    env.tree.evict(EvictParams(num_tokens=10**6))


def arrive(env, rid, ids):
    req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=1))
    plugin._flexflow_arrival(lambda s, r: None, Sched(env.tree), req)
    return req


def admitted(env, req):
    """What the scheduler's loop does per step: tick, then offer the request to the adder."""
    plugin._flexflow_tick(Sched(env.tree))
    return plugin._flexflow_admit(lambda a, r: "added", Adder(env.tree), req) == "added"


def wait_admitted(env, req, timeout=5.0):
    end = time.monotonic() + timeout
    while not admitted(env, req):
        assert time.monotonic() < end, "request never admitted"
        time.sleep(0.01)


def test_queued_request_loads_from_host_after_prefetch(envs):
    env, tier = envs(policy="timeout")
    ids = list(range(40, 80))
    only_in_tier(env, tier, ids)
    tier.gate.clear()  # a slow link: the request waits in the queue
    req = arrive(env, "b", ids + [1])
    for _ in range(3):
        assert not admitted(env, req)
    assert plugin._flexflow_admit(lambda a, r: "added", Adder(env.tree), req) == AddReqResult.CONTINUE
    lookups = env.connector.metrics()["lookup_pages_deep"]
    tier.gate.set()
    wait_admitted(env, req)
    r = E.serve(env, "b", ids + [1], req=req)
    assert r.loaded == len(ids) and r.kv_ok and r.storage_hit == len(ids)  # reported as storage hits
    m = env.connector.metrics()
    assert m["prefetch_pages"] == len(ids) and m["pages_loaded_deep"] == 0  # a host hit, no deep read inline
    assert m["lookup_pages_deep"] == lookups  # match_prefix never asked the deep tier for this request
    assert env.tree.metrics()["prefetch_holds"] >= 3 and env.tree._prefetch == {}  # released with the request


def test_timeout_policy_admits_after_budget_as_a_miss(envs):
    env, tier = envs(policy="timeout", base=0.1)
    ids = list(range(100, 130))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    req = arrive(env, "b", ids + [1])
    assert not admitted(env, req)
    t0 = time.monotonic()
    wait_admitted(env, req)
    assert time.monotonic() - t0 < 2.0
    r = E.serve(env, "b", ids + [1], req=req)
    assert r.host_hit == 0 and r.kv_ok  # nothing landed in time: recomputed
    assert env.tree.metrics()["prefetch_timeouts"] == 1
    tier.gate.set()
    assert env.connector.drain(5)
    assert env.connector.lookup(env.connector.page_keys(ids), deep=False) == len(ids)  # it still landed


def test_best_effort_never_holds_and_wait_complete_waits(envs):
    env, tier = envs(policy="best_effort")
    ids = list(range(200, 220))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    req = arrive(env, "b", ids + [1])
    assert admitted(env, req)
    tier.gate.set()
    env.connector.drain(5)

    env2, tier2 = envs(policy="wait_complete", base=0.0)
    only_in_tier(env2, tier2, ids)
    tier2.gate.clear()
    req2 = arrive(env2, "c", ids + [1])
    time.sleep(0.1)
    assert not admitted(env2, req2)  # a zero budget does not matter to wait_complete
    tier2.gate.set()
    wait_admitted(env2, req2)
    assert E.serve(env2, "c", ids + [1], req=req2).loaded == len(ids)


def test_abort_flush_and_failure_end_as_misses(envs):
    env, tier = envs()
    ids = list(range(300, 340))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    a = arrive(env, "a", ids + [1])
    env.tree.release_aborted_request(a.cache_request_handle)  # abort while queued
    assert env.tree._prefetch == {} and admitted(env, a)
    b = arrive(env, "b", ids + [2])
    env.tree.reset()  # flush_cache
    assert env.tree._prefetch == {} and admitted(env, b)
    tier.gate.set()
    assert env.connector.drain(5)
    assert env.idle_ok()

    def broken(keys, out):
        raise OSError("tier died")
    env.connector.host.clear()
    tier.get_many_into = broken
    c = arrive(env, "c", ids + [3])
    wait_admitted(env, c)
    r = E.serve(env, "c", ids + [3], req=c)
    assert r.host_hit == 0 and r.kv_ok and env.connector.metrics()["prefetch_failures"] == 0  # no pages: a miss


def test_no_prefetch_without_deep_pages_or_with_policy_off(envs):
    env, tier = envs(policy="off")
    req = arrive(env, "a", list(range(10)))
    assert env.tree._prefetch == {} and admitted(env, req)
    env2, _ = envs()
    req2 = arrive(env2, "a", list(range(10)))  # nothing anywhere: ready once the worker's lookup missed
    wait_admitted(env2, req2)
    m = env2.connector.metrics()
    assert m["prefetches"] == 1 and m["prefetch_pages"] == 0 and m["transfer"]["held_bytes"] == 0


def test_no_job_and_no_hold_when_the_tier_can_tell_it_lacks_the_next_page(envs, monkeypatch):
    """A tier that answers from local state (the storage tier's index) that it lacks the first page
    past the device + host hit: no prefetch job, the request admitted at the first step (a new
    prompt or a new user turn never waits for a worker to find nothing). Where the tier holds the
    page the prefetch runs as before."""
    env, tier = envs()
    monkeypatch.setattr(tier, "holds_locally", lambda keys: [k in tier.pages for k in keys], raising=False)
    req = arrive(env, "a", list(range(10, 30)))
    assert admitted(env, req)
    m, t = env.connector.metrics(), env.tree.metrics()
    assert m["prefetches"] == 0 and t["prefetches_skipped_absent"] == 1 and t["prefetch_holds"] == 0
    ids = list(range(40, 80))
    only_in_tier(env, tier, ids)
    req2 = arrive(env, "b", ids + [1])
    wait_admitted(env, req2)
    assert env.connector.metrics()["prefetch_pages"] == len(ids)
    assert env.tree.metrics()["prefetches_skipped_absent"] == 1


def test_no_prefetch_and_no_hold_when_the_fetch_is_estimated_slower_than_the_prefill(envs):
    """With `transfer.recompute_tokens_per_s` set, a prefetch the tier's measured read speed says
    would arrive after the forward could have recomputed its tokens is not started and the request
    is not held (the inline lookup's rule, asked before the hold); the match is host-only, so SGLang
    prefills those tokens. Before the tier's first read only the selector's estimate counts (a
    fast mock NVMe link here): the first prefetch runs, and its read is measured."""
    # 4,000 tokens/s: the 40-token prefixes below recompute in 10 ms; a read takes >= 50 ms
    env, tier = envs(policy="timeout", recompute_tokens_per_s=4000.0)
    a, b = list(range(200, 240)), list(range(300, 340))
    only_in_tier(env, tier, a)
    only_in_tier(env, tier, b)
    tier.delay_s = 0.05  # a slow link: every read takes 50 ms
    req = arrive(env, "a", a + [1])  # not measured yet: fetched, and the read is timed
    wait_admitted(env, req)
    assert env.connector.metrics()["prefetch_pages"] == len(a)
    assert env.tree.metrics()["prefetches_skipped_recompute_cheaper"] == 0
    E.serve(env, "a", a + [1], req=req)
    read = tier.pages_read
    req2 = arrive(env, "b", b + [1])
    assert admitted(env, req2)  # the first step: no hold
    m, t = env.connector.metrics(), env.tree.metrics()
    assert t["prefetches_skipped_recompute_cheaper"] == 1 and m["prefetch_pages"] == len(a)
    r = E.serve(env, "b", b + [1], req=req2)
    assert r.loaded == 0 and tier.pages_read == read  # recomputed: the slow tier was not read for it
    assert env.tree._prefetch == {}


def test_requests_sharing_a_prefix_share_one_fetch(envs):
    """Requests queued together with the same deep prefix (a system prompt) wait on one fetch
    instead of each reading the same pages; the first one leaving (abort) does not cancel the
    fetch the other still waits on; both load the prefix from the host tier, KV byte-equal."""
    env, tier = envs(policy="wait_complete")
    ids = list(range(200, 240))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    read0 = tier.pages_read
    a = arrive(env, "a", ids + [1, 2])
    b = arrive(env, "b", ids + [3, 4])
    assert env.connector.metrics()["prefetches"] == 1 and env.tree.metrics()["prefetches_shared"] == 1
    env.tree.release_aborted_request(a.cache_request_handle)  # a leaves; b still waits on the fetch
    tier.gate.set()
    wait_admitted(env, b)
    r = E.serve(env, "b", ids + [3, 4], req=b)
    assert r.loaded == len(ids) and r.kv_ok
    m = env.connector.metrics()
    assert m["prefetch_pages"] == len(ids) and m["pages_loaded_deep"] == 0
    assert tier.pages_read - read0 == len(ids)  # the prefix was read once, not once per request


def test_a_fetch_nobody_waits_for_is_skipped(envs):
    env, tier = envs(policy="wait_complete")
    ids = list(range(300, 340))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    blocker = env.connector.prefetch(env.connector.page_keys(list(range(5000, 5008))))  # occupies the fetch lane
    a = arrive(env, "a", ids + [1])
    b = arrive(env, "b", ids + [2])
    h = env.tree._prefetch[a.cache_request_handle].handle
    assert h is env.tree._prefetch[b.cache_request_handle].handle and h.refs == 2
    env.tree.release_aborted_request(a.cache_request_handle)
    assert not h.cancelled  # b still waits
    env.tree.release_aborted_request(b.cache_request_handle)
    assert h.cancelled  # nobody left: a queued fetch skips its I/O
    tier.gate.set()
    assert env.connector.drain(5) and blocker.done


def test_the_device_prefix_a_prefetch_continues_stays_until_the_request_is_admitted(envs):
    """The prefetch fetches the pages past the device prefix. If other requests' KV evicted that
    prefix while the request waits (a multi-turn history pushed out by other conversations), the
    prefetched pages would be unreachable (a match starts at the root) and the request would
    recompute everything: the device prefix stays locked until the request may be scheduled."""
    env, tier = envs(policy="wait_complete")
    ids = list(range(500, 540))
    E.serve(env, "head", ids[:20])
    E.serve(env, "full", ids)  # written through: the tier holds all 40 pages
    assert env.connector.drain(5) and tier.contains_prefix(env.connector.page_keys(ids)) == 40
    env.connector.host.clear()
    env.tree.evict(EvictParams(num_tokens=20))  # the tail leaves the device; ids[:20] stay
    tier.gate.clear()
    req = arrive(env, "b", ids + [1])
    protected = env.tree.protected_size()
    assert protected == 20 and env.tree._prefetch_lock_tokens == 20
    env.tree.evict(EvictParams(num_tokens=10**6))  # other requests' KV pushes everything out ...
    assert env.tree.evictable_size() == 0 and env.tree.protected_size() == 20  # ... but the locked prefix
    tier.gate.set()
    wait_admitted(env, req)
    assert env.tree.protected_size() == 0 and env.tree._prefetch_lock_tokens == 0  # unlocked once ready
    r = E.serve(env, "b", ids + [1], req=req)
    assert r.cached_device == 20 and r.loaded == 20 and r.kv_ok  # device prefix + the prefetched pages


def test_prefetch_locks_are_bounded_to_a_quarter_of_the_pool(envs):
    env, tier = envs(policy="wait_complete")
    fams = [list(range(1000 + 100 * f, 1000 + 100 * f + 24)) for f in range(3)]
    for f, ids in enumerate(fams):
        E.serve(env, f"f{f}", ids)  # written through: the tier holds every page
    env.tree.evict(EvictParams(num_tokens=10**6))
    for f, ids in enumerate(fams):
        E.serve(env, f"h{f}", ids[:16])  # the device holds the 16-token heads only
    assert env.connector.drain(5)
    env.connector.host.clear()
    tier.gate.clear()
    reqs = [arrive(env, f"r{f}", ids + [1]) for f, ids in enumerate(fams)]
    # the pool holds 128 tokens: locks stop at 32 (two heads of 16), the third prefetch goes unlocked
    assert env.tree._prefetch_lock_tokens == 32 and env.tree.protected_size() == 32
    tier.gate.set()
    for r in reqs:
        wait_admitted(env, r)
    assert env.tree._prefetch_lock_tokens == 0 and env.tree.protected_size() == 0


class _Batch:
    def __init__(self, empty):
        self.empty = empty

    def is_empty(self):
        return self.empty


def test_idle_scheduler_sleeps_on_the_engine_while_a_prefetch_is_held(envs, monkeypatch):
    """SGLang's on_idle (no batch): with a request held for its prefetch the loop sleeps on the engine
    (GIL released) until a job finishes, instead of spinning; never with a running batch or nothing held."""
    from flexflow_sglang.backend import cache as cache_mod
    env, tier = envs(policy="timeout")
    sched = Sched(env.tree)
    t0 = time.monotonic()
    plugin._flexflow_idle(None, sched)
    assert env.tree.metrics()["idle_waits"] == 0 and time.monotonic() - t0 < 0.5  # nothing held: no sleep
    ids = list(range(300, 340))
    only_in_tier(env, tier, ids)
    tier.gate.clear()
    req = arrive(env, "b", ids + [1])
    assert not admitted(env, req)
    monkeypatch.setattr(cache_mod, "IDLE_WAIT_S", 30.0)
    sched.running_batch = _Batch(empty=False)  # a decode batch exists: never sleep
    plugin._flexflow_idle(None, sched)
    assert env.tree.metrics()["idle_waits"] == 0
    sched.running_batch = _Batch(empty=True)
    threading.Timer(0.2, tier.gate.set).start()
    t0 = time.monotonic()
    plugin._flexflow_idle(None, sched)  # woken by the finished prefetch, long before 30 s
    waited = time.monotonic() - t0
    assert env.tree.metrics()["idle_waits"] == 1 and 0.15 < waited < 10.0, waited
    wait_admitted(env, req)
    assert E.serve(env, "b", ids + [1], req=req).loaded == len(ids)
