"""The tier benchmark runs end to end on tiny sizes and reports throughputs and ratios."""
from __future__ import annotations

import pytest

from flexflow_sglang.tools.bench import tier_bench as bench

from tier_helpers import requires_nixl


def test_bench_storage_only_without_nixl(monkeypatch, tmp_path):
    from flexflow_sglang.tiers import storage as storage_mod
    monkeypatch.setattr(storage_mod, "load_nixl", lambda: (None, None, "disabled by test"))
    r = bench.run(page_nbytes=32 * 1024, n_pages=4, repeats=1, storage_dir=str(tmp_path), remote=False)
    assert r["storage_backend"] == "os"
    assert r["commit"] and r["commit"] != "unknown"  # every figure names the commit it was measured at
    assert r["storage_write_ratio"] > 0 and r["storage_read_ratio"] > 0


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_bench_run_reports_ratios(tmp_path):
    r = bench.run(page_nbytes=64 * 1024, n_pages=8, repeats=1, storage_dir=str(tmp_path))
    assert r["storage_backend"] == "nixl-posix"
    for k in ("storage_write", "storage_read", "remote_write", "remote_read"):
        assert r[f"{k}_gbps"] > 0 and r[f"{k}_ratio"] > 0, (k, r)
    for k in ("plain_write_gbps", "plain_read_gbps", "raw_ucx_write_gbps", "raw_ucx_read_gbps", "crc32_gbps",
              "hash64_gbps"):
        assert r[k] > 0
    assert r["remote_timeouts"] == 0


@pytest.mark.timeout(180)
def test_bench_hicache_backends_side_by_side(tmp_path):
    """issue 18: SGLang's file backend (and Mooncake when it is installed) through hicache_storage, in
    the same run as the other tiers; a backend that cannot run is skipped with the reason."""
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    r = bench.run(page_nbytes=16 * 1024, n_pages=8, repeats=1, storage=False, remote=False,
                  hicache=["file", "mooncake", "no-such-backend"])
    assert r["hicache_file_write_gbps"] > 0 and r["hicache_file_read_gbps"] > 0, r
    assert "hicache_no-such-backend_skipped" in r and "hicache_no-such-backend_write_gbps" not in r
    from flexflow_sglang.tools.mooncake_master import mooncake_missing
    if not mooncake_missing():
        assert r["hicache_mooncake_write_gbps"] > 0 and r["hicache_mooncake_read_gbps"] > 0, r
    else:
        assert "hicache_mooncake_skipped" in r


def test_bench_storage_writes_beside_a_python_thread(monkeypatch, tmp_path):
    """`--beside-python`: both modes write every page (the bench asserts it) and report their times;
    the compiled module is put back afterwards."""
    from flexflow_sglang.tiers import storage as storage_mod
    compiled = storage_mod._fb
    monkeypatch.setattr(storage_mod, "load_nixl", lambda: (None, None, "disabled by test"))
    r = bench.run(page_nbytes=4 * 1024, n_pages=6, repeats=1, storage_dir=str(tmp_path), remote=False,
                  beside_python=1)
    assert r["beside_python_write_s_python"] > 0
    if compiled is not None:
        assert r["beside_python_write_s_compiled"] > 0 and r["beside_python_twin_over_compiled"] > 0
    assert storage_mod._fb is compiled


def test_bench_layouts_side_by_side_with_room_and_full(monkeypatch, tmp_path):
    """`--layouts files,slabs`: both layouts store and read back every page (the bench asserts the
    bytes), with room and full; full, every store after the first evicts a whole round of pages."""
    from flexflow_sglang.tiers import storage as storage_mod
    monkeypatch.setattr(storage_mod, "load_nixl", lambda: (None, None, "disabled by test"))
    r = bench.run(page_nbytes=4 * 1024, n_pages=8, repeats=2, storage_dir=str(tmp_path), remote=False,
                  layouts=["files", "slabs"])
    for tag in ("", "full_"):
        for m in ("files", "slabs"):
            assert r[f"layout_{tag}{m}_write_gbps"] > 0 and r[f"layout_{tag}{m}_read_gbps"] > 0
            assert r[f"layout_{tag}{m}_write_cpu_us_per_page"] >= 0
        assert r[f"layout_{tag}slabs_over_files_write"] > 0
    assert r["layout_files_evictions"] == r["layout_slabs_evictions"] == 0
    assert r["layout_full_files_evictions"] == r["layout_full_slabs_evictions"] == 2 * 8


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_bench_slab_backends_idle_and_beside_python(tmp_path):
    """`--slab-backends`: the slab layout through NIXL POSIX and through os, idle and beside a Python
    thread; each stores and reads back every page (the bench asserts the bytes and which backend ran)."""
    r = bench.run(page_nbytes=16 * 1024, n_pages=8, repeats=2, storage_dir=str(tmp_path), remote=False,
                  slab_backends=True)
    for tag in ("idle", "beside_python"):
        for b in ("posix", "os"):
            for d in ("write", "read"):
                assert r[f"slabs_{tag}_{b}_{d}_gbps"] > 0, (tag, b, d, r)
        assert r[f"slabs_{tag}_os_over_posix_write"] > 0 and r[f"slabs_{tag}_os_over_posix_read"] > 0


def test_bench_slab_backends_without_nixl_says_why(monkeypatch, tmp_path):
    from flexflow_sglang.tools.bench import tier_bench
    monkeypatch.setattr(tier_bench, "load_nixl", lambda: (None, None, "disabled by test"))
    r = bench.run(page_nbytes=4 * 1024, n_pages=4, repeats=1, storage_dir=str(tmp_path), remote=False,
                  slab_backends=True)
    assert "NIXL not installed" in r["slab_backends_skipped"]
    assert not any(k.startswith("slabs_idle") for k in r)
