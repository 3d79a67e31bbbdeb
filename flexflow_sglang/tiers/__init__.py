"""Deep KV tiers below host memory, moved by NIXL (see docs/tiers.md).

* StorageTier - local directory, one file per page (NIXL POSIX backend; survives restarts).
* RemoteTier  - other nodes' tier servers (TCP control channel + NIXL UCX data).
* tier_server - `python -m flexflow_sglang.tiers.tier_server` (`flexflow tier-server`).
* bench.run   - tier throughput against plain file I/O and raw NIXL UCX.

Importing this package does not import nixl; agents are created on first use.
"""
from .base import KVTier
from .remote import RemoteTier
from .storage import StorageTier, StorageTierError
from .wire import WireError

__all__ = ["KVTier", "StorageTier", "StorageTierError", "RemoteTier", "WireError",
           "storage_from_config", "remote_from_config"]


def storage_from_config(cfg, fingerprint: str, node: str = "nvme0", page_nbytes=None) -> StorageTier:
    """StorageTier from a config.StorageTierConfig (path, capacity_gb, backend, eviction, read_only, fsync)."""
    return StorageTier(cfg.path, capacity_gb=cfg.capacity_gb, backend=cfg.backend, eviction=cfg.eviction,
                       fingerprint=fingerprint, page_nbytes=page_nbytes, node=node,
                       read_only=getattr(cfg, "read_only", False), fsync=getattr(cfg, "fsync", False))


def remote_from_config(cfg, node=None, selector=None, local_node=None, engine=None) -> RemoteTier:
    """RemoteTier from a config.RemoteTierConfig (peers, relay_peers, timeout_ms, retry_after_s,
    secret_file). With `selector` and `local_node` (its topology node; cfg.local_node wins) every
    batch is routed (Direct / CrossNodeRelay / Split, tiers/routing.py) through `engine`'s tickets."""
    from .trust import load_secret
    t = RemoteTier(list(cfg.peers), timeout_ms=cfg.timeout_ms, retry_after_s=cfg.retry_after_s, node=node,
                   secret=load_secret(getattr(cfg, "secret_file", None)),
                   relay_peers=list(getattr(cfg, "relay_peers", ()) or ()))
    local = getattr(cfg, "local_node", None) or local_node
    if selector is not None and local in selector.topology.nodes:
        t.route_with(selector, local, engine=engine)
    return t
