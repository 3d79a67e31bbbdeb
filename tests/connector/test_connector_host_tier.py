"""FlexFlowConnector on the real SGLang KV pools (CPU): layout, keys, host tier, executors, deeper tiers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402

from flexflow_sglang.config import config_from_dict  # noqa: E402
from flexflow_sglang.connector import FlexFlowConnector, HostTier, InMemoryTier, KVLayout, KVTier  # noqa: E402
from flexflow_sglang.connector import executors as ex_mod  # noqa: E402
from flexflow_sglang.monitor import NodeAgent  # noqa: E402
from flexflow_sglang.selector import PathType  # noqa: E402
from flexflow_sglang.topology import LinkType, NodeKind, Topology, make_mock_dgx  # noqa: E402

SIZE = 256


def cfg(host_tokens=1024, verify=True, **sel):
    data = {"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
            "host_tier": {"capacity_tokens": host_tokens, "verify_checksums": verify, "pin_memory": "never"}}
    if sel:
        data["selector"] = sel
    return config_from_dict(data, "<test>")


def mha(ps=1, dtype=torch.float16, layers=3, heads=2, dim=8, v_dim=None):
    kv = MHATokenToKVPool(size=SIZE, page_size=ps, dtype=dtype, head_num=heads, head_dim=dim, layer_num=layers,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False, v_head_dim=v_dim)
    g = torch.Generator().manual_seed(ps * 31 + layers)
    for b in kv.k_buffer + kv.v_buffer:
        b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return kv


def snapshot(kv, slots):
    return [(k[slots].clone(), v[slots].clone()) for k, v in zip(kv.k_buffer, kv.v_buffer)]


def same(kv, slots, snap):
    return all(torch.equal(k[slots], a) and torch.equal(v[slots], b)
               for (k, v), (a, b) in zip(zip(kv.k_buffer, kv.v_buffer), snap))


def rand_slots(n_pages, ps, seed):
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(SIZE // ps - 1, generator=g)[:n_pages] + 1
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


@pytest.fixture
def make_conn():
    made = []

    def _make(kv, ps, config=None, **kw):
        kw.setdefault("start_agent", False)
        c = FlexFlowConnector(KVLayout.from_pool(kv, ps), config or cfg(), fingerprint={"t": 1}, **kw)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


# ---------------------------------------------------------------------------------------- layout
def test_layout_mha_and_mla():
    kv = mha(ps=4, dtype=torch.bfloat16, layers=2, heads=2, dim=8, v_dim=4)
    lay = KVLayout.from_pool(kv, 4)
    assert lay.kind == "mha" and lay.layer_num == 2
    assert lay.page_nbytes == 2 * 4 * (2 * 8 + 2 * 4) * 2  # layers * ps * (K row + V row) * bytes
    assert lay.word_dtype == torch.int64
    mla = MLATokenToKVPool(size=SIZE, page_size=1, dtype=torch.float16, kv_lora_rank=8, qk_rope_head_dim=4,
                           layer_num=3, device="cpu", enable_memory_saver=False)
    lay = KVLayout.from_pool(mla, 1)
    assert lay.kind == "mla" and len(lay.seg_words) == 1 and lay.page_nbytes == 3 * 12 * 2


def test_layout_rejects_unknown_pool():
    class Fake:
        pass
    with pytest.raises(ValueError, match="not a plain"):
        KVLayout.from_pool(Fake(), 1)


# ---------------------------------------------------------------------------------------- keys
def test_page_keys_chain_and_namespace(make_conn):
    c = make_conn(mha(ps=4), 4)
    toks = list(range(1000, 1023))  # 5 full pages + 3 tokens
    keys = c.page_keys(toks)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == 32 for k in keys)
    assert c.page_keys(toks[:8]) == keys[:2]  # a prefix's keys are the keys' prefix
    other = toks[:4] + [1] + toks[5:]
    k2 = c.page_keys(other)
    assert k2[0] == keys[0] and all(a != b for a, b in zip(k2[1:], keys[1:]))  # chained: later pages differ too
    assert c.page_keys(toks, extra_key="lora-a")[0] != keys[0]
    assert c.page_keys(toks, cache_salt="s")[0] != keys[0]
    assert c.page_keys(toks, bigram=True) != keys
    other_model = FlexFlowConnector(c.layout, cfg(), fingerprint={"t": 2}, start_agent=False)
    try:
        assert other_model.page_keys(toks) != keys
    finally:
        other_model.close()


# ---------------------------------------------------------------------------------------- store / load
@pytest.mark.parametrize("ps,dtype", [(1, torch.float16), (4, torch.float32), (4, torch.bfloat16)])
def test_store_load_roundtrip_scattered(make_conn, ps, dtype):
    kv = mha(ps=ps, dtype=dtype)
    c = make_conn(kv, ps)
    keys = c.page_keys(list(range(50, 50 + 12 * ps)))
    src = rand_slots(12, ps, 1)
    snap = snapshot(kv, src)
    h = c.store(keys, src)
    assert h.done and h.ok and h.stored_pages == 12
    assert c.lookup(keys) == 12 and c.lookup(keys[:5]) == 5
    dst = rand_slots(12, ps, 2)
    others = [s for s in range(ps, SIZE) if s not in set(dst.tolist())]
    before = snapshot(kv, torch.tensor(others))
    assert c.load(keys, dst)
    assert same(kv, dst, snap)
    assert same(kv, torch.tensor(others), before)  # nothing else written
    # storing again deduplicates
    h = c.store(keys, src)
    assert h.ok and h.stored_pages == 0
    m = c.metrics()
    assert m["pages_stored"] == 12 and m["pages_deduplicated"] == 12 and m["pages_loaded"] == 12
    assert m["tokens_loaded"] == 12 * ps and m["bytes_loaded"] == 12 * c.layout.page_nbytes
    assert m["bandwidth_by_path_type"]["Direct"]["moves"] == 2  # the deduplicated store moved nothing
    assert m["host_tier"]["used_pages"] == 12


def test_fragmented_host_pages_use_staging(make_conn):
    kv = mha(ps=1)
    c = make_conn(kv, 1, cfg(host_tokens=64))
    k1 = c.page_keys(list(range(64)))
    c.store(k1, rand_slots(64, 1, 3))
    c.host.discard(k1[::2])  # 32 free pages, every other one
    toks = list(range(500, 532))
    k2 = c.page_keys(toks)
    src = rand_slots(32, 1, 4)
    snap = snapshot(kv, src)
    assert c.store(k2, src).ok
    pages = [c.host.page_of(k) for k in k2]
    assert len(ex_mod.contiguous_runs(pages)) > ex_mod.MAX_DIRECT_RUNS
    dst = rand_slots(32, 1, 5)
    assert c.load(k2, dst) and same(kv, dst, snap)


def test_load_missing_is_false_and_writes_nothing(make_conn):
    kv = mha(ps=1)
    c = make_conn(kv, 1)
    keys = c.page_keys(list(range(10)))
    c.store(keys[:5], rand_slots(5, 1, 6))
    dst = rand_slots(10, 1, 7)
    snap = snapshot(kv, dst)
    assert c.lookup(keys) == 5
    r = c.load(keys, dst)
    assert not r and (r.ok, r.pages, r.host_pages, r.deep_pages) == (False, 10, 0, 0)  # falsy: a miss
    assert same(kv, dst, snap)
    assert c.metrics()["load_failures"] == 1


def test_checksum_mismatch_is_a_miss(make_conn):
    kv = mha(ps=2)
    c = make_conn(kv, 2)
    keys = c.page_keys(list(range(20)))
    c.store(keys, rand_slots(10, 2, 8))
    c.host.words[c.host.page_of(keys[3]), 5] += 1  # flip host memory
    dst = rand_slots(10, 2, 9)
    snap = snapshot(kv, dst)
    assert not c.load(keys, dst)
    assert same(kv, dst, snap)  # slots the caller still owns: verified before any device write
    assert c.lookup(keys) == 3  # the corrupt page (and what follows) is gone
    m = c.metrics()
    assert m["checksum_failures"] == 1 and m["host_tier"]["checksum_failures"] == 1


@pytest.mark.parametrize("page", [3, 7])
def test_fresh_slot_load_verifies_inside_the_copy(make_conn, page):
    """init_load_back's loads (fresh slots, freed on a miss) verify in the copy pass itself: a
    flipped word on any page is still a miss, and an intact load is byte-exact."""
    kv = mha(ps=2)
    c = make_conn(kv, 2)
    assert c._fused_store() and c._fused_load()  # the compiled kernels, not the torch fallback
    keys = c.page_keys(list(range(20)))
    src = rand_slots(10, 2, 8)
    c.store(keys, src)
    want = snapshot(kv, src)  # the slot sets may overlap: compare with the stored bytes
    dst = rand_slots(10, 2, 9)
    assert c.load(keys, dst, fresh_slots=True)
    assert same(kv, dst, want)
    c.host.words[c.host.page_of(keys[page]), 11] ^= 1 << 3  # one flipped bit
    assert not c.load(keys, rand_slots(10, 2, 10), fresh_slots=True)
    assert c.lookup(keys) == page
    assert c.metrics()["checksum_failures"] == 1


def test_checksums_off_skips_verification(make_conn):
    kv = mha(ps=1)
    c = make_conn(kv, 1, cfg(verify=False))
    keys = c.page_keys(list(range(4)))
    c.store(keys, rand_slots(4, 1, 10))
    c.host.words[c.host.page_of(keys[0]), 0] += 1
    assert c.load(keys, rand_slots(4, 1, 11))


def test_host_full_lru_and_protection(make_conn):
    kv = mha(ps=1)
    c = make_conn(kv, 1, cfg(host_tokens=8))
    a = c.page_keys(list(range(100, 106)))
    b = c.page_keys(list(range(200, 206)))
    c.store(a, rand_slots(6, 1, 12))
    c.store(b, rand_slots(6, 1, 13))  # evicts the 4 least recent pages of a
    assert c.lookup(b) == 6 and c.lookup(a) == 0
    assert c.host.stats()["evictions"] == 4
    big = c.page_keys(list(range(300, 312)))  # larger than the tier: the leading 8 pages are kept
    h = c.store(big, rand_slots(12, 1, 14))
    assert h.done and not h.ok and h.stored_pages == 8
    assert c.lookup(big) == 8


def test_store_failure_releases_pages(make_conn, monkeypatch):
    kv = mha(ps=1)
    c = make_conn(kv, 1)
    keys = c.page_keys(list(range(6)))

    ex = c.executor
    real = ex._move

    def boom(direction, *a, **k):  # every copy in this direction fails (fused kernels or torch)
        if direction == "d2h":
            raise RuntimeError("injected")
        return real(direction, *a, **k)
    monkeypatch.setattr(ex, "_move", boom)
    h = c.store(keys, rand_slots(6, 1, 15))
    assert h.done and not h.ok
    assert c.lookup(keys) == 0 and c.host.free_pages == c.host.capacity_pages
    assert c.metrics()["store_failures"] == 1


def test_bad_slots_are_a_failed_store(make_conn):
    c = make_conn(mha(ps=4), 4)
    keys = c.page_keys(list(range(8)))
    h = c.store(keys, torch.tensor([4, 5, 6, 7, 9, 10, 11, 12]))  # second page not aligned
    assert h.done and not h.ok and c.lookup(keys) == 0


def test_deferred_store_poll_and_reset(make_conn):
    kv = mha(ps=1)
    c = make_conn(kv, 1, defer_stores=True)
    k1 = c.page_keys(list(range(10)))
    h = c.store(k1, rand_slots(10, 1, 16))
    assert not h.done and c.lookup(k1) == 0  # reserved pages are invisible
    assert c.poll() == 1 and h.done and h.ok and c.lookup(k1) == 10
    k2 = c.page_keys(list(range(50, 60)))
    h2 = c.store(k2, rand_slots(10, 1, 17))
    c.reset()
    assert h2.done and not h2.ok and c.lookup(k2) == 0
    assert c.host.used_pages == 10 and c.host.free_pages == c.host.capacity_pages - 10


def test_clear_and_close_idempotent(make_conn):
    c = make_conn(mha(ps=1), 1)
    keys = c.page_keys(list(range(5)))
    c.store(keys, rand_slots(5, 1, 18))
    c.clear()
    assert c.lookup(keys) == 0
    c.close()
    c.close()
    assert c.closed


def test_agent_gets_feedback(make_conn):
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    c = make_conn(kv, 1)
    calls = []
    orig = c.agent.report_transfer
    c.agent.report_transfer = lambda links, n, s, q=0.0, **kw: calls.append((tuple(links), n)) or orig(links, n, s, q, **kw)
    keys = c.page_keys(list(range(40)))
    c.store(keys, rand_slots(40, 1, 19))
    assert calls and calls[0][1] == 40 * c.layout.page_nbytes
    assert calls[0][0] == tuple(c.selector.select(
        __import__("flexflow_sglang").TransferRequest("gpu0", "cpu0", 1)).subpaths[0].links)


# ---------------------------------------------------------------------------------------- path types
def two_rail_topology():
    t = Topology("two-rail")
    t.add_node("gpu0", NodeKind.GPU)
    t.add_node("cpu0", NodeKind.CPU)
    t.add_link("gpu0", "cpu0", LinkType.PCIE, 10.0)
    t.add_link("gpu0", "cpu0", LinkType.PCIE, 10.0)
    return t


def test_split_path_divides_pages(make_conn):
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    topo = two_rail_topology()
    agent = NodeAgent(topo, source="mock")
    c = make_conn(kv, 1, topology=topo, agent=agent)
    keys = c.page_keys(list(range(200)))
    src = rand_slots(200, 1, 20)
    snap = snapshot(kv, src)
    decision = c.selector.select(__import__("flexflow_sglang").TransferRequest("gpu0", "cpu0",
                                                                              200 * c.layout.page_nbytes))
    assert decision.chosen_type == PathType.SplitPath
    stats = []
    orig = c.executor._move
    c.executor._move = lambda *a: stats.append(orig(*a)) or stats[-1]
    assert c.store(keys, src).ok
    assert stats[0].path_type == "SplitPath" and len(stats[0].legs) == 2
    assert sum(b for _, b, _ in stats[0].legs) == 200 * c.layout.page_nbytes
    agent.clear()  # forget the store's feedback (CPU copies are far below the mock links' 10 GB/s)
    dst = rand_slots(200, 1, 21)
    assert c.load(keys, dst) and same(kv, dst, snap)
    assert len(stats[1].legs) == 2


def test_relay_degrades_to_direct_on_cpu(make_conn):
    kv = mha(ps=1, layers=2, heads=4, dim=64)
    topo = make_mock_dgx(4)
    agent = NodeAgent(topo, source="mock")
    for link in topo.links_between("gpu0", "pcisw0"):
        agent.set_link_utilization(link.id, 0.95)  # gpu0's PCIe uplink is busy: go through a peer GPU
    c = make_conn(kv, 1, config=cfg(enable_split_path=False), topology=topo, agent=agent)
    keys = c.page_keys(list(range(100)))
    src = rand_slots(100, 1, 22)
    snap = snapshot(kv, src)
    assert c.store(keys, src).ok
    bw = c.metrics()["bandwidth_by_path_type"]
    assert set(bw) - {"Direct"}, bw  # the selector picked a relay...
    dst = rand_slots(100, 1, 23)
    assert c.load(keys, dst) and same(kv, dst, snap)  # ...and it was carried out as a direct copy


# ---------------------------------------------------------------------------------------- deeper tiers
class MemTier(InMemoryTier):
    """The reference in-memory tier, named "fake" here."""

    def __init__(self):
        super().__init__(name="fake", node="nvme0")


def test_fake_tier_is_a_kvtier():
    assert isinstance(MemTier(), KVTier)


def test_spill_lookup_and_load_from_deeper_tier(make_conn):
    kv = mha(ps=1)
    tier = MemTier()
    c = make_conn(kv, 1, cfg(host_tokens=8), tiers=[tier])
    a = c.page_keys(list(range(100, 108)))
    src_a = rand_slots(8, 1, 24)
    snap_a = snapshot(kv, src_a)
    c.store(a, src_a)
    c.store(c.page_keys(list(range(200, 206))), rand_slots(6, 1, 25))  # pushes 6 pages of `a` down
    assert c.drain(5)  # spills are engine jobs
    assert tier.puts == 6 and c.host.contains_prefix(a) == 0
    assert c.lookup(a) == 8  # the leading 6 pages from the deeper tier, the last 2 from host memory
    dst = rand_slots(8, 1, 26)
    r = c.load(a, dst)
    assert r.ok and same(kv, dst, snap_a)
    assert (r.pages, r.host_pages, r.deep_pages) == (8, 2, 6)
    assert c.drain(5)  # the promotion spilled host victims in the background
    m = c.metrics()
    assert m["hits_by_tier"]["fake"] == 6 and m["hits_by_tier"]["host"] == 2 and m["pages_spilled"] == tier.puts
    assert m["deeper_tiers"]["fake"]["pages"] == len(tier.pages)
    assert c.agent.feedback_count > 0  # tier I/O (cpu0 <-> nvme0) was routed and reported too
    assert c.host.contains_prefix(a) > 0  # promoted back into host memory
    c.clear()
    assert not tier.pages and c.lookup(a) == 0
    c.close()
    assert tier.closed


def test_broken_tier_is_a_miss(make_conn):
    class Broken(MemTier):
        def get_many_into(self, keys, out_u8):
            raise OSError("disk gone")
    kv = mha(ps=1)
    tier = Broken()
    c = make_conn(kv, 1, cfg(host_tokens=4), tiers=[tier])
    a = c.page_keys(list(range(4)))
    c.store(a, rand_slots(4, 1, 27))
    c.store(c.page_keys(list(range(50, 54))), rand_slots(4, 1, 28))
    assert c.drain(5)
    assert c.lookup(a) == 4
    dst = rand_slots(4, 1, 29)
    snap = snapshot(kv, dst)
    assert not c.load(a, dst) and same(kv, dst, snap)


def test_host_tier_unit():
    h = HostTier(4, torch.int64, 4)
    pages, ev = h.reserve(3)
    assert pages == [0, 1, 2] and not ev
    h.words[torch.tensor(pages)] = torch.arange(12).view(3, 4)
    h.commit([b"a", b"b", b"c"], pages)
    assert h.contains_prefix([b"a", b"b", b"x", b"c"]) == 2
    assert h.first_bad_page(pages) == -1
    h.touch([b"a"])
    pages2, ev = h.reserve(2, protect={b"c"})
    assert [k for k, _ in ev] == [b"b"] and len(pages2) == 2
    h.release(pages2)
    assert h.free_pages == 2 and h.used_pages == 2
