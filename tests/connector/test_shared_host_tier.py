"""SharedHostTier across real processes (multiprocessing spawn) and under the real connector:
pages one process stores are hits for another, a writer SIGKILLed mid-write leaves nothing
visible and its pages are reclaimed, a page rewritten during a reader's copy turns that load into a
miss, segments are owner-only and named by the fingerprint, and nothing stays in the shm directory
after every process has gone (closed or killed)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import stat
import time

import pytest

torch = pytest.importorskip("torch")

from flexflow_sglang.connector.shared_host_tier import SharedHostTier, segment_name  # noqa: E402

PW = 32  # words per page
CAP = 16


def key(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def fp(tmp_path) -> str:
    return f"test:{tmp_path}"  # one segment per test


def make(tmp_path, cap=CAP, shm=None, **kw):
    kw.setdefault("start_reaper", False)
    return SharedHostTier(PW, torch.int64, cap, fingerprint=fp(tmp_path), shm_dir=shm or str(tmp_path), **kw)


def write(tier, keys, base):
    pages, evicted = tier.reserve(len(keys))
    for i, p in enumerate(pages):
        tier.words[p].copy_(torch.arange(PW, dtype=torch.int64) + base + i)
    tier.commit(keys[:len(pages)], pages)
    return pages, evicted


def leftovers(d):
    return [n for n in os.listdir(d) if n.startswith("flexflow-kv-")]


# ----------------------------------------------------------------- one process, two attachments
def test_interface_matches_host_tier(tmp_path):
    a, b = make(tmp_path), make(tmp_path)
    try:
        st = os.stat(a.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert os.path.basename(a.path) == segment_name(fp(tmp_path), PW, 8, CAP)
        ks = [key(i) for i in range(4)]
        pages, _ = a.reserve(4)
        assert b.contains_prefix(ks) == 0  # reserved, written or not: invisible until committed
        for i, p in enumerate(pages):
            a.words[p].fill_(i + 1)
        a.commit(ks, pages)
        assert b.contains_prefix(ks + [key(99)]) == 4 and b.used_pages == 4
        p = b.page_of(ks[2])
        assert int(b.words[p][0]) == 3 and b.first_bad_page([p]) == -1 and b.first_changed([p]) == -1
        # LRU: touch key 0, fill the tier; key 0 and the protected key 1 survive, 2 and 3 go first
        b.touch([ks[0]])
        more = range(CAP - 2)  # 12 free pages + 2 victims
        _, evicted = a.reserve(len(more), protect={ks[1]})
        assert {k for k, _ in evicted} == {ks[2], ks[3]}
        assert b.first_changed([p]) == 0  # the page b looked up was taken for a rewrite
        assert b.discard([ks[0]]) == 1 and a.contains_prefix([ks[0]]) == 0
        a.clear()
        assert b.used_pages == 0 and b.contains_prefix([ks[1]]) == 0
    finally:
        b.close()
        assert os.path.exists(a.path)  # a is still attached
        a.close()
    assert leftovers(tmp_path) == []


def test_fingerprint_and_geometry_separate_segments(tmp_path):
    a = make(tmp_path)
    b = SharedHostTier(PW, torch.int64, CAP, fingerprint="other model", shm_dir=str(tmp_path), start_reaper=False)
    c = SharedHostTier(PW, torch.int64, CAP * 2, fingerprint=fp(tmp_path), shm_dir=str(tmp_path), start_reaper=False)
    try:
        assert len({a.path, b.path, c.path}) == 3
        write(a, [key(1)], 0)
        assert b.contains_prefix([key(1)]) == 0 and c.contains_prefix([key(1)]) == 0
    finally:
        for t in (a, b, c):
            t.close()
    assert leftovers(tmp_path) == []


def test_foreign_permissions_refused(tmp_path):
    a = make(tmp_path)
    path = a.path
    a.close()
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)
    with pytest.raises(PermissionError, match="mode 0600"):
        make(tmp_path)
    os.unlink(path)


def test_pinned_pages_survive_eviction_and_discard(tmp_path):
    a, b = make(tmp_path, cap=4), make(tmp_path, cap=4)
    try:
        pages, _ = write(a, [key(i) for i in range(4)], 0)
        a.pin([pages[0]])
        got, evicted = b.reserve(4)
        assert pages[0] not in got and len(got) == 3  # the pinned page is not a victim for anyone
        b.release(got)
        a.discard([key(0)])  # retired, not free, while pinned
        assert pages[0] not in b.reserve(4)[0]
        a.unpin([pages[0]])
        assert a.free_pages == 1
    finally:
        b.close()
        a.close()


# ----------------------------------------------------------------- real processes
def _writer(path_dir, fingerprint, n, base, ready, go):
    t = SharedHostTier(PW, torch.int64, CAP, fingerprint=fingerprint, shm_dir=path_dir, start_reaper=False)
    keys = [key(base + i) for i in range(n)]
    pages, _ = t.reserve(n)
    half = PW // 2
    for i, p in enumerate(pages):
        t.words[p, :half].fill_(7)  # half of each page written, then stuck
    ready.set()
    go.wait(60)
    for i, p in enumerate(pages):
        t.words[p, half:].fill_(7)
    t.commit(keys, pages)
    t.close()


def _store_then_exit(path_dir, fingerprint, n, base, close):
    t = SharedHostTier(PW, torch.int64, CAP, fingerprint=fingerprint, shm_dir=path_dir, start_reaper=False)
    write(t, [key(base + i) for i in range(n)], base)
    if close:
        t.close()
    elif close is None:
        os._exit(0)  # as if killed: no close, no finaliser


def test_other_process_stores_are_hits(tmp_path):
    ctx = mp.get_context("spawn")
    a = make(tmp_path)
    try:
        p = ctx.Process(target=_store_then_exit, args=(str(tmp_path), fp(tmp_path), 5, 50, True))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        ks = [key(50 + i) for i in range(5)]
        assert a.contains_prefix(ks) == 5
        pages = a.pages_for(ks)
        assert [int(a.words[q][0]) for q in pages] == [50 + i for i in range(5)]
        assert a.first_bad_page(pages) == -1 and a.attached_processes() == 1
    finally:
        a.close()
    assert leftovers(tmp_path) == []


def test_sigkill_mid_write_leaves_no_visible_page_and_is_reclaimed(tmp_path):
    ctx = mp.get_context("spawn")
    a = make(tmp_path)
    try:
        write(a, [key(i) for i in range(CAP - 6)], 0)  # 10 published pages of our own
        ready, go = ctx.Event(), ctx.Event()
        w = ctx.Process(target=_writer, args=(str(tmp_path), fp(tmp_path), 6, 500, ready, go))
        w.start()
        assert ready.wait(120)
        assert a.attached_processes() == 2 and a.free_pages == 0
        os.kill(w.pid, signal.SIGKILL)
        w.join(30)
        assert a.contains_prefix([key(500)]) == 0  # never published
        assert a.contains_prefix([key(i) for i in range(CAP - 6)]) == CAP - 6  # ours untouched
        # the next writer short of pages gets the dead writer's six back, without evicting ours
        pages, evicted = a.reserve(6)
        assert len(pages) == 6 and evicted == [] and a.stats()["reclaimed_pages"] == 6
        a.release(pages)
        assert a.attached_processes() == 1
    finally:
        a.close()
    assert leftovers(tmp_path) == []


def test_survivor_keeps_serving_and_restart_attaches(tmp_path):
    ctx = mp.get_context("spawn")
    a = make(tmp_path)
    try:
        p = ctx.Process(target=_store_then_exit, args=(str(tmp_path), fp(tmp_path), 3, 70, False))
        p.start()
        p.join(120)  # exits without close(): as a SIGKILLed process would, its slot is dead
        assert p.exitcode == 0 and a.attached_processes() == 1
        assert a.contains_prefix([key(70 + i) for i in range(3)]) == 3  # published pages outlive it
        q = ctx.Process(target=_store_then_exit, args=(str(tmp_path), fp(tmp_path), 2, 80, True))
        q.start()
        q.join(120)
        assert q.exitcode == 0 and a.contains_prefix([key(80), key(81)]) == 2
    finally:
        a.close()
    assert leftovers(tmp_path) == []


def _attach_and_hang(path_dir, fingerprint, ready):
    t = SharedHostTier(PW, torch.int64, CAP, fingerprint=fingerprint, shm_dir=path_dir, start_reaper=True)
    write(t, [key(1)], 1)
    ready.set()
    time.sleep(600)


def test_reaper_unlinks_after_every_process_is_killed(tmp_path):
    ctx = mp.get_context("spawn")
    procs, evs = [], []
    for _ in range(2):
        ev = ctx.Event()
        p = ctx.Process(target=_attach_and_hang, args=(str(tmp_path), fp(tmp_path), ev))
        p.start()
        procs.append(p)
        evs.append(ev)
    for ev in evs:
        assert ev.wait(120)
    assert len(leftovers(tmp_path)) == 1
    # the reaper is nobody's descendant here (SGLang kills its schedulers' process trees)
    import numpy as np
    from flexflow_sglang.connector.shared_host_tier import H_REAPER_PID
    seg = os.path.join(tmp_path, leftovers(tmp_path)[0])
    deadline = time.time() + 20
    while time.time() < deadline:
        reaper = int(np.fromfile(seg, dtype=np.int64, count=H_REAPER_PID + 1)[H_REAPER_PID])
        if reaper > 0:
            break
        time.sleep(0.2)
    ppid = int(open(f"/proc/{reaper}/stat").read().rsplit(")", 1)[1].split()[1])
    assert ppid not in {p.pid for p in procs} | {os.getpid()}
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    deadline = time.time() + 20
    while leftovers(tmp_path) and time.time() < deadline:
        time.sleep(0.2)
    assert leftovers(tmp_path) == []


def _rewrite_on_signal(fingerprint, page_words, word_dtype, go, done):
    t = SharedHostTier(page_words, word_dtype, 4, fingerprint=fingerprint, start_reaper=False)
    go.wait(60)
    pages, _ = t.reserve(4)  # the tier is full: every page is a victim
    for p in pages:
        t.words[p].fill_(5)
    t.commit([key(900 + i) for i in range(4)], pages)
    t.close()
    done.set()


def test_connector_load_is_a_miss_when_a_page_is_rewritten_during_the_copy(tmp_path, monkeypatch):
    """The real connector over real SGLang pools: another process rewrites the host pages while this
    one copies them to the device; the load reports a miss, never the mixed bytes."""
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector import FlexFlowConnector, KVLayout

    kv = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=2,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    for b in kv.k_buffer + kv.v_buffer:
        b.copy_(torch.randn(b.shape))
    layout = KVLayout.from_pool(kv, 1)
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": 4, "shared": True, "pin_memory": "never"},
                            "transfer": {"mode": "sync"}}, "<test>")
    monkeypatch.setenv("FLEXFLOW_SHM_DIR", str(tmp_path))
    conn = FlexFlowConnector(layout, cfg, fingerprint={"t": "rewrite"}, start_agent=False)
    try:
        assert isinstance(conn.host, SharedHostTier)
        keys = conn.page_keys(list(range(10, 14)))
        src = torch.arange(1, 5)
        conn.store(keys, src)
        conn.poll()
        assert conn.lookup(keys) == 4
        dst = torch.arange(20, 24)
        assert conn.load(keys, dst)  # undisturbed: a hit with the right bytes
        assert all(torch.equal(k[dst], k[src]) for k in kv.k_buffer)

        ctx = mp.get_context("spawn")
        go, done = ctx.Event(), ctx.Event()
        other = ctx.Process(target=_rewrite_on_signal,
                            args=(conn._seed.hex(), layout.page_words, layout.word_dtype, go, done))
        other.start()
        real = conn.executor.host_to_device

        def copy_then_rewrite(src_t, pages, dev):
            out = real(src_t, pages, dev)
            go.set()  # the other process now evicts and rewrites every page we just read
            assert done.wait(120)
            return out

        monkeypatch.setattr(conn.executor, "host_to_device", copy_then_rewrite)
        assert not conn.load(keys, torch.arange(30, 34))
        other.join(60)
        assert other.exitcode == 0
        assert conn.metrics()["load_failures"] >= 1
    finally:
        conn.close()
    assert leftovers(tmp_path) == []


def test_pin_present_hands_pins_to_the_loader(tmp_path):
    """Pipeline stage 0 pins a later stage's pages (all present and intact, or none); the stage
    releases them after its load. A corrupt page pins nothing."""
    owner, stage0 = make(tmp_path, cap=4), None
    try:
        pages, _ = write(owner, [key(i) for i in range(3)], 0)
        stage0 = SharedHostTier(PW, torch.int64, 4, path=owner.path, start_reaper=False)
        assert stage0.pin_present([key(0), key(1), key(7)]) is None  # one missing: nothing pinned
        assert owner.stats()["pages_pinned_by_jobs"] == 0
        owner.words[pages[2], 3] += 1  # corruption after commit
        assert stage0.pin_present([key(2)]) is None and owner.stats()["pages_pinned_by_jobs"] == 0
        got = stage0.pin_present([key(0), key(1)])
        assert got == pages[:2] and owner.stats()["pages_pinned_by_jobs"] == 2
        assert set(owner.reserve(4)[0]).isdisjoint(got)  # nobody may take them now
        owner.unpin_foreign(got)
        assert owner.stats()["pages_pinned_by_jobs"] == 0
    finally:
        if stage0 is not None:
            stage0.close()
        owner.close()
    assert leftovers(tmp_path) == []


def test_stale_segment_of_dead_processes_is_removed_at_next_start(tmp_path):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_store_then_exit, args=(str(tmp_path), "a dead model", 2, 10, None))
    p.start()
    p.join(120)  # exited without close and without a reaper: its segment stays behind
    assert p.exitcode == 0 and len(leftovers(tmp_path)) == 1
    t = make(tmp_path)  # any tier starting in this directory cleans up
    try:
        assert leftovers(tmp_path) == [os.path.basename(t.path)]
    finally:
        t.close()
    assert leftovers(tmp_path) == []


def test_prefetch_into_the_shared_tier_copies_and_checksums_on_a_worker(tmp_path, monkeypatch):
    """Async engine, shared host tier: a prefetch's promotion (copy and this tier's word sums) runs
    on an engine worker; the scheduler-side commit takes those sums as they are, and a load of the
    promoted pages verifies against them."""
    import threading

    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector import FlexFlowConnector, InMemoryTier, KVLayout

    kv = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=2,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    for b in kv.k_buffer + kv.v_buffer:
        b.copy_(torch.randn(b.shape))
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": 8, "shared": True, "pin_memory": "never"}}, "<test>")
    monkeypatch.setenv("FLEXFLOW_SHM_DIR", str(tmp_path))
    deep = InMemoryTier(name="deep", node="nvme0")
    conn = FlexFlowConnector(KVLayout.from_pool(kv, 1), cfg, fingerprint={"t": "promote"}, tiers=[deep],
                             start_agent=False)
    threads = []
    real_sums = SharedHostTier.page_sums

    def spy(self, pages):
        threads.append(threading.current_thread().name)
        return real_sums(self, pages)
    try:
        assert isinstance(conn.host, SharedHostTier) and conn.engine.is_async
        keys = conn.page_keys(list(range(40, 46)))
        src = torch.arange(1, 7)
        conn.store(keys, src)
        assert conn.drain(10) and conn.host.contains_prefix(keys) == 6
        rows = conn.host.words[torch.as_tensor(conn.host.pages_for(keys))]
        assert deep.put_many(keys, rows.view(torch.uint8).numpy()) == 6  # the deep tier's copy ...
        assert conn.host.discard(keys) == 6  # ... is the only one now
        monkeypatch.setattr(SharedHostTier, "page_sums", spy)
        h = conn.prefetch(keys)
        assert conn.drain(10) and h.done and h.pages == 6 and not h.failed
        assert threads and all(t.startswith(conn.engine.name) for t in threads), threads
        dst = torch.arange(20, 26)
        r = conn.load(keys, dst)
        assert r.ok and r.host_pages == 6
        assert all(torch.equal(b[dst], b[src]) for b in kv.k_buffer + kv.v_buffer)
    finally:
        conn.close()
