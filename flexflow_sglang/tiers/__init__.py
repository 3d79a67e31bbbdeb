"""Deep KV tiers below host memory (see docs/tiers.md).

* KVTier      - the interface every deep tier implements (base.py, an abstract base class).
* StorageTier - local directory, one file per page (NIXL POSIX backend; survives restarts).
* RemoteTier  - other nodes' tier servers (TCP control channel + NIXL UCX data).
* InMemoryTier - the reference tier: pages in a dict (memory.py).
* registry    - tier name -> factory: register_tier / create_tier; built-ins storage, remote, memory.
* tier_server - `python -m flexflow_sglang.tiers.tier_server` (`flexflow tier-server`).

Importing this package does not import nixl; agents are created on first use.
"""
import hashlib
import os
from dataclasses import replace
from typing import Any, Mapping

from ..errors import ConfigError
from .base import KVTier
from .memory import InMemoryTier
from .registry import TierContext, TierFactory, create_tier, register_tier, registered_tiers
from .remote import RemoteTier
from .storage import StorageTier, StorageTierError
from .storage_slabs import SlabStorageTier
from .wire import WireError

__all__ = ["KVTier", "StorageTier", "SlabStorageTier", "StorageTierError", "RemoteTier", "InMemoryTier", "WireError",
           "TierContext", "TierFactory", "register_tier", "registered_tiers", "create_tier",
           "storage_from_config", "remote_from_config", "storage_factory", "remote_factory"]


def storage_from_config(cfg, fingerprint: str, node: str = "nvme0", page_nbytes=None) -> StorageTier:
    """StorageTier from a config.StorageTierConfig (path, capacity_gb, backend, eviction, read_only, fsync,
    layout: `files` -> StorageTier, `slabs` -> SlabStorageTier)."""
    cls = StorageTier if getattr(cfg, "layout", "slabs") == "files" else SlabStorageTier
    return cls(cfg.path, capacity_gb=cfg.capacity_gb, backend=cfg.backend, eviction=cfg.eviction,
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


def storage_factory(ctx: TierContext, options: Mapping[str, Any]) -> StorageTier:
    """The registered tier `storage`: `options` are storage_tier keys over their defaults (`enabled`
    and `write_through` are the connector's). The pages live in <path>/<fingerprint hash>/<rank_dir>,
    so different models and shards never share files and no two processes contend for a directory
    lock (a restarted rank finds its own files again); every level is created owner-only."""
    from ..config import section_from_options
    cfg = section_from_options("storage_tier", options, "storage tier options")
    fp_hash = hashlib.blake2b(ctx.fingerprint_text.encode(), digest_size=8).hexdigest()
    path = os.path.join(cfg.path, fp_hash, ctx.rank_dir)
    # makedirs' mode covers only the leaf: the configured root and the fingerprint level too
    os.makedirs(cfg.path, mode=0o700, exist_ok=True)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    return storage_from_config(replace(cfg, path=path), fingerprint=ctx.fingerprint_text,
                               node=ctx.node or "nvme0", page_nbytes=ctx.page_nbytes)


def remote_factory(ctx: TierContext, options: Mapping[str, Any]) -> RemoteTier:
    """The registered tier `remote`: `options` are remote_tier keys over their defaults (`enabled`
    and `write_through` are the connector's). Routed when `ctx` carries a selector."""
    from ..config import section_from_options
    cfg = section_from_options("remote_tier", options, "remote tier options")
    if not cfg.peers:
        raise ConfigError("no peers: give `peers` (host:port of `flexflow tier-server`s)")
    return remote_from_config(cfg, node=ctx.node, selector=ctx.selector, local_node=ctx.local_node,
                              engine=ctx.engine)
