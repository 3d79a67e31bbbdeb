"""Storage tier: byte equality, restart persistence, damaged files, permissions, eviction, full disk.

Most tests run four times: through NIXL's POSIX backend (marked nixl) and through the plain-os fallback
that is used when nixl cannot be imported, each with the compiled per-file batch helpers and with their
Python twin."""
from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest

from flexflow_sglang.tiers import storage as storage_mod
from flexflow_sglang.tiers.base import KVTier, page_checksum
from flexflow_sglang.tiers.storage import HDR, StorageTier, StorageTierError

from tier_helpers import NIXL_WHY, STORAGE_BACKENDS, requires_nixl, storage_tiers, use_storage_backend

P = 4096 + 123  # an odd page size: nothing may assume alignment


def keys_for(n, tag=b"k"):
    import hashlib
    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


def pages_for(n, seed=0, p=P):
    return np.random.default_rng(seed).integers(0, 256, size=(n, p), dtype=np.uint8)


@pytest.fixture(params=STORAGE_BACKENDS)
def backend(request, monkeypatch):
    """nixl / os: the data path; -python: the per-file system calls made from Python (the twin of the
    compiled _file_batch helpers, used when the extension is not built): same checks, same outcome."""
    return use_storage_backend(request.param, monkeypatch)


@pytest.fixture
def make(tmp_path, backend):
    yield from storage_tiers(StorageTier, tmp_path / "kv")


def files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


def test_put_get_byte_equal(make, backend):
    t = make()
    assert isinstance(t, KVTier)
    assert t.stats()["backend"] == ("nixl-posix" if backend == "nixl" else "os")
    ks, pg = keys_for(20), pages_for(20)
    assert t.contains_prefix(ks) == 0
    assert t.put_many(ks, pg) == 20
    assert t.contains_prefix(ks) == 20
    assert t.contains_prefix(ks[:5] + keys_for(1, b"other")) == 5
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 20
    assert np.array_equal(out, pg)
    # a prefix whose 4th key is unknown: 3 pages
    out[:] = 0
    assert t.get_many_into(ks[:3] + keys_for(1, b"zz") + ks[3:], np.zeros((21, P), np.uint8)) == 3
    s = t.stats()
    assert s["hits"] == 23 and s["bytes_written"] == 20 * P and s["pages"] == 20
    # re-putting is a no-op that still reports the leading count
    assert t.put_many(ks, pg) == 20 and t.stats()["pages_written"] == 20


def test_scheduler_thread_calls_never_wait_for_the_io_lock(make):
    """stats() (the metrics export) and contains_prefix() (match_prefix) run on SGLang's scheduler
    thread; a worker holds the I/O lock for a whole chunk of file I/O. They must answer anyway."""
    import threading
    import time
    t = make()
    ks, pg = keys_for(8), pages_for(8)
    assert t.put_many(ks, pg) == 8
    held, release = threading.Event(), threading.Event()

    def worker():
        with t._lock:  # as get_many_into / put_many do around their I/O
            held.set()
            release.wait(10)
    th = threading.Thread(target=worker)
    th.start()
    try:
        assert held.wait(5)
        t0 = time.monotonic()
        assert t.contains_prefix(ks) == 8 and t.stats()["pages"] == 8
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        th.join()


def test_torch_tensors(make):
    torch = pytest.importorskip("torch")
    t = make()
    ks = keys_for(3)
    src = torch.randint(0, 256, (3, P), dtype=torch.uint8)
    assert t.put_many(ks, src) == 3
    out = torch.zeros((5, P), dtype=torch.uint8)
    assert t.get_many_into(ks, out[1:4]) == 3  # a row slice of a bigger buffer
    assert torch.equal(out[1:4], src) and not out[0].any() and not out[4].any()


def test_restart_hits_pages_from_before(make, tmp_path):
    ks, pg = keys_for(8), pages_for(8)
    t = make()
    assert t.put_many(ks, pg) == 8
    t.close()
    t.close()  # idempotent
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0  # closed: a miss, not a crash
    t2 = make()
    assert t2.stats()["pages"] == 8
    assert t2.contains_prefix(ks) == 8
    out = np.zeros_like(pg)
    assert t2.get_many_into(ks, out) == 8 and np.array_equal(out, pg)


def test_second_process_on_same_dir_is_refused(make):
    t = make()
    with pytest.raises(StorageTierError, match="in use"):
        StorageTier(t.path)


def test_names_are_keyed_hashes_and_modes(make, tmp_path):
    old = os.umask(0)
    try:
        t = make()
    finally:
        os.umask(old)
    ks = [b"\x00" * 32, b"prompt text that must never become a file name!!"[:32]]
    t.put_many(ks, pages_for(2))
    d = tmp_path / "kv"
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    names = files(d)
    assert len(names) == 2
    for nm in names:
        assert stat.S_IMODE(os.stat(d / nm).st_mode) == 0o600
        assert len(nm) == 35 and all(c in "0123456789abcdef" for c in nm[:32])
    assert ks[0].hex()[:32] + ".kv" not in names and not any("prompt" in n for n in os.listdir(d))
    # the same key under another fingerprint lands under another name
    t.close()
    t2 = make(tmp_path / "kv2", fingerprint="model-B|layout-1")
    t2.put_many(ks[:1], pages_for(1))
    assert files(tmp_path / "kv2")[0] not in names


def test_existing_dir_is_tightened(tmp_path, make):
    d = tmp_path / "loose"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    make(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def _file_of(t, key):
    return os.path.join(t.path, t._name(key))


def test_corrupt_payload_is_a_miss_and_dropped(make):
    t = make()
    ks, pg = keys_for(6), pages_for(6)
    t.put_many(ks, pg)
    with open(_file_of(t, ks[3]), "r+b") as f:
        f.seek(HDR + 100)
        b = f.read(1)
        f.seek(HDR + 100)
        f.write(bytes([b[0] ^ 0x40]))
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 3
    assert np.array_equal(out[:3], pg[:3])
    assert not os.path.exists(_file_of(t, ks[3]))
    s = t.stats()
    assert s["corrupt_dropped"] == 1 and s["pages"] == 5
    assert t.contains_prefix(ks) == 3
    assert t.get_many_into(ks[4:], out[:2]) == 2  # the pages after it are intact


@pytest.mark.parametrize("damage", ["truncate", "version", "magic", "header_bit", "fingerprint", "empty"])
def test_damaged_files_dropped_at_restart(make, damage):
    t = make()
    ks, pg = keys_for(4), pages_for(4)
    t.put_many(ks, pg)
    path = _file_of(t, ks[1])
    t.close()
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(HDR + P // 2)
        elif damage == "empty":
            f.truncate(0)
        elif damage == "magic":
            f.write(b"NOPE")
        elif damage == "header_bit":
            f.seek(20)
            f.write(b"\xff")
        else:  # rewrite a valid-looking header: other version / other fingerprint, header CRC fixed up
            raw = bytearray(f.read(HDR))
            if damage == "version":
                struct.pack_into("<H", raw, 4, 2)
            else:
                raw[20:36] = b"\x11" * 16
            struct.pack_into("<I", raw, 60, page_checksum(bytes(raw[:60])))
            f.seek(0)
            f.write(raw)
    t2 = make()
    assert not os.path.exists(path)
    assert t2.stats()["scan_dropped"] == 1 and t2.stats()["pages"] == 3
    out = np.zeros_like(pg)
    assert t2.get_many_into(ks, out) == 1 and np.array_equal(out[0], pg[0])
    assert t2.get_many_into(ks[2:], out[:2]) == 2


def test_foreign_fingerprint_dir_is_cleared(make, tmp_path):
    t = make()
    t.put_many(keys_for(3), pages_for(3))
    t.close()
    t2 = make(fingerprint="model-B|layout-1")
    assert t2.contains_prefix(keys_for(3)) == 0
    assert t2.stats()["scan_dropped"] == 3 and files(tmp_path / "kv") == []


def test_damage_while_running_and_missing_file(make):
    t = make()
    ks, pg = keys_for(5), pages_for(5)
    t.put_many(ks, pg)
    os.unlink(_file_of(t, ks[2]))                  # vanished
    with open(_file_of(t, ks[4]), "r+b") as f:     # truncated under the running tier
        f.truncate(10)
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 2
    assert t.get_many_into(ks[3:], out[:2]) == 1
    assert t.stats()["corrupt_dropped"] == 2
    assert t.contains_prefix(ks) == 2
    # a stray temp file from a crashed writer is removed at the next start; foreign files stay
    open(os.path.join(t.path, ".tmp." + "a" * 32 + ".dead"), "wb").close()
    open(os.path.join(t.path, "README"), "w").close()
    t.close()
    make()
    names = os.listdir(t.path)
    assert "README" in names and not any(n.startswith(".tmp.") for n in names)


def test_wrong_page_size_is_a_miss(make):
    t = make()
    ks = keys_for(2)
    t.put_many(ks, pages_for(2))
    assert t.get_many_into(ks, np.zeros((2, P + 1), np.uint8)) == 0
    assert t.stats()["size_mismatch"] == 1 and t.stats()["corrupt_dropped"] == 0
    assert t.get_many_into(ks, np.zeros((2, P), np.uint8)) == 2  # the files were kept


def test_capacity_lru_eviction(make):
    size = HDR + P
    t = make(capacity_bytes=4 * size)
    a, b, c, d, e = (keys_for(1, bytes([x])) for x in b"abcde")
    for k in (a, b, c):
        assert t.put_many(k, pages_for(1)) == 1
    assert t.get_many_into(a, np.zeros((1, P), np.uint8)) == 1  # a is now most recent
    assert t.put_many(d + e, pages_for(2)) == 2                   # evicts b (LRU), keeps a
    assert t.contains_prefix(a) == 1 and t.contains_prefix(b) == 0
    assert t.contains_prefix(c + d + e) == 3
    s = t.stats()
    assert s["evictions"] == 1 and s["used_bytes"] <= 4 * size
    assert len(files(t.path)) == 4
    # a batch bigger than the tier keeps its leading pages
    big = keys_for(6, b"big")
    assert t.put_many(big, pages_for(6)) == 4
    assert t.contains_prefix(big) == 4 and len(files(t.path)) == 4
    # LRU order survives a restart (mtime); a smaller capacity evicts at start
    t.close()
    t2 = make(capacity_bytes=2 * size)
    assert t2.contains_prefix(big[2:4]) == 2 and t2.stats()["pages"] == 2


def _hook_preallocate(monkeypatch, fn):
    """Replace the tier's fallocate step with `fn`. The compiled batch create calls posix_fallocate
    itself, so file creation goes through the Python twin while hooked (test_real_enospc_on_tiny_tmpfs
    and the create/publish tests cover the compiled one)."""
    monkeypatch.setattr(storage_mod, "_preallocate", fn)
    monkeypatch.setattr(storage_mod, "_fb", None)


def test_disk_full_degrades_with_one_warning(make, monkeypatch, caplog):
    t = make(disk_full_retry_s=3600)
    ks, pg = keys_for(6), pages_for(6)
    assert t.put_many(ks[:2], pg[:2]) == 2
    calls = {"n": 0}

    def full(fd, size):
        calls["n"] += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    _hook_preallocate(monkeypatch, full)
    caplog.set_level(logging.WARNING, logger="flexflow_sglang.tiers.storage")
    assert t.put_many(ks, pg) == 2          # nothing new, no crash
    assert t.put_many(ks, pg) == 2          # degraded: not even tried
    assert t.put_many(keys_for(3, b"x"), pages_for(3)) == 0
    assert calls["n"] == 1
    s = t.stats()
    assert s["disk_full"] == 1 and s["write_degraded"] and s["writes_skipped"] == 4 + 4 + 3
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1
    assert not [n for n in os.listdir(t.path) if n.startswith(".tmp.")]
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 2 and np.array_equal(out[:2], pg[:2])  # reads still work
    # after the retry period, writes are tried again
    _hook_preallocate(monkeypatch, lambda fd, size: None)
    t._degraded_until = 0
    assert t.put_many(ks, pg) == 6


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="needs root to mount a tmpfs")
def test_real_enospc_on_tiny_tmpfs(tmp_path, make):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.decode().strip()}")
    try:
        t = make(mnt / "kv", capacity_gb=1.0)  # capacity far above the real space
        ks, pg = keys_for(40), pages_for(40)
        n = t.put_many(ks, pg)
        assert 0 < n < 40
        s = t.stats()
        assert s["disk_full"] == 1 and s["write_degraded"]
        out = np.zeros_like(pg)
        assert t.get_many_into(ks, out) == n and np.array_equal(out[:n], pg[:n])
        assert not [x for x in os.listdir(t.path) if x.startswith(".tmp.")]
        t.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@requires_nixl
@pytest.mark.nixl
def test_gds_never_created_without_gpu(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flexflow_sglang.tiers.storage")
    ok, why = storage_mod._gds_usable()
    if ok:
        pytest.skip("this machine has a GPU and cuFile")
    t = StorageTier(str(tmp_path / "g"), capacity_gb=0.1, backend="gds")
    try:
        assert set(t._agent.backends) == {"POSIX"}
        assert t.stats()["backend"] == "nixl-posix"
        assert any("backend=gds requested" in r.getMessage() for r in caplog.records)
    finally:
        t.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        StorageTier(str(tmp_path / "a"), backend="nvme")
    with pytest.raises(ValueError):
        StorageTier(str(tmp_path / "b"), eviction="fifo")
    t = StorageTier(str(tmp_path / "c"), capacity_gb=0.01)
    try:
        with pytest.raises(TypeError):
            t.put_many(["not bytes"], pages_for(1))
        with pytest.raises(ValueError):
            t.put_many(keys_for(2), pages_for(1))
        with pytest.raises(ValueError):
            t.get_many_into(keys_for(1), np.zeros((1, P), np.float32))
    finally:
        t.close()


def test_nixl_reason_exposed():
    # the suite states which path it exercised
    assert NIXL_WHY == "" or isinstance(NIXL_WHY, str)


def test_a_long_write_lets_waiting_reads_in_between_its_chunks(make, monkeypatch):
    """A write-through of a long prompt is written chunk by chunk, the lock released between chunks,
    and a read waiting meanwhile (a prefetch a queued request waits on) goes first: it returns while
    the write is still running, with the right bytes, and the write still stores every page."""
    import threading
    import time
    monkeypatch.setattr(storage_mod, "WRITE_CHUNK_BYTES", 2 * (HDR + P))  # 2 pages per chunk
    t = make()
    old_k, old_p = keys_for(4, b"old"), pages_for(4, seed=1)
    assert t.put_many(old_k, old_p) == 4
    real_write, chunks = t._write, []

    def slow_write(*a):
        chunks.append(time.monotonic())
        time.sleep(0.05)  # a busy disk
        return real_write(*a)
    monkeypatch.setattr(t, "_write", slow_write)
    new_k, new_p = keys_for(20, b"new"), pages_for(20, seed=2)
    done = threading.Event()
    th = threading.Thread(target=lambda: (t.put_many(new_k, new_p), done.set()))
    th.start()
    while not chunks:
        time.sleep(0.001)
    out = np.zeros((4, P), dtype=np.uint8)
    assert t.get_many_into(old_k, out) == 4 and np.array_equal(out, old_p)
    assert not done.is_set(), "the read waited for the whole write"
    th.join(10)
    assert done.is_set() and len(chunks) == 10
    got = np.zeros((20, P), dtype=np.uint8)
    assert t.get_many_into(new_k, got) == 20 and np.array_equal(got, new_p)


def _block_file_creation(monkeypatch):
    """Make the next write stop inside its file creation (fallocate) until released."""
    import threading
    inside, release = threading.Event(), threading.Event()
    real = storage_mod._preallocate

    def slow(fd, size):
        inside.set()
        assert release.wait(10)
        return real(fd, size)
    _hook_preallocate(monkeypatch, slow)
    return inside, release


def test_a_read_never_waits_for_a_write_in_its_file_io(make, monkeypatch):
    """A write's file creation, fallocate, fsync and rename run without the tier's lock: a read (a
    prefetch a queued request waits on) returns, with the right bytes, while a write is stopped in
    the middle of its file I/O; the write then lands every page, and its bytes were reserved
    against the capacity all along."""
    import threading
    t = make()
    old_k, old_p = keys_for(4, b"old"), pages_for(4, seed=1)
    assert t.put_many(old_k, old_p) == 4
    inside, release = _block_file_creation(monkeypatch)
    new_k, new_p = keys_for(6, b"new"), pages_for(6, seed=2)
    res = []
    th = threading.Thread(target=lambda: res.append(t.put_many(new_k, new_p)))
    th.start()
    try:
        assert inside.wait(5)
        out = np.zeros((4, P), dtype=np.uint8)
        assert t.get_many_into(old_k, out) == 4 and np.array_equal(out, old_p)
        assert t.contains_prefix(new_k) == 0  # not published before it is complete
        assert t.stats()["used_bytes"] == 10 * (HDR + P)  # reserved while in flight
        # a second put of the same pages skips the claimed ones instead of writing them twice
        assert t.put_many(new_k[:2], new_p[:2]) == 0
    finally:
        release.set()
        th.join(10)
    assert res == [6]
    got = np.zeros((6, P), dtype=np.uint8)
    assert t.get_many_into(new_k, got) == 6 and np.array_equal(got, new_p)
    assert t.stats()["pages_written"] == 10 and len(files(t.path)) == 10
    assert not [f for f in os.listdir(t.path) if f.startswith(".tmp.")]


def test_discard_during_a_write_is_not_undone_by_it(make, monkeypatch):
    """Pages discarded while their write is in flight are not published when it ends (no file,
    no index entry, their reservation returned), and nothing else is lost."""
    import threading
    t = make()
    inside, release = _block_file_creation(monkeypatch)
    ks, pg = keys_for(5), pages_for(5)
    th = threading.Thread(target=t.put_many, args=(ks, pg))
    th.start()
    try:
        assert inside.wait(5)
        t.discard(ks[2:])
    finally:
        release.set()
        th.join(10)
    assert t.contains_prefix(ks) == 2
    assert t.contains_prefix(ks[2:]) == 0 and len(files(t.path)) == 2
    assert t.stats()["used_bytes"] == 2 * (HDR + P)
    out = np.zeros((2, P), dtype=np.uint8)
    assert t.get_many_into(ks[:2], out) == 2 and np.array_equal(out, pg[:2])


@pytest.mark.parametrize("p", [4096, P])  # compiled hash / numpy twin
def test_files_written_with_crc32_before_the_page_hash_still_read(make, p):
    """Files written by a build whose payload checksum was CRC32 (algo 1) stay hits; new files carry
    the 64-bit page hash (algo 2), and a payload that no longer matches either way is a miss."""
    from flexflow_sglang.tiers.base import CHECKSUM_CRC32, CHECKSUM_HASH64
    from flexflow_sglang.tiers.storage_files import build_header, parse_header
    t = make()
    ks, pg = keys_for(4), pages_for(4, p=p)
    assert t.put_many(ks, pg) == 4
    with open(_file_of(t, ks[0]), "rb") as f:
        (algo, _), why = parse_header(f.read(HDR), t._fp, bytes.fromhex(t._name(ks[0])[:32]), p)
    assert why == "" and algo == CHECKSUM_HASH64
    for i in (1, 2):  # rewrite as the older format: CRC32 of the payload, algo 1
        nm = t._name(ks[i])
        with open(_file_of(t, ks[i]), "r+b") as f:
            f.write(build_header(p, t._fp, bytes.fromhex(nm[:32]), page_checksum(pg[i]), algo=CHECKSUM_CRC32))
    with open(_file_of(t, ks[2]), "r+b") as f:  # and damage one of them
        f.seek(HDR + 7)
        f.write(bytes([pg[2, 7] ^ 1]))
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 2 and np.array_equal(out[:2], pg[:2])
    assert t.stats()["corrupt_dropped"] == 1


def test_swapped_words_in_a_stored_page_are_a_miss(make):
    t = make()
    ks, pg = keys_for(3), pages_for(3, p=4096)
    t.put_many(ks, pg)
    with open(_file_of(t, ks[1]), "r+b") as f:  # swap two 8-byte words of the payload
        f.seek(HDR + 8 * 5)
        a = f.read(8)
        f.seek(HDR + 8 * 9)
        b = f.read(8)
        assert a != b
        f.seek(HDR + 8 * 5)
        f.write(b)
        f.seek(HDR + 8 * 9)
        f.write(a)
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 1 and t.stats()["corrupt_dropped"] == 1


def test_the_os_backend_is_chosen_by_config_even_where_nixl_loads(tmp_path):
    t = StorageTier(str(tmp_path / "kv"), capacity_gb=1.0, fingerprint="m", backend="os")
    try:
        assert t.stats()["backend"] == "os" and t._agent is None
        ks, pg = keys_for(3), pages_for(3, p=4096)
        assert t.put_many(ks, pg) == 3
        out = np.zeros_like(pg)
        assert t.get_many_into(ks, out) == 3 and np.array_equal(out, pg)
    finally:
        t.close()
