"""`flexflow demo --mock`: flexFlow's demo scenarios on mock topologies, one decision each."""

from __future__ import annotations

import json

from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.selector import PathSelector, SelectorConfig, TransferRequest
from flexflow_sglang.topology import make_mock

MiB = 1 << 20


def _scenarios():
    # (title, mock, selector overrides, loads [(a, b, util)], request)
    yield ("idle NVLink mesh, 64 MiB gpu0->gpu1 (split disabled: flexFlow's baseline)", "dgx-a100",
           {"enable_split_path": False}, [], ("gpu0", "gpu1", 64 * MiB, False))
    yield ("85% load on gpu0-gpu1 NVLink: relay through an idle GPU", "dgx-a100",
           {"enable_split_path": False}, [("gpu0", "gpu1", 0.85)], ("gpu0", "gpu1", 64 * MiB, False))
    yield ("50% load on gpu0-gpu1: relay gain vs relay_benefit_margin", "dgx-a100",
           {"enable_split_path": False}, [("gpu0", "gpu1", 0.5)], ("gpu0", "gpu1", 64 * MiB, False))
    yield ("TTFT-sensitive 256 KiB under 50% load: hops penalised, stay direct", "dgx-a100",
           {"enable_split_path": False}, [("gpu0", "gpu1", 0.5)], ("gpu0", "gpu1", 256 << 10, True))
    yield ("idle mesh with splitting on: direct + relay in parallel", "dgx-a100", {}, [],
           ("gpu0", "gpu1", 256 * MiB, False))
    yield ("KV offload gpu0->host with its PCIe switch at 90%: relay via a peer GPU's PCIe", "dgx8", {},
           [("gpu0", "pcisw0", 0.9), ("gpu1", "pcisw0", 0.9)], ("gpu0", "cpu0", 64 * MiB, False))
    yield ("3 hosts, direct Ethernet link at 85%: CrossNodeRelay through the third host", "hosts3",
           {"enable_split_path": False}, [("n0", "n2", 0.85)], ("n0", "n2", 64 * MiB, False))
    yield ("2-node cluster, NIC rail saturated, shared storage idle: StorageRelay", "cluster2x8x4",
           {"enable_split_path": False},
           [("n0.nic0", "leaf0", 0.95), ("n0.nic1", "leaf1", 0.95), ("n0.nic2", "leaf2", 0.95),
            ("n0.nic3", "leaf3", 0.95), ("leaf0", "spine", 0.95)], ("n0.gpu0", "n1.gpu0", 64 * MiB, False))


def run_demo(json_out: bool = False) -> int:
    results = []
    for title, mock, over, loads, (src, dst, nbytes, ttft) in _scenarios():
        topo = make_mock(mock)
        agent = NodeAgent(topo, source="mock")
        for a, b, u in loads:
            agent.set_utilization(a, b, u)
        sel = PathSelector(topo, agent, SelectorConfig(**over))
        req = TransferRequest(src, dst, nbytes, ttft_sensitive=ttft)
        d = sel.select(req)
        base = sel.always_direct(req)
        speedup = base.estimated_time_us / d.estimated_time_us
        results.append({"scenario": title, "topology": mock, "decision": d.to_dict(),
                        "estimated_speedup_vs_direct": round(speedup, 3)})
        if not json_out:
            print(f"== {title}  [{topo.name}]")
            for sp in d.subpaths:
                print(f"   {d.chosen_type.value:<15} {' -> '.join(sp.nodes)}  ({sp.nbytes} B)")
            print(f"   est. {d.estimated_bandwidth:.2f} GB/s, {d.estimated_time_us:.0f} us "
                  f"({speedup:.2f}x always-direct){'  QoS NOT MET' if d.qos_violation else ''}")
            print(f"   why: {d.reason}\n")
    if json_out:
        print(json.dumps(results, indent=2))
    return 0
