"""HiCacheStorageTier over SGLang's own `file` HiCache storage backend (CPU, tmp_path): round trip,
integrity (corrupt object, foreign fingerprint, wrong size), leading-run semantics, bounded waits,
clear start-up errors, the registry factory."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from flexflow_sglang.backend.hicache_tier import (HDR, KEY_PREFIX, HiCacheStorageTier,  # noqa: E402
                                                  HiCacheTierError, create_backend, hicache_factory)
from flexflow_sglang.errors import ConfigError  # noqa: E402

PAGE = 4096
FP = "model=tiny|layers=2|dtype=float16|tp=0/1"


def keys_of(n, salt=b""):
    out, h = [], b"seed" + salt
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(h)
    return out


def pages_of(n, seed=0, page=PAGE):
    return np.random.default_rng(seed).integers(0, 256, size=(n, page), dtype=np.uint8)


def file_tier(path, fp=FP, page=PAGE, **kw):
    return HiCacheStorageTier("file", fingerprint=fp, page_nbytes=page,
                              extra_config={"file_storage_path": str(path)}, **kw)


def object_files(path):
    return sorted(p for p in path.iterdir() if p.name.endswith(".bin"))


def test_round_trip_is_byte_equal_and_survives_a_new_instance(tmp_path):
    t = file_tier(tmp_path)
    keys, pages = keys_of(12), pages_of(12)
    assert t.contains_prefix(keys) == 0
    assert t.put_many(keys, pages) == 12
    assert t.contains_prefix(keys) == 12
    out = np.zeros_like(pages)
    assert t.get_many_into(keys, out) == 12
    assert np.array_equal(out, pages)
    st = t.stats()
    assert st["hits"] == 12 and st["pages_written"] == 12 and st["bytes_read"] == 12 * (HDR + PAGE)
    assert st["backend"] == "hicache-file" and st["node"] == "nvme0" and st["read_gbps"] > 0
    t.close()
    # a second "server" on the same store reads what the first wrote
    t2 = file_tier(tmp_path)
    out2 = np.zeros_like(pages)
    assert t2.contains_prefix(keys) == 12 and t2.get_many_into(keys, out2) == 12
    assert np.array_equal(out2, pages)
    t2.close()


def test_torch_rows_and_leading_runs(tmp_path):
    import torch
    t = file_tier(tmp_path, staging_mb=3 * (HDR + PAGE) / (1 << 20))  # 3 objects per backend batch
    keys, pages = keys_of(8), pages_of(8, seed=1)
    assert t.put_many(keys[:5], torch.from_numpy(pages[:5])) == 5
    assert t.contains_prefix(keys) == 5                 # held: the first 5
    assert t.contains_prefix(keys[5:]) == 0
    out = torch.zeros((8, PAGE), dtype=torch.uint8)
    assert t.get_many_into(keys, out) == 5             # leading run, across staging batches
    assert torch.equal(out[:5], torch.from_numpy(pages[:5]))
    assert t.stats()["misses"] == 3
    t.close()


def test_backend_calls_carry_at_most_max_batch_objects(tmp_path):
    """A Mooncake client's TCP transport fails transfers past 1,024 queued per peer: flexflow splits a
    long run into backend calls of max_batch_objects pages, and the run still reads back whole."""
    t = file_tier(tmp_path, max_batch_objects=2)
    sizes = {"put": [], "get": []}
    for op in sizes:
        orig = getattr(t._io, op)
        setattr(t._io, op, (lambda orig, op: lambda names, *a: sizes[op].append(len(names)) or orig(names, *a))(orig, op))
    keys, pages = keys_of(5), pages_of(5, seed=4)
    assert t.put_many(keys, pages) == 5
    out = np.zeros_like(pages)
    assert t.get_many_into(keys, out) == 5 and np.array_equal(out, pages)
    assert sizes == {"put": [2, 2, 1], "get": [2, 2, 1]}, sizes
    t.close()
    ctx = type("Ctx", (), dict(fingerprint_text=FP, page_nbytes=PAGE, rank_dir="rank0", node=None))()
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ConfigError, match="max_batch_objects"):
            hicache_factory(ctx, {"backend": "file", "max_batch_objects": bad,
                                  "extra_config": {"file_storage_path": str(tmp_path / "x")}})


def test_names_are_keyed_hashes_and_files_are_owner_only(tmp_path):
    ctx = type("Ctx", (), dict(fingerprint_text=FP, page_nbytes=PAGE, rank_dir="rank0", node=None))()
    root = tmp_path / "store"
    t = hicache_factory(ctx, {"backend": "file", "extra_config": {"file_storage_path": str(root)}})
    keys = keys_of(3)
    assert t.put_many(keys, pages_of(3)) == 3
    files = object_files(root / "rank0")
    assert len(files) == 3
    assert all(f.name.startswith(KEY_PREFIX) for f in files)
    assert not any(k.hex()[:16] in f.name for k in keys for f in files)   # never the raw key
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE((root / "rank0").stat().st_mode) == 0o700
    assert all(f.stat().st_size == HDR + PAGE for f in files)
    t.close()


def test_corrupt_object_is_a_miss_and_is_dropped(tmp_path):
    t = file_tier(tmp_path)
    keys, pages = keys_of(6), pages_of(6, seed=2)
    assert t.put_many(keys, pages) == 6
    victim = tmp_path / f"{t._names([keys[3]])[0]}{t.backend.config_suffix}.bin"
    assert victim.exists()
    raw = bytearray(victim.read_bytes())
    raw[HDR + 100] ^= 0xFF                                  # one payload bit flips
    victim.write_bytes(bytes(raw))
    out = np.zeros_like(pages)
    assert t.get_many_into(keys, out) == 3                  # the run ends before the bad page
    assert np.array_equal(out[:3], pages[:3])
    st = t.stats()
    assert st["corrupt_dropped"] == 1 and st["removed"] == 1
    assert not victim.exists()                              # dropped from the backend
    assert t.contains_prefix(keys) == 3
    assert t.put_many(keys, pages) == 6                     # rewritten
    assert t.get_many_into(keys, out) == 6 and np.array_equal(out, pages)
    t.close()


def test_damaged_header_and_truncated_object_are_misses(tmp_path):
    t = file_tier(tmp_path)
    keys, pages = keys_of(4), pages_of(4, seed=3)
    assert t.put_many(keys, pages) == 4
    names = t._names(keys)
    f1 = tmp_path / f"{names[1]}{t.backend.config_suffix}.bin"
    raw = bytearray(f1.read_bytes())
    raw[25] ^= 0x01                                         # header byte: header CRC fails
    f1.write_bytes(bytes(raw))
    out = np.zeros_like(pages)
    assert t.get_many_into(keys, out) == 1
    assert t.stats()["corrupt_dropped"] == 1
    f0 = tmp_path / f"{names[0]}{t.backend.config_suffix}.bin"
    f0.write_bytes(f0.read_bytes()[:HDR + 10])              # truncated (a torn write)
    assert t.get_many_into(keys, out) == 0
    t.close()


def test_wrong_fingerprint_is_a_miss(tmp_path):
    a = file_tier(tmp_path, fp=FP)
    b = file_tier(tmp_path, fp=FP + "|other-model")
    keys, pages = keys_of(4), pages_of(4, seed=4)
    assert a.put_many(keys, pages) == 4
    out = np.zeros_like(pages)
    # another fingerprint: other backend keys, nothing shared
    assert b.contains_prefix(keys) == 0 and b.get_many_into(keys, out) == 0
    # an object of the other fingerprint under our name (misplaced / colliding writer): header says foreign
    b_names, a_names = b._names(keys[:1]), a._names(keys[:1])
    assert b.put_many(keys[:1], pages[:1]) == 1
    src = tmp_path / f"{b_names[0]}{b.backend.config_suffix}.bin"
    dst = tmp_path / f"{a_names[0]}{a.backend.config_suffix}.bin"
    dst.write_bytes(src.read_bytes())
    assert a.get_many_into(keys, out) == 0
    assert a.stats()["foreign_dropped"] == 1
    a.close()
    b.close()


def test_other_page_size_is_a_miss(tmp_path):
    a = file_tier(tmp_path, page=PAGE)
    keys, pages = keys_of(2), pages_of(2, seed=5)
    assert a.put_many(keys, pages) == 2
    a.close()
    b = file_tier(tmp_path, page=PAGE // 2)  # same fingerprint text, smaller pages: the header says no
    out = np.zeros((2, PAGE // 2), dtype=np.uint8)
    assert b.get_many_into(keys, out) == 0
    assert b.stats()["foreign_dropped"] + b.stats()["size_mismatch"] + b.stats()["corrupt_dropped"] == 1
    b.close()


def test_discard_forgets_and_bad_shapes_raise(tmp_path):
    t = file_tier(tmp_path)
    keys, pages = keys_of(3), pages_of(3, seed=6)
    assert t.put_many(keys, pages) == 3
    t.discard(keys[1:2])
    assert t.contains_prefix(keys) == 1
    with pytest.raises(ValueError):
        t.put_many(keys, np.zeros((3, PAGE + 1), dtype=np.uint8))
    with pytest.raises(ValueError):
        t.get_many_into(keys, np.zeros((2, PAGE), dtype=np.uint8))
    t.close()
    t.close()  # idempotent
    assert t.contains_prefix(keys) == 0 and t.get_many_into(keys[:1], np.zeros((1, PAGE), np.uint8)) == 0


class _Stuck:
    """A backend whose calls block until released (a hung store)."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls = 0

    def batch_exists(self, keys, extra_info=None):
        self.calls += 1
        self.gate.wait(30)
        return len(keys)

    def batch_set(self, keys, values=None, **kw):
        return True

    def batch_get(self, keys, target_locations=None, **kw):
        return [None] * len(keys)


def test_a_hung_backend_costs_at_most_the_timeout_then_misses_until_retry(tmp_path):
    be = _Stuck()
    t = HiCacheStorageTier("stuck", fingerprint=FP, page_nbytes=PAGE, backend_obj=be, timeout_ms=200,
                           retry_after_s=0.3, staging_mb=0.1)
    keys = keys_of(4)
    t0 = time.monotonic()
    assert t.contains_prefix(keys) == 0
    assert time.monotonic() - t0 < 2.0
    # while the stuck call runs, nothing else reaches the backend and nothing waits for it
    t0 = time.monotonic()
    assert t.contains_prefix(keys) == 0 and t.put_many(keys, pages_of(4)) == 0
    assert time.monotonic() - t0 < 1.0
    assert be.calls == 1
    st = t.stats()
    assert st["timeouts"] == 1 and st["down"] and st["busy_skipped"] + st["down_skipped"] >= 2
    be.gate.set()                       # the store answers again
    time.sleep(0.5)                     # past retry_after_s
    assert t.contains_prefix(keys) == 4
    t.close()


class _Raising(_Stuck):
    def batch_exists(self, keys, extra_info=None):
        self.calls += 1
        raise ConnectionError("store gone")


def test_backend_errors_are_misses_counted_and_logged(tmp_path, caplog):
    be = _Raising()
    t = HiCacheStorageTier("raising", fingerprint=FP, page_nbytes=PAGE, backend_obj=be, retry_after_s=60,
                           staging_mb=0.1)
    with caplog.at_level("WARNING", logger="flexflow_sglang.backend.hicache_tier"):
        assert t.contains_prefix(keys_of(2)) == 0
        assert t.contains_prefix(keys_of(2)) == 0
    assert be.calls == 1                      # the second call did not reach the broken store
    st = t.stats()
    assert st["backend_errors"] == 1 and st["down_skipped"] == 1 and "store gone" in st["down_reason"]
    assert any("store gone" in r.getMessage() for r in caplog.records)
    t.close()


def test_a_backend_that_cannot_start_names_itself():
    with pytest.raises(HiCacheTierError, match="'nosuch'.*Unknown storage backend"):
        create_backend("nosuch")
    with pytest.raises(HiCacheTierError, match="'mooncake'"):
        # either not installed, or (installed) no master on a port nobody listens on: one message, fast
        t0 = time.monotonic()
        try:
            create_backend("mooncake", {"master_server_address": "127.0.0.1:9", "protocol": "tcp"},
                           connect_timeout_s=0.5)
        finally:
            assert time.monotonic() - t0 < 10


def test_factory_validates_options(tmp_path):
    ctx = type("Ctx", (), dict(fingerprint_text=FP, page_nbytes=PAGE, rank_dir="rank0", node=None))()
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        hicache_factory(ctx, {"backend": "file", "bogus": 1})
    with pytest.raises(ConfigError, match="extra_config"):
        hicache_factory(ctx, {"backend": "file", "extra_config": [1]})
    with pytest.raises(ConfigError, match="timeout_ms"):
        hicache_factory(ctx, {"backend": "file", "timeout_ms": -1})
    with pytest.raises(ConfigError, match="staging_mb"):
        hicache_factory(ctx, {"backend": "file", "staging_mb": 1e9})
    t = hicache_factory(ctx, {"backend": "file", "node": "nic0", "enabled": True, "write_through": False,
                              "extra_config": {"file_storage_path": str(tmp_path)}})
    assert t.name == "hicache_file" and t.node == "nic0"
    t.close()


def test_config_section(tmp_path):
    from flexflow_sglang.config import config_from_dict
    cfg = config_from_dict({"hicache_storage": {"enabled": True, "backend": "mooncake",
                                                "extra_config": {"master_server_address": "127.0.0.1:50051"}}})
    assert cfg.hicache_storage.enabled and cfg.hicache_storage.extra_config["master_server_address"]
    assert config_from_dict({}).hicache_storage.enabled is False
    with pytest.raises(ConfigError, match="hicache_storage.extra_config"):
        config_from_dict({"hicache_storage": {"extra_config": "master=1"}})
    with pytest.raises(ConfigError, match="hicache_storage.bogus"):
        config_from_dict({"hicache_storage": {"bogus": 1}})


def test_registered_through_the_tier_registry(tmp_path):
    reg = pytest.importorskip("flexflow_sglang.tiers.registry")
    from flexflow_sglang.backend import plugin
    plugin.register_tiers()
    assert "hicache_storage" in reg.registered_tiers()
    ctx = reg.TierContext(fingerprint={"model": "tiny"}, fingerprint_text=FP, page_nbytes=PAGE, rank_dir="rank3")
    t = reg.create_tier("hicache_storage", ctx, {"backend": "file",
                                                 "extra_config": {"file_storage_path": str(tmp_path)}})
    try:
        assert t.put_many(keys_of(2), pages_of(2)) == 2
        assert len(object_files(tmp_path / "rank3")) == 2
    finally:
        t.close()
    with pytest.raises(Exception, match="nosuch"):
        reg.create_tier("hicache_storage", ctx, {"backend": "nosuch"})


def test_the_connector_builds_it_from_the_config_section(tmp_path, caplog):
    from flexflow_sglang.backend import plugin
    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector.connector import build_deeper_tiers
    plugin.register_tiers()
    cfg = config_from_dict({"hicache_storage": {"enabled": True, "backend": "file", "write_through": True,
                                                "extra_config": {"file_storage_path": str(tmp_path)}}})
    tiers = build_deeper_tiers(cfg, {"model": "tiny", "layers": 2}, PAGE, "rank1")
    try:
        assert [t.name for t in tiers] == ["hicache_file"] and tiers[0].write_through
        assert tiers[0].put_many(keys_of(1), pages_of(1)) == 1
        assert len(object_files(tmp_path / "rank1")) == 1
    finally:
        for t in tiers:
            t.close()
    # a backend that cannot start: one line naming it, and the connector goes on without the tier
    bad = config_from_dict({"hicache_storage": {"enabled": True, "backend": "mooncake",
                                                "extra_config": {"master_server_address": "127.0.0.1:9",
                                                                 "protocol": "tcp"}}})
    with caplog.at_level("WARNING"):
        t0 = time.monotonic()
        assert build_deeper_tiers(bad, {"model": "tiny"}, PAGE, "rank0") == []
        assert time.monotonic() - t0 < 15
    lines = [r.getMessage() for r in caplog.records if "hicache_storage" in r.getMessage()]
    assert len(lines) == 1 and "mooncake" in lines[0] and "serving without it" in lines[0], lines
