"""Issue 7: the adaptive policy reserves its in-flight legs on the NodeAgent, so a transfer that
arrives while an earlier one still fills its links does not pile onto the same links."""

import pytest

from flexflow_sglang.selector import PathSelector, SelectorConfig, TransferRequest
from flexflow_sglang.tools.sim.engine import Network, Simulator
from flexflow_sglang.tools.sim.sim_agent import SimMonitor
from flexflow_sglang.tools.sim.policies import SelectorPolicy
from flexflow_sglang.tools.sim.scenarios import thresholds
from flexflow_sglang.topology import make_mock


def _two_overlapping(reserve: bool, gap_s: float = 0.5e-3):
    topo = make_mock("dgx8")
    net = Network(topo, thresholds(topo, SelectorConfig()))
    mon = SimMonitor(topo, reserve=reserve)
    pol = SelectorPolicy(PathSelector(topo, mon.agent, SelectorConfig()), "adaptive", mon)
    sim = Simulator(net, policy=pol, monitor=mon)
    n = 256 << 20
    sim.add_arrivals([(0.25, TransferRequest("gpu0", "gpu1", n)),
                      (0.25 + gap_s, TransferRequest("gpu0", "gpu1", n))])
    sim.run()
    recs = sorted(sim.transfers.values(), key=lambda r: r.tid)
    return recs, mon


def test_overlapping_transfers_on_idle_dgx8_take_disjoint_links():
    recs, mon = _two_overlapping(reserve=True)
    a, b = ({l for s in r.plan.subs for l in s.links} for r in recs)
    assert recs[0].fct < 3.0e-3 > recs[1].fct  # both near the idle split time (~2.7 ms)
    assert not (a & b), "the second transfer took links the first one still filled"
    assert all(recs[0].plan.tokens) and all(recs[1].plan.tokens)
    # every leg released when it drained: nothing held, nothing reserved
    assert mon.agent.in_flight == 0 and not mon.agent.reserved.any()


def test_without_reservation_the_second_transfer_shares_links():
    recs, _ = _two_overlapping(reserve=False)
    a, b = ({l for s in r.plan.subs for l in s.links} for r in recs)
    assert a == b  # the regression the reservation fixes: same links, both slowed down
    fct_res = [r.fct for r in _two_overlapping(reserve=True)[0]]
    assert sum(r.fct for r in recs) > 1.5 * sum(fct_res)


def test_transfer_after_the_first_ended_sees_idle_links_again():
    recs, mon = _two_overlapping(reserve=True, gap_s=10e-3)  # first one long done
    a, b = ({l for s in r.plan.subs for l in s.links} for r in recs)
    assert a == b
    assert recs[1].fct == pytest.approx(recs[0].fct, rel=1e-6)
