"""RemoteTier routed by the PathSelector: Direct, CrossNodeRelay (RELAY_GET / RELAY_PUT) and SplitPath.

* wire: the relay messages round-trip; a decoder that predates them rejects them exactly as an
  old tier server does ("unknown message type").
* loopback (nixl): a relay server pulls from / forwards to the owner; an old server's ERROR means
  "relay unsupported" and the rows go direct in the same call; a dead owner or a frozen relay is a
  miss, never a hang; SplitPath runs a direct and a relay leg and reports both to the NodeAgent.
* netns (root + nixl): three namespaces n0-n1-n2 with 1 Gbit/s tbf links, tier servers in n1 and n2,
  the client in n0 with a sysfs NodeAgent. Idle reads go Direct; with UDP at 95 % of the cap on
  n2 -> n0 the selector routes through n1, and the relayed read beats a forced-direct read.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from flexflow_sglang.tiers import wire
from flexflow_sglang.tiers.wire import (HEADER, HEADER_LEN, MsgType, WireError, decode_frame,
                                        decode_header, encode_frame, pack_keys, unpack_keys, write_frame)

from tier_helpers import REPO, freeze, requires_nixl, stop_proc

P = 64 * 1024
OLD_TYPES = frozenset(range(1, 16)) | {127}  # what a tier server before CrossNodeRelay decodes


def keys_for(n, tag=b"rt"):
    import hashlib
    return [hashlib.blake2b(tag + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


def pages_for(n, seed=0, p=P):
    return np.random.default_rng(seed).integers(0, 256, size=(n, p), dtype=np.uint8)


# ------------------------------------------------------------------------------------------ wire
def test_relay_messages_roundtrip():
    assert (MsgType.RELAY_GET, MsgType.RELAY_GET_OK, MsgType.RELAY_PUT, MsgType.RELAY_PUT_OK) == (16, 17, 18, 19)
    assert wire.WIRE_VERSION == 2  # the relay types came within version 1 (old peers answer ERROR); 2: 64-bit sums
    ks = keys_for(3)
    klen, blob = pack_keys(ks)
    for t, body in [
        (MsgType.RELAY_GET, {"klen": klen, "n": 3, "owner": "10.77.2.2:7300", "owner_node": "n2", "timeout_ms": 2000.0}),
        (MsgType.RELAY_PUT, {"klen": klen, "n": 3, "sums": [1, 2, 2**32 - 1], "owner": "[::1]:7", "owner_node": None,
                             "timeout_ms": 500}),
    ]:
        f = decode_frame(encode_frame(t, body, blob))
        assert f.type == t and f.body == body and unpack_keys(f.body, f.blob) == ks
    for t, body in [
        (MsgType.RELAY_GET_OK, {"count": 2, "lease": 9, "addrs": [1 << 40, (1 << 40) + P], "sums": [5, 6], "pull_s": 0.25}),
        (MsgType.RELAY_GET_OK, {"count": 0, "lease": 0, "addrs": [], "sums": [], "pull_s": 0.0, "error": "owner down"}),
        (MsgType.RELAY_PUT_OK, {"lease": 3, "status": [0, 0, -1], "addrs": [4096, 8192]}),
    ]:
        f = decode_frame(encode_frame(t, body))
        assert f.type == t and f.body == body and f.blob == b""


def test_old_decoder_rejects_relay_types(monkeypatch):
    """A server that predates the relay messages fails at the header: 'unknown message type', which
    it answers with ERROR before closing (tier_server._serve_conn); the client reads that ERROR."""
    monkeypatch.setattr(wire, "_TYPES", set(OLD_TYPES))
    data = encode_frame(MsgType.PING)  # old types still decode
    assert decode_header(data[:HEADER_LEN])[0] == MsgType.PING
    raw = HEADER.pack(wire.MAGIC, wire.WIRE_VERSION, 16, 0, 2, 0)
    with pytest.raises(WireError, match="unknown message type 16"):
        decode_header(raw)


class OldServer:
    """Speaks the tier wire format as a server without CrossNodeRelay: HELLO/PING/STATS/LOOKUP
    answered, anything it cannot decode gets ERROR and the connection is closed."""

    def __init__(self, node="n1"):
        self.node = node
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen = []
        self._stop = False
        self.th = threading.Thread(target=self._loop, daemon=True)
        self.th.start()

    def _loop(self):
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c):
        try:
            while True:
                hdr = b""
                while len(hdr) < HEADER_LEN:
                    r = c.recv(HEADER_LEN - len(hdr))
                    if not r:
                        return
                    hdr += r
                magic, ver, t, flags, jlen, blen = HEADER.unpack(hdr)
                self.seen.append(t)
                if t not in OLD_TYPES:
                    write_frame(c, MsgType.ERROR, {"error": f"unknown message type {t}"})
                    return
                left = jlen + blen
                body = b""
                while len(body) < left:
                    r = c.recv(left - len(body))
                    if not r:
                        return
                    body += r
                body = json.loads(body[:jlen] or b"{}")
                if t == MsgType.HELLO:
                    write_frame(c, MsgType.HELLO_OK, {"agent": "old", "page_nbytes": body.get("page_nbytes", 0),
                                                      "slots": 8, "node": self.node}, b"not-nixl-metadata")
                elif t == MsgType.LOOKUP:
                    write_frame(c, MsgType.LOOKUP_OK, {"count": 0, "lease": 0, "addrs": [], "sums": []})
                elif t == MsgType.PING:
                    write_frame(c, MsgType.PONG, {})
                elif t != MsgType.RELEASE:
                    write_frame(c, MsgType.ERROR, {"error": "not in this fake"})
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self._stop = True
        self.sock.close()


# ------------------------------------------------------------------------------------------ loopback
def _hosts_selector():
    from flexflow_sglang.monitor import NodeAgent
    from flexflow_sglang.selector import PathSelector
    from flexflow_sglang.topology.mock import make_mock_hosts
    topo = make_mock_hosts(3)
    agent = NodeAgent(topo, source="mock")
    return PathSelector(topo, agent), agent


@pytest.fixture
def routed():
    made = []

    def mk(peers, **kw):
        from flexflow_sglang.tiers.remote import RemoteTier
        kw.setdefault("timeout_ms", 5000)
        kw.setdefault("retry_after_s", 30)
        t = RemoteTier(peers, **kw)
        made.append(t)
        return t

    yield mk
    for t in made:
        t.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_old_server_error_means_relay_unsupported(spawn_server, routed):
    owner = spawn_server(extra=("--node", "n2"))
    old = OldServer("n1")
    try:
        sel, agent = _hosts_selector()
        agent.set_utilization("n0", "n2", 0.95)  # direct rejected: the selector picks the relay via n1
        t = routed([owner.addr], relay_peers=[old.addr], selector=sel, local_node="n0",
                   peer_nodes={owner.addr: "n2", old.addr: "n1"})
        ks, pg = keys_for(8), pages_for(8)
        assert t.put_many(ks, pg) == 8  # RELAY_PUT -> ERROR + close -> PUT to the owner, same call
        assert old.seen.count(MsgType.RELAY_PUT) == 1
        s = t.stats()
        assert s["relay_unsupported"] == 1 and s["peer_down"] == 0 and s["peers"][old.addr]["up"]
        assert [r["type"] for r in t.last_routes if r["pages"]] == ["Direct"]
        assert t.last_routes[-1]["note"] == "relay unsupported"
        out = np.zeros_like(pg)
        assert t.get_many_into(ks, out) == 8 and np.array_equal(out, pg)
        assert MsgType.RELAY_GET not in old.seen  # remembered for retry_after_s: no second attempt
        assert t.last_routes[0]["planned"] == "CrossNodeRelay" and t.last_routes[0]["type"] == "Direct"
        assert t.stats()["peer_down"] == 0
    finally:
        old.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_relay_put_and_get_through_a_second_server(spawn_server, routed):
    owner = spawn_server(extra=("--node", "n2"))
    relay = spawn_server(extra=("--node", "n1"))
    sel, agent = _hosts_selector()
    agent.set_utilization("n0", "n2", 0.95)
    # both servers are owners; keys chosen so that rendezvous puts them on `owner`
    t = routed([owner.addr, relay.addr], selector=sel, local_node="n0", relay_chunk_bytes=16 * P)
    ks = [k for k in keys_for(400, b"own") if t.node_for(k) == owner.addr][:40]
    pg = pages_for(40, seed=3)
    assert t.put_many(ks, pg) == 40
    assert [(r["type"], r["via"]) for r in t.last_routes] == [("CrossNodeRelay", relay.addr)]
    plain = routed([owner.addr])  # no selector: reads the owner directly
    out = np.zeros_like(pg)
    assert plain.get_many_into(ks, out) == 40 and np.array_equal(out, pg)
    fb0 = agent.feedback_count
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 40 and np.array_equal(out, pg)
    (leg,) = t.last_routes
    assert leg["type"] == "CrossNodeRelay" and leg["via"] == relay.addr and leg["bytes"] == 40 * P
    assert agent.feedback_count == fb0 + 1
    rs = t.server_stats(relay.addr)
    assert rs["relay_gets"] == 3 and rs["relay_pages_out"] == 40 and rs["relay_puts"] == 3
    assert rs["relay_pages_fwd"] == 40 and rs["used_slots"] == 0 and rs["leases"] == 0  # temp slots freed
    assert t.server_stats(owner.addr)["pages_stored"] == 40
    s = t.stats()
    assert s["relay_pages_read"] == 40 and s["relay_pages_written"] == 40 and s["corrupt_dropped"] == 0
    # idle again: the direct link is used again (since equal-finish split shares, an idle direct
    # link plus an idle disjoint relay is a SplitPath: direct leg + relay leg)
    agent.clear()
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 40 and np.array_equal(out, pg)
    types = [r["type"] for r in t.last_routes]
    assert types[0] == "Direct" and set(types) <= {"Direct", "CrossNodeRelay"}
    assert {r["decision"] for r in t.last_routes} <= {"Direct", "SplitPath"}


class _Stub:
    """A selector that always answers SplitPath (direct + relay via n1) and records feedback."""

    def __init__(self):
        from flexflow_sglang.topology.mock import make_mock_hosts
        self.topology = make_mock_hosts(3)
        self.agent = self
        self.config = None
        self.reports = []

    def report_transfer(self, links, nbytes, seconds, relays=0, **kw):
        self.reports.append((tuple(links), nbytes, seconds, relays))

    def _links(self, nodes):
        return tuple(self.topology.links_between(a, b)[0].id for a, b in zip(nodes, nodes[1:]))

    def always_direct(self, req):
        return self.select(req, split=False)

    def select(self, req, split=True):
        from flexflow_sglang.selector.types import PathType, SubPath
        d = SubPath(PathType.Direct, (req.src, req.dst), self._links((req.src, req.dst)), req.data_bytes // 4)
        r = SubPath(PathType.CrossNodeRelay, (req.src, "n1", req.dst), self._links((req.src, "n1", req.dst)),
                    req.data_bytes - req.data_bytes // 4)
        subs = (d, r) if split else (d,)
        return type("D", (), {"subpaths": subs, "chosen_type": PathType.SplitPath if split else PathType.Direct})()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_split_runs_a_direct_and_a_relay_leg(spawn_server, routed):
    owner = spawn_server(extra=("--node", "n2"))
    relay = spawn_server(extra=("--node", "n1"))
    stub = _Stub()
    t = routed([owner.addr], relay_peers=[relay.addr], selector=stub, local_node="n0", relay_chunk_bytes=8 * P)
    ks, pg = keys_for(32, b"split"), pages_for(32, seed=5)
    assert t.put_many(ks, pg) == 32
    legs = {r["type"]: r for r in t.last_routes}
    assert legs["Direct"]["pages"] == 8 and legs["CrossNodeRelay"]["pages"] == 24
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 32 and np.array_equal(out, pg)
    legs = {r["type"]: r for r in t.last_routes}
    assert legs["Direct"]["bytes"] == 8 * P and legs["CrossNodeRelay"]["bytes"] == 24 * P
    assert legs["CrossNodeRelay"]["via"] == relay.addr and t.stats()["route_split"] == 2
    got = sorted((links, nb, relays) for links, nb, _, relays in stub.reports[-2:])
    assert got == sorted([(stub._links(("n2", "n0")), 8 * P, 0), (stub._links(("n2", "n1", "n0")), 24 * P, 1)])
    assert t.server_stats(relay.addr)["used_slots"] == 0


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_failed_relay_is_a_miss_not_a_hang(spawn_server, routed):
    owner = spawn_server(extra=("--node", "n2"))
    relay = spawn_server(extra=("--node", "n1"))
    sel, agent = _hosts_selector()
    t = routed([owner.addr], relay_peers=[relay.addr], selector=sel, local_node="n0", timeout_ms=1500,
               retry_after_s=30)
    ks, pg = keys_for(16, b"fail"), pages_for(16, seed=9)
    assert t.put_many(ks, pg) == 16  # idle: direct
    agent.set_utilization("n0", "n2", 0.95)
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 16 and np.array_equal(out, pg)  # warm: relay's client of the owner
    # owner gone: the relay's pull fails -> RELAY_GET_OK count 0 + error -> a miss; the relay stays up
    stop_proc(owner.proc)
    t0 = time.monotonic()
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0
    assert time.monotonic() - t0 < 3.0
    s = t.stats()
    assert s["relay_failures"] == 1 and s["peers"][relay.addr]["up"] and s["misses"] == 16
    # frozen relay: the RELAY_GET_OK deadline passes -> a miss, the relay is marked down
    freeze(relay.pid)
    t0 = time.monotonic()
    assert t.get_many_into(ks, np.zeros_like(pg)) == 0
    assert time.monotonic() - t0 < 3 * 1.5 + 1
    s = t.stats()
    assert not s["peers"][relay.addr]["up"] and s["timeouts"] >= 1


# ------------------------------------------------------------------------------------------ netns
CLIENT = textwrap.dedent(r"""
    import json, os, socket, sys, time
    import numpy as np
    from flexflow_sglang.monitor import NodeAgent
    from flexflow_sglang.selector import PathSelector, SelectorConfig
    from flexflow_sglang.tiers.remote import RemoteTier
    from flexflow_sglang.topology import LinkType, NodeKind, Topology

    a1, a2, out_path, n, P, udp_port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    res = {"phases": {}}
    def say(msg):
        print(msg, flush=True)
    # UDP sink for the cross-traffic: bound but never read (no ICMP back, no CPU)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("0.0.0.0", udp_port))
    topo = Topology("netlab-hosts3", "netlab")
    for h in ("n0", "n1", "n2"):
        topo.add_node(h, NodeKind.CPU, h, 0)
    topo.add_link("n0", "n1", LinkType.ETHERNET, 0.125, 70.0, counter={"sysfs_net": "v01"})
    topo.add_link("n0", "n2", LinkType.ETHERNET, 0.125, 70.0, counter={"sysfs_net": "v02"})
    topo.add_link("n1", "n2", LinkType.ETHERNET, 0.125, 70.0)  # not visible from n0: feedback only
    agent = NodeAgent(topo, sample_interval_ms=100, source="sysfs").start()
    # splits off: idle is Direct (with splits on, a 16 MiB batch is split over direct + n1 even when
    # idle, since two 1 Gbit/s paths beat one; the `ts` tier below runs that for real)
    sel = PathSelector(topo, agent, SelectorConfig(enable_split_path=False))
    nodes = {a1: "n1", a2: "n2"}
    t = RemoteTier([a1, a2], timeout_ms=20000, retry_after_s=30, selector=sel, local_node="n0", peer_nodes=nodes)
    ts = RemoteTier([a1, a2], timeout_ms=20000, retry_after_s=30, selector=PathSelector(topo, agent),
                    local_node="n0", peer_nodes=nodes)
    plain = RemoteTier([a2], timeout_ms=20000, retry_after_s=30)  # forced direct: no selector
    import hashlib
    keys, i = [], 0
    while len(keys) < n:
        k = hashlib.blake2b(b"netns" + i.to_bytes(4, "little"), digest_size=32).digest()
        i += 1
        if t.node_for(k) == a2:
            keys.append(k)
    pages = np.random.default_rng(11).integers(0, 256, size=(n, P), dtype=np.uint8)

    def phase(name, tier):
        out = np.zeros_like(pages)
        t0 = time.perf_counter()
        got = tier.get_many_into(keys, out)
        dt = time.perf_counter() - t0
        res["phases"][name] = {"got": got, "equal": bool(np.array_equal(out, pages)), "seconds": dt,
                               "routes": tier.last_routes, "util_n0n2": float(agent.util[1])}
        return dt

    t0 = time.perf_counter()
    res["stored"] = t.put_many(keys, pages)
    res["put"] = {"seconds": time.perf_counter() - t0, "routes": t.last_routes}
    phase("idle", t)
    ts.get_many_into(keys[:2], np.zeros((2, P), np.uint8))      # warm (agent, connections)
    phase("idle_split", ts)
    plain.get_many_into(keys[:2], np.zeros((2, P), np.uint8))  # warm the forced-direct client at idle
    agent.set_utilization("n0", "n2", 1.0)                      # warm the relay path (n1's client of n2)
    phase("warm_relay", t)
    agent.clear()
    time.sleep(0.3)
    say("CONGEST")
    assert sys.stdin.readline().strip() == "GO"
    time.sleep(0.6)  # > 5 sampling intervals
    res["util_before_relay"] = float(agent.util[1])
    phase("congested_routed", t)
    phase("congested_direct", plain)
    res["stats"] = {k: v for k, v in t.stats().items() if isinstance(v, (int, float, str))}
    res["relay_server"] = t.server_stats(a1)
    agent.stop()
    t.close()
    ts.close()
    plain.close()
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)
    say("DONE")
""")


def _netns_skip():
    from flexflow_sglang.tools.bench.contention import netlab
    from flexflow_sglang.tiers.base import load_nixl
    ok, why = netlab.available()
    if not ok:
        return f"netns lab unavailable: {why}"
    nixl_why = load_nixl()[2]
    if nixl_why:
        return f"nixl is not importable: {nixl_why}"
    return ""


def _wait_links_up(lab, timeout=5.0):
    """veth carrier comes up asynchronously (linkwatch, up to ~1 s): an interface that is not
    RUNNING yet when a UCX worker starts is left out of its address, and peers then fail with
    "UCX endpoint create failed ... Destination is unreachable"."""
    end = time.monotonic() + timeout
    devs = [(a, lab.dev(a, b)) for a in lab.nodes for b in lab.nodes if a != b]
    while True:
        down = []
        for node, dev in devs:
            out = subprocess.run(["ip", "-n", lab.ns(node), "-j", "link", "show", "dev", dev],
                                 capture_output=True, text=True).stdout
            if not out or json.loads(out)[0].get("operstate") != "UP":
                down.append(dev)
        if not down:
            return
        if time.monotonic() > end:
            pytest.fail(f"lab interfaces not up after {timeout} s: {down}")
        time.sleep(0.05)


@pytest.mark.root
@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_netns_congested_direct_link_is_routed_through_n1(tmp_path):
    why = _netns_skip()
    if why:
        pytest.skip(why)
    from flexflow_sglang.tools.bench.contention.netlab import NetLab
    port, udp_port, n, page = 7300, 7000, 64, 256 << 10
    env = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error", "UCX_WARN_UNUSED_ENV_VARS": "n",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = []
    t_start = time.monotonic()
    with NetLab(["n0", "n1", "n2"]) as lab:
        for a, b in (("n0", "n1"), ("n0", "n2"), ("n1", "n2")):
            lab.link(a, b, "1gbit")
        _wait_links_up(lab)
        a1 = f"{lab.addr('n1', 'n0')}:{port}"       # n1 as seen from n0
        a2 = f"{lab.addr('n2', 'n0')}:{port}"       # n2 over the direct link
        n2_from_n1 = f"{lab.addr('n2', 'n1')}:{port}"
        n1_from_n2 = f"{lab.addr('n1', 'n2')}:{port}"

        def server(node, devs, relay_peers):
            ready = tmp_path / f"{node}.ready"
            log = open(tmp_path / f"{node}.log", "wb")
            logs.append(tmp_path / f"{node}.log")
            lab.spawn(node, [sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", f"0.0.0.0:{port}",
                             "--capacity-gb", "0.1", "--node", node, "--relay-peers", relay_peers,
                             "--ready-file", str(ready), "--log-level", "INFO"],
                      env={**env, "UCX_NET_DEVICES": devs}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            return ready

        readies = [server("n1", "v10,v12", f"n2={n2_from_n1}"), server("n2", "v20,v21", f"n1={n1_from_n2}")]
        deadline = time.monotonic() + 30
        while not all(r.exists() for r in readies):
            assert time.monotonic() < deadline, "tier servers not ready: " + "".join(p.read_text()[-1500:] for p in logs)
            time.sleep(0.05)
        result = tmp_path / "client.json"
        clog = open(tmp_path / "client.log", "wb")
        logs.append(tmp_path / "client.log")
        cl = lab.spawn("n0", [sys.executable, "-c", CLIENT, a1, a2, str(result), str(n), str(page), str(udp_port)],
                       env={**env, "UCX_NET_DEVICES": "v01,v02"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=clog, cwd=REPO)

        def expect(word, timeout):
            import select
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                r, _, _ = select.select([cl.stdout], [], [], 0.2)
                if r:
                    line = cl.stdout.readline().decode()
                    if line.strip() == word:
                        return
                    if not line:
                        break
                if cl.poll() is not None:
                    break
            pytest.fail(f"client did not say {word}: " + "".join(p.read_text()[-3000:] for p in logs))

        expect("CONGEST", 45)
        # 95 % of the cap on n2 -> n0: the data direction of a get (n0's sysfs counter sees it as rx)
        lab.spawn("n2", [sys.executable, "-m", "flexflow_sglang.tools.bench.contention.traffic", "udp",
                         lab.addr("n0", "n2"), str(udp_port), str(0.95e9)], env=env,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        cl.stdin.write(b"GO\n")
        cl.stdin.flush()
        expect("DONE", 60)
        cl.wait(10)
        res = json.loads(result.read_text())
    ph = res["phases"]
    summary = {k: (v["got"], v["equal"], round(v["seconds"], 3), [(r["type"], r["via"]) for r in v["routes"]],
                   round(v["util_n0n2"], 2)) for k, v in ph.items()}
    print("netns phases:", summary, "total", round(time.monotonic() - t_start, 1), "s")
    assert res["stored"] == n, res["put"]
    for name in ("idle", "idle_split", "warm_relay", "congested_routed", "congested_direct"):
        assert ph[name]["got"] == n and ph[name]["equal"], (name, summary)
    assert [r["type"] for r in ph["idle"]["routes"]] == ["Direct"], summary
    assert [r["type"] for r in res["put"]["routes"]] == ["Direct"], res["put"]
    split = ph["idle_split"]["routes"]
    assert {r["decision"] for r in split} == {"SplitPath"} and sorted(r["type"] for r in split) == \
        ["CrossNodeRelay", "Direct"] and sum(r["bytes"] for r in split) == n * page, split
    assert [(r["type"], r["via"]) for r in ph["congested_routed"]["routes"]] == [("CrossNodeRelay", a1)], summary
    assert res["util_before_relay"] > 0.8, res["util_before_relay"]
    ratio = ph["congested_direct"]["seconds"] / ph["congested_routed"]["seconds"]
    print(f"netns relay-vs-forced-direct ratio under congestion: {ratio:.2f}x")
    assert ratio > 1.3, summary
    assert res["relay_server"]["relay_pages_out"] >= 2 * n and res["relay_server"]["used_slots"] == 0
