"""Legs: what moves one chunk of pages along one subpath, for the moves the engine routes.

Device <-> host copies are `connector.executors.TransferExecutor` (gather / scatter per layer,
CUDA staging, relay through a peer GPU); it routes each move through `TransferEngine.move`.
Here are the deeper tiers' legs: a tier's own batch call over a chunk of pages (the storage tier's
NIXL POSIX files, the remote tier's tier servers). A tier that routes its own traffic (the remote
tier with a selector: Direct / CrossNodeRelay / Split over tier servers, tiers/routing.py) is
handed the whole batch once, unchunked and unrouted here: its Router opens the engine's tickets
itself, so the path is selected, reserved and reported exactly once.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

logger = logging.getLogger(__name__)


def routes_itself(tier) -> bool:
    """True for a tier whose I/O is routed inside the tier (KVTier.routes_itself: a remote tier with
    a Router)."""
    return tier.routes_itself


def tier_put(engine, tier, src_node: Optional[str], keys: Sequence[bytes], rows_u8) -> int:
    """put_many(keys, rows) routed src_node -> tier.node in chunks; returns leading pages stored."""
    n = len(keys)
    if n == 0:
        return 0
    if routes_itself(tier):
        return int(tier.put_many(list(keys), rows_u8) or 0)
    unit = int(rows_u8.shape[1])
    stats = engine.move(src_node, tier.node, n, unit, lambda sub, i0, i1: int(tier.put_many(keys[i0:i1], rows_u8[i0:i1]) or 0),
                        record="tier:", chunk_bytes=getattr(tier, "io_chunk_bytes", None))
    return stats.nbytes // unit


def tier_get(engine, tier, dst_node: Optional[str], keys: Sequence[bytes], out_u8) -> int:
    """get_many_into(keys, out) routed tier.node -> dst_node in chunks; leading pages loaded
    (and verified by the tier)."""
    n = len(keys)
    if n == 0:
        return 0
    if routes_itself(tier):
        return int(tier.get_many_into(list(keys), out_u8) or 0)
    unit = int(out_u8.shape[1])
    stats = engine.move(tier.node, dst_node, n, unit,
                        lambda sub, i0, i1: int(tier.get_many_into(keys[i0:i1], out_u8[i0:i1]) or 0),
                        record="tier:", chunk_bytes=getattr(tier, "io_chunk_bytes", None))
    return stats.nbytes // unit


def deep_prefix(tiers, keys: Sequence[bytes]) -> int:
    """Leading keys held by the deeper tiers, page runs taken from whichever tier holds them (a
    broken tier is a miss). Runs on a worker for prefetches: tiers are thread-safe."""
    n, total = 0, len(keys)
    while n < total:
        m = 0
        for tier in tiers:
            try:
                m = int(tier.contains_prefix(list(keys[n:])) or 0)
            except Exception:  # noqa: BLE001
                logger.exception("flexflow: tier %s lookup failed", getattr(tier, "name", tier))
                m = 0
            if m > 0:
                break
        if m <= 0:
            break
        n += m
    return n
