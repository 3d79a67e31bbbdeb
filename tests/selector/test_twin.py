"""The compiled core and the pure-Python twin make identical decisions (bit-identical floats)."""
import os
import random

import pytest

from flexflow_sglang import NodeAgent, PathSelector, SelectorConfig, SelectorError, TransferRequest
from flexflow_sglang.selector import selector_backend
from flexflow_sglang.topology import make_mock

pytestmark = pytest.mark.skipif(selector_backend() != "compiled", reason="compiled core not built")


@pytest.mark.parametrize("mock", ["dgx8", "dgx1", "nvswitch8", "cluster2x8x4", "hosts3", "dgx-a100", "single"])
def test_identical_decisions_on_random_loads(mock):
    rng = random.Random(hash(mock) & 0xFFFF)
    topo = make_mock(mock)
    agent = NodeAgent(topo, source="mock")
    cfgs = [SelectorConfig(), SelectorConfig(enable_split_path=False), SelectorConfig(max_split_paths=3, w_hops=0.5),
            SelectorConfig(w_qos_risk=0.0, relay_benefit_margin=0.0, split_benefit_margin=0.0),
            SelectorConfig(max_split_paths=8, w_hops=0.0, split_benefit_margin=0.0, relay_chunk_bytes=1 << 20)]
    sels = [(PathSelector(topo, agent, c, impl="compiled"), PathSelector(topo, agent, c, impl="python")) for c in cfgs]
    eps = [n.name for n in topo.nodes.values() if n.kind.value in ("gpu", "cpu", "storage")]
    checked = 0
    for _ in range(700):
        for l in topo.links:
            agent._mock[l.id] = rng.choice([0.0, 0.0, 0.3, 0.5, 0.7, 0.8, 0.81, 0.85, 0.95, 1.0, rng.random()])
            agent._fb_q[l.id] = rng.choice([0.0, 0.0, rng.random() * 50])
        agent._fb_t[:] = 0.0
        agent.refresh()
        src, dst = rng.sample(eps, 2)
        nbytes = rng.choice([1, 4096, 1 << 20, 64 << 20, rng.randint(1, 1 << 34)])
        ttft = rng.random() < 0.3
        a, b = rng.choice(sels)
        try:
            x = a.select(TransferRequest(src, dst, nbytes, ttft))
        except SelectorError:
            with pytest.raises(SelectorError):
                b.select(TransferRequest(src, dst, nbytes, ttft))
            continue
        y = b.select(TransferRequest(src, dst, nbytes, ttft))
        assert x._raw == y._raw, (src, dst, nbytes, ttft)
        assert x.reason == y.reason
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("mock", ["dgx8", "cluster2x8x4", "dgx-a100"])
def test_pruned_split_search_decides_like_the_exhaustive_one(mock, monkeypatch):
    """Issue 15's shortcuts (skip the mirrored pair, skip pairs whose lower bound cannot win, keep
    the best pair's shares) change no decision: the compiled core vs the twin costing every
    ordered pair as before."""
    from flexflow_sglang.selector import _core_py

    class Exhaustive(_core_py.PairCore):
        EXHAUSTIVE = True

    rng = random.Random(15)
    topo = make_mock(mock)
    agent = NodeAgent(topo, source="mock")
    cfgs = [SelectorConfig(), SelectorConfig(max_split_paths=3, w_hops=0.5),
            SelectorConfig(w_qos_risk=0.0, split_benefit_margin=0.0)]
    sels = []
    for c in cfgs:
        ref = PathSelector(topo, agent, c, impl="python")
        ref._core_cls = Exhaustive
        sels.append((PathSelector(topo, agent, c, impl="compiled"), ref))
    gpus = [n.name for n in topo.nodes_of_kind("gpu")]
    splits = 0
    for _ in range(300):
        for l in topo.links:
            agent._mock[l.id] = rng.choice([0.0, 0.2, 0.5, 0.85, rng.random()])
        agent.refresh()
        a, b = rng.choice(sels)
        r = TransferRequest(*rng.sample(gpus, 2), rng.choice([1 << 20, 16 << 20, 64 << 20, rng.randint(1, 1 << 30)]),
                            rng.random() < 0.3)
        x, y = a.select(r), b.select(r)
        assert x._raw == y._raw, r
        splits += x.reason_code == 3
    assert splits > 5  # the split search ran (dgx8: most requests split)


def test_compiled_dispatch_follows_update_config():
    topo = make_mock("dgx8")
    agent = NodeAgent(topo, source="mock")
    a, b = PathSelector(topo, agent, impl="compiled"), PathSelector(topo, agent, impl="python")
    r = TransferRequest("gpu0", "gpu5", 1 << 20)
    assert a.select(r)._raw == b.select(r)._raw
    for s in (a, b):
        s.update_config(SelectorConfig(ttft_sensitive=True, w_latency=50.0))
    x, y = a.select(r), b.select(r)
    assert x._raw == y._raw
    assert x._raw == a.select(TransferRequest("gpu0", "gpu5", 1 << 20, True))._raw
    assert x.cost != PathSelector(topo, agent, impl="compiled").select(r).cost  # the knob took effect


def test_require_compiled_env(monkeypatch):
    from flexflow_sglang.errors import CompiledCoreMissing
    from flexflow_sglang.selector import selector as selmod
    monkeypatch.setenv("FLEXFLOW_REQUIRE_COMPILED", "1")
    assert selmod.selector_backend() == "compiled"
    assert selmod._resolve_impl("python")[0] == "python"  # an explicit request for the twin is honoured
    monkeypatch.setattr(selmod, "_compiled", None)
    with pytest.raises(CompiledCoreMissing):
        selmod.selector_backend()
    monkeypatch.delenv("FLEXFLOW_REQUIRE_COMPILED")
    assert selmod.selector_backend() == "python"
