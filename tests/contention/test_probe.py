"""The contention lab's elastic-sharing probe (node.Sender.step_probe) without NIXL or namespaces:
a fake NIXL agent whose chunks never complete plays a direct link saturated by UDP at 95 %."""

import time

from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.monitor.sources import LinkLoadSource
from flexflow_sglang.tools.bench.contention import node

MiB = 1 << 20


class _SaturatedLink(LinkLoadSource):
    def read_rates(self, dt):
        return [(1, 0.125e9)]  # the direct link (n0-n2), full of foreign load


class _StuckNixl:
    """Posts succeed; no chunk ever completes (TCP retransmission back-off under UDP at 95 %)."""

    def __init__(self):
        self.posted = 0

    def get_xfer_descs(self, descs, mem):
        return descs

    def initialize_xfer(self, *a):
        return object()

    def transfer(self, h):
        self.posted += 1
        return "PROC"

    def check_xfer_state(self, h):
        return "PROC"

    def release_xfer_handle(self, h):
        pass


def _sender():
    topo = node.build_topology()
    s = node.Sender.__new__(node.Sender)  # no NIXL agents, no metadata exchange
    s.topo = topo
    s.l01, s.l02, s.l12 = 0, 1, 2
    s.agent = NodeAgent(topo, source="mock", sources=[_SaturatedLink()])
    s.agent_el = NodeAgent(topo, source="mock", sources=[_SaturatedLink()], elastic_share=0.5)
    for ag in (s.agent, s.agent_el):
        ag.sample_once()
        time.sleep(0.01)
        ag.sample_once()
    s.a_direct, s.p_direct = _StuckNixl(), {"name": "t-direct", "addr": 0}
    s.addr, s.max_bytes, s.chunk, s.window = 0, 64 * MiB, MiB, 2
    s.probe, s.probe_token, s.next_probe_t, s.probes = None, 0, 0.0, []
    return s


def test_a_running_probe_with_nothing_to_do_lets_the_transfer_loop_sleep():
    # issue 15 item 4: step_probe said "busy" for as long as a probe ran, so the transfer loop never
    # slept during it (4x the sender's CPU over the first transfers of the elastic block, on two
    # cores shared with the relay and target processes); one relay transfer took 231 ms, not 42
    s = _sender()
    assert s.agent_el.probe_due(s.l02)
    assert s.step_probe(time.monotonic(), True), "starting the probe and posting its chunks is work"
    assert s.probe is not None and s.a_direct.posted == s.window
    # both chunks stuck in flight, window full: nothing to do until one completes
    for _ in range(5):
        assert not s.step_probe(time.monotonic(), True)
    assert s.probe is not None, "the probe still runs (its chunks are in flight)"
    assert s.a_direct.posted == s.window
