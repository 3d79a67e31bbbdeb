"""The Router (tiers/routing.py) and the relay server drive RemoteTier only through its public
interface (RemoteTier's class docstring): no private attribute of the tier is touched from outside
remote.py, and every name they use exists on a RemoteTier. No NIXL, no server: a source check."""
from __future__ import annotations

import ast
import os

from flexflow_sglang.tiers.remote import RemoteTier
from flexflow_sglang.tiers.remote_peers import Peer

TIERS = os.path.join(os.path.dirname(__file__), "..", "..", "flexflow_sglang", "tiers")


def _tier_attrs(path: str) -> set:
    """Attribute names read or written on the tier object: `t.X`, `self.t.X`, `tier.X`."""
    tree = ast.parse(open(os.path.join(TIERS, path)).read())
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id in ("t", "tier")) or \
                (isinstance(v, ast.Attribute) and v.attr == "t" and isinstance(v.value, ast.Name)):
            out.add(node.attr)
    return out


def test_router_and_relay_use_only_public_remote_tier_names():
    tier = RemoteTier(["127.0.0.1:1"], relay_peers=["127.0.0.1:2"])
    try:
        for path in ("routing.py", "relay_server.py"):
            used = _tier_attrs(path)
            assert used, path
            private = sorted(a for a in used if a.startswith("_"))
            assert not private, f"{path} reaches into RemoteTier: {private}"
            missing = sorted(a for a in used if not hasattr(tier, a) and not hasattr(RemoteTier, a))
            assert not missing, f"{path} uses names RemoteTier lacks: {missing}"
    finally:
        tier.close()


def test_peer_accessors_without_a_connection():
    tier = RemoteTier(["127.0.0.1:1"], relay_peers=["127.0.0.1:2"])
    try:
        with tier.lock:
            assert list(tier.peer_ids()) == [0, 1]
            p = tier.peer(1)
            assert isinstance(p, Peer) and p.addr == "127.0.0.1:2" and not p.connected
            # nothing connected, no NIXL agent yet: any transfer would pay setup first
            assert tier.first_contact(0) and not tier.has_metadata(0)
            p.note_bandwidth(2.0)
            p.note_bandwidth(1.0)
            assert abs(p.bw_gbps - (0.7 * 2.0 + 0.3 * 1.0)) < 1e-12
    finally:
        tier.close()
