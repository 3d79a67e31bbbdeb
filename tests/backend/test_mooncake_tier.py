"""HiCacheStorageTier over SGLang's `mooncake` HiCache backend, for real: a `mooncake_master` on
loopback (TCP transport), two tier instances (two "servers", each its own Mooncake client and
segment) sharing pages, integrity of what the store returns, and a master killed and restarted
mid-run (misses within a bounded time, no hang, recovery)."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from mooncake_fixture import MooncakeMaster, need_mooncake  # noqa: E402

PAGE = 8192
FP = "model=tiny|mooncake-test"


def keys_of(n, salt=b""):
    out, h = [], b"mc" + salt
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(h)
    return out


def pages_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)


@pytest.fixture
def master(tmp_path):
    need_mooncake()
    m = MooncakeMaster(tmp_path).start()
    yield m
    m.kill()


def tier(master, **kw):
    from flexflow_sglang.backend.hicache_tier import HiCacheStorageTier
    kw.setdefault("timeout_ms", 3000)
    kw.setdefault("retry_after_s", 1.0)
    return HiCacheStorageTier("mooncake", fingerprint=FP, page_nbytes=PAGE, extra_config=master.extra_config(),
                              staging_mb=1, **kw)


def test_two_servers_share_pages_through_the_store(master):
    a = tier(master)
    b = tier(master)
    try:
        assert a.stats()["backend"] == "hicache-mooncake"
        keys, pages = keys_of(300), pages_of(300)          # > one staging buffer (127 objects)
        assert b.contains_prefix(keys) == 0
        assert a.put_many(keys, pages) == 300
        assert a.put_many(keys[:10], pages[:10]) == 10     # already held: still "held"
        assert b.contains_prefix(keys) == 300
        out = np.zeros_like(pages)
        assert b.get_many_into(keys, out) == 300
        assert np.array_equal(out, pages)                  # byte-equal across two clients
        st = b.stats()
        assert st["hits"] == 300 and st["read_gbps"] > 0 and st["backend_errors"] == 0
        # a prefix that continues past what is stored: the leading run
        more = keys + keys_of(5, b"tail")
        assert b.contains_prefix(more) == 300
        out2 = np.zeros((305, PAGE), dtype=np.uint8)
        assert b.get_many_into(more, out2) == 300
    finally:
        a.close()
        b.close()


def test_a_page_changed_in_the_store_is_a_miss(master):
    a = tier(master)
    try:
        keys, pages = keys_of(4, b"c"), pages_of(4, seed=1)
        assert a.put_many(keys, pages) == 4
        name = a._names([keys[2]])[0]
        # another writer replaces the object's bytes (same length): the CRC catches it
        bad = np.zeros((1, a.obj_nbytes), dtype=np.uint8)
        store = a.backend.store
        raw = np.zeros(a.obj_nbytes, dtype=np.uint8)
        assert store.get_into(name, raw.ctypes.data, raw.nbytes) == a.obj_nbytes
        bad[0] = raw
        bad[0, -1] ^= 0xFF
        assert store.register_buffer(bad.ctypes.data, bad.nbytes) == 0
        assert store.upsert_from(name, bad.ctypes.data, bad.nbytes) == 0
        out = np.zeros_like(pages)
        assert a.get_many_into(keys, out) == 2
        st = a.stats()
        assert st["corrupt_dropped"] == 1
        # dropped (removed, or quarantined while its lease runs): a miss from now on, and a put heals it
        assert a.contains_prefix(keys) == 2
        assert a.put_many(keys, pages) == 4
        assert a.get_many_into(keys, out) == 4 and np.array_equal(out, pages)
        store.unregister_buffer(bad.ctypes.data)
    finally:
        a.close()


def test_master_killed_mid_run_misses_fast_then_recovers(master):
    a = tier(master)
    b = tier(master)
    try:
        keys, pages = keys_of(32, b"k"), pages_of(32, seed=2)
        assert a.put_many(keys, pages) == 32
        out = np.zeros_like(pages)
        assert b.get_many_into(keys, out) == 32

        master.kill()
        t0 = time.monotonic()
        assert b.contains_prefix(keys) == 0
        assert b.get_many_into(keys, out) == 0
        assert a.put_many(keys_of(8, b"while-down"), pages[:8]) == 0
        assert b.contains_prefix(keys) == 0
        took = time.monotonic() - t0
        # a dead master answers RPC_FAIL at once: the first call marks the tier down, the rest do not
        # even reach the store (measured: a few ms for all four); bounded by timeout_ms in any case
        assert took < 5.0, f"calls against a dead master took {took:.1f} s"
        st = b.stats()
        assert st["backend_errors"] + st["timeouts"] >= 1 and st["misses"] >= 32

        master.start()                                  # same port, empty metadata
        deadline = time.monotonic() + 60
        new_keys, new_pages = keys_of(16, b"after"), pages_of(16, seed=3)
        stored = 0
        while time.monotonic() < deadline:
            stored = a.put_many(new_keys, new_pages)
            if stored == 16:
                break
            time.sleep(1.0)
        assert stored == 16, (a.stats(), master.tail())
        out2 = np.zeros_like(new_pages)
        got = 0
        while time.monotonic() < deadline:
            got = b.get_many_into(new_keys, out2)
            if got == 16:
                break
            time.sleep(1.0)
        assert got == 16 and np.array_equal(out2, new_pages), b.stats()
        # what the dead master indexed is gone with it (0.3.13: a miss); whatever is served is right
        out3 = np.zeros_like(pages)
        old = b.get_many_into(keys, out3)
        assert np.array_equal(out3[:old], pages[:old])
    finally:
        a.close()
        b.close()
