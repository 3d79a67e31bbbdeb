"""FlexFlowNixlKVManager's routed send and settle logic on SGLang's real class, with fake NIXL agents
(the class is built without __init__, which needs a running scheduler; the servers in
tests/server/test_pd_server.py cover construction)."""

import threading

import numpy as np
import pytest

pytest.importorskip("sglang", reason="the manager subclasses SGLang's NixlKVManager")
pytest.importorskip("nixl", reason="SGLang's NIXL connector imports nixl")

from flexflow_sglang.pd.nixl_manager import RoutedXfer, flexflow_nixl_manager_class  # noqa: E402
from flexflow_sglang.pd.rails import RailShare, RoutePlan  # noqa: E402
from flexflow_sglang.pd.stats import ChunkStats  # noqa: E402


class FakeAgent:
    def __init__(self, name, states=None):
        self.name = name
        self.states = dict(states or {})  # handle -> list of states returned in turn (last repeats)
        self.posted = []

    def check_xfer_state(self, h):
        seq = self.states.get(h, ["DONE"])
        return seq.pop(0) if len(seq) > 1 else seq[0]


class FakeRouter:
    """RailRouter's leg API, recorded; tickets are plain objects (the real ones: tests/pd/test_rails.py)."""

    def __init__(self, plan=None, exc=None):
        self._plan, self._exc = plan, exc
        self.reports, self.posted, self.released, self.finished = [], [], [], []

    def plan(self, nbytes):
        if self._exc:
            raise self._exc
        if self._plan is not None and self._plan.ticket is None:
            self._plan.ticket = object()
        return self._plan

    def leg_posted(self, ticket, share, rail, nbytes):
        self.posted.append((rail, nbytes))

    def leg_done(self, ticket, share, rail, nbytes, seconds, ok=True):
        self.released.append(share)
        if ok and rail >= 0:
            self.reports.append((rail, nbytes))

    def finish(self, ticket):
        self.finished.append(ticket)


def _manager(router, n_rails=2, stats=True):
    cls = flexflow_nixl_manager_class()
    m = cls.__new__(cls)
    m.__dict__["_ff_tls"] = threading.local()
    m.__dict__["_ff_primary_agent"] = FakeAgent("primary")
    m._ff_rails = [(f"eth{i}", FakeAgent(f"rail{i}")) for i in range(n_rails)]
    m._ff_rail_peers = [{"peer"} for _ in range(n_rails)]
    m._ff_router = router
    m._ff_stats = ChunkStats(n_rails, "adaptive") if stats else None
    m.kv_args = type("KVArgs", (), {"kv_item_lens": [100, 100], "kv_data_ptrs": [1, 2]})()
    m.src_mem_kind = "DRAM"
    return m


@pytest.fixture
def generic_calls(monkeypatch):
    """Record _send_kvcache_generic calls with the agent the calling thread sees."""
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    calls = []

    def fake_generic(self, **kw):
        calls.append((self.agent.name, list(kw["prefill_data_indices"]), list(kw["dst_data_indices"])))
        if kw.get("bypass_prepped") is not True:
            raise AssertionError("rail legs must bypass the prepped (primary-agent) descriptor lists")
        if getattr(self.agent, "fail_post", False):
            raise RuntimeError("post failed")
        return f"h{len(calls)}"

    def fake_send(self, peer, src, ptrs, dst, gpu, kind="VRAM"):
        calls.append(("sglang", list(src), list(dst)))
        return "hs"

    monkeypatch.setattr(NixlKVManager, "_send_kvcache_generic", fake_generic)
    monkeypatch.setattr(NixlKVManager, "send_kvcache", fake_send)
    return calls


def test_split_posts_each_part_on_its_rail_agent(generic_calls):
    plan = RoutePlan([RailShare(1, 0.75), RailShare(0, 0.25)], "split", "test")
    router = FakeRouter(plan)
    m = _manager(router)
    src, dst = np.arange(8, dtype=np.int32), np.arange(100, 108, dtype=np.int32)
    x = m.send_kvcache("peer", src, [9], dst, 0, "DRAM")
    assert isinstance(x, RoutedXfer) and x.path_type == "split"
    assert generic_calls == [("rail1", [0, 1, 2, 3, 4, 5], [100, 101, 102, 103, 104, 105]),
                             ("rail0", [6, 7], [106, 107])]
    assert router.posted == [(1, 1200), (0, 400)]  # 200 B per page
    assert m.agent.name == "primary"  # the per-thread override is gone after the call
    settled, failed = m._ff_state(x)
    assert settled and not failed
    assert sorted(router.reports) == [(0, 400), (1, 1200)]
    assert sorted(router.released) == [0, 1]  # each leg's in-flight reservation ended with it (share index)
    assert router.finished and router.finished[-1] is plan.ticket  # the chunk's ticket closed once settled
    assert m._ff_stats.metrics()["bytes_per_rail"] == {"rail0": 400, "rail1": 1200}


def test_planning_error_or_failed_first_post_goes_via_sglang(generic_calls):
    m = _manager(FakeRouter(exc=RuntimeError("boom")))
    x = m.send_kvcache("peer", np.arange(4, dtype=np.int32), [9], np.arange(4, dtype=np.int32), 0)
    assert generic_calls[-1][0] == "sglang" and x.path_type == "sglang" and x.legs[0][2] == -1
    m = _manager(FakeRouter(RoutePlan([RailShare(0, 1.0)], "direct", "t")))
    m._ff_rails[0][1].fail_post = True
    x = m.send_kvcache("peer", np.arange(4, dtype=np.int32), [9], np.arange(4, dtype=np.int32), 0)
    assert generic_calls[-1][0] == "sglang" and x.path_type == "sglang"


def test_unknown_peer_on_rails_uses_sglang(generic_calls):
    m = _manager(FakeRouter(RoutePlan([RailShare(0, 1.0)], "direct", "t")))
    m._ff_rail_peers = [set(), set()]
    m.send_kvcache("other", np.arange(4, dtype=np.int32), [9], np.arange(4, dtype=np.int32), 0)
    assert generic_calls == [("sglang", [0, 1, 2, 3], [0, 1, 2, 3])]


def test_settles_only_when_every_leg_is_done_and_records_once():
    m = _manager(FakeRouter())
    a0, a1 = m._ff_rails[0][1], m._ff_rails[1][1]
    a0.states["x0"] = ["PROC", "DONE"]
    a1.states["x1"] = ["PROC", "PROC", "PROC", "DONE"]
    x = RoutedXfer("split", 0.0)
    x.add(a0, "x0", 0, 100, 0.0)
    x.add(a1, "x1", 1, 100, 0.0)
    seen = [m._ff_state(x) for _ in range(5)]
    assert seen == [(False, False), (False, False), (False, False), (True, False), (True, False)]
    assert m._ff_stats.metrics()["chunks"] == 1


def test_failed_leg_waits_for_siblings_then_reports_failure(monkeypatch):
    m = _manager(FakeRouter())
    a0, a1 = m._ff_rails[0][1], m._ff_rails[1][1]
    a0.states["x0"] = ["ERR"]
    a1.states["x1"] = ["PROC", "PROC", "DONE"]
    x = RoutedXfer("split", 0.0)
    x.add(a0, "x0", 0, 100, 0.0)
    x.add(a1, "x1", 1, 100, 0.0)
    aux = "aux"  # a plain SGLang handle in the same batch
    m.__dict__["_ff_primary_agent"].states[aux] = ["DONE"]
    settled, failed = m._await_handles([x, aux], failure_seen=False)
    assert settled and failed and all(t is not None for t in x.t_done)  # no early return while x1 ran
    assert m._ff_stats.metrics()["failed_chunks"] == 1


def test_stuck_leg_after_failure_is_bounded(monkeypatch):
    from sglang.srt.disaggregation.nixl import conn as nixl_conn
    monkeypatch.setattr(nixl_conn, "NIXL_ERR_SETTLE_TIMEOUT_S", 0.2, raising=False)
    monkeypatch.setattr(nixl_conn, "NIXL_ERR_SETTLE_POLL_S", 0.01, raising=False)
    m = _manager(FakeRouter())
    a0, a1 = m._ff_rails[0][1], m._ff_rails[1][1]
    a0.states["x0"] = ["ERR"]
    a1.states["x1"] = ["PROC"]  # never finishes
    x = RoutedXfer("split", 0.0)
    x.add(a0, "x0", 0, 100, 0.0)
    x.add(a1, "x1", 1, 100, 0.0)
    assert m._await_handles([x], failure_seen=False) == (False, True)
