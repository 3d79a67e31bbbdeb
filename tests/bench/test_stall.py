"""`flexflow bench stall` logic (no server, no namespaces) and the realistic-KV model preset."""

from __future__ import annotations

import pytest

from flexflow_sglang.tools.cpu_support import tiny_model as tm


def test_kv128k_preset_has_an_8b_models_kv_per_token():
    p = tm.PRESETS["kv128k"]
    assert tm.kv_bytes_per_token(**p) == 128 << 10  # float32, as the CPU server runs these checkpoints
    assert tm.kv_bytes_per_token(**p, dtype_bytes=2) == 64 << 10
    assert tm._params(seed=0, max_position_embeddings=64, **p)["head_dim"] == 128
    assert "head_dim" not in tm._params(seed=0, max_position_embeddings=64, **tm.PRESETS["tiny"])  # old markers stay valid
    with pytest.raises(ValueError, match="head_dim"):
        tm._params(seed=0, max_position_embeddings=64, **dict(p, head_dim=3))


def test_mode_configs_and_ratios():
    from flexflow_sglang.tools.bench import stall
    from flexflow_sglang.config import config_from_dict
    cfgs = {m: config_from_dict(stall.mode_config(m, host_tokens=512, storage_path="/tmp/x", peer="10.0.0.2:7400"),
                                "<t>") for m in stall.MODES}
    assert not cfgs["off"].storage_tier.enabled and not cfgs["off"].remote_tier.enabled
    assert cfgs["async"].transfer.mode == "async" and cfgs["sync"].transfer.mode == "sync"
    assert cfgs["async"].remote_tier.peers == ("10.0.0.2:7400",) and cfgs["sync"].storage_tier.write_through
    with pytest.raises(ValueError, match="mode"):
        stall.mode_config("later", host_tokens=1, storage_path="/x", peer=None)
    r = stall.ratios({"off": {"itl": {"p50_ms": 10.0, "p99_ms": 20.0}}, "async": {"itl": {"p50_ms": 11.0, "p99_ms": 21.0}},
                      "sync": {"error": "runner exited 1"}})
    assert r == {"off": {"p50_vs_off": 1.0, "p99_vs_off": 1.0}, "async": {"p50_vs_off": 1.1, "p99_vs_off": 1.05}}
    s = stall.itl_stats([0.01] * 99 + [0.5])
    assert s["n"] == 100 and s["p50_ms"] == 10.0 and s["max_ms"] == 500.0
    assert stall.prompt(3, 5) == stall.prompt(3, 5) != stall.prompt(4, 5)


def test_cli_lists_stall(capsys):
    from flexflow_sglang.tools.bench import stall
    with pytest.raises(SystemExit):
        stall.main(["--streams", "0"])
    assert "--streams must be positive" in capsys.readouterr().err


def test_off_mode_host_tier_holds_the_background():
    from flexflow_sglang.tools.bench import stall
    assert stall.off_host_tokens(2, 8, 256) == 2 * 2 * 8 * 272 and stall.off_host_tokens(1, 1, 8) == 1024


def test_open_loop_pacing_keeps_the_rate_and_never_bursts():
    from flexflow_sglang.tools.bench.stall import next_slot
    t, wait = next_slot(10.0, 2.0, 10.1)       # on schedule: the next slot is 0.5 s after the last
    assert t == 10.5 and abs(wait - 0.4) < 1e-9
    t, wait = next_slot(10.0, 2.0, 13.0)       # 2.5 s late: start now, no back-to-back catch-up
    assert (t, wait) == (13.0, 0.0)
    t, wait = next_slot(t, 2.0, 13.0)          # and the schedule goes on from there
    assert t == 13.5 and wait == 0.5
