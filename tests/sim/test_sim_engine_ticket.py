"""Issue 13: the simulator's adaptive policy routes through the production TransferEngine (one place
for select -> reserve -> legs -> release -> report), not a copy of its own; every reservation it
takes is released by the time the transfers complete."""

import pytest

from flexflow_sglang.errors import SelectorError
from flexflow_sglang.selector import PathSelector, SelectorConfig, TransferRequest
from flexflow_sglang.tools.sim.engine import Network, Simulator
from flexflow_sglang.tools.sim.policies import SelectorPolicy
from flexflow_sglang.tools.sim.scenarios import thresholds
from flexflow_sglang.tools.sim.sim_agent import SimMonitor
from flexflow_sglang.topology import make_mock
from flexflow_sglang.transfer.engine import TransferEngine

MiB = 1 << 20


def _run(reserve: bool = True, feedback: bool = True, progress: bool = False, monkeypatch=None):
    topo = make_mock("dgx8")
    net = Network(topo, thresholds(topo, SelectorConfig()))
    mon = SimMonitor(topo, reserve=reserve, feedback=feedback, progress=progress)
    sel = PathSelector(topo, mon.agent, SelectorConfig())
    opened = []
    if monkeypatch is not None:
        real = TransferEngine.open

        def spy(self, *a, **kw):
            t = real(self, *a, **kw)
            opened.append((kw.get("reserve", True), t))
            return t
        monkeypatch.setattr(TransferEngine, "open", spy)
    pol = SelectorPolicy(sel, "adaptive", mon)
    # the selector must not be reached around the engine: any direct call would show up here
    calls = {"select": 0}
    real_select = sel.select

    def counting_select(req):
        calls["select"] += 1
        return real_select(req)
    sel.select = counting_select
    sim = Simulator(net, policy=pol, monitor=mon)
    reqs = [(0.25 + 0.4e-3 * i, TransferRequest("gpu0", "gpu1" if i % 2 else "gpu2", (64 + 32 * i) * MiB))
            for i in range(6)]
    sim.add_arrivals(reqs)
    sim.run()
    recs = sorted(sim.transfers.values(), key=lambda r: r.tid)
    return recs, mon, pol, opened, calls


def test_adaptive_moves_are_engine_tickets(monkeypatch):
    recs, mon, pol, opened, calls = _run(monkeypatch=monkeypatch)
    assert len(recs) == 6 and all(r.finish is not None for r in recs)
    # one engine ticket per move, each with the decision the plan executes, reserved on the agent
    assert len(opened) == 6 and calls["select"] == 6
    assert all(reserve for reserve, _ in opened)
    for r, (_, t) in zip(recs, opened):
        assert r.plan.ticket is t and t.decision is pol.decisions[r.tid]
        assert [tuple(sp.links) for sp in t.decision.subpaths] == [s.links for s in r.plan.subs]
        assert r.plan.tokens and all(r.plan.tokens)
        # closed when its last leg completed: every leg reported through the ticket
        assert t.closed and not t.tokens
        assert len(t.stats.legs) == sum(1 for s in r.plan.subs if s.nbytes > 0)
        assert t.stats.nbytes == r.nbytes
    # the engine's books hold every move, by chosen path type
    by_type = pol.engine.bandwidth_by_type()
    assert sum(v["moves"] for v in by_type.values()) == 6
    assert sum(v["bytes"] for v in by_type.values()) == sum(r.nbytes for r in recs)
    assert set(by_type) == {r.plan.label for r in recs}
    # every reservation released, and the feedback went through the ticket's leg ends
    assert mon.agent.in_flight == 0 and not mon.agent.reserved.any()
    assert mon.agent.reservations_made == sum(len(r.plan.tokens) for r in recs)
    assert mon.reports == sum(len(t.stats.legs) for _, t in opened)


@pytest.mark.parametrize("feedback,progress", [(False, False), (True, True)])
def test_tickets_close_without_feedback_and_with_progress(feedback, progress):
    recs, mon, pol, _, _ = _run(feedback=feedback, progress=progress)
    assert all(r.plan.ticket.closed for r in recs)
    assert mon.agent.in_flight == 0
    assert sum(v["moves"] for v in pol.engine.bandwidth_by_type().values()) == len(recs)
    assert mon.reports == (sum(len(r.plan.ticket.stats.legs) for r in recs) if feedback else 0)


def test_no_reserve_opens_unreserved_tickets(monkeypatch):
    recs, mon, _, opened, _ = _run(reserve=False, monkeypatch=monkeypatch)
    assert [reserve for reserve, _ in opened] == [False] * 6
    assert mon.agent.reservations_made == 0
    assert all(r.plan.tokens == () and r.plan.ticket.closed for r in recs)


def test_a_failed_route_is_an_error_not_an_unrouted_move():
    topo = make_mock("dgx8")
    mon = SimMonitor(topo)
    pol = SelectorPolicy(PathSelector(topo, mon.agent, SelectorConfig()), "adaptive", mon)
    sim = Simulator(Network(topo, thresholds(topo, SelectorConfig())), policy=pol, monitor=mon)
    sim.add_arrivals([(0.1, TransferRequest("gpu0", "gpu0", MiB))])
    # as before the engine: the selector's own error (TransferEngine.open alone would swallow it)
    with pytest.raises(SelectorError, match="same node"):
        sim.run()
