"""Deep-tier I/O off the caller's thread: write-through, spills, load-back fetches and prefetches as
transfer-engine jobs, with a bounded queue and pinned host pages (real SGLang KV pool, CPU)."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from flexflow_sglang.config import config_from_dict  # noqa: E402
from flexflow_sglang.connector import FlexFlowConnector, InMemoryTier, KVLayout  # noqa: E402

from test_connector_host_tier import mha, rand_slots, same, snapshot  # noqa: E402


def cfg(host_tokens=64, **transfer):
    return config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                             "host_tier": {"capacity_tokens": host_tokens, "pin_memory": "never"},
                             "transfer": transfer}, "<test>")


class GatedTier(InMemoryTier):
    """An in-memory tier whose puts/gets wait for `gate` (a slow link), recording their threads."""

    def __init__(self, write_through=True):
        super().__init__(name="slow", node="nvme0")
        self.write_through = write_through
        self.gate = threading.Event()
        self.threads = set()

    def put_many(self, keys, pages_u8):
        self.threads.add(threading.current_thread())
        self.gate.wait(10)
        return super().put_many(keys, pages_u8)

    def get_many_into(self, keys, out_u8):
        self.threads.add(threading.current_thread())
        self.gate.wait(10)
        return super().get_many_into(keys, out_u8)


@pytest.fixture
def conns():
    made = []

    def _make(kv, config, tiers=()):
        c = FlexFlowConnector(KVLayout.from_pool(kv, 1), config, fingerprint={"t": 2}, tiers=list(tiers),
                              start_agent=False)
        made.append(c)
        return c

    yield _make
    for c in made:
        for t in c.tiers:
            getattr(t, "gate", threading.Event()).set()
        c.close()


def test_write_through_runs_off_thread_and_pins_pages(conns):
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = GatedTier()
    c = conns(kv, cfg(host_tokens=32), [tier])  # pin budget: a quarter of the tier, 8 pages
    a = c.page_keys(list(range(8)))
    t0 = time.perf_counter()
    assert c.store(a, rand_slots(8, 1, 1)).ok  # host copy done; the tier write waits on the gate
    assert time.perf_counter() - t0 < 2.0 and c.host.pinned_pages == 8
    assert threading.current_thread() not in tier.threads
    # fill the rest of the tier; a store that must evict may not take the pages the write still reads
    for i in range(3):
        assert c.store(c.page_keys(list(range(100 * (i + 1), 100 * (i + 1) + 8))), rand_slots(8, 1, 2 + i)).ok
    h = c.store(c.page_keys(list(range(900, 932))), rand_slots(32, 1, 9))
    assert not h.ok and h.stored_pages == 24 and c.lookup(a) == 8  # every unpinned page, none of a's
    assert c.metrics()["store_pages_short"] == 8
    c.host.discard(a[:2])  # discarded while pinned: freed only when the job ends
    assert c.host.free_pages == 0
    tier.gate.set()
    assert c.drain(5)
    assert c.host.pinned_pages == 0 and c.host.free_pages == 2
    assert tier.contains_prefix(a) == 8
    rows = torch.stack([torch.from_numpy(tier.pages[k]) for k in a[2:]])  # InMemoryTier keeps numpy rows
    host_rows = c.host.words[torch.tensor([c.host.page_of(k) for k in a[2:]])].view(torch.uint8)
    assert torch.equal(rows, host_rows)  # the tier got the bytes the host tier holds


def test_write_through_backlog_past_the_pin_budget_copies_and_leaves_pages_evictable(conns):
    """A slow remote link builds a write-through backlog. Past a quarter of the host tier the jobs
    copy their rows instead of pinning, so new stores still find pages (before: the backlog pinned
    the whole tier, stores came up short and their KV was lost at device eviction)."""
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = GatedTier()
    c = conns(kv, cfg(host_tokens=16), [tier])  # budget 4 pages
    a, b = c.page_keys(list(range(4))), c.page_keys(list(range(10, 18)))
    assert c.store(a, rand_slots(4, 1, 1)).ok and c.host.pinned_pages == 4
    assert c.store(b, rand_slots(8, 1, 2)).ok
    assert c.host.pinned_pages == 4 and c.metrics()["write_through_copied"] == 1  # b copied, not pinned
    b_rows = c.host.words[torch.tensor([c.host.page_of(k) for k in b])].view(torch.uint8).clone()
    # the tier is 12/16 full; a 12-page store evicts b's pages (its job holds a copy) but never a's
    h = c.store(c.page_keys(list(range(50, 62))), rand_slots(12, 1, 3))
    assert h.ok and c.metrics()["store_pages_short"] == 0
    assert c.lookup(a) == 4 and c.host.contains_prefix(b) < 8
    tier.gate.set()
    assert c.drain(5) and c.host.pinned_pages == 0
    assert tier.contains_prefix(b) == 8  # the copy reached the tier intact, after its host pages were reused
    assert torch.equal(torch.stack([torch.from_numpy(tier.pages[k]) for k in b]), b_rows)


def test_a_store_past_the_pin_budget_pins_what_fits_and_copies_only_the_rest(conns):
    """Room for 4 of 6 pages in the pin budget: those 4 go zero-copy (pinned), only 2 are copied on
    the scheduler's thread, and all 6 reach the tier with the bytes the host tier held."""
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = GatedTier()
    c = conns(kv, cfg(host_tokens=16), [tier])  # budget 4 pages
    a = c.page_keys(list(range(6)))
    assert c.store(a, rand_slots(6, 1, 1)).ok
    m = c.metrics()
    assert c.host.pinned_pages == 4 and m["write_through_copied"] == 1 and m["write_through_dropped"] == 0
    host_rows = c.host.words[torch.tensor([c.host.page_of(k) for k in a])].view(torch.uint8).clone()
    tier.gate.set()
    assert c.drain(5) and c.host.pinned_pages == 0
    assert tier.contains_prefix(a) == 6
    assert torch.equal(torch.stack([torch.from_numpy(tier.pages[k]) for k in a]), host_rows)
    assert c.metrics()["pages_written_through"] == 6


@pytest.mark.parametrize("host_tokens", [2048, 800])  # the second store pinned / copied (pin budget 512 / 200)
def test_full_queue_drops_write_through_never_blocks(conns, host_tokens):
    kv = mha(ps=1, layers=4, heads=4, dim=64)  # 4 KiB pages
    tier = GatedTier()
    c = conns(kv, cfg(host_tokens=host_tokens, queue_bytes=1 << 20), [tier])
    assert c.store(c.page_keys(list(range(200))), rand_slots(200, 1, 3)).ok  # 800 KiB queued
    t0 = time.perf_counter()
    h = c.store(c.page_keys(list(range(1000, 1100))), rand_slots(100, 1, 4))  # 400 KiB more: over 1 MiB
    assert h.ok and time.perf_counter() - t0 < 2.0
    m = c.metrics()
    # refused by the engine (pinned path) or before the copy was made (copy path: nothing copied)
    assert m["write_through_dropped"] == 1 and m["transfer"]["dropped"] == (1 if host_tokens == 2048 else 0)
    assert c.host.pinned_pages == 200  # the dropped job's pages were unpinned at once
    tier.gate.set()
    assert c.drain(5) and c.host.pinned_pages == 0 and len(tier.pages) == 200


def test_spill_dropped_when_queue_full(conns):
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = GatedTier(write_through=False)
    c = conns(kv, cfg(host_tokens=300, queue_bytes=1 << 20), [tier])
    c.store(c.page_keys(list(range(250))), rand_slots(250, 1, 5))
    c.store(c.page_keys(list(range(5000, 5200))), rand_slots(200, 1, 6))  # 150 victims: one spill job, 600 KiB
    c.store(c.page_keys(list(range(9000, 9200))), rand_slots(200, 1, 7))  # 200 more victims: no room
    m = c.metrics()
    assert m["spills_dropped"] == 1 and m["pages_spill_dropped"] == 200
    tier.gate.set()
    assert c.drain(5) and c.metrics()["pages_spilled"] == 150


def test_load_back_fetch_is_bounded(conns):
    kv = mha(ps=1)
    tier = GatedTier(write_through=False)
    c = conns(kv, cfg(host_tokens=4, load_timeout_ms=200), [tier])
    a = c.page_keys(list(range(4)))
    c.store(a, rand_slots(4, 1, 8))
    c.store(c.page_keys(list(range(50, 54))), rand_slots(4, 1, 9))  # a -> the tier
    tier.gate.set()
    assert c.drain(5) and tier.contains_prefix(a) == 4
    tier.gate.clear()  # the tier becomes slow
    dst = rand_slots(4, 1, 10)
    snap = snapshot(kv, dst)
    t0 = time.perf_counter()
    assert not c.load(a, dst)  # a miss after ~200 ms, not a stall until the tier answers
    assert 0.15 < time.perf_counter() - t0 < 2.0 and same(kv, dst, snap)
    assert c.metrics()["fetch_timeouts"] == 1
    tier.gate.set()
    assert c.drain(5)


def test_sync_mode_runs_on_the_caller(conns):
    kv = mha(ps=1)
    tier = GatedTier()
    tier.gate.set()
    c = conns(kv, cfg(mode="sync"), [tier])
    assert c.prefetch_policy == "off"
    c.store(c.page_keys(list(range(10))), rand_slots(10, 1, 11))
    assert tier.threads == {threading.current_thread()} and len(tier.pages) == 10
    assert c.host.pinned_pages == 0 and c.metrics()["pages_written_through"] == 10


def test_prefetch_brings_deep_pages_into_host(conns):
    kv = mha(ps=1)
    tier = GatedTier(write_through=False)
    c = conns(kv, cfg(host_tokens=16), [tier])
    a = c.page_keys(list(range(16)))
    src = rand_slots(16, 1, 12)
    snap = snapshot(kv, src)
    c.store(a, src)
    c.store(c.page_keys(list(range(500, 516))), rand_slots(16, 1, 13))  # all of a -> the tier
    tier.gate.set()
    assert c.drain(5) and c.host.contains_prefix(a) == 0 and tier.contains_prefix(a) == 16
    tier.gate.clear()
    h = c.prefetch(a[:10] + [b"\0" * 32])  # 10 pages held, then a key no tier has
    c.poll()
    assert not h.done and c.lookup(a, deep=False) == 0
    tier.gate.set()
    assert c.drain(5) and h.done and h.pages == 10 and not h.failed
    assert c.lookup(a, deep=False) == 10
    dst = rand_slots(10, 1, 14)
    r = c.load(a[:10], dst)
    assert r.ok and same(kv, dst, [(k[:10], v[:10]) for k, v in snap])
    assert (r.pages, r.host_pages, r.deep_pages) == (10, 10, 0)  # a host hit now
    assert c.metrics()["prefetch_pages"] == 10


def test_prefetch_promotion_copies_on_a_worker_and_a_clear_meanwhile_frees_its_pages(conns, monkeypatch):
    """A finished prefetch's copy into the host tier (and its page hashes) runs on an engine worker,
    not on the thread that polls (SGLang's scheduler thread, which decodes meanwhile): its pages stay
    reserved and invisible until the copy settles; a clear meanwhile gives them back, none land."""
    import flexflow_sglang.connector.prefetch as prefetch_mod
    gate, threads, real = threading.Event(), [], prefetch_mod._promote_rows

    def gated(*a):
        threads.append(threading.current_thread().name)
        gate.wait(10)
        return real(*a)
    monkeypatch.setattr(prefetch_mod, "_promote_rows", gated)
    kv = mha(ps=1)
    tier = GatedTier(write_through=False)
    tier.gate.set()
    c = conns(kv, cfg(host_tokens=16), [tier])
    a = c.page_keys(list(range(16)))
    src = rand_slots(16, 1, 21)
    snap = snapshot(kv, src)
    c.store(a, src)
    c.store(c.page_keys(list(range(700, 716))), rand_slots(16, 1, 22))  # all of a -> the tier
    assert c.drain(5) and c.host.contains_prefix(a) == 0 and tier.contains_prefix(a) == 16
    c.host.clear()
    cap = c.host.free_pages

    def promote_pending(h):
        end = time.monotonic() + 5
        while not threads and time.monotonic() < end:
            c.poll()  # settles the prefetch: reserves host pages, queues the copy
            time.sleep(0.01)
        return bool(threads) and not h.done

    h = c.prefetch(a[:10])
    assert promote_pending(h)
    assert threads[-1] != threading.current_thread().name and threads[-1].startswith(c.engine.name)
    assert c.lookup(a, deep=False) == 0 and c.host.free_pages == cap - 10  # reserved, not visible
    gate.set()
    assert c.drain(5) and h.done and h.pages == 10 and not h.failed and c.lookup(a, deep=False) == 10
    dst = rand_slots(10, 1, 23)
    r = c.load(a[:10], dst)  # verifies the hashes the worker took
    assert r.ok and r.host_pages == 10 and same(kv, dst, [(k[:10], v[:10]) for k, v in snap])
    assert c.host.checksum_failures == 0

    c.host.clear()
    gate.clear()
    threads.clear()
    h2 = c.prefetch(a[:12])
    assert promote_pending(h2)
    threading.Timer(0.2, gate.set).start()
    c.clear()  # waits for the running copy; its pages are stale: released, not committed
    assert h2.done and h2.pages == 0 and c.lookup(a, deep=False) == 0 and c.host.free_pages == cap
    assert c.metrics()["prefetch_discarded"] >= 1


def test_prefetch_lands_in_pieces_and_the_leading_ones_are_usable_before_the_rest(conns, monkeypatch):
    """A prefetch hands its pages over piece by piece: while a later piece is still being read,
    the earlier ones are already host-tier pages (what a request whose timeout budget ran out is
    admitted with); the handle is done once every piece is promoted, with all pages counted."""
    import flexflow_sglang.connector.prefetch as prefetch_mod
    monkeypatch.setattr(prefetch_mod, "PREFETCH_PIECE_BYTES", 4 * 192)  # 4 pages of 192 B per piece

    class Stepped(InMemoryTier):
        """Reads of pages at or past `allowed` (their index in the prompt) wait: the test lets the
        pieces through one at a time."""
        def __init__(self):
            super().__init__(name="stepped", node="nvme0")
            self.write_through = False
            self.cv = threading.Condition()
            self.allowed = 0
            self.index = {}
            self.read = 0

        def allow(self, n):
            with self.cv:
                self.allowed = n
                self.cv.notify_all()

        def get_many_into(self, keys, out_u8):
            with self.cv:
                if not self.cv.wait_for(lambda: max(self.index[k] for k in keys) < self.allowed, 10):
                    return 0
            got = super().get_many_into(keys, out_u8)
            self.read += got
            return got

    kv = mha(ps=1)
    tier = Stepped()
    c = conns(kv, cfg(host_tokens=16), [tier])
    a = c.page_keys(list(range(10)))
    src = rand_slots(10, 1, 31)
    snap = snapshot(kv, src)
    c.store(a, src)
    assert c.drain(5)
    rows = c.host.words[torch.as_tensor(c.host.pages_for(a))]
    assert tier.put_many(a, rows.view(torch.uint8).numpy()) == 10
    tier.index = {k: i for i, k in enumerate(a)}
    assert c.host.discard(a) == 10 and c.lookup(a, deep=False) == 0

    h = c.prefetch(a)
    tier.allow(4)  # the first piece (pages 0-3) only

    def wait_for(cond):
        end = time.monotonic() + 5
        while not cond() and time.monotonic() < end:
            c.poll()
            time.sleep(0.01)
        return cond()
    assert wait_for(lambda: c.lookup(a, deep=False) == 4)
    assert not h.done and h.pages == 4 and tier.read == 4  # the rest is still to be read
    tier.allow(10)
    assert c.drain(5) and h.done and not h.failed and h.pages == 10 and tier.read == 10
    assert c.lookup(a, deep=False) == 10 and c.metrics()["prefetch_pages"] == 10
    dst = rand_slots(10, 1, 32)
    r = c.load(a, dst)
    assert r.ok and r.host_pages == 10 and same(kv, dst, snap)


def test_prefetch_cancel_clear_and_failure_are_misses(conns):
    kv = mha(ps=1)
    tier = GatedTier(write_through=False)
    c = conns(kv, cfg(host_tokens=8), [tier])
    a = c.page_keys(list(range(8)))
    c.store(a, rand_slots(8, 1, 15))
    c.store(c.page_keys(list(range(300, 308))), rand_slots(8, 1, 16))
    tier.gate.set()
    assert c.drain(5)
    tier.gate.clear()
    h1 = c.prefetch(a)  # will be running (blocked in the tier) when the tiers are cleared
    end = time.monotonic() + 5
    while h1.job.state.value != "running" and time.monotonic() < end:
        time.sleep(0.01)
    h2 = c.prefetch(a)
    h2.cancel()
    threading.Timer(0.2, tier.gate.set).start()
    c.clear()  # waits for the running fetch; its pages are stale and must not land
    assert h1.done and h1.pages == 0 and h2.done and h2.pages == 0
    assert c.lookup(a) == 0 and c.metrics()["prefetch_discarded"] >= 1

    class Broken(InMemoryTier):
        def contains_prefix(self, keys):
            return len(keys)

        def get_many_into(self, keys, out):
            raise OSError("link down")
    c2 = conns(mha(ps=1), cfg(), [Broken("broken", "nvme0")])
    h = c2.prefetch(c2.page_keys(list(range(5))))
    assert c2.drain(5) and h.done and h.pages == 0 and c2.lookup(h.keys, deep=False) == 0


def test_remote_tier_is_routed_through_the_engine(conns):
    from flexflow_sglang.tiers import RemoteTier, remote_from_config
    t = RemoteTier(["127.0.0.1:9"], timeout_ms=200)  # nothing listens: construction does not connect
    c = conns(mha(ps=1), cfg(), [t])
    assert t._router is not None and t._router.engine is c.engine and t._router.local == c.host_node
    rc = config_from_dict({"topology": {"source": "mock", "mock": "single"},
                           "remote_tier": {"enabled": True, "peers": ["127.0.0.1:9"], "local_node": "cpu0",
                                           "relay_peers": ["127.0.0.1:10"]}}, "<test>").remote_tier
    t2 = remote_from_config(rc, selector=c.selector, engine=c.engine)
    try:
        assert t2._router is not None and t2._router.local == "cpu0" and len(t2._peers) == 2
    finally:
        t2.close()
    assert remote_from_config(rc)._router is None  # no selector: unrouted, as before


def test_clear_rotates_keys_so_a_tier_that_keeps_pages_cannot_serve_them(conns):
    """A weight update: the storage / remote / external tiers are not emptied (another server's
    pages live there, or the tier cannot enumerate), so clear() must make their pages unreachable."""
    class Keeping(InMemoryTier):
        def clear(self):
            pass  # like StorageTier / RemoteTier / HiCacheStorageTier

    kv = mha(ps=1)
    tier = Keeping("kept", "nvme0")
    tier.write_through = True
    c = conns(kv, cfg(host_tokens=8), [tier])
    tokens = list(range(40, 48))
    old = c.page_keys(tokens)
    assert c.store(old, rand_slots(8, 1, 21)).ok and c.drain(5)
    assert c.lookup(old, deep=True) == 8 and tier.contains_prefix(old) == 8
    c.clear()
    new = c.page_keys(tokens)
    assert new != old and not set(new) & set(old)
    assert tier.contains_prefix(old) == 8  # the stale pages are still in the tier ...
    assert c.lookup(new, deep=True) == 0  # ... but no lookup of these tokens reaches them
    assert not c.load(new, rand_slots(8, 1, 22)).ok


class HoldsTier(GatedTier):
    """A tier that can say from local state which keys it holds (as the storage tier's index does)."""

    def holds_locally(self, keys):
        return [k in self.pages for k in keys]


def test_host_victims_the_first_tier_already_holds_are_not_spilled_again(conns):
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = HoldsTier(write_through=False)
    tier.gate.set()
    c = conns(kv, cfg(host_tokens=16), [tier])
    a = c.page_keys(list(range(8)))
    assert c.store(a, rand_slots(8, 1, 1)).ok
    assert c.store(c.page_keys(list(range(100, 108))), rand_slots(8, 1, 2)).ok
    assert c.store(c.page_keys(list(range(200, 208))), rand_slots(8, 1, 3)).ok  # evicts a: spilled
    assert c.drain(5) and tier.contains_prefix(a) == 8
    assert c.metrics()["pages_spilled"] == 8 and c.metrics()["spills_skipped_held"] == 0
    # a comes back into the host tier from the tier (a load-back), and is evicted again: no second copy
    slots = rand_slots(8, 1, 4)
    assert c.lookup(a) == 8 and c.load(a, slots, fresh_slots=True).ok and c.drain(5)
    before = c.metrics()["pages_spilled"]
    assert c.store(c.page_keys(list(range(300, 316))), rand_slots(16, 1, 5)).ok  # evicts everything
    assert c.drain(5)
    m = c.metrics()
    assert m["spills_skipped_held"] == 8  # a's pages: held by the tier, neither copied nor written
    assert m["pages_spilled"] - before == 8  # the other victims (200..207) were spilled as before
    assert tier.contains_prefix(a) == 8 and c.lookup(a) == 8  # still served, from the tier


def test_write_through_skips_pages_the_tier_already_holds(conns):
    """A multi-turn conversation resends its history every round: after a host-tier eviction the
    recomputed history is stored again, and the write-through tier gets only the pages it lacks."""
    kv = mha(ps=1, layers=4, heads=4, dim=64)
    tier = HoldsTier(write_through=True)
    tier.gate.set()
    c = conns(kv, cfg(host_tokens=16), [tier])
    hist = list(range(8))
    a = c.page_keys(hist)
    assert c.store(a, rand_slots(8, 1, 1)).ok and c.drain(5)
    assert tier.contains_prefix(a) == 8 and c.metrics()["pages_written_through"] == 8
    c.host.discard(a)  # evicted from the host tier; the tier keeps the pages
    b = c.page_keys(hist + list(range(50, 54)))  # the next round: the same 8 pages, then 4 new ones
    puts = []
    real_put = tier.put_many
    tier.put_many = lambda keys, rows: puts.append(list(keys)) or real_put(keys, rows)
    assert c.store(b, rand_slots(12, 1, 2)).ok and c.drain(5)
    m = c.metrics()
    assert puts == [b[8:]]  # only the new pages were written
    assert m["write_through_skipped_held"] == 8 and m["pages_written_through"] == 12
    assert tier.contains_prefix(b) == 12
    # every page held already: no job at all
    c.host.discard(b)
    before = c.engine.c["submitted"]
    assert c.store(b, rand_slots(12, 1, 3)).ok and c.drain(5)
    assert c.engine.c["submitted"] == before and m["write_through_skipped_held"] + 12 == \
        c.metrics()["write_through_skipped_held"]


def test_a_load_back_queued_behind_a_long_write_back_runs_between_its_pieces(conns, monkeypatch):
    """A write-through goes to the tier in pieces; a load-back fetch queued meanwhile (every worker
    busy: here the only one) runs on the write-back's worker after the piece in flight, not after the
    whole write, so it is a hit and not a miss at its timeout."""
    import flexflow_sglang.connector.write_back as wb_mod
    kv = mha(ps=1)
    page = KVLayout.from_pool(kv, 1).page_nbytes
    monkeypatch.setattr(wb_mod, "WRITE_BACK_PIECE_BYTES", 2 * page)  # 2 pages per piece

    class PieceGated(InMemoryTier):
        """Each put waits until the test allows one more piece; reads never wait."""
        def __init__(self):
            super().__init__(name="pieces", node="nvme0")
            self.write_through = True
            self.cv = threading.Condition()
            self.allowed = self.pieces = self.waiting = 0

        def allow(self, n):
            with self.cv:
                self.allowed = n
                self.cv.notify_all()

        def put_many(self, keys, pages_u8):
            with self.cv:
                self.waiting += 1
                self.cv.notify_all()
                try:
                    if not self.cv.wait_for(lambda: self.pieces < self.allowed, 10):
                        return 0
                finally:
                    self.waiting -= 1
                self.pieces += 1
            return super().put_many(keys, pages_u8)

    tier = PieceGated()
    c = conns(kv, cfg(host_tokens=64, workers=1, load_timeout_ms=3000), [tier])
    b = c.page_keys(list(range(200, 206)))  # pages only the tier holds, stored there directly
    src = rand_slots(6, 1, 40)
    snap = snapshot(kv, src)
    assert c.store(b, src).ok
    tier.allow(3)
    assert c.drain(5) and tier.contains_prefix(b) == 6
    assert c.host.discard(b) == 6 and c.lookup(b, deep=False) == 0
    a = c.page_keys(list(range(8)))
    assert c.store(a, rand_slots(8, 1, 41)).ok  # write-through of 8 pages: 4 pieces, the first waits
    with tier.cv:  # the write-back holds the only worker before the load comes (else the fetch, which
        # sorts first, would simply run first: not the case under test)
        assert tier.cv.wait_for(lambda: tier.waiting > 0, 5)
    threading.Timer(0.3, tier.allow, args=(4,)).start()  # the write's first piece, while the load waits
    dst = rand_slots(6, 1, 42)
    t0 = time.perf_counter()
    r = c.load(b, dst)  # its fetch queues behind the write-through on the only worker
    assert r.ok and r.deep_pages == 6 and same(kv, dst, snap)
    assert time.perf_counter() - t0 < 2.5 and c.metrics().get("fetch_timeouts", 0) == 0
    assert tier.pieces == 4 and tier.contains_prefix(a) == 2  # the write-through is not done
    tier.allow(10)
    assert c.drain(5) and tier.contains_prefix(a) == 8 and c.metrics()["pages_written_through"] == 8 + 6
