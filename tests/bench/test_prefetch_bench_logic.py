"""`flexflow bench prefetch`: configs, prompts and ratios (the benchmark itself runs real servers)."""

import pytest

from flexflow_sglang.config import config_from_dict
from flexflow_sglang.tools.bench import prefetch_bench as pb


def test_config_is_valid_and_names_the_policy(tmp_path):
    for policy in pb.POLICIES:
        cfg = pb.bench_config(str(tmp_path / "kv"), 4096, policy)
        parsed = config_from_dict(cfg, "<bench>")  # the server's strict loader accepts it
        assert parsed.transfer.prefetch_policy == policy and parsed.storage_tier.enabled
        assert parsed.host_tier.capacity_tokens == 4096
    with pytest.raises(ValueError, match="prefetch policy"):
        pb.bench_config("/x", 1, "sometimes")
    nice = config_from_dict(pb.bench_config(str(tmp_path / "kv"), 64, "timeout:nice10"), "<bench>")
    assert nice.transfer.worker_nice == 10 and nice.transfer.prefetch_policy == "timeout"
    for bad in ("timeout:nice20", "timeout:fast", "off:nice"):
        with pytest.raises(ValueError, match="niceN"):
            pb.parse_mode(bad)


def test_prompts_are_deterministic_and_in_vocab():
    a, b = pb.make_prompts(3, 50, 1000, seed=1), pb.make_prompts(3, 50, 1000, seed=1)
    assert a == b and len(a) == 3 and all(len(p) == 50 for p in a)
    assert all(100 <= t < 900 for p in a for t in p)
    assert pb.make_prompts(3, 50, 1000, seed=2) != a


def test_ratios_from_medians_and_missing_phases():
    r = pb.ratio_summary({"deep": {"ttft_s": [2.0, 3.0, 4.0], "after_blocker_s": [1.0]},
                          "host": {"ttft_s": [1.0, 2.0, 3.0], "after_blocker_s": [0.5]}})
    assert r == {"deep_over_host": 1.5, "deep_over_host_after_blocker": 2.0}
    assert pb.ratio_summary({"deep": {"ttft_s": [1.0]}, "host": {}})["deep_over_host"] is None


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        pb.main(["--modes", "timeout,sometimes"])
    with pytest.raises(SystemExit):
        pb.main(["--targets", "0"])
