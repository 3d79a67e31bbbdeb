import pytest

from flexflow_sglang import LinkType, PathType, Topology, TopologyError
from flexflow_sglang.topology import make_mock


def _count(paths, t):
    return sum(1 for p in paths if p.type == t)


def test_dgx_mesh_path_counts():
    topo = Topology.make_mock_dgx(8)
    assert len(topo.nodes_of_kind("gpu")) == 8
    nvlinks = [l for l in topo.links if l.type == LinkType.NVLINK]
    assert len(nvlinks) == 8 * 7 // 2
    paths = topo.enumerate_paths("gpu0", "gpu1")
    assert paths[0].type == PathType.Direct and paths[0].nodes == ("gpu0", "gpu1")
    assert _count(paths, PathType.NVLinkRelay) == 6  # through each of the other six GPUs
    for p in paths:
        assert p.nodes[0] == "gpu0" and p.nodes[-1] == "gpu1"
        # consecutive nodes are really linked by the listed link
        for i, lid in enumerate(p.links):
            link = topo.links[lid]
            assert {link.a, link.b} == {p.nodes[i], p.nodes[i + 1]}


def test_dgx1_cube_mesh_has_fewer_direct_links():
    topo = make_mock("dgx1")
    assert not topo.links_between("gpu0", "gpu5")  # not neighbours in the hybrid cube mesh
    paths = topo.enumerate_paths("gpu0", "gpu5")
    assert all(p.type != PathType.Direct or len(p.nodes) > 2 for p in paths)
    assert any(p.type == PathType.NVLinkRelay for p in paths)


def test_nvswitch_relay_goes_through_port_both_ways():
    topo = Topology.make_mock_nvswitch(8)
    paths = topo.enumerate_paths("gpu0", "gpu1")
    assert paths[0].nodes == ("gpu0", "nvswitch", "gpu1")
    relays = [p for p in paths if p.type == PathType.NVLinkRelay]
    assert relays and all(p.relays[0].startswith("gpu") for p in relays)


def test_cluster_cross_node_and_storage_relay():
    topo = Topology.make_mock_cluster(2, 8, 4)
    paths = topo.enumerate_paths("n0.gpu0", "n1.gpu0")
    assert paths[0].type == PathType.Direct and "n0.nic0" in paths[0].nodes
    assert _count(paths, PathType.StorageRelay) == 1
    three = Topology.make_mock_cluster(3, 2, 1)
    assert _count(three.enumerate_paths("n0.gpu0", "n1.gpu0"), PathType.CrossNodeRelay) >= 1


def test_hosts_relay_is_cross_node_not_transit():
    topo = make_mock("hosts3")
    paths = topo.enumerate_paths("n0", "n2")
    assert [p.type for p in paths] == [PathType.Direct, PathType.CrossNodeRelay]
    assert paths[1].relays == ("n1",)


def test_yaml_round_trip(tmp_path):
    import yaml
    topo = Topology.make_mock_dgx(4)
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(topo.to_dict()))
    back = Topology.from_yaml(f)
    assert back.to_dict() == topo.to_dict()
    assert [p.nodes for p in back.enumerate_paths("gpu0", "gpu3")] == \
        [p.nodes for p in topo.enumerate_paths("gpu0", "gpu3")]


@pytest.mark.parametrize("data,needle", [
    ({"nodes": [{"name": "a", "kind": "gpu"}], "links": [{"a": "a", "b": "zz", "type": "nvlink", "capacity_gbps": 1}]}, "zz"),
    ({"nodes": [{"name": "a", "kind": "tpu"}]}, "tpu"),
    ({"nodes": [{"name": "a", "kind": "gpu"}, {"name": "b", "kind": "gpu"}],
      "links": [{"a": "a", "b": "b", "type": "nvlink", "capacity_gbps": -5}]}, "capacity_gbps"),
    ({"nodes": [{"name": "a", "kind": "gpu"}, {"name": "a", "kind": "gpu"}]}, "duplicate"),
    ({"nodes": [], "bogus": 1}, "bogus"),
])
def test_bad_topology_names_the_problem(data, needle):
    with pytest.raises(TopologyError, match=needle):
        Topology.from_dict(data)


def test_same_endpoint_rejected():
    with pytest.raises(TopologyError):
        Topology.make_mock_dgx(2).enumerate_paths("gpu0", "gpu0")
