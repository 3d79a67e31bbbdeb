"""Sim vs real: the three-namespace lab of docs/contention.md (flexflow_sglang/tools/sim/hosts3.py)."""

import json
import math

import pytest

from flexflow_sglang.selector import TransferRequest
from flexflow_sglang.tools.sim import hosts3
from flexflow_sglang.tools.sim.engine import GB, BgFlow, Network, Plan, Simulator, SubPlan
from flexflow_sglang.tools.sim.sim_agent import SimMonitor
from flexflow_sglang.topology import make_mock_hosts
from flexflow_sglang.topology.graph import PathType


def _direct_plan(net, nbytes):
    links, _ = net.route("n0", "n2")
    return Plan("Direct", [SubPlan(PathType.Direct, ("n0", "n2"), links, nbytes)])


@pytest.mark.parametrize("responsive,kv_share", [(False, 0.15), (True, 0.5)])
def test_non_responsive_background_keeps_its_rate(responsive, kv_share):
    topo = make_mock_hosts(3, link_gbps=0.125)
    net = Network(topo)
    links, res = net.route("n0", "n2")
    bg = [BgFlow("udp", links, res, 0.85 * 0.125 * GB, 0, responsive=responsive)]
    sim = Simulator(net, bg)
    nbytes = 10_000_000
    rec = sim.start_transfer(TransferRequest("n0", "n2", nbytes), _direct_plan(net, nbytes))
    sim.run()
    assert rec.fct == pytest.approx(nbytes / (kv_share * 0.125 * GB) + 70e-6, rel=1e-6)
    assert rec.throttled == responsive  # a fair share takes from the background, priority does not


def test_greedy_background_shares_equally():
    topo = make_mock_hosts(3, link_gbps=0.125)
    net = Network(topo)
    links, res = net.route("n0", "n2")
    sim = Simulator(net, [BgFlow(f"tcp{k}", links, res, math.inf, 0) for k in range(3)])
    nbytes = 5_000_000
    rec = sim.start_transfer(TransferRequest("n0", "n2", nbytes), _direct_plan(net, nbytes))
    sim.run()
    assert rec.fct == pytest.approx(nbytes / (0.25 * 0.125 * GB) + 70e-6, rel=1e-6)


@pytest.mark.parametrize("progress", [False, True])
def test_progress_reports_hide_our_own_long_transfer_from_the_counters(progress):
    topo = make_mock_hosts(3, link_gbps=0.125)
    net = Network(topo)
    mon = SimMonitor(topo, sample_interval_ms=100.0, progress=progress)
    sim = Simulator(net, monitor=mon)
    sim.run(until=0.01)
    nbytes = 50_000_000  # 0.4 s at 1 Gbit/s: four sampling intervals
    sim.start_transfer(TransferRequest("n0", "n2", nbytes), _direct_plan(net, nbytes))
    l02 = topo.links_between("n0", "n2")[0].id
    sim.run(until=0.25)
    assert mon.util[l02] == (pytest.approx(0.0, abs=1e-9) if progress else pytest.approx(1.0))
    sim.run()
    assert mon.reports == 1


def test_monitor_observes_only_the_listed_links():
    topo = make_mock_hosts(3)
    mon = SimMonitor(topo, observe=[0, 1])
    assert mon.observed == [0, 1]
    with pytest.raises(ValueError):
        SimMonitor(topo, observe=[7])


@pytest.fixture(scope="module")
def cmp():
    return hosts3.compare(("idle", "udp85", "tcp3"))


def test_sim_matches_the_measured_ratios(cmp):
    for sc, r in cmp.items():
        assert abs(r["ratio_err"]) <= 0.10, (sc, r["sim_ratio"], r["real_ratio"])
    # UDP at 85 %: direct gets the 15 % the UDP flow leaves; adaptive relays every payload
    assert cmp["udp85"]["sim"]["direct"] == pytest.approx(150, rel=0.02)
    assert cmp["udp85"]["sim_paths"] == "R:8"
    # idle: splits every payload, as the measured run (912b2c9, the current selector) did
    assert "SplitPath" in {x["path"] for x in cmp["idle"]["transfers"]["adaptive"]}
    for sc, r in cmp.items():
        assert r["sim_paths"] == r["real_paths"], (sc, r["sim_paths"], r["real_paths"])


def test_fair_udp_ablation_gives_flexflows_shape():
    r = hosts3.compare(("udp85",), ("direct", "adaptive"), hosts3.LabSettings(udp_fair=True))["udp85"]
    assert 1.7 <= r["sim_ratio"] <= 2.0  # max-min: direct keeps half the link


def test_relay_model_ablation_matches_the_real_paths():
    res = hosts3.relay_model_ablation()
    # the measured run (912b2c9, the current selector) split every payload under either model
    for chunk in (1 << 20, 4 << 20):
        assert res[chunk]["sim"]["paths"] == res[chunk]["real"]["paths"]
    assert res[1 << 20]["sim"]["small"] > res[4 << 20]["sim"]["small"]


def test_cli(tmp_path):
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(
        "sim_vs_real", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sim_vs_real.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--scenarios", "idle,udp50"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data["compare"]) == {"idle", "udp50"}
    assert "| udp50 | 9 |" in (tmp_path / "results.md").read_text()
