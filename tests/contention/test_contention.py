"""Real links: three network namespaces joined by 1 Gbit/s veths (tbf), NIXL UCX agents over TCP.

Congest the direct link n0-n2 with UDP at 95% of its capacity and check that the live selector
(NodeAgent reading n0's interface counters) routes around it, that the payload arrives intact, and
that routing around pays. Ratios with wide margins only: contended absolute rates vary run to run.
"""

import subprocess
import sys
import time

import pytest

from flexflow_sglang.tools.bench.contention.netlab import NetLab, available, list_namespaces, sweep_stale

MiB = 1 << 20


def _lab_skip_reason():
    ok, why = available()
    return None if ok else why


def _nixl_skip_reason():
    from flexflow_sglang.tools.bench.contention.lab import nixl_available
    ok, why = nixl_available()
    return None if ok else why


@pytest.mark.root
def test_netlab_teardown_and_stale_sweeper():
    why = _lab_skip_reason()
    if why:
        pytest.skip(f"network namespaces: {why}")
    with NetLab(["a", "b"]) as lab:
        lab.link("a", "b", "1gbit")
        p = lab.spawn("b", ["sleep", "60"])
        prefix = lab.prefix
        assert any(ns.startswith(prefix) for ns in list_namespaces())
        lab.change_rate("a", "b", "200mbit")  # live cap change works on a running lab
        assert "200Mbit" in lab.qdisc_stats("a", "b")
    assert p.poll() is not None, "processes must not outlive the lab"
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix)]
    # a lab whose owner died (e.g. SIGKILLed) is swept
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"ffc-{dead.pid}-dead00-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
    finally:
        subprocess.run(["ip", "netns", "del", stale], stderr=subprocess.DEVNULL)
    assert stale not in list_namespaces()


@pytest.mark.root
@pytest.mark.timeout(120)
def test_tier_server_spawned_in_a_namespace_becomes_ready_and_a_bad_one_is_killed(tmp_path):
    """The benchmarks' one tier-server launcher (stall, remote-routing): ready within the wait and
    reachable on its lab address; one that cannot start (an unknown flag) is reported at once and
    killed, not waited on for the whole timeout."""
    why = _lab_skip_reason()
    if why:
        pytest.skip(f"network namespaces: {why}")
    import time

    from flexflow_sglang.tools.bench.contention.netlab import spawn_tier_server, wait_ready
    with NetLab(["a", "b"]) as lab:
        lab.link("a", "b", "1gbit")
        good = spawn_tier_server(lab, "b", 7499, str(tmp_path), "tier-b", capacity_gb=0.01,
                                 ucx_devs=lab.dev("b", "a"))
        assert wait_ready(lab, [good]), (tmp_path / "tier-b.log").read_text()[-2000:]
        assert good[0].poll() is None and (tmp_path / "tier-b.log").exists()
        probe = lab.spawn("a", [sys.executable, "-c", f"import socket; socket.create_connection(('{lab.addr('b', 'a')}', 7499), 5)"])
        assert probe.wait(30) == 0
        bad = spawn_tier_server(lab, "b", 7498, str(tmp_path), "tier-bad", capacity_gb=0.01,
                                ucx_devs=lab.dev("b", "a"), extra=["--no-such-flag"])
        t0 = time.monotonic()
        assert not wait_ready(lab, [bad], timeout=60)
        assert time.monotonic() - t0 < 30 and bad[0].poll() is not None
        assert "no-such-flag" in (tmp_path / "tier-bad.log").read_text()


@pytest.mark.root
@pytest.mark.nixl
def test_selector_routes_around_congested_direct_link(tmp_path):
    why = _lab_skip_reason() or _nixl_skip_reason()
    if why:
        pytest.skip(f"contention lab: {why}")
    from flexflow_sglang.tools.bench.contention.lab import ContentionLab
    n = 16 * MiB
    with ContentionLab(max_bytes=n, log_dir=str(tmp_path / "logs")) as lab:
        prefix = lab.net.prefix
        idle = lab.xfer("direct", n)
        lab.start_background("udp", pct=0.95)
        try:
            time.sleep(0.5)  # a few 100 ms sampling intervals
            congested = lab.xfer("direct", n)
            time.sleep(0.3)  # let the NodeAgent forget our own direct transfer
            adaptive = lab.xfer("adaptive", n)
        finally:
            lab.stop_background()
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix)], "namespaces left behind"
    for r in (idle, congested, adaptive):
        assert r["complete"] and r["verified"], f"{r['policy']}: bytes at n2 do not match (checksum)"
    dec = adaptive["decision"]
    assert dec["type"] in ("CrossNodeRelay", "SplitPath"), dec
    direct_bytes = sum(b for t, b in dec["shares"] if t == "Direct")
    assert direct_bytes < n / 2, dec
    # the congestion is real, and routing around it pays (expected ~15-20x for both; margins are wide)
    assert congested["seconds"] > 3 * idle["seconds"], (idle["seconds"], congested["seconds"])
    assert adaptive["seconds"] * 3 < congested["seconds"], (adaptive["seconds"], congested["seconds"])


@pytest.mark.root
@pytest.mark.nixl
def test_elastic_sharing_takes_a_share_of_tcp_but_not_of_udp(tmp_path):
    """monitor.elastic_share 0.5 (the lab's adaptive-elastic policy): a probe finds that one greedy
    TCP flow yields and splits transfers onto the direct link; UDP at 95 % does not yield, so the
    transfers stay off it. Both with the payload verified at n2."""
    why = _lab_skip_reason() or _nixl_skip_reason()
    if why:
        pytest.skip(f"contention lab: {why}")
    from flexflow_sglang.tools.bench.contention.lab import ContentionLab
    n = 16 * MiB

    def phase(lab, kind, seconds=3.0, **bg):
        """Fresh NodeAgent state, background `kind` on n0-n2, adaptive-elastic transfers for `seconds`."""
        lab.clear()
        lab.start_background(kind, **bg)
        try:
            time.sleep(1.0)
            out, t_end = [], time.monotonic() + seconds
            while time.monotonic() < t_end:
                out.append(lab.xfer("adaptive-elastic", n))
            return out
        finally:
            lab.stop_background()

    with ContentionLab(max_bytes=n, log_dir=str(tmp_path / "logs")) as lab:
        direct_link = lab.info["link_ids"]["n0-n2"]
        tcp = phase(lab, "tcp", flows=1)
        udp = phase(lab, "udp", pct=0.95)
    for r in tcp + udp:
        assert r["complete"] and r["verified"], r
    probes = [p for r in tcp for p in r.get("probes", [])]
    assert probes, "a saturated link with no evidence must be probed"
    from flexflow_sglang.monitor.node_agent import ELASTIC_MIN_YIELD
    # the estimate moves with every interval one of our legs holds the link; judge its typical
    # value against the agent's own classification threshold (the level depends on the machine:
    # 0.46-0.9 seen, lower on a busy 2-core runner), not against a fixed number
    late = sorted(r["elastic_est"][direct_link] for r in tcp[len(tcp) // 2:])
    assert late[len(late) // 2] >= ELASTIC_MIN_YIELD, [r["elastic_est"] for r in tcp]
    # How large a share the direct link gets depends on the estimate (our measured share of the
    # link), which runs lower on a slower or busier machine (0.5-0.9 seen): at ~0.5 the direct leg
    # offers ~25 % of the link and the selector rightly keeps most transfers on the relay. What
    # must hold anywhere: after the probe, several transfers put bytes on the direct link under
    # TCP, far more than under UDP
    on_direct = [r for r in tcp if any(leg["kind"] == "direct" and leg["done"] > 0 for leg in r["legs"])]
    assert len(on_direct) >= 2, [r["decision"] for r in tcp]

    def direct_fraction(results):
        return sum(leg["done"] for r in results for leg in r["legs"] if leg["kind"] == "direct") / (n * len(results))

    est = udp[-1]["elastic_est"][direct_link]
    assert 0.0 <= est < ELASTIC_MIN_YIELD, [(r["elastic_est"], r["util_at_decision"], r.get("probes")) for r in udp]
    assert direct_fraction(udp) < 0.1, "transfers must stay off a link whose load does not yield"
    assert direct_fraction(tcp) > max(0.03, 3 * direct_fraction(udp)), (direct_fraction(tcp), direct_fraction(udp))
