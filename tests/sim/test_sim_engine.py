"""Simulator: completion times, demand caps, relays, bursts, QoS accounting, the monitor's view."""

import math

import pytest

from flexflow_sglang.monitor import node_agent
from flexflow_sglang.selector import TransferRequest
from flexflow_sglang.tools.sim.engine import GB, BgFlow, BgGroup, Network, Plan, SimParams, Simulator, SubPlan
from flexflow_sglang.tools.sim.sim_agent import SimMonitor
from flexflow_sglang.topology.graph import LinkType, NodeKind, PathType, Topology


def line_topo():
    """a -(10 GB/s, 2 us)- b -(5 GB/s, 3 us)- c, plus a - c (10 GB/s, 1 us)."""
    t = Topology("line")
    for n in "abc":
        t.add_node(n, NodeKind.GPU, "h", ord(n) - 97)
    t.add_link("a", "b", LinkType.NVLINK, 10.0, 2.0)
    t.add_link("b", "c", LinkType.NVLINK, 5.0, 3.0)
    t.add_link("a", "c", LinkType.NVLINK, 10.0, 1.0)
    return t


def plan(net, *legs, relays=0):
    subs = []
    for nodes, nbytes in legs:
        links, _ = net.route(*nodes)
        subs.append(SubPlan(PathType.Direct, tuple(nodes), links, nbytes, relays))
    return Plan("test", subs)


def run_one(net, p, bg=(), groups=(), params=None, t0=0.0):
    sim = Simulator(net, bg, groups, params)
    sim.run(until=t0)
    rec = sim.start_transfer(TransferRequest("a", "c", sum(s.nbytes for s in p.subs)), p)
    sim.run()
    return sim, rec


def test_idle_path_completion_is_bytes_over_rate_plus_latency():
    net = Network(line_topo())
    nbytes = 50_000_000
    _, rec = run_one(net, plan(net, (("a", "b", "c"), nbytes)))
    assert rec.fct == pytest.approx(nbytes / (5 * GB) + 5e-6, rel=1e-9)
    _, rec = run_one(net, plan(net, (("a", "c"), nbytes)))
    assert rec.fct == pytest.approx(nbytes / (10 * GB) + 1e-6, rel=1e-9)
    assert not rec.qos_violation


def test_relay_adds_one_chunk_and_the_handoff_overhead():
    net = Network(line_topo())
    nbytes = 50_000_000
    params = SimParams(relay_chunk_bytes=4_000_000, relay_overhead_us=5.0)
    _, rec = run_one(net, plan(net, (("a", "b", "c"), nbytes), relays=1), params=params)
    assert rec.fct == pytest.approx(nbytes / (5 * GB) + 5e-6 + 4_000_000 / (5 * GB) + 5e-6, rel=1e-9)


def test_split_legs_run_concurrently():
    net = Network(line_topo())
    _, rec = run_one(net, plan(net, (("a", "c"), 20_000_000), (("a", "b", "c"), 10_000_000)))
    assert rec.fct == pytest.approx(max(20e6 / 10e9 + 1e-6, 10e6 / 5e9 + 5e-6), rel=1e-9)


def test_background_demand_cap_respected_and_leftover_used():
    net = Network(line_topo(), thresholds=[0.8] * 3)
    links, res = net.route("a", "c")
    bg = [BgFlow("bg", links, res, 3 * GB, 0)]
    sim, rec = run_one(net, plan(net, (("a", "c"), 70_000_000)), bg=bg)
    assert rec.fct == pytest.approx(70e6 / (7 * GB) + 1e-6, rel=1e-9)
    assert not rec.throttled  # the inference flow kept its 3 GB/s
    assert rec.over_thr  # but the link ran at 100% > 80% with inference traffic on it
    assert sim.shortfall_bytes == 0.0


def test_background_above_fair_share_is_throttled_and_counted():
    net = Network(line_topo(), thresholds=[0.8] * 3)
    links, res = net.route("a", "c")
    bg = [BgFlow("hot", links, res, 8.5 * GB, 0)]
    sim, rec = run_one(net, plan(net, (("a", "c"), 50_000_000)), bg=bg)
    assert rec.fct == pytest.approx(50e6 / (5 * GB) + 1e-6, rel=1e-9)
    assert rec.throttled and rec.qos_violation
    assert sim.shortfall_bytes == pytest.approx(3.5 * GB * 50e6 / (5 * GB), rel=1e-6)


def test_reverse_direction_is_independent():
    net = Network(line_topo(), thresholds=[0.8] * 3)
    links, res = net.route("c", "a")  # background c -> a, transfer a -> c: full duplex
    bg = [BgFlow("rev", links, res, 9 * GB, 0)]
    _, rec = run_one(net, plan(net, (("a", "c"), 10_000_000)), bg=bg)
    assert rec.fct == pytest.approx(10e6 / (10 * GB) + 1e-6, rel=1e-9)
    assert not rec.qos_violation


def test_burst_toggle_changes_the_rate_mid_transfer():
    net = Network(line_topo())
    links, res = net.route("a", "c")
    # on for the first 1 ms of every 10 ms: a transfer starting at t=0 shares the link for 1 ms
    groups = [BgGroup("const"), BgGroup("burst", 0.010, 0.1, 0.0)]
    bg = [BgFlow("b", links, res, 10 * GB, 1)]
    _, rec = run_one(net, plan(net, (("a", "c"), 20_000_000)), bg=bg, groups=groups)
    # 1 ms at 5 GB/s (5 MB), then 15 MB at 10 GB/s (1.5 ms)
    assert rec.fct == pytest.approx(1e-3 + 1.5e-3 + 1e-6, rel=1e-9)


def test_bg_group_schedule():
    g = BgGroup("x", 1.0, 0.25, 0.0)
    assert g.state_at(0.1) == (True, pytest.approx(0.25))
    assert g.state_at(0.5) == (False, pytest.approx(1.0))
    assert BgGroup("c").state_at(3.0) == (True, math.inf)


def test_monitor_sees_sampled_load_not_the_instantaneous_state():
    topo = line_topo()
    net = Network(topo)
    links, res = net.route("a", "c")
    groups = [BgGroup("const"), BgGroup("burst", 0.4, 0.5, 0.0)]  # on 0-200 ms, off 200-400 ms
    bg = [BgFlow("b", links, res, 8 * GB, 1)]
    mon = SimMonitor(topo, sample_interval_ms=100.0)
    sim = Simulator(net, bg, groups, monitor=mon)
    sim.run(until=0.05)
    assert mon.util[links[0]] == 0.0  # nothing sampled yet
    sim.run(until=0.15)
    assert mon.util[links[0]] == pytest.approx(0.8)  # first full interval
    sim.run(until=0.25)
    assert mon.util[links[0]] == pytest.approx(0.8)  # still: the burst stopped at 200 ms (stale view)
    sim.run(until=0.35)
    assert mon.util[links[0]] == pytest.approx(0.0)
    assert node_agent.time.monotonic is not None and node_agent.time.__name__ == "time"  # clock restored


def test_feedback_reaches_the_agent():
    topo = line_topo()
    net = Network(topo)
    mon = SimMonitor(topo, sample_interval_ms=100.0)
    sim = Simulator(net, monitor=mon)
    sim.run(until=0.01)
    sim.start_transfer(TransferRequest("a", "c", 10_000_000), plan(net, (("a", "c"), 10_000_000)))
    sim.run()
    assert mon.reports == 1 and mon.agent.feedback_count == 1
