"""`flexflow bench two-server` logic without servers: configs per kind, the summary, the CLI."""

from __future__ import annotations

import pytest
import yaml

from flexflow_sglang.tools.bench import two_server as ts


def test_each_kind_writes_a_valid_config_with_its_shared_tier(tmp_path):
    from flexflow_sglang.config import load_config
    none = load_config(ts._write_config(str(tmp_path), "none", 4096, None))
    assert not none.remote_tier.enabled and not none.hicache_storage.enabled
    remote = load_config(ts._write_config(str(tmp_path), "tier-server", 4096, {"listen": "127.0.0.1:7300"}))
    assert remote.remote_tier.enabled and list(remote.remote_tier.peers) == ["127.0.0.1:7300"]
    extra = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}
    mc = load_config(ts._write_config(str(tmp_path), "mooncake", 4096, {"extra_config": extra}))
    assert mc.hicache_storage.enabled and mc.hicache_storage.backend == "mooncake"
    for cfg in (none, remote, mc):
        assert cfg.host_tier.capacity_tokens == 4096 and cfg.transfer.prefetch_policy == "wait_complete"
    raw = yaml.safe_load(open(tmp_path / "flexflow-mooncake.yaml"))
    assert raw["hicache_storage"]["extra_config"] == extra


def test_summary_compares_server_b_with_no_shared_tier():
    def run(kind, hit, ttft):
        b = {"tier_hit_ratio": hit, "cached_ratio": hit, "mean_ttft_ms": ttft, "median_ttft_ms": ttft,
             "output_throughput": 1.0}
        return {"kind": kind, "ran": True, "servers": {"A": dict(b, tier_hit_ratio=0.0), "B": b}}
    res = [run("none", 0.0, 400.0), run("tier-server", 0.8, 200.0), run("mooncake", 0.7, 300.0),
           {"kind": "x", "ran": False, "error": "missing"}]
    s = ts.summarize(res)
    assert set(s["server_b"]) == {"none", "tier-server", "mooncake"}
    assert s["tier-server_over_none_mean_ttft"] == pytest.approx(0.5)
    assert s["mooncake_over_none_mean_ttft"] == pytest.approx(0.75)
    assert ts.summarize([res[1]]) == {"server_b": {"tier-server": res[1]["servers"]["B"]}}


def test_unknown_kind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        ts.main(["--kinds", "none,nfs"])
    assert e.value.code == 2 and "unknown ['nfs']" in capsys.readouterr().err
