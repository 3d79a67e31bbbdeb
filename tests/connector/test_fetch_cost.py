"""Fetch or recompute (connector/fetch_cost.py): a deep run whose fetch is estimated slower than
recomputing its tokens is left to SGLang's prefill; no evidence means fetch."""

from __future__ import annotations

import time

import pytest

from flexflow_sglang.connector.fetch_cost import OBSERVED_TTL_S, FetchCost


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def cost(rate=1000.0, est=None, clock=None):
    # page of 16 tokens and 1 MB: recomputing one page takes 16 ms at 1000 tokens/s
    return FetchCost(rate, page_size=16, page_nbytes=1_000_000, estimate_s=lambda node, nb: est(node, nb) if est else None,
                     clock=clock or Clock())


def test_disabled_or_no_evidence_fetches():
    assert cost(rate=0.0, est=lambda n, b: 1e9).worth_fetching("storage", "nvme0", 10)  # off: always fetch
    c = cost()
    assert c.fetch_s("storage", None, 10) is None and c.worth_fetching("storage", None, 10)


def test_selector_estimate_decides():
    slow = cost(est=lambda node, nb: nb / 10e6)    # 10 MB/s: 10 pages in 1 s vs 0.16 s recompute
    fast = cost(est=lambda node, nb: nb / 10e9)    # 10 GB/s: 1 ms
    assert not slow.worth_fetching("remote", "n1", 10)
    assert fast.worth_fetching("remote", "n1", 10)
    assert slow.recompute_s(10) == pytest.approx(0.16)


def test_observed_bandwidth_counts_until_it_is_stale():
    clk = Clock()
    c = cost(est=lambda node, nb: nb / 10e9, clock=clk)  # the path looks fast ...
    c.observe("hicache_mooncake", 1_000_000, 0.5)         # ... but the store delivered 2 MB/s
    assert c.fetch_s("hicache_mooncake", None, 10) == pytest.approx(5.0)
    assert not c.worth_fetching("hicache_mooncake", None, 10)
    assert c.worth_fetching("other", None, 10)            # per tier
    c.observe("hicache_mooncake", 1_000_000, 0.0001)      # a fast read moves the average
    assert c.fetch_s("hicache_mooncake", None, 10) < 5.0
    clk.t += OBSERVED_TTL_S + 1                            # old evidence: fetch and measure again
    assert c.worth_fetching("hicache_mooncake", None, 10)


def test_the_cheapest_of_several_tiers_decides():
    class T:
        def __init__(self, name, node=None):
            self.name, self.node = name, node
    slow, fast, fresh = T("storage", "nvme0"), T("remote", "n1"), T("mooncake")
    bw = {"nvme0": 10e6, "n1": 10e9}  # 10 pages: 1 s from storage, 1 ms from remote; recompute 0.16 s
    c = cost(est=lambda node, nb: nb / bw[node] if node in bw else None)
    assert not c.worth_fetching_from([slow], 10)
    assert c.worth_fetching_from([slow, fast], 10)  # the fast tier is read first
    assert c.worth_fetching_from([slow, fresh], 10)  # not measured yet: fetch, and measure
    assert c.worth_fetching_from([], 10) and cost(rate=0.0, est=lambda n, b: 1e9).worth_fetching_from([slow], 10)
    for tiers in ([slow], [slow, fast], [slow, fresh]):  # the same answer as the tier order() reads first
        first = c.order(tiers, 10)[0]
        assert c.worth_fetching_from(tiers, 10) == c.worth_fetching(first.name, first.node, 10)


def test_a_failing_estimator_is_no_evidence():
    def broken(node, nb):
        raise RuntimeError("no route")
    assert cost(est=broken).worth_fetching("storage", "nvme0", 3)


def test_connector_lookup_leaves_a_slow_deep_run_to_prefill():
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector import FlexFlowConnector, InMemoryTier, KVLayout
    from test_connector_host_tier import mha, rand_slots

    class SlowTier(InMemoryTier):
        def get_many_into(self, keys, out):
            time.sleep(0.05)  # a congested link: ~50 ms per read
            return super().get_many_into(keys, out)

    def make(rate):
        cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                                "host_tier": {"capacity_tokens": 8, "pin_memory": "never"},
                                "transfer": {"recompute_tokens_per_s": rate}}, "<test>")
        tier = SlowTier(name="slow", node=None)
        tier.write_through = True
        return FlexFlowConnector(KVLayout.from_pool(mha(ps=1), 1), cfg, fingerprint={"t": 3}, tiers=[tier],
                                 start_agent=False)

    # 1e9 tokens/s: recomputing is always faster than a 50 ms read; 0: the rule is off
    for rate, expect_deep in ((1e9, False), (0.0, True)):
        c = make(rate)
        try:
            a, b = c.page_keys(list(range(8))), c.page_keys(list(range(50, 58)))
            for keys, seed in ((a, 1), (b, 2)):
                assert c.store(keys, rand_slots(8, 1, seed)).ok
                assert c.drain(5)  # the write-through ends before the next store needs the pages
            # a was evicted from the 8-page host tier by b: it lives in the slow tier only
            assert c.host.contains_prefix(a) == 0
            # first contact: no evidence yet, so the pages are fetched (and the read is timed)
            assert c.load(a[:2], rand_slots(2, 1, 3)).ok
            assert c.drain(5)  # the promotion into the host tier is an engine job: settle it
            # those 2 pages were promoted to the host tier; the other 6 are a deep run
            n = c.lookup(a, deep=True)
            assert n == (8 if expect_deep else 2), (rate, n, c.metrics())
            skipped = c.metrics()["deep_pages_recompute_cheaper"]
            assert skipped == (0 if expect_deep else 6), c.metrics()
        finally:
            c.close()


def test_tiers_holding_the_same_run_are_read_cheapest_first():
    class T:
        def __init__(self, name, node=None):
            self.name, self.node = name, node
    slow, fast, fresh = T("storage", "nvme0"), T("remote", "n1"), T("mooncake")
    c = cost(est=lambda node, nb: {"nvme0": 2.0, "n1": 0.5}.get(node))
    assert [t.name for t in c.order([slow, fast], 4)] == ["remote", "storage"]
    assert [t.name for t in c.order([slow, fast, fresh], 4)] == ["mooncake", "remote", "storage"]  # unmeasured first
    c.observe("mooncake", 1_000_000, 10.0)  # measured: 100 kB/s
    assert [t.name for t in c.order([slow, fast, fresh], 4)] == ["remote", "storage", "mooncake"]
    assert [t.name for t in cost().order([slow, fast], 4)] == ["storage", "remote"]  # no evidence: config order


def test_connector_reads_a_shared_run_from_the_faster_tier():
    pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector import FlexFlowConnector, InMemoryTier, KVLayout
    from test_connector_host_tier import mha, rand_slots

    class Slow(InMemoryTier):
        def get_many_into(self, keys, out):
            time.sleep(0.05)
            return super().get_many_into(keys, out)

    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": 8, "pin_memory": "never"}}, "<test>")
    slow, fast = Slow(name="slowdisk", node=None), InMemoryTier(name="fastpeer", node=None)
    for t in (slow, fast):
        t.write_through = True
    c = FlexFlowConnector(KVLayout.from_pool(mha(ps=1), 1), cfg, fingerprint={"t": 4}, tiers=[slow, fast],
                          start_agent=False)
    try:
        runs = [c.page_keys(list(range(i * 100, i * 100 + 8))) for i in range(4)]
        for i, keys in enumerate(runs):
            assert c.store(keys, rand_slots(8, 1, 30 + i)).ok and c.drain(5)
        # runs 0-2 were pushed out of the 8-page host tier: both deep tiers hold them
        for i in range(3):
            assert c.host.contains_prefix(runs[i]) == 0
            assert c.load(runs[i][:2], rand_slots(2, 1, 40 + i)).ok
        hits = c.metrics()["hits_by_tier"]  # tokens (page size 1: pages)
        # read 1 measured slowdisk (config order, nothing known), read 2 measured fastpeer
        # (unmeasured counts as free), read 3 went to the faster one
        assert hits.get("slowdisk", 0) == 2 and hits.get("fastpeer", 0) == 4, hits
    finally:
        c.close()
