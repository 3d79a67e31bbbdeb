"""Storage tier, slab layout (`storage_tier.layout: slabs`): byte equality, restart with LRU order,
slot reuse at capacity, damage of every kind as a miss, read-only, a full disk, the files layout's
entries left alone, concurrent reads and writes under eviction, and the config key.

Every test runs through NIXL's POSIX backend (marked nixl) and the os backend, each with the compiled
positioned-I/O batch (_file_batch.transfer_at) and with its Python twin."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading

import numpy as np
import pytest

from flexflow_sglang.tiers import storage as storage_mod
from flexflow_sglang.tiers.base import KVTier
from flexflow_sglang.tiers.storage import StorageTier, StorageTierError
from flexflow_sglang.tiers.storage_files import HDR
from flexflow_sglang.tiers.storage_slabs import SB, STAMP, SlabStorageTier

from tier_helpers import STORAGE_BACKENDS, storage_tiers, use_storage_backend

P = 4096 + 96  # not a multiple of 4 KiB: payload offsets must not assume alignment
SLOT = HDR + STAMP + P


def keys_for(n, tag=b"k"):
    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


def pages_for(n, seed=0, p=P):
    return np.random.default_rng(seed).integers(0, 256, size=(n, p), dtype=np.uint8)


@pytest.fixture(params=STORAGE_BACKENDS)
def backend(request, monkeypatch):
    return use_storage_backend(request.param, monkeypatch)


@pytest.fixture
def make(tmp_path, backend):
    yield from storage_tiers(SlabStorageTier, tmp_path / "kv")


def slab_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".kvs"))


def where(t, key):
    """(slab file path, header offset, payload offset) of a stored page."""
    s, slot = t._loc[t._name(key)]
    sl = t._slabs[s]
    return os.path.join(t.path, sl.name), sl.hdr_off(slot), sl.page_off(slot)


def patch(path, off, data):
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def test_put_get_byte_equal_in_one_slab(make, backend):
    t = make()
    assert isinstance(t, KVTier) and t.layout == "slabs"
    s = t.stats()
    assert s["backend"] == ("nixl-posix" if backend == "nixl" else "os") and s["layout"] == "slabs"
    ks, pg = keys_for(40), pages_for(40)
    assert t.contains_prefix(ks) == 0
    assert t.put_many(ks, pg) == 40
    assert t.contains_prefix(ks) == 40 and t.contains_prefix(ks[:5] + keys_for(1, b"other")) == 5
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 40 and np.array_equal(out, pg)
    # a prefix whose 4th key is unknown: 3 pages
    assert t.get_many_into(ks[:3] + keys_for(1, b"zz") + ks[3:], np.zeros((41, P), np.uint8)) == 3
    s = t.stats()
    assert s["hits"] == 43 and s["bytes_written"] == 40 * P and s["pages"] == 40 and s["used_bytes"] == 40 * SLOT
    assert t.put_many(ks, pg) == 40 and t.stats()["pages_written"] == 40  # held already: no rewrite
    # one preallocated file, owner-only, named by number (never by request content)
    assert slab_files(t.path) == ["slab-0000.kvs"] and not [f for f in os.listdir(t.path) if f.endswith(".kv")]
    assert os.stat(os.path.join(t.path, "slab-0000.kvs")).st_mode & 0o777 == 0o600
    assert os.stat(t.path).st_mode & 0o777 == 0o700


def test_torch_rows_of_a_bigger_buffer(make):
    torch = pytest.importorskip("torch")
    t = make()
    ks = keys_for(3)
    src = torch.randint(0, 256, (3, P), dtype=torch.uint8)
    assert t.put_many(ks, src) == 3
    out = torch.zeros((5, P), dtype=torch.uint8)
    assert t.get_many_into(ks, out[1:4]) == 3
    assert torch.equal(out[1:4], src) and not out[0].any() and not out[4].any()


def test_restart_keeps_pages_and_their_lru_order(make):
    a, b, c = (keys_for(1, bytes([x])) for x in b"abc")
    t = make()
    for k, seed in ((a, 1), (b, 2), (c, 3)):
        assert t.put_many(k, pages_for(1, seed)) == 1
    assert t.get_many_into(a, np.zeros((1, P), np.uint8)) == 1  # a is now the most recent
    t.close()
    t.close()  # idempotent
    assert t.get_many_into(a, np.zeros((1, P), np.uint8)) == 0  # closed: a miss, not a crash
    t2 = make(capacity_bytes=2 * SLOT)  # a smaller capacity evicts the least recently used at start
    assert t2.stats()["pages"] == 2 and t2.contains_prefix(b) == 0
    out = np.zeros((1, P), np.uint8)
    assert t2.get_many_into(a, out) == 1 and np.array_equal(out, pages_for(1, 1))
    assert t2.get_many_into(c, out) == 1 and np.array_equal(out, pages_for(1, 3))


def test_a_second_process_on_the_dir_is_refused(make):
    t = make()
    with pytest.raises(StorageTierError, match="in use"):
        SlabStorageTier(t.path)


def test_at_capacity_slots_are_reused_and_no_file_is_created_or_deleted(make):
    t = make(capacity_bytes=4 * SLOT)
    ks = keys_for(10)
    for i, k in enumerate(ks):
        assert t.put_many([k], pages_for(1, seed=i)) == 1
    size = os.stat(os.path.join(t.path, "slab-0000.kvs")).st_size
    ino = os.stat(os.path.join(t.path, "slab-0000.kvs")).st_ino
    assert t.contains_prefix(ks[6:]) == 4 and t.contains_prefix(ks[5:6]) == 0
    s = t.stats()
    assert s["evictions"] == 6 and s["used_bytes"] == 4 * SLOT and s["slabs"] == 1
    for i in range(6, 10):
        out = np.zeros((1, P), np.uint8)
        assert t.get_many_into(ks[i:i + 1], out) == 1 and np.array_equal(out, pages_for(1, seed=i))
    # a batch bigger than the tier keeps its leading pages (never evicts its own)
    big = keys_for(6, b"big")
    assert t.put_many(big, pages_for(6)) == 4 and t.contains_prefix(big) == 4
    st = os.stat(os.path.join(t.path, "slab-0000.kvs"))
    assert slab_files(t.path) == ["slab-0000.kvs"] and (st.st_size, st.st_ino) == (size, ino)


def test_slabs_grow_up_to_the_capacity(make):
    t = make(capacity_bytes=10 * SLOT, slab_bytes=4 * P)  # 4 slots per slab
    ks, pg = keys_for(12), pages_for(12)
    assert t.put_many(ks, pg) == 10
    assert slab_files(t.path) == ["slab-0000.kvs", "slab-0001.kvs", "slab-0002.kvs"]
    assert t.stats()["free_slots"] == 0
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 10 and np.array_equal(out[:10], pg[:10])


def test_corrupt_payload_is_a_miss_and_stays_gone_after_restart(make):
    t = make()
    ks, pg = keys_for(3), pages_for(3)
    t.put_many(ks, pg)
    path, _, off = where(t, ks[1])
    patch(path, off + 17, bytes([pg[1, 17] ^ 0x10]))  # one flipped bit
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 1 and np.array_equal(out[0], pg[0])
    assert t.stats()["corrupt_dropped"] == 1 and t.contains_prefix(ks[1:2]) == 0
    assert t.contains_prefix(ks[2:]) == 1  # the others stay
    t.close()
    t2 = make()
    assert t2.contains_prefix(ks[1:2]) == 0 and t2.contains_prefix(ks[2:]) == 1  # its header was zeroed


def test_swapped_words_and_swapped_slots_are_misses(make):
    t = make()
    ks, pg = keys_for(3), pages_for(3)
    t.put_many(ks, pg)
    path, _, off = where(t, ks[0])
    with open(path, "r+b") as f:  # swap two 8-byte words of page 0's payload
        f.seek(off + 40)
        a = f.read(8)
        f.seek(off + 72)
        b = f.read(8)
        assert a != b
        f.seek(off + 40)
        f.write(b)
        f.seek(off + 72)
        f.write(a)
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0 and t.stats()["corrupt_dropped"] == 1
    # a half-reused slot: page 2's header over page 1's slot (its payload is page 1's)
    p1, h1, _ = where(t, ks[1])
    p2, h2, _ = where(t, ks[2])
    with open(p2, "rb") as f:
        f.seek(h2)
        head2 = f.read(HDR)
    patch(p1, h1, head2)
    assert t.get_many_into(ks[1:], np.zeros((2, P), np.uint8)) == 0  # page 1: its key's header is gone


@pytest.mark.parametrize("damage", ["truncated", "magic", "geometry"])
def test_a_damaged_slab_is_dropped_at_start(make, damage):
    t = make()
    ks = keys_for(4)
    t.put_many(ks, pages_for(4))
    path = os.path.join(t.path, "slab-0000.kvs")
    t.close()
    if damage == "truncated":
        os.truncate(path, os.stat(path).st_size - 1)
    elif damage == "magic":
        patch(path, 0, b"XXXX")
    else:
        patch(path, 8, (0).to_bytes(4, "little"))  # zero slots (the superblock checksum catches it)
    t2 = make()
    s = t2.stats()
    assert s["pages"] == 0 and s["scan_dropped"] == 1 and not slab_files(t2.path)
    assert t2.put_many(ks, pages_for(4)) == 4  # and the tier works on


def test_a_foreign_fingerprint_is_not_read(make, tmp_path):
    t = make()
    ks = keys_for(2)
    t.put_many(ks, pages_for(2))
    t.close()
    t2 = make(fingerprint="model-B|layout-1")
    assert t2.contains_prefix(ks) == 0 and t2.stats()["scan_dropped"] == 1


def test_discarded_pages_stay_gone_after_restart(make):
    t = make()
    ks, pg = keys_for(4), pages_for(4)
    t.put_many(ks, pg)
    t.discard(ks[2:])
    assert t.contains_prefix(ks) == 2 and t.stats()["used_bytes"] == 2 * SLOT
    t.close()
    t2 = make()
    assert t2.contains_prefix(ks) == 2 and t2.contains_prefix(ks[2:]) == 0


def test_read_only_serves_and_changes_nothing(make, tmp_path):
    t = make()
    ks, pg = keys_for(3), pages_for(3)
    t.put_many(ks, pg)
    t.close()
    path = os.path.join(t.path, "slab-0000.kvs")
    before = (os.stat(path).st_mtime_ns, open(path, "rb").read())
    ro = make(read_only=True)
    out = np.zeros_like(pg)
    assert ro.get_many_into(ks, out) == 3 and np.array_equal(out, pg)
    assert ro.put_many(ks + keys_for(2, b"new"), pages_for(5)) == 3
    assert ro.stats()["read_only_skipped"] == 2
    ro.discard(ks[:1])
    assert ro.contains_prefix(ks) == 0  # forgotten here...
    ro.close()
    assert (os.stat(path).st_mtime_ns, open(path, "rb").read()) == before  # ...and nothing written


def test_the_files_layout_entries_are_left_alone(tmp_path, make, caplog):
    files = StorageTier(str(tmp_path / "kv"), capacity_gb=1.0, fingerprint="model-A|layout-1")
    ks = keys_for(3)
    files.put_many(ks, pages_for(3))
    files.close()
    caplog.set_level(logging.WARNING, logger="flexflow_sglang.tiers.storage")
    t = make()
    assert t.stats()["foreign_files"] == 3 and t.contains_prefix(ks) == 0
    assert len([f for f in os.listdir(t.path) if f.endswith(".kv")]) == 3
    assert any("files layout" in r.getMessage() for r in caplog.records)


def test_a_full_disk_at_slab_creation_degrades_and_recovers(make, monkeypatch):
    t = make(disk_full_retry_s=3600)

    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage_mod, "_preallocate", full)
    ks, pg = keys_for(3), pages_for(3)
    assert t.put_many(ks, pg) == 0
    assert t.put_many(ks, pg) == 0  # degraded: not tried again
    s = t.stats()
    assert s["disk_full"] == 1 and s["write_degraded"] and s["writes_skipped"] == 3
    assert not slab_files(t.path) and s["used_bytes"] == 0
    monkeypatch.setattr(storage_mod, "_preallocate", lambda fd, size: None)
    t._degraded_until = 0
    assert t.put_many(ks, pg) == 3


def test_a_symlink_named_like_a_slab_is_skipped_not_followed(make, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not yours" * 100)
    os.makedirs(tmp_path / "kv", mode=0o700)
    os.symlink(target, tmp_path / "kv" / "slab-0000.kvs")
    t = make()
    assert t.stats()["odd_skipped"] == 1 and t.stats()["pages"] == 0
    assert target.read_bytes() == b"not yours" * 100


def test_a_slab_readable_by_others_is_tightened(make):
    t = make()
    t.put_many(keys_for(1), pages_for(1))
    t.close()
    path = os.path.join(t.path, "slab-0000.kvs")
    os.chmod(path, 0o644)
    t2 = make()
    assert t2.stats()["modes_tightened"] == 1 and os.stat(path).st_mode & 0o777 == 0o600
    assert t2.contains_prefix(keys_for(1)) == 1


def test_a_wrong_page_size_is_a_miss_or_an_error(make):
    t = make()
    ks = keys_for(2)
    t.put_many(ks, pages_for(2))
    assert t.get_many_into(ks, np.zeros((2, P + 1), np.uint8)) == 0 and t.stats()["size_mismatch"] == 1
    with pytest.raises(ValueError, match="page_nbytes"):
        t.put_many(keys_for(1, b"x"), pages_for(1, p=P + 1))
    assert t.get_many_into(ks, np.zeros((2, P), np.uint8)) == 2


def test_concurrent_writes_under_eviction_never_return_wrong_bytes(make):
    """Writers keep evicting and reusing slots while readers read: every page a read returns is the
    page stored under that key (slot reuse may make a read short, never wrong)."""
    t = make(capacity_bytes=24 * SLOT)
    per_key = {}
    ks = keys_for(200)
    for i, k in enumerate(ks):
        per_key[k] = pages_for(1, seed=i)[0]
    stop, errors = threading.Event(), []

    def writer(part):
        for rnd in range(3):
            for i in range(part, len(ks), 2):
                t.put_many([ks[i]], per_key[ks[i]][None])

    def reader():
        out = np.zeros((4, P), np.uint8)
        rng = np.random.default_rng(0)
        while not stop.is_set():
            i = int(rng.integers(0, len(ks) - 4))
            k = t.get_many_into(ks[i:i + 4], out)
            for j in range(k):
                if not np.array_equal(out[j], per_key[ks[i + j]]):
                    errors.append(i + j)
    ws = [threading.Thread(target=writer, args=(p,)) for p in (0, 1)]
    rs = [threading.Thread(target=reader) for _ in range(2)]
    for th in ws + rs:
        th.start()
    for th in ws:
        th.join(60)
    stop.set()
    for th in rs:
        th.join(60)
    assert not errors
    s = t.stats()
    assert s["pages"] <= 24 and s["evictions"] > 0 and s["corrupt_dropped"] == 0


def test_fsync_counts_one_per_slab_per_write(make):
    t = make(fsync=True)
    t.put_many(keys_for(3), pages_for(3))
    assert t.stats()["fsyncs"] == 1


def test_peek_page_nbytes_reads_the_superblock(make):
    t = make()
    assert SlabStorageTier.peek_page_nbytes(t.path) is None
    t.put_many(keys_for(1), pages_for(1))
    assert SlabStorageTier.peek_page_nbytes(t.path) == P


def test_the_config_key_selects_the_layout(tmp_path):
    from flexflow_sglang.config import ConfigError, config_from_dict
    from flexflow_sglang.tiers import storage_from_config
    cfg = config_from_dict({"storage_tier": {"enabled": True, "path": str(tmp_path / "s")}}, "<t>")
    t = storage_from_config(cfg.storage_tier, fingerprint="fp")
    try:
        assert isinstance(t, SlabStorageTier) and t.stats()["layout"] == "slabs"  # the default
    finally:
        t.close()
    cfg = config_from_dict({"storage_tier": {"path": str(tmp_path / "f"), "layout": "files"}}, "<t>")
    t = storage_from_config(cfg.storage_tier, fingerprint="fp")
    try:
        assert type(t) is StorageTier
    finally:
        t.close()
    with pytest.raises(ConfigError, match="storage_tier.layout"):
        config_from_dict({"storage_tier": {"layout": "blocks"}}, "<t>")


def test_superblock_size_matches_the_layout_constants():
    assert SB == 64 and STAMP == 8 and HDR == 64
