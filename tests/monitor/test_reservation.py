"""In-flight reservations: NodeAgent.reserve / reserve_decision / release (issue 7)."""

import threading

import numpy as np
import pytest

from flexflow_sglang import NodeAgent, PathSelector, SelectorConfig, Topology, TransferRequest
from flexflow_sglang.monitor import node_agent as na
from flexflow_sglang.monitor.sources import LinkLoadSource


class _Clock:
    """Stands in for the `time` module of monitor.node_agent (deterministic decay and rates)."""

    def __init__(self, t=100.0):
        self.t = t

    def monotonic(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(na, "time", c)
    return c


class _Rates(LinkLoadSource):
    """Counter source returning fixed rates (bytes/s) per link id."""
    name = "fixed"

    def __init__(self):
        self.rates = {}

    def read_rates(self, dt):
        return list(self.rates.items())


def _leg_links(topo, *nodes):
    return [topo.links_between(a, b)[0].id for a, b in zip(nodes, nodes[1:])]


def test_reserve_raises_exactly_the_leg_links_and_release_restores(clock):
    topo = Topology.make_mock_dgx(4, nvlink_gbps=50.0)
    agent = NodeAgent(topo, source="mock")
    agent.set_utilization("gpu0", "gpu3", 0.3)  # foreign load elsewhere, and on one leg link below
    agent.set_utilization("gpu2", "gpu1", 0.1)
    before = agent.util.copy()
    links = _leg_links(topo, "gpu0", "gpu2", "gpu1")
    # 10 GB over 1 s on 50 GB/s links: 0.2 of each link
    tok = agent.reserve(links, 10 * 10 ** 9, 1.0)
    assert tok and agent.in_flight == 1
    want = before.copy()
    want[links] += 0.2
    np.testing.assert_allclose(agent.util, want, atol=1e-12)
    assert set(np.flatnonzero(agent.reserved)) == set(links)
    agent.release(tok)
    np.testing.assert_array_equal(agent.util, before)
    assert agent.in_flight == 0 and not agent.reserved.any()
    agent.release(tok)  # twice: harmless
    agent.release([0, None, 12345])
    np.testing.assert_array_equal(agent.util, before)


def test_cap_decay_floor_and_expiry(clock):
    topo = Topology.make_mock_dgx(4, nvlink_gbps=50.0)
    agent = NodeAgent(topo, source="mock", reserve_cap=0.5, reserve_timeout_s=5.0)
    lid = _leg_links(topo, "gpu0", "gpu1")
    # line rate on an idle link: 1.0 of the link, capped at 0.5
    agent.reserve(lid, 50 * 10 ** 9, 1.0)
    assert agent.util[lid[0]] == pytest.approx(0.5)
    agent.release(list(agent._res))
    # 0.4 of the link for 2 s: decays with the predicted fraction still to go
    tok = agent.reserve(lid, 40 * 10 ** 9, 2.0)
    assert agent.util[lid[0]] == pytest.approx(0.4)
    clock.t += 1.0
    agent.refresh()
    assert agent.util[lid[0]] == pytest.approx(0.2)
    clock.t += 1.5  # past the predicted end, still held: the floor
    agent.refresh()
    assert agent.util[lid[0]] == pytest.approx(0.4 * na.RESERVE_FLOOR)
    clock.t += 20.0  # never released: dropped after max(8 x 2 s, 5 s)
    agent.refresh()
    assert agent.util[lid[0]] == 0.0 and agent.in_flight == 0
    agent.release(tok)
    # without a predicted time: the leg's narrowest link at line rate
    agent.reserve(lid, 1 << 20)
    assert agent.util[lid[0]] == pytest.approx(0.5)
    assert agent.reserve(lid, 0, 1.0) == 0 and agent.reserve([], 10, 1.0) == 0
    with pytest.raises(ValueError):
        agent.reserve([len(topo.links)], 10, 1.0)
    with pytest.raises(ValueError):
        NodeAgent(topo, source="mock", reserve_cap=1.5)


def test_reserve_decision_per_leg_tokens_and_next_select_avoids_links(clock):
    topo = Topology.make_mock_dgx(4, nvlink_gbps=50.0)
    agent = NodeAgent(topo, source="mock")
    sel = PathSelector(topo, agent, SelectorConfig())
    req = TransferRequest("gpu0", "gpu1", 256 << 20)
    d1 = sel.select(req)
    assert d1.chosen_type.value == "SplitPath"
    toks = agent.reserve_decision(d1)
    assert len(toks) == len(d1.subpaths) and all(toks)
    used1 = {l for s in d1.subpaths for l in s.links}
    assert set(np.flatnonzero(agent.reserved)) == used1
    d2 = sel.select(req)  # the first transfer still fills its links: the next one goes elsewhere
    used2 = {l for s in d2.subpaths for l in s.links}
    assert not (used1 & used2)
    agent.release(toks[0])  # one leg ended: only its links are freed
    assert set(np.flatnonzero(agent.reserved)) == set(d1.subpaths[1].links)
    agent.report_decision(d1, [1e-3] * len(d1.subpaths), tokens=toks)
    assert agent.in_flight == 0 and not agent.reserved.any()
    assert agent.reserve_decision(object()) == ()  # not a decision: nothing, no exception


def test_concurrent_reserve_release_is_consistent(clock):
    topo = Topology.make_mock_dgx(8, nvlink_gbps=50.0)
    agent = NodeAgent(topo, source="mock", reserve_cap=1.0)
    lid = _leg_links(topo, "gpu0", "gpu1")
    held = [agent.reserve(lid, 5 * 10 ** 9, 1.0) for _ in range(3)]  # 0.1 each, kept throughout
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                links = rng.choice(len(topo.links), size=int(rng.integers(1, 4)), replace=False)
                tok = agent.reserve(links.tolist(), int(rng.integers(1, 10 ** 9)), float(rng.uniform(0.1, 2)))
                u = agent.util[lid[0]]  # readers never lock: any value between refreshes is sane
                if not (0.3 - 1e-9 <= u <= 1.0):
                    errors.append(u)
                agent.release(tok)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert agent.in_flight == 3
    assert agent.util[lid[0]] == pytest.approx(0.3)
    others = np.delete(np.arange(len(topo.links)), lid)
    assert np.abs(agent.util[others]).max() < 1e-9
    agent.release(held)
    assert agent.in_flight == 0 and not agent.util.any() and not agent._res_rate.any()


def test_no_double_counting_with_report_progress(clock):
    topo = Topology.make_mock_hosts(2, link_gbps=1.0)
    src = _Rates()
    agent = NodeAgent(topo, source="mock", sources=[src])
    lid = 0
    agent.sample_once()
    # our transfer: 1 GB/s for 2 s on an otherwise idle 1 GB/s link, reported chunk by chunk
    tok = agent.reserve([lid], 2 * 10 ** 9, 2.0)
    for _ in range(2):
        clock.t += 1.0
        src.rates = {lid: 1e9}  # the counters see our own bytes
        agent.report_progress([lid], 10 ** 9)
        agent.sample_once()
        assert agent._sampled[lid] == pytest.approx(0.0, abs=1e-9)  # our bytes are not foreign load
        assert agent.util[lid] == pytest.approx(agent.reserved[lid])  # counted once, as reserved
    agent.release(tok)
    agent.report_transfer([lid], 2 * 10 ** 9, 2.0, progress_reported=True)
    assert agent.util[lid] == pytest.approx(0.0, abs=1e-9)


def test_no_double_counting_when_reported_only_at_the_end(clock):
    """A transfer reported only when it completes: while it runs, the reservation's estimate is
    subtracted from the counters; the late report is not subtracted again (so foreign load that
    starts afterwards is seen)."""
    topo = Topology.make_mock_hosts(2, link_gbps=1.0)
    src = _Rates()
    agent = NodeAgent(topo, source="mock", sources=[src])
    lid = 0
    agent.sample_once()
    # 20 % foreign load; our transfer predicted at the remaining 0.8 GB/s for 1 s
    tok = agent.reserve([lid], 8 * 10 ** 8, 1.0)
    clock.t += 0.5
    src.rates = {lid: 1e9}  # ours (0.8) + foreign (0.2), our bytes not reported yet
    agent.sample_once()
    assert agent._sampled[lid] == pytest.approx(0.2)
    assert agent.util[lid] == pytest.approx(0.2 + 0.8 * 0.5)  # foreign + reserved, half to go
    clock.t += 0.5
    agent.release(tok)
    agent.report_transfer([lid], 8 * 10 ** 8, 1.0)  # completion: all its bytes reported now
    agent.sample_once()
    assert agent._sampled[lid] == pytest.approx(0.2)  # the half already subtracted is not again
    clock.t += 0.5  # next interval: only foreign traffic, 30 %; no leftover own bytes hide it
    src.rates = {lid: 0.3e9}
    agent.sample_once()
    assert agent._sampled[lid] == pytest.approx(0.3)
    assert agent.util[lid] == pytest.approx(0.3)


def test_reservation_never_makes_a_link_cross_its_qos_threshold(clock):
    topo = Topology.make_mock_dgx(4, nvlink_gbps=50.0)
    agent = NodeAgent(topo, source="mock")
    sel = PathSelector(topo, agent, SelectorConfig())  # hands the agent its QoS thresholds
    thr = SelectorConfig().nvlink_util_threshold
    lid = _leg_links(topo, "gpu0", "gpu1")
    agent.set_utilization("gpu0", "gpu1", 0.5)  # foreign load, under the threshold
    tok = agent.reserve(lid, 50 * 10 ** 9, 1.0)
    assert agent.util[lid[0]] == pytest.approx(thr)  # capped: less bandwidth, but not rejected
    assert not any(rej for p, *_, rej in sel.scores("gpu0", "gpu1", 1 << 20) if p.links == tuple(lid))
    agent.release(tok)
    agent.set_utilization("gpu0", "gpu1", 0.9)  # foreign load alone over it: rejected anyway,
    agent.reserve(lid, 50 * 10 ** 9, 1.0)         # and the reservation still counts for bandwidth
    assert agent.util[lid[0]] == pytest.approx(1.0)
