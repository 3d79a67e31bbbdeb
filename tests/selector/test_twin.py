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
