import dataclasses
import os

import pytest
import yaml

from flexflow_sglang import ConfigError, SelectorConfig, load_config
from flexflow_sglang.config import (DEFAULT_CONFIG_PATH, FlexFlowConfig, HostTierConfig, MonitorConfig,
                                    RemoteTierConfig, StorageTierConfig, TopologyConfig, build_topology)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def test_defaults_match_default_yaml():
    """configs/default.yaml is the single source of defaults: the dataclasses agree with it."""
    with open(DEFAULT_CONFIG_PATH) as f:
        d = yaml.safe_load(f)
    for cls, section in ((SelectorConfig, "selector"), (TopologyConfig, "topology"), (MonitorConfig, "monitor"),
                         (HostTierConfig, "host_tier"), (StorageTierConfig, "storage_tier"),
                         (RemoteTierConfig, "remote_tier")):
        inst = cls()
        for f in dataclasses.fields(cls):
            v = getattr(inst, f.name)
            assert (list(v) if isinstance(v, tuple) else v) == d[section][f.name], f"{section}.{f.name}"
    assert d["extra_tiers"] == [] and FlexFlowConfig().extra_tiers == ()
    assert load_config().to_dict() == FlexFlowConfig().to_dict()
    assert os.path.samefile(DEFAULT_CONFIG_PATH, os.path.join(ROOT, "configs", "default.yaml"))


def test_flexflow_selector_defaults():
    c = SelectorConfig()
    assert (c.w_bandwidth, c.w_queue_delay, c.w_hops, c.w_qos_risk, c.w_latency) == (1.0, 0.5, 0.05, 0.3, 0.5)
    assert (c.nvlink_util_threshold, c.rdma_util_threshold, c.cnic_util_threshold, c.snic_util_threshold) == \
        (0.80, 0.80, 0.70, 0.85)
    assert (c.relay_benefit_margin, c.enable_split_path, c.max_split_paths, c.split_benefit_margin,
            c.ttft_sensitive) == (0.10, True, 2, 0.10, False)


@pytest.mark.parametrize("name", ["default.yaml", "cpu-dev.yaml", "dgx-a100.yaml", "cluster.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(os.path.join(ROOT, "configs", name))
    assert isinstance(cfg.selector, SelectorConfig)
    build_topology(cfg)


def test_overlay_and_env(tmp_path, monkeypatch):
    p = write(tmp_path, {"selector": {"w_hops": 0.7}, "host_tier": {"capacity_tokens": 4096}})
    monkeypatch.setenv("FLEXFLOW_CONFIG", p)
    cfg = load_config()
    assert cfg.selector.w_hops == 0.7 and cfg.selector.w_bandwidth == 1.0
    assert cfg.host_tier.capacity_tokens == 4096 and cfg.path == p


@pytest.mark.parametrize("data,needles", [
    ({"selector": {"w_hops": -1}}, ["selector.w_hops", "-1", ">= 0"]),
    ({"selector": {"nvlink_util_threshold": 1.5}}, ["selector.nvlink_util_threshold", "(0, 1]"]),
    ({"selector": {"rdma_util_threshold": 0}}, ["rdma_util_threshold", "(0, 1]"]),
    ({"selector": {"relay_benefit_margin": -0.1}}, ["relay_benefit_margin"]),
    ({"selector": {"max_split_paths": 0}}, ["max_split_paths", "[1, 8]"]),
    ({"selector": {"enable_split_path": "yes"}}, ["enable_split_path", "true or false"]),
    ({"selector": {"w_bandwith": 1.0}}, ["selector.w_bandwith", "valid keys", "w_bandwidth"]),
    ({"bogus": 1}, ["'bogus'", "valid keys"]),
    ({"host_tier": {"write_policy": "sometimes"}}, ["host_tier.write_policy", "write_through"]),
    ({"monitor": {"sample_interval_ms": 0}}, ["monitor.sample_interval_ms"]),
    ({"topology": {"source": "file"}}, ["topology.file"]),
    ({"selector": "fast"}, ["selector must be a mapping"]),
    ({"extra_tiers": {"name": "memory"}}, ["extra_tiers", "must be a list"]),
    ({"extra_tiers": ["memory"]}, ["extra_tiers[0]", "must be a mapping"]),
    ({"extra_tiers": [{"name": "memory", "capacity": 3}]},
     ["'extra_tiers[0].capacity'", "valid keys in an extra_tiers entry", "options"]),
    ({"extra_tiers": [{"factory": "a.b:c"}]}, ["extra_tiers[0].name"]),
    ({"extra_tiers": [{"name": "x", "factory": "a.b.c"}]}, ["extra_tiers[0].factory", "'a.b.c'", "module.path:callable"]),
    ({"extra_tiers": [{"name": "x", "factory": "a:b"}, {"name": "x", "factory": "a:c"}]},
     ["extra_tiers[1].name", "repeats extra_tiers[0]"]),
    ({"extra_tiers": [{"name": "memory", "options": [1, 2]}]}, ["extra_tiers[0].options", "mapping"]),
    ({"extra_tiers": [{"name": "memory", "write_through": "yes"}]}, ["extra_tiers[0].write_through", "true or false"]),
])
def test_bad_values_one_clear_message(tmp_path, data, needles):
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert p in msg
    for n in needles:
        assert n in msg, msg


def test_extra_tiers_parse_in_order(tmp_path):
    from flexflow_sglang.config import ExtraTierConfig
    p = write(tmp_path, {"extra_tiers": [{"name": "memory", "options": {"capacity_pages": 8}},
                                         {"name": "mine", "factory": "my_pkg.mod:make", "write_through": False}]})
    cfg = load_config(p)
    assert cfg.extra_tiers == (ExtraTierConfig("memory", None, {"capacity_pages": 8}, True),
                               ExtraTierConfig("mine", "my_pkg.mod:make", {}, False))
    assert cfg.to_dict()["extra_tiers"][1] == {"name": "mine", "factory": "my_pkg.mod:make", "options": {},
                                               "write_through": False}


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "selector: [unclosed"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_python_api_validates_too():
    with pytest.raises(ConfigError, match="w_latency"):
        SelectorConfig(w_latency=-2)


def test_topology_file_relative_to_config(tmp_path):
    from flexflow_sglang import Topology
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(Topology.make_mock_dgx(2).to_dict()))
    cfg = load_config(write(tmp_path, {"topology": {"source": "file", "file": "topo.yaml"}}))
    assert len(build_topology(cfg).nodes_of_kind("gpu")) == 2
    cfg = load_config(write(tmp_path, {"topology": {"source": "mock", "mock": "nope"}}, "m.yaml"))
    with pytest.raises(ConfigError, match="nope"):
        build_topology(cfg)
