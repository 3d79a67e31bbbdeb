"""Every flexFlow rule, on both implementations (compiled core and Python twin)."""
import pytest

from flexflow_sglang import NodeAgent, PathSelector, PathType, SelectorConfig, Topology, TransferRequest
from flexflow_sglang.selector import selector_backend
from flexflow_sglang.topology import make_mock

MiB = 1 << 20
IMPLS = ["python"] + (["compiled"] if selector_backend() == "compiled" else [])


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def mk(mock, impl, **cfg):
    topo = make_mock(mock)
    agent = NodeAgent(topo, source="mock")
    return topo, agent, PathSelector(topo, agent, SelectorConfig(**cfg), impl=impl)


def test_idle_direct(impl):
    _, _, sel = mk("dgx-a100", impl, enable_split_path=False)
    d = sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB))
    assert d.chosen_type == PathType.Direct and d.hops == ("gpu0", "gpu1")
    assert d.estimated_bandwidth == pytest.approx(100.0)
    assert d.estimated_time_us == pytest.approx(64 * MiB / 100e3 + 2.0)
    assert not d.qos_violation


def test_qos_threshold_rejects_direct(impl):
    _, agent, sel = mk("dgx-a100", impl, enable_split_path=False)
    agent.set_utilization("gpu0", "gpu1", 0.81)
    d = sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB))
    assert d.chosen_type == PathType.NVLinkRelay
    assert d.hops[0] == "gpu0" and d.hops[-1] == "gpu1" and len(d.hops) == 3
    assert "rejected" in d.reason and "gpu0-gpu1" in d.reason and "nvlink" in d.reason


def test_threshold_is_configurable(impl):
    _, agent, sel = mk("dgx-a100", impl, enable_split_path=False, nvlink_util_threshold=0.9, w_qos_risk=0.0,
                       relay_benefit_margin=10.0)
    agent.set_utilization("gpu0", "gpu1", 0.85)
    assert sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB)).chosen_type == PathType.Direct


def test_relay_margin(impl):
    # 15% load: the relay scores better (direct 789 us vs relay ~749 us: 671 us of bytes plus one
    # 4 MiB pipeline fill, x1.05 for its extra hop), but by less than the 10% margin -> stay direct
    _, agent, sel = mk("dgx-a100", impl, enable_split_path=False, w_qos_risk=0.0)
    agent.set_utilization("gpu0", "gpu1", 0.15)
    sc = {p.type: cost for p, _, _, cost, _ in sel.scores("gpu0", "gpu1", 64 * MiB)}
    assert sc[PathType.NVLinkRelay] < sc[PathType.Direct]
    d = sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB))
    assert d.chosen_type == PathType.Direct and d.reason_code == 5 and "margin" in d.reason
    # 40% load: the relay wins by far more than the margin
    agent.set_utilization("gpu0", "gpu1", 0.4)
    d = sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB))
    assert d.chosen_type == PathType.NVLinkRelay and d.gain > 0.10
    # a huge margin keeps direct even then
    _, agent2, sel2 = mk("dgx-a100", impl, enable_split_path=False, relay_benefit_margin=5.0)
    agent2.set_utilization("gpu0", "gpu1", 0.4)
    assert sel2.select(TransferRequest("gpu0", "gpu1", 64 * MiB)).chosen_type == PathType.Direct


def test_ttft_penalises_hops(impl):
    _, agent, sel = mk("dgx-a100", impl, enable_split_path=False)
    agent.set_utilization("gpu0", "gpu1", 0.5)
    big = sel.select(TransferRequest("gpu0", "gpu1", 64 * MiB))
    assert big.chosen_type == PathType.NVLinkRelay
    small = sel.select(TransferRequest("gpu0", "gpu1", 64 << 10, ttft_sensitive=True))
    assert small.chosen_type == PathType.Direct
    # the global TTFT switch does the same
    _, agent3, sel3 = mk("dgx-a100", impl, enable_split_path=False, ttft_sensitive=True)
    agent3.set_utilization("gpu0", "gpu1", 0.5)
    assert sel3.select(TransferRequest("gpu0", "gpu1", 64 << 10)).chosen_type == PathType.Direct


def test_split_shares_sum_exactly(impl):
    _, agent, sel = mk("hosts3", impl)
    agent.set_utilization("n0", "n2", 0.5)
    for n in (1, 7, 4096, 64 * MiB + 3, 999_999_937):
        d = sel.select(TransferRequest("n0", "n2", n))
        if d.chosen_type != PathType.SplitPath:
            continue
        assert sum(b for _, b in d.hops) == n
        assert sum(s.nbytes for s in d.subpaths) == n
        legs = d.subpaths
        assert not set(legs[0].links) & set(legs[1].links)  # link-disjoint
    d = sel.select(TransferRequest("n0", "n2", 64 * MiB))
    assert d.chosen_type == PathType.SplitPath
    shares = {s.nodes: s.nbytes for s in d.subpaths}
    # the idle relay carries more than the half-loaded direct link, though less than the 2x its
    # bandwidth alone would give it: it also pays a second hop and the pipeline fill
    assert shares[("n0", "n2")] < shares[("n0", "n1", "n2")] < 2 * shares[("n0", "n2")]
    times = _leg_finish_us(sel, d)
    assert max(times) == pytest.approx(min(times), rel=1e-6)
    assert d.estimated_time_us == pytest.approx(max(times), rel=1e-6)


def _leg_finish_us(sel, d):
    """Each leg's predicted finish (us) under the single-path model applied to its own share: share
    at the path's available bandwidth + link latencies + per relay one min(share, chunk) pipeline
    chunk and the hand-off + queueing."""
    from flexflow_sglang.selector.cost_model import path_time_us
    by_nodes = {p.nodes: (p, bw) for p, bw, _, _, _ in sel.scores(d.request.src, d.request.dst, d.request.data_bytes)}
    out = []
    for leg in d.subpaths:
        path, bw = by_nodes[leg.nodes]
        lat = sum(sel.topology.links[l].latency_us for l in path.links)
        q = sum(float(sel.agent.qdelay_us[l]) for l in path.links)
        out.append(path_time_us(leg.nbytes, bw, lat, len(path.relays), q, sel.config.relay_chunk_bytes))
    return out


def _latency_skewed_triangle():
    """n0-n2 direct with 1 us latency; the relay via n1 has the same 10 GB/s but 200 us per hop."""
    from flexflow_sglang.topology.graph import LinkType, NodeKind
    topo = Topology("skewed", "test:skewed")
    for h in range(3):
        topo.add_node(f"n{h}", NodeKind.CPU, f"n{h}", 0)
    topo.add_link("n0", "n2", LinkType.ETHERNET, 10.0, 1.0)
    topo.add_link("n0", "n1", LinkType.ETHERNET, 10.0, 200.0)
    topo.add_link("n1", "n2", LinkType.ETHERNET, 10.0, 200.0)
    return topo


def test_split_shares_equalise_finish_times(impl):
    # equal bandwidth, very different fixed latency: proportional-to-bandwidth shares (50/50) would
    # make the relay leg finish ~450 us after the direct one
    topo = _latency_skewed_triangle()
    agent = NodeAgent(topo, source="mock")
    sel = PathSelector(topo, agent, SelectorConfig(), impl=impl)
    for n in (64 * MiB, 256 * MiB + 5):
        d = sel.select(TransferRequest("n0", "n2", n))
        assert d.chosen_type == PathType.SplitPath
        shares = {s.nodes: s.nbytes for s in d.subpaths}
        assert sum(shares.values()) == n
        assert shares[("n0", "n1", "n2")] < shares[("n0", "n2")]
        times = _leg_finish_us(sel, d)
        assert max(times) == pytest.approx(min(times), rel=1e-6)
        assert d.estimated_time_us == pytest.approx(max(times), rel=1e-6)
        assert d.estimated_time_us < sel.always_direct(TransferRequest("n0", "n2", n)).estimated_time_us
    # the relay leg's fixed latency (400 us + fill) exceeds the whole transfer's time on the direct
    # leg (~105 us for 1 MiB): it would get no bytes, so no split even with a zero margin
    sel0 = PathSelector(topo, agent, SelectorConfig(split_benefit_margin=0.0), impl=impl)
    for n in (1, 4096, 1 * MiB):
        d = sel0.select(TransferRequest("n0", "n2", n))
        assert d.chosen_type == PathType.Direct and d.hops == ("n0", "n2")


def test_split_shares_small_payload_pays_fill_on_its_share(impl):
    # under one chunk, a relay leg's pipeline fill is its own share (store-and-forward of the whole
    # share), not min(request, chunk): the 1 MiB idle-mesh split is still predicted to finish together
    _, _, sel = mk("dgx-a100", impl, split_benefit_margin=0.0)
    d = sel.select(TransferRequest("gpu0", "gpu1", 1 * MiB))
    assert d.chosen_type == PathType.SplitPath
    times = _leg_finish_us(sel, d)
    assert max(times) == pytest.approx(min(times), abs=1e-4)  # shares are whole bytes: 1e-5 us each


def test_split_margin_and_switch(impl):
    _, agent, sel = mk("hosts3", impl, split_benefit_margin=5.0)
    agent.set_utilization("n0", "n2", 0.5)
    assert sel.select(TransferRequest("n0", "n2", 64 * MiB)).chosen_type != PathType.SplitPath
    _, agent, sel = mk("hosts3", impl, enable_split_path=False)
    assert sel.select(TransferRequest("n0", "n2", 64 * MiB)).chosen_type == PathType.Direct
    _, agent, sel = mk("hosts3", impl, max_split_paths=1)
    assert sel.select(TransferRequest("n0", "n2", 64 * MiB)).chosen_type == PathType.Direct


def test_storage_relay_when_fast_paths_rejected(impl):
    _, agent, sel = mk("cluster2x8x4", impl, enable_split_path=False)
    for k in range(4):
        agent.set_utilization(f"n0.nic{k}", f"leaf{k}", 0.95)
    d = sel.select(TransferRequest("n0.gpu0", "n1.gpu0", 64 * MiB))
    assert d.chosen_type == PathType.StorageRelay and "shared-storage" in d.hops
    assert not d.qos_violation


def test_excluded_types_are_never_returned_nor_split(impl):
    """A serving path without a StorageRelay / NVLinkRelay executor asks a selector without them;
    the sibling shares the agent, so loads and reservations stay one view."""
    topo, agent, sel = mk("cluster2x8x4", impl)
    for k in range(4):
        agent.set_utilization(f"n0.nic{k}", f"leaf{k}", 0.95)
    req = TransferRequest("n0.gpu0", "n1.gpu0", 64 * MiB)
    assert any(sp.type == PathType.StorageRelay for sp in sel.select(req).subpaths)
    no_st = sel.without(PathType.StorageRelay, "NVLinkRelay")
    assert no_st.agent is agent and no_st.exclude_types == {PathType.StorageRelay, PathType.NVLinkRelay}
    assert not any(p.type in no_st.exclude_types for p in no_st.candidates("n0.gpu0", "n1.gpu0"))
    for nbytes in (64 * 1024, 4 * MiB, 64 * MiB, 1024 * MiB):
        d = no_st.select(TransferRequest("n0.gpu0", "n1.gpu0", nbytes))
        assert d.chosen_type not in no_st.exclude_types
        assert all(sp.type not in no_st.exclude_types for sp in d.subpaths), d
    # the original is unchanged, and asking the topology with other options is not served from a cache
    assert any(sp.type == PathType.StorageRelay for sp in sel.select(req).subpaths)
    assert any(p.type == PathType.StorageRelay for p in topo.enumerate_paths("n0.gpu0", "n1.gpu0"))
    assert not any(p.type == PathType.StorageRelay
                   for p in topo.enumerate_paths("n0.gpu0", "n1.gpu0", allow_storage=False))


def test_least_bad_when_everything_rejected(impl):
    _, agent, sel = mk("hosts3", impl)
    agent.set_utilization("n0", "n2", 0.95)
    agent.set_utilization("n0", "n1", 0.9)
    d = sel.select(TransferRequest("n0", "n2", 64 * MiB))
    assert d.qos_violation and "QoS not met" in d.reason
    # least bad = the path with the most available bandwidth (relay's worst link is at 90% vs 95%)
    assert d.hops == ("n0", "n1", "n2")


def test_decision_json_fields(impl):
    _, _, sel = mk("dgx8", impl)
    d = sel.select(TransferRequest("gpu0", "cpu0", 16 * MiB)).to_dict()
    for key in ("chosen_type", "hops", "estimated_bandwidth_gbps", "estimated_time_us", "reason", "qos_violation"):
        assert key in d


def test_bad_requests():
    with pytest.raises(ValueError):
        TransferRequest("gpu0", "gpu1", 0)
    from flexflow_sglang import SelectorError
    _, _, sel = mk("dgx8", "python")
    with pytest.raises(SelectorError, match="nosuch"):
        sel.select(TransferRequest("gpu0", "nosuch", 10))


def test_load_update_visible_without_rebuild(impl):
    _, agent, sel = mk("dgx-a100", impl, enable_split_path=False)
    req = TransferRequest("gpu0", "gpu1", 64 * MiB)
    assert sel.select(req).chosen_type == PathType.Direct
    agent.set_utilization("gpu0", "gpu1", 0.9)
    assert sel.select(req).chosen_type == PathType.NVLinkRelay
    agent.set_utilization("gpu0", "gpu1", 0.0)
    assert sel.select(req).chosen_type == PathType.Direct


def test_relay_fill_costed_as_transfer_time(impl):
    # a relay's pipeline fill is bytes moving at the path's bandwidth: it is weighted like the
    # transfer time (w_bandwidth), not like a fixed latency, so w_latency = 0 does not hide it
    topo, _, sel = mk("dgx8", impl, w_latency=0.0, w_hops=0.0, w_qos_risk=0.0, w_queue_delay=0.0)
    for size in (1 * MiB, 64 * MiB):
        for p, bw, est, cost, _ in sel.scores("gpu0", "gpu1", size):
            fill = len(p.relays) * min(size, 4 * MiB) / (bw * 1e3)
            assert cost == pytest.approx(size / (bw * 1e3) + fill, rel=1e-12)
            lat = sum(topo.links[l].latency_us for l in p.links) + 5.0 * len(p.relays)
            assert est == pytest.approx(cost + lat, rel=1e-12)


def test_small_split_prefers_fill_free_leg(impl):
    # dgx8, GPU0-GPU1 at 85%: at 1 MiB a relay leg cannot pipeline (its fill is its whole share),
    # so PCIe plus one relay beats two relays, as the selector's own estimate says
    _, agent, sel = mk("dgx8", impl)
    agent.set_utilization("gpu0", "gpu1", 0.85)
    d = sel.select(TransferRequest("gpu0", "gpu1", 1 * MiB))
    assert d.chosen_type == PathType.SplitPath
    assert sorted(s.type.value for s in d.subpaths) == ["Direct", "NVLinkRelay"]
    assert any(s.nodes == ("gpu0", "pcisw0", "gpu1") for s in d.subpaths)
