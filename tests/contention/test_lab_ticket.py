"""Issue 13: the contention lab's adaptive transfers are routed by the production TransferEngine
(select + reserve through a Ticket, released per leg, closed at the end), without NIXL or
namespaces: a fake NIXL agent completes every chunk at once and the fake relay acknowledges it."""

from collections import deque

import numpy as np
import pytest

from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.selector import PathSelector, SelectorConfig
from flexflow_sglang.tools.bench.contention import node
from flexflow_sglang.transfer.engine import TransferEngine

MiB = 1 << 20


class _InstantNixl:
    """Every posted chunk is DONE at once; a chunk posted with a relay notification ('c|xid|k|...')
    is acknowledged end to end ('a|xid|k') at the next get_new_notifs()."""

    def __init__(self):
        self.posted = 0
        self.notifs = []

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, op, src, dst, peer, notif=b""):
        if notif.startswith(b"c|"):
            _, xid, k = notif.decode().split("|")[:3]
            self.notifs.append(f"a|{xid}|{k}".encode())
        return object()

    def transfer(self, h):
        self.posted += 1
        return "PROC"

    def check_xfer_state(self, h):
        return "DONE"

    def release_xfer_handle(self, h):
        pass

    def get_new_notifs(self):
        out, self.notifs = self.notifs, []
        return {"r-out": out} if out else {}


def _sender(max_bytes=16 * MiB):
    topo = node.build_topology()
    s = node.Sender.__new__(node.Sender)  # no NIXL agents, no metadata exchange
    s.topo = topo
    s.l01, s.l02, s.l12 = (topo.links_between("n0", "n1")[0].id, topo.links_between("n0", "n2")[0].id,
                           topo.links_between("n1", "n2")[0].id)
    s.agent = NodeAgent(topo, source="mock")
    s.agent_el = NodeAgent(topo, source="mock", elastic_share=0.5)
    s.selector = PathSelector(topo, s.agent, SelectorConfig())
    s.selector_el = PathSelector(topo, s.agent_el, SelectorConfig())
    s._matched = None
    s.src = np.zeros(max_bytes, dtype=np.uint8)
    s.src64 = s.src.view(np.uint64)
    s.addr, s.max_bytes, s.chunk, s.window, s.slots = 0, max_bytes, MiB, 2, 4
    s.a_direct, s.p_direct = _InstantNixl(), {"name": "t-direct", "addr": 0}
    s.a_relay, s.p_relay = _InstantNixl(), {"name": "r-in", "addr": 0}
    s.acks, s.cur_xid, s.trace, s._last_trace = deque(), -1, [], 0.0
    s.probe, s.probe_token, s.next_probe_t, s.probes = None, 0, 1e18, []  # no elastic probe here
    return s


@pytest.mark.parametrize("policy,report", [("adaptive", None), ("adaptive", "leg"),
                                           ("adaptive-chunkmodel", None), ("adaptive-elastic", None)])
def test_adaptive_transfer_goes_through_an_engine_ticket(monkeypatch, policy, report):
    s = _sender()
    opened = []
    real = TransferEngine.open

    def spy(self, *a, **kw):
        t = real(self, *a, **kw)
        opened.append((self, t))
        return t
    monkeypatch.setattr(TransferEngine, "open", spy)
    agent = s.agent_el if policy == "adaptive-elastic" else s.agent
    fb0 = agent.feedback_count
    out = s.transfer(1, policy, 12 * MiB, report=report)
    assert out["complete"] and out["delivered"] == 12 * MiB
    assert len(opened) == 1
    eng, t = opened[0]
    assert eng.agent is agent and t.decision is not None
    assert out["decision"]["shares"] == [[sp.type.value, sp.nbytes] for sp in t.decision.subpaths]
    # reserved one token per leg at open, all released by the end, the ticket closed and recorded
    assert agent.reservations_made == len(t.decision.subpaths)
    assert agent.in_flight == 0 and t.closed and not t.tokens
    assert sum(v["moves"] for v in eng.bandwidth_by_type().values()) == 1
    assert eng.by_type[t.stats.path_type]["bytes"] == 12 * MiB
    legs = [l for l in out["legs"] if l["done"]]
    if report == "leg":  # one feedback report per leg, through Ticket.leg_done
        assert agent.feedback_count - fb0 == len(legs)
    else:  # per chunk, by the legs themselves
        assert agent.feedback_count - fb0 >= 12  # 1 MiB chunks (a split share adds a partial one)
    # the engine is made once per (selector, agent) pair
    s.transfer(2, policy, 4 * MiB, report=report)
    assert len(opened) == 2 and opened[1][0] is eng and agent.in_flight == 0


def test_fixed_route_policies_open_no_ticket(monkeypatch):
    s = _sender()
    monkeypatch.setattr(TransferEngine, "open", lambda *a, **k: pytest.fail("a fixed route was routed"))
    out = s.transfer(1, "direct", 4 * MiB, report="leg")
    assert out["complete"] and "decision" not in out
    assert s.agent.reservations_made == 0 and s.agent.feedback_count == 1


def test_a_failed_selection_releases_nothing_and_raises(monkeypatch):
    s = _sender()

    def broken(req):
        raise RuntimeError("selector down")
    monkeypatch.setattr(s.selector, "select", broken)
    with pytest.raises(RuntimeError, match="no path decision"):
        s.transfer(1, "adaptive", 4 * MiB)
    assert s.agent.in_flight == 0
