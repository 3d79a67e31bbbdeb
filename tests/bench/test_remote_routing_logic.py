"""`flexflow bench remote-routing` logic without servers or namespaces: modes, the topology and
server configs (adaptive vs forced direct), metric deltas, the per-mode summary, ratios, targets and
argument validation."""

from __future__ import annotations

import pytest
import yaml

from flexflow_sglang.selector.types import TransferRequest
from flexflow_sglang.tiers.routing import UNEXECUTED_TYPES
from flexflow_sglang.tools.bench import remote_routing as rr


def test_modes_parse_and_reject():
    assert rr.parse_modes(rr.DEFAULT_MODES) == ["direct-idle", "adaptive-idle", "direct-udp", "adaptive-udp"]
    assert rr.parse_modes(" adaptive-udp , ") == ["adaptive-udp"]
    for bad, msg in (("", "no modes"), ("relay-idle", "POLICY-LOAD"), ("adaptive-busy", "POLICY-LOAD"),
                     ("adaptive", "POLICY-LOAD"), ("direct-idle,direct-idle", "repeated")):
        with pytest.raises(ValueError, match=msg):
            rr.parse_modes(bad)


def _write(tmp_path, policy):
    topo = tmp_path / f"topology-{policy}.yaml"
    topo.write_text(yaml.safe_dump(rr.topology_dict(0.125, "v01", "v02", policy == "adaptive")))
    cfg = tmp_path / f"flexflow-{policy}.yaml"
    cfg.write_text(yaml.safe_dump(rr.server_config(policy, topology_file=str(topo), owner="10.77.2.2:7410",
                                                   relay="10.77.1.2:7410", host_tokens=8192, timeout_ms=60000,
                                                   write_through=False)))
    return str(cfg)


def _selector(topo, cfg):
    """The selector the remote tier's router gets in serving (RemoteTier.route_with), mock-fed."""
    from flexflow_sglang.monitor import NodeAgent
    from flexflow_sglang.selector import PathSelector
    agent = NodeAgent(topo, source="mock")
    return PathSelector(topo, agent, cfg.selector).without(*UNEXECUTED_TYPES), agent


def test_adaptive_config_routes_from_n0_with_a_relay_and_split(tmp_path):
    from flexflow_sglang.config import build_topology, load_config
    from flexflow_sglang.topology.graph import PathType
    cfg = load_config(_write(tmp_path, "adaptive"))
    rt = cfg.remote_tier
    assert rt.enabled and rt.peers == ("10.77.2.2:7410",) and rt.relay_peers == ("10.77.1.2:7410",)
    assert rt.local_node == "n0" and not rt.write_through and not cfg.storage_tier.enabled
    assert cfg.selector.enable_split_path and cfg.monitor.source == "sysfs"
    assert cfg.transfer.prefetch_policy == "wait_complete" and cfg.transfer.load_timeout_ms == 60000
    topo = build_topology(cfg)
    # the connector's host node is n0 (next to the device pool gpu0): the remote tier is routed from n0
    assert topo.host_memory(host="n0", near="gpu0").name == "n0"
    counters = {(l.a, l.b): l.counter for l in topo.links}
    assert counters[("n0", "n2")] == {"sysfs_net": "v02"} and counters[("n0", "n1")] == {"sysfs_net": "v01"}
    assert counters[("n1", "n2")] == {}
    paths = [p for p in topo.enumerate_paths("n2", "n0", allow_storage=False) if p.type not in UNEXECUTED_TYPES]
    assert [p.type for p in paths] == [PathType.Direct, PathType.CrossNodeRelay]
    assert paths[1].nodes == ("n2", "n1", "n0")
    # what the remote tier's router would be told: idle -> split over both; n0-n2 at 85 % -> relay via n1
    sel, agent = _selector(topo, cfg)
    assert sel.select(TransferRequest("n2", "n0", 32 << 20)).chosen_type == PathType.SplitPath
    agent.set_utilization("n0", "n2", 0.85)
    d = sel.select(TransferRequest("n2", "n0", 32 << 20))
    assert d.chosen_type == PathType.CrossNodeRelay and d.subpaths[0].nodes == ("n2", "n1", "n0")


def test_forced_direct_has_no_relay_path_and_no_relay_peer(tmp_path):
    from flexflow_sglang.config import build_topology, load_config
    from flexflow_sglang.topology.graph import PathType
    cfg = load_config(_write(tmp_path, "direct"))
    assert cfg.remote_tier.relay_peers == () and not cfg.selector.enable_split_path
    topo = build_topology(cfg)
    assert "n1" not in topo.nodes
    assert [p.type for p in topo.enumerate_paths("n2", "n0", allow_storage=False)
            if p.type not in UNEXECUTED_TYPES] == [PathType.Direct]
    sel, agent = _selector(topo, cfg)
    for util in (0.0, 0.85, 1.0):  # direct whatever the load: there is no other path
        agent.set_utilization("n0", "n2", util)
        assert sel.select(TransferRequest("n2", "n0", 32 << 20)).chosen_type == PathType.Direct
    with pytest.raises(ValueError, match="policy"):
        rr.server_config("relay", topology_file="t.yaml", owner="a:1", relay=None, host_tokens=1, timeout_ms=1,
                         write_through=True)


def test_metric_delta_and_summary():
    before = {"flexflow_deeper_tiers_remote_read_s": 1.0, "flexflow_deeper_tiers_remote_bytes_read": 100.0,
              "flexflow_deeper_tiers_remote_route_relay": 1.0, "flexflow_prefetch_pages": 5.0}
    after = {"flexflow_deeper_tiers_remote_read_s": 3.5, "flexflow_deeper_tiers_remote_bytes_read": 2.5e8 + 100,
             "flexflow_deeper_tiers_remote_route_relay": 4.0, "flexflow_deeper_tiers_remote_route_split": 1.0,
             "flexflow_prefetch_pages": 15.0}
    d = rr.metric_delta(before, after)
    assert d["remote_read_s"] == 2.5 and d["remote_bytes_read"] == 2.5e8 and d["remote_route_relay"] == 3
    assert d["remote_route_direct"] == 0 and d["prefetch_pages"] == 10
    reqs = [{"ttft_s": 1.0, "text": "a"}, {"ttft_s": 3.0, "text": "b"}, {"ttft_s": 2.0, "text": "c"}]
    s = rr.mode_summary(reqs, d, ["a", "b", "c"])
    assert s["n"] == 3 and s["ttft_median_s"] == 2.0 and s["fetch_s"] == 2.5 and s["fetch_bytes"] == 250000000
    assert s["fetch_gbit_s"] == 0.8 and s["routes"] == {"direct": 0, "relay": 3, "split": 1}
    assert s["outputs_equal"] and s["outputs_mismatched"] == []
    s = rr.mode_summary(reqs, d, ["a", "x"])  # a differing and a missing reference both count
    assert not s["outputs_equal"] and s["outputs_mismatched"] == [1, 2]
    assert rr.mode_summary([], {}, [])["ttft_median_s"] is None and not rr.mode_summary([], {}, [])["outputs_equal"]


def test_ratios_and_targets_come_from_the_same_run():
    def mode(fetch_s, ttft, nbytes=1000):
        return {"summary": {"fetch_s": fetch_s, "ttft_median_s": ttft, "fetch_bytes": nbytes}}
    modes = {"direct-idle": mode(1.0, 2.0), "adaptive-idle": mode(0.5, 1.6),
             "direct-udp": mode(9.0, 10.0), "adaptive-udp": mode(2.0, 2.5, nbytes=999)}
    r = rr.ratios(modes)
    assert r["idle"] == {"bytes_equal": True, "fetch": 2.0, "ttft_median": 1.25}
    assert r["udp"] == {"bytes_equal": False, "fetch": 4.5, "ttft_median": 4.0}
    t = rr.targets(r)
    assert t == {"udp_fetch_ge_3x": False, "idle_fetch_ge_1x": True}  # udp: unequal bytes fail the claim
    modes["adaptive-udp"] = mode(2.0, 2.5)
    assert rr.targets(rr.ratios(modes))["udp_fetch_ge_3x"] is True
    modes["adaptive-idle"] = mode(1.25, 2.0)
    assert rr.targets(rr.ratios(modes))["idle_fetch_ge_1x"] is False
    part = rr.ratios({"direct-udp": mode(9.0, 10.0), "adaptive-udp": {"error": "runner exited 1"}})
    assert part == {} and rr.targets(part) == {"udp_fetch_ge_3x": None, "idle_fetch_ge_1x": None}


def test_outputs_check_against_the_cached_reference_and_across_modes():
    fill = {"requests": [{"text": "a"}, {"text": "b"}], "full_prefill": [{"text": "a"}, {"text": "B"}]}
    modes = {"direct-idle": {"requests": [{"text": "a"}, {"text": "b"}]},
             "adaptive-udp": {"requests": [{"text": "a"}, {"text": "b"}]}, "direct-udp": {"error": "x"}}
    o = rr.outputs_check(fill, modes)
    assert o == {"modes_equal_reference": {"direct-idle": True, "adaptive-udp": True},
                 "modes_equal_each_other": True, "full_prefill_equal_reference": 1, "prompts": 2}
    modes["adaptive-udp"]["requests"][1]["text"] = "c"
    o = rr.outputs_check(fill, modes)
    assert o["modes_equal_reference"]["adaptive-udp"] is False and o["modes_equal_each_other"] is False
    assert rr.outputs_check({}, {})["modes_equal_each_other"] is None


def test_sizes_texts_and_udp_rate():
    assert rr.host_tokens_for(12, 1536, 16) == 2 * 12 * (1536 + 16 + 64) and rr.host_tokens_for(1, 8, 1) == 4096
    assert rr.words_for(1100) == 1000 and rr.words_for(1) == 8
    assert rr.udp_bps("1gbit", 0.85) == pytest.approx(0.85e9) and rr.udp_bps("300mbit", 0.5) == pytest.approx(1.5e8)
    assert rr.prompt_text(3, 20) == rr.prompt_text(3, 20) != rr.prompt_text(4, 20)
    # warm-up / flush texts never share a first word with another server's texts (no stray fetches)
    first = {t.split()[0] for t in (rr.prompt_text(1, 20), rr._aux_text("fill", "warm up"),
                                    rr._aux_text("direct-udp", "flush before"))}
    assert len(first) == 3
    assert rr._aux_text("fill", "settle", fixed=True) == rr._aux_text("fill", "settle", fixed=True)


@pytest.mark.parametrize("argv,msg", [
    (["--udp-share", "1.2"], "--udp-share must be in (0, 1)"),
    (["--modes", "adaptive-busy"], "--modes"),
    (["--rate", "fast"], "--rate"),
    (["--prompts", "0"], "--prompts must be positive"),
    (["--page-size", "0"], "--page-size must be positive"),
    (["--prompt-tokens", "4030"], "cannot hold one request"),
])
def test_bad_arguments_are_usage_errors(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(rr, "run_driver", lambda args: pytest.fail("the benchmark must not start"))
    with pytest.raises(SystemExit) as e:
        rr.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_cli_lists_the_benchmark():
    from flexflow_sglang.tools.cli.main import build_parser
    args = build_parser().parse_args(["bench", "remote-routing", "--prompts", "2"])
    assert args.what == "remote-routing" and args.rest == ["--prompts", "2"]
