"""The host-tier benchmark runs end to end on a tiny shape (numbers are not asserted: CPU noise)."""

import pytest

pytest.importorskip("torch")


def test_bench_runs_both_modes():
    from flexflow_sglang.tools.bench.host_tier_bench import run

    res = run(num_tokens=256, layers=2, heads=2, head_dim=16, dtype="bfloat16", page_size=4, repeats=2,
              progress=False)
    for mode in ("with_checksums", "without_checksums"):
        r = res[mode]
        assert r["roundtrip_equal"] and r["bytes_per_move"] == 64 * 2 * 2 * 4 * 32 * 2
        assert r["store_gbps"] > 0 and r["load_gbps"] > 0 and r["copy_gbps"] > 0
        assert r["path_types"]["Direct"]["moves"] == 6
    assert res["store_ratio"] == res["with_checksums"]["store_ratio"]
    assert set(res["target_met"]) == {"with_checksums", "without_checksums"}


def test_bench_rejects_bad_args():
    from flexflow_sglang.tools.bench.host_tier_bench import run

    with pytest.raises(ValueError):
        run(num_tokens=2, page_size=4, progress=False)
