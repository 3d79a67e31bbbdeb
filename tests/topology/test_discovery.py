import logging
import os

from flexflow_sglang import Topology
from flexflow_sglang.topology import discover


def _w(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def fake_sysfs(root):
    _w(f"{root}/devices/system/node/node0/cpulist", "0-1")
    _w(f"{root}/devices/system/node/node1/cpulist", "2-3")
    # an RDMA NIC on NUMA 1 with a 400 Gb/s port
    _w(f"{root}/class/infiniband/mlx5_0/device/numa_node", "1")
    _w(f"{root}/class/infiniband/mlx5_0/ports/1/rate", "400 Gb/sec (4X NDR)")
    _w(f"{root}/class/infiniband/mlx5_0/ports/1/counters/port_xmit_data", "0")
    _w(f"{root}/class/infiniband/mlx5_0/ports/1/counters/port_rcv_data", "0")
    # a physical Ethernet NIC (has device/) and a virtual one (skipped by default)
    _w(f"{root}/class/net/eth0/device/numa_node", "0")
    _w(f"{root}/class/net/eth0/speed", "25000")
    _w(f"{root}/class/net/eth0/statistics/tx_bytes", "0")
    _w(f"{root}/class/net/eth0/statistics/rx_bytes", "0")
    _w(f"{root}/class/net/veth9/speed", "-1")
    _w(f"{root}/class/net/lo/speed", "0")
    _w(f"{root}/block/nvme0n1/device/device/numa_node", "0")


def test_discovery_on_fake_sysfs_without_nvml(tmp_path, caplog, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails like a machine without the driver
    fake_sysfs(tmp_path)
    with caplog.at_level(logging.INFO):
        topo = discover(sysfs_root=str(tmp_path))
    assert sorted(n.name for n in topo.nodes_of_kind("cpu")) == ["cpu0", "cpu1"]
    assert not topo.nodes_of_kind("gpu")
    nics = {n.attrs["device"]: n for n in topo.nodes_of_kind("nic")}
    assert set(nics) == {"mlx5_0/1", "eth0"}
    rdma = [l for l in topo.links if l.counter.get("sysfs_ib") == "mlx5_0/1"][0]
    assert rdma.capacity_gbps == 50.0  # 400 Gb/s
    eth = [l for l in topo.links if l.counter.get("sysfs_net") == "eth0"][0]
    assert abs(eth.capacity_gbps - 25000 / 8000) < 1e-9
    assert topo.nodes_of_kind("storage")
    assert "NVML unavailable" in caplog.text
    # the RDMA NIC hangs off NUMA node 1
    nic = nics["mlx5_0/1"].name
    assert any({l.a, l.b} == {nic, "cpu1"} for l in topo.links)


def test_discovery_with_nothing(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo = discover(sysfs_root=str(tmp_path / "empty"))
    assert [n.name for n in topo.nodes.values()] == ["cpu0"]


def test_discovery_real_machine_does_not_crash():
    topo = Topology.discover()
    assert topo.nodes_of_kind("cpu")
