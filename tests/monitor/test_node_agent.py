import os
import threading
import time

import pytest

from flexflow_sglang import NodeAgent, PathSelector, PathType, SelectorConfig, Topology, TransferRequest
from flexflow_sglang.topology import LinkType, NodeKind


def test_set_utilization_and_errors():
    topo = Topology.make_mock_dgx(4)
    agent = NodeAgent(topo, source="mock")
    agent.set_utilization("gpu0", "gpu1", 0.6)
    lid = topo.links_between("gpu0", "gpu1")[0].id
    assert agent.util[lid] == pytest.approx(0.6)
    with pytest.raises(ValueError):
        agent.set_utilization("gpu0", "gpu1", 1.5)
    with pytest.raises(Exception, match="no link"):
        agent.set_utilization("gpu0", "cpu1", 0.1)


def test_feedback_marks_bottleneck_and_decays():
    topo = Topology.make_mock_hosts(3, link_gbps=1.0)
    agent = NodeAgent(topo, source="mock", feedback_half_life_ms=50)
    lid = topo.links_between("n0", "n2")[0].id
    # 64 MiB in 0.2 s over a 1 GB/s link = ~0.34 GB/s observed -> ~66% busy
    gbps = agent.report_transfer([lid], 64 << 20, 0.2, queue_delay_us=300.0)
    assert gbps == pytest.approx((64 << 20) / 0.2 / 1e9)
    assert agent.util[lid] == pytest.approx(1 - gbps, abs=0.02)
    assert agent.qdelay_us[lid] > 0
    sel = PathSelector(topo, agent, SelectorConfig(enable_split_path=False))
    assert sel.select(TransferRequest("n0", "n2", 64 << 20)).chosen_type == PathType.CrossNodeRelay
    time.sleep(0.4)  # 8 half-lives
    agent.refresh()
    assert agent.util[lid] < 0.05
    assert sel.select(TransferRequest("n0", "n2", 64 << 20)).chosen_type == PathType.Direct


def test_small_transfers_do_not_claim_congestion():
    topo = Topology.make_mock_hosts(2, link_gbps=1.0)
    agent = NodeAgent(topo, source="mock")
    agent.report_transfer([0], 4096, 0.001)  # latency-bound
    assert agent.util[0] == 0.0


def _w(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_sysfs_counters_drive_utilisation(tmp_path):
    topo = Topology("t")
    topo.add_node("a", NodeKind.CPU, "a")
    topo.add_node("b", NodeKind.CPU, "b")
    topo.add_link("a", "b", LinkType.ETHERNET, 0.125, 50.0, counter={"sysfs_net": "veth0"})
    stats = tmp_path / "class/net/veth0/statistics"
    _w(str(stats / "tx_bytes"), "0")
    _w(str(stats / "rx_bytes"), "0")
    agent = NodeAgent(topo, source="sysfs", sysfs_root=str(tmp_path), sample_interval_ms=20)
    assert agent.sources and agent.sources[0].name == "sysfs-net"
    agent.sample_once()
    t0 = time.monotonic()
    time.sleep(0.1)
    _w(str(stats / "tx_bytes"), str(int(0.125e9 * 0.1 * 0.5)))  # half the link for 0.1 s
    agent.sample_once()
    el = time.monotonic() - t0
    assert agent.util[0] == pytest.approx(0.5 * 0.1 / el, rel=0.25)
    # our own bytes are subtracted: a link busy only with our transfer looks free
    agent.report_transfer([0], int(0.125e9 * 0.1), 0.1)  # ran at line rate: no feedback congestion
    _w(str(stats / "tx_bytes"), str(int(0.125e9 * 0.1 * 0.5) + int(0.125e9 * 0.1)))
    time.sleep(0.1)
    agent.sample_once()
    assert agent.util[0] < 0.1


def test_background_thread_and_nonblocking_reads(tmp_path):
    topo = Topology.make_mock_dgx(4)
    agent = NodeAgent(topo, source="mock", sample_interval_ms=5)
    sel = PathSelector(topo, agent)
    with agent:
        assert agent.running
        # hold the writer lock: readers (select) must not block on it
        with agent._lock:
            done = threading.Event()
            th = threading.Thread(target=lambda: (sel.select(TransferRequest("gpu0", "gpu1", 1 << 20)), done.set()))
            th.start()
            assert done.wait(2.0)
        time.sleep(0.05)
        assert agent.samples >= 2
    assert not agent.running


def test_nvml_absent_is_not_fatal(monkeypatch, caplog):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo = Topology.make_mock_dgx(2)  # links carry NVML counters
    agent = NodeAgent(topo, source="auto")
    assert all(s.name != "nvml" for s in agent.sources)
    agent.start()
    agent.stop()


def test_progress_reports_and_late_reports_do_not_hide_foreign_load(tmp_path):
    topo = Topology("t")
    topo.add_node("a", NodeKind.CPU, "a")
    topo.add_node("b", NodeKind.CPU, "b")
    topo.add_link("a", "b", LinkType.ETHERNET, 0.125, 50.0, counter={"sysfs_net": "veth0"})
    stats = tmp_path / "class/net/veth0/statistics"
    _w(str(stats / "rx_bytes"), "0")
    tx = [0]

    def put(n):
        tx[0] += n
        _w(str(stats / "tx_bytes"), str(tx[0]))

    put(0)
    agent = NodeAgent(topo, source="sysfs", sysfs_root=str(tmp_path))
    agent.sample_once()
    chunk = int(0.125e9 * 0.05)
    # our own transfer, reported chunk by chunk while it runs: the link looks free
    for _ in range(2):
        put(chunk)
        agent.report_progress([0], chunk)
    time.sleep(0.1)
    agent.sample_once()
    assert agent.util[0] < 0.1
    agent.report_transfer([0], 2 * chunk, 0.1, progress_reported=True)  # no double counting
    # a big transfer reported only at its end, when the counters no longer show it ...
    agent.report_transfer([0], 10 * chunk, 100.0)
    agent._fb_util[:] = 0.0
    time.sleep(0.05)
    agent.sample_once()
    # ... must not hide foreign traffic that shows up in the intervals after
    for _ in range(2):
        put(2 * chunk)
        time.sleep(0.1)
        agent.sample_once()
    assert agent.util[0] > 0.5
