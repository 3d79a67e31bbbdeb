"""Rail topology, RailRouter decisions, page splitting, chunk stats and the PD config section."""

import json
import os

import pytest

from flexflow_sglang.config import config_from_dict
from flexflow_sglang.errors import ConfigError
from flexflow_sglang.pd.rails import (RailRouter, RailShare, build_rail_topology, check_rail_names,
                                      rail_capacity_gbps, split_by_shares)
from flexflow_sglang.pd.stats import ChunkStats, load_trace
from flexflow_sglang.selector import SelectorConfig
from flexflow_sglang.topology.graph import PathType


def _router(n=2, caps=(1.0, 1.0), policy="adaptive", **kw):
    return RailRouter([f"eth{i}" for i in range(n)], SelectorConfig(), policy=policy, start_monitor=False,
                      capacities=list(caps), sysfs_root="/nonexistent", **kw)


def test_rail_topology_has_one_direct_path_per_rail_and_disjoint_pairs():
    topo = build_rail_topology(["eth0", "eth1", "eth2"], 12.5, sysfs_root="/nonexistent")
    paths = topo.enumerate_paths("prefill", "decode")
    direct = [p for p in paths if p.type == PathType.Direct]
    assert len(direct) == 3 and len(paths) == 3  # no relay: the decode peer is the only endpoint
    assert {p.nodes[1] for p in direct} == {"rail0", "rail1", "rail2"}
    assert all(topo.link_disjoint(a, b) for a in direct for b in direct if a is not b)


def test_capacity_config_else_sysfs_speed_else_fallback(tmp_path):
    d = tmp_path / "class" / "net" / "eth7"
    d.mkdir(parents=True)
    (d / "speed").write_text("25000\n")  # Mbit/s
    gbps, src = rail_capacity_gbps("eth7", None, str(tmp_path))
    assert gbps == pytest.approx(3.125) and src.endswith("eth7/speed")
    # a configured capacity wins: a shaped or shared NIC delivers less than its link speed
    assert rail_capacity_gbps("eth7", 0.125, str(tmp_path)) == (0.125, "pd.rail_gbps")
    (d / "speed").write_text("-1\n")  # virtual devices may report -1
    assert rail_capacity_gbps("eth7", None, str(tmp_path))[0] == 12.5
    topo = build_rail_topology(["eth7"], 0.125, sysfs_root=str(tmp_path))
    net = topo.links_between("rail0", "decode")[0]
    assert net.counter == {"sysfs_net": "eth7"} and net.capacity_gbps == 0.125


@pytest.mark.parametrize("bad", ["../etc", "", "a b", "x/y", ".."])
def test_rail_names_are_device_names(bad):
    with pytest.raises(ConfigError, match=r"pd.rails\[0\]"):
        check_rail_names([bad])


def test_idle_equal_rails_split_large_chunks():
    r = _router()
    plan = r.plan(64 << 20)
    assert plan.path_type == "split"
    assert sorted(s.rail for s in plan.shares) == [0, 1]
    assert sum(s.fraction for s in plan.shares) == pytest.approx(1.0)
    assert all(0.4 < s.fraction < 0.6 for s in plan.shares)


def test_loaded_rail_is_avoided_and_qos_respected():
    r = _router()
    r.agent.set_link_utilization(r._net_link[0], 0.9)  # above rdma_util_threshold 0.8
    for nbytes in (64 << 10, 4 << 20, 256 << 20):
        plan = r.plan(nbytes)
        assert [s.rail for s in plan.shares] == [1], (nbytes, plan)
        assert not plan.qos_violation


def test_partly_loaded_rail_gets_the_smaller_share():
    r = _router()
    r.agent.set_link_utilization(r._net_link[0], 0.5)
    plan = r.plan(256 << 20)
    shares = {s.rail: s.fraction for s in plan.shares}
    assert plan.path_type == "split" and shares[1] > shares[0] > 0.2


def test_feedback_from_slow_legs_moves_traffic():
    r = _router()
    # rail 0 delivered 8 MiB in 0.5 s (16 MB/s on a 1 GB/s rail): it is congested by someone else
    for _ in range(3):
        r.feedback(0, 8 << 20, 0.5)
    plan = r.plan(32 << 20)
    shares = {s.rail: s.fraction for s in plan.shares}
    assert shares.get(1, 0) > 0.9


def test_planned_chunk_is_in_flight_until_its_legs_end():
    """select -> reserve -> legs -> release -> report run through the transfer engine's ticket."""
    r = _router()
    before = r.utilization()
    plan = r.plan(64 << 20)
    assert plan.path_type == "split" and plan.ticket is not None and r.agent.in_flight == 2
    assert all(u > b for u, b in zip(r.utilization(), before))  # both rails show our chunk in flight
    reports = []
    orig = r.agent.report_transfer
    r.agent.report_transfer = lambda links, n, s, **kw: reports.append((tuple(links), n, kw)) or orig(links, n, s, **kw)
    s0, s1 = plan.shares
    r.leg_posted(plan.ticket, 0, s0.rail, 32 << 20)
    r.leg_done(plan.ticket, 0, s0.rail, 32 << 20, 0.05)
    assert r.agent.in_flight == 1 and len(reports) == 1
    links, n, kw = reports[0]
    assert r._net_link[s0.rail] in links and n == 32 << 20 and kw.get("progress_reported") is True
    r.leg_done(plan.ticket, 1, s1.rail, 32 << 20, 0.05, ok=False)  # a failed leg: released, not reported
    assert r.agent.in_flight == 0 and len(reports) == 1
    r.finish(plan.ticket)
    r.finish(plan.ticket)  # idempotent
    assert r.engine.bandwidth_by_type()["pd:SplitPath"]["moves"] == 1


def test_abandoned_chunk_releases_everything():
    r = _router()
    plan = r.plan(64 << 20)
    assert r.agent.in_flight == 2
    r.finish(plan.ticket)
    assert r.agent.in_flight == 0


def test_first_rail_policy_is_fixed():
    r = _router(policy="first_rail")
    r.agent.set_link_utilization(r._net_link[0], 0.95)
    plan = r.plan(1 << 20)
    assert plan.path_type == "fixed" and [(s.rail, s.fraction) for s in plan.shares] == [(0, 1.0)]


def test_split_by_shares_covers_every_page_once():
    for n in (1, 2, 7, 100, 1001):
        for fr in ((1.0,), (0.5, 0.5), (0.9, 0.1), (0.001, 0.999)):
            shares = [RailShare(i, f) for i, f in enumerate(fr)]
            parts = split_by_shares(n, shares)
            covered = [i for _, a, b in parts for i in range(a, b)]
            assert covered == list(range(n))
            assert all(b > a for _, a, b in parts)
    parts = split_by_shares(100, [RailShare(1, 0.7), RailShare(0, 0.3)])
    assert parts == [(1, 0, 70), (0, 70, 100)]


def test_chunk_stats_trace_is_owner_only_and_complete(tmp_path):
    path = str(tmp_path / "t.jsonl")
    st = ChunkStats(2, "adaptive", trace_path=path)
    st.record("split", [(0, 300, 1.0, 1.2), (1, 700, 1.0, 1.5)], True, 0.9)
    st.record("direct", [(1, 100, 2.0, 2.1)], False, 2.0)
    st.close()
    recs = load_trace(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [r["path"] for r in recs] == ["split", "direct"] and [r["ok"] for r in recs] == [True, False]
    assert recs[0]["bytes"] == 1000 and recs[0]["seconds"] == pytest.approx(0.6)
    assert [leg["rail"] for leg in recs[0]["legs"]] == [0, 1]
    m = st.metrics()
    assert m["chunks"] == 2 and m["failed_chunks"] == 1 and m["bytes"] == 1000
    assert m["bytes_per_rail"] == {"rail0": 300, "rail1": 700}
    json.dumps(m)


def test_pd_config_section_validation():
    cfg = config_from_dict({"pd": {"enabled": True, "rails": ["eth2", "eth3"], "policy": "first_rail"}})
    assert cfg.pd.enabled and cfg.pd.rails == ("eth2", "eth3") and cfg.pd.policy == "first_rail"
    with pytest.raises(ConfigError) as e:
        config_from_dict({"pd": {"policy": "fastest", "rail_gbps": 0, "bogus": 1}})
    msg = str(e.value)
    assert "pd.policy = 'fastest'" in msg and "pd.rail_gbps = 0" in msg and "'pd.bogus'" in msg


def test_pd_settings_reject_bad_rail_name(tmp_path, monkeypatch):
    from flexflow_sglang.pd import settings
    p = tmp_path / "c.yaml"
    p.write_text("pd:\n  enabled: true\n  rails: ['../../etc']\n")
    monkeypatch.setenv("FLEXFLOW_CONFIG", str(p))
    with pytest.raises(ConfigError, match=r"pd.rails\[0\] = '../../etc'"):
        settings.pd_settings(reload=True)
    monkeypatch.delenv("FLEXFLOW_CONFIG")
    assert settings.pd_settings(reload=True).enabled is False
