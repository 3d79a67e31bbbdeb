"""selector/cost_model.py is the one definition of the cost model: the compiled core's typed copies of
its constants equal it, the params vector and the result tuple follow its layout, and its formulas are
the ones the core, the NodeAgent's feedback and the simulator use."""
import dataclasses
import time

import pytest

from flexflow_sglang import NodeAgent, PathSelector, SelectorConfig, TransferRequest
from flexflow_sglang.selector import _core_py, cost_model as cm, selector_backend
from flexflow_sglang.topology import make_mock
from flexflow_sglang.topology.graph import PATH_TYPE_CODES, PathType

compiled = pytest.mark.skipif(selector_backend() != "compiled", reason="compiled core not built")

_SCALARS = ("MIN_AVAIL_FRAC", "TTFT_HOP_FACTOR", "TTFT_LAT_FACTOR", "SPLIT_TOP", "MAX_SPLIT_CAP")


@compiled
def test_the_compiled_core_constants_equal_the_cost_model():
    from flexflow_sglang import _selector_core
    got = _selector_core.layout()
    assert {k: v for k, v in got.items() if k.startswith("P_")} == cm.param_layout()
    assert {k: got[k] for k in _SCALARS} == {k: getattr(cm, k) for k in _SCALARS}
    codes = {"PT_DIRECT": PathType.Direct, "PT_NVLINK_RELAY": PathType.NVLinkRelay,
             "PT_CROSSNODE_RELAY": PathType.CrossNodeRelay, "PT_SPLIT": PathType.SplitPath,
             "PT_STORAGE_RELAY": PathType.StorageRelay}
    assert {k: got[k] for k in codes} == {k: PATH_TYPE_CODES[t] for k, t in codes.items()}
    assert {k: getattr(_core_py, k) for k in codes} == {k: got[k] for k in codes}


def test_the_twin_reads_the_cost_model():
    for k in (*cm.param_layout(), *_SCALARS):
        assert getattr(_core_py, k) is getattr(cm, k), k


def test_param_layout_is_dense_and_named_after_the_config():
    lay = cm.param_layout()
    assert sorted(v for k, v in lay.items() if k != "P_NPARAMS") == list(range(cm.P_NPARAMS))
    assert lay["P_NPARAMS"] == len(cm.PARAM_NAMES)
    cfg_fields = {f.name for f in dataclasses.fields(SelectorConfig)}
    assert set(cm.PARAM_NAMES) - cfg_fields == {"relay_overhead_us"}  # the model's constant, not a knob


def test_pack_params_follows_the_layout():
    cfg = SelectorConfig(w_bandwidth=1.5, w_queue_delay=0.25, w_hops=0.125, w_qos_risk=0.75, w_latency=2.0,
                         relay_benefit_margin=0.2, split_benefit_margin=0.3, enable_split_path=False,
                         max_split_paths=3, relay_chunk_bytes=1 << 20)
    p = cm.pack_params(cfg)
    assert p.dtype.name == "float64" and len(p) == cm.P_NPARAMS
    assert (p[cm.P_W_BW], p[cm.P_W_Q], p[cm.P_W_HOPS], p[cm.P_W_QOS], p[cm.P_W_LAT]) == (1.5, 0.25, 0.125, 0.75, 2.0)
    assert (p[cm.P_RELAY_MARGIN], p[cm.P_SPLIT_MARGIN], p[cm.P_ENABLE_SPLIT], p[cm.P_MAX_SPLIT]) == (0.2, 0.3, 0.0, 3.0)
    assert (p[cm.P_RELAY_CHUNK], p[cm.P_RELAY_OVERHEAD_US]) == (float(1 << 20), cm.RELAY_OVERHEAD_US)
    assert cm.pack_params(SelectorConfig())[cm.P_ENABLE_SPLIT] == 1.0
    assert SelectorConfig().relay_chunk_bytes == cm.RELAY_CHUNK_BYTES


@pytest.mark.parametrize("impl", ["python", pytest.param("compiled", marks=compiled)])
def test_decisions_read_the_result_by_name(impl):
    topo = make_mock("dgx8")
    agent = NodeAgent(topo, source="mock")
    for l in topo.links:
        agent._mock[l.id] = 0.5 if l.id % 3 else 0.0
    agent.refresh()
    sel = PathSelector(topo, agent, impl=impl)
    for nbytes in (4096, 1 << 20, 64 << 20):
        d = sel.select(TransferRequest("gpu0", "gpu5", nbytes))
        assert len(d._raw) == len(cm.CoreResult._fields)
        raw = d.raw
        assert raw == d._raw and isinstance(raw, cm.CoreResult)
        assert (raw.est_bw_gbps, raw.est_time_us, raw.cost, raw.gain) == \
            (d.estimated_bandwidth, d.estimated_time_us, d.cost, d.gain)
        assert (raw.reason, bool(raw.qos_violation)) == (d.reason_code, d.qos_violation)
        assert sum(raw.shares) == nbytes and len(raw.indices) == len(d.subpaths)
    direct = sel.always_direct(TransferRequest("gpu0", "gpu5", 1 << 20))
    assert isinstance(direct._raw, cm.CoreResult) and direct.raw.indices == direct._raw[cm.R_INDICES]


@pytest.mark.parametrize("impl", ["python", pytest.param("compiled", marks=compiled)])
def test_path_time_us_is_the_cores_single_path_estimate(impl):
    topo = make_mock("dgx8")
    agent = NodeAgent(topo, source="mock")
    for l in topo.links:
        agent._mock[l.id] = (l.id % 5) / 10.0
        agent._fb_q[l.id] = (l.id % 4) * 1.5
    agent._fb_t[:] = time.monotonic()  # fresh: the queue delays count
    agent.refresh()
    cfg = SelectorConfig(relay_chunk_bytes=1 << 20)
    sel = PathSelector(topo, agent, cfg, impl=impl)
    n = 0
    for nbytes in (1000, 1 << 20, 48 << 20):
        for path, bw, est, _, _ in sel.scores("gpu0", "gpu3", nbytes):
            lat = sum(topo.links[l].latency_us for l in path.links)
            q = 0.0
            for l in path.links:
                q = q + float(agent.qdelay_us[l])
            assert cm.path_time_us(nbytes, bw, lat, len(path.relays), q, cfg.relay_chunk_bytes) == est
            n += len(path.relays) > 0
    assert n > 0  # relays were among the candidates


def test_relay_fill_and_fixed_latency():
    assert cm.relay_fill_s(0, 1 << 30, 1e9) == 0.0
    # one relay, payload below the chunk: the whole payload once more, plus the hand-off
    assert cm.relay_fill_s(1, 1 << 20, 1e9) == pytest.approx((1 << 20) / 1e9 + 5e-6)
    assert cm.relay_fill_s(2, 1 << 30, 1e9, chunk_bytes=4 << 20, overhead_us=10.0) == \
        pytest.approx(2 * ((4 << 20) / 1e9 + 10e-6))
    assert cm.fixed_latency_s([1.0, 2.5], 1, 1 << 20, 1e9) == pytest.approx(3.5e-6 + cm.relay_fill_s(1, 1 << 20, 1e9))


def test_the_agent_discounts_the_models_relay_fill():
    """A relayed transfer that took exactly fixed latency + fill + bytes at 60 % of capacity reads as 40 %
    utilisation of the bottleneck: the agent subtracts the cost model's fixed latency, no other."""
    topo = make_mock("dgx8")
    agent = NodeAgent(topo, source="mock")
    sel = PathSelector(topo, agent, SelectorConfig(relay_chunk_bytes=1 << 20))
    assert agent.relay_chunk_bytes == 1 << 20
    path = next(p for p in sel.candidates("gpu0", "gpu5") if p.relays)
    cap_bps = min(topo.links[l].capacity_gbps for l in path.links) * 1e9
    nbytes = 64 << 20
    fixed = cm.fixed_latency_s([topo.links[l].latency_us for l in path.links], len(path.relays), nbytes,
                               cap_bps, 1 << 20)
    agent.report_transfer(path.links, nbytes, fixed + nbytes / (0.6 * cap_bps), relays=len(path.relays))
    bott = min(path.links, key=lambda l: topo.links[l].capacity_gbps)
    assert agent._fb_util[bott] == pytest.approx(0.4, abs=1e-9)


@pytest.mark.parametrize("impl", ["python", pytest.param("compiled", marks=compiled)])
def test_the_reason_quotes_the_load_the_decision_saw(impl):
    """A QoS rejection's reason names the link's utilisation at the decision, not whatever the
    agent's live array holds when the reason is read (the contention lab logged "at 48% > 80%")."""
    topo = make_mock("hosts3")  # n0, n1, n2 in a triangle of rdma links
    agent = NodeAgent(topo, source="mock")
    agent.set_utilization("n0", "n2", 0.95)
    sel = PathSelector(topo, agent, impl=impl)
    d = sel.select(TransferRequest("n0", "n2", 16 << 20))
    assert d.reason_code == 2 and d.raw.aux_link >= 0, d.reason
    assert d.raw.aux_util == pytest.approx(float(agent.util[d.raw.aux_link]))
    agent.set_utilization("n0", "n2", 0.1)  # the load moves on before anyone reads the reason
    assert "at 95% >" in d.reason, d.reason
