"""Pipeline parallelism: stage 0 checks and pins every later stage's host pages before it decides.

Each PP stage holds only its own layers, so a host hit is usable only if every stage holds its part
of it. SGLang's PP loop makes a blocking all-stage agreement impossible at scheduling time: a later
stage is still waiting for the outputs stage 0 sends after its next scheduling step (seen: stage 0
blocked in an all-reduce, stage 1 in recv_tensor_dict), so values can only flow down the pipeline
(rank_sync: stage 0 decides, isend/recv to the next stage). A later stage therefore cannot veto by
message. Instead stage 0 looks into the later stages' host tiers directly: with PP every stage's
host tier is a SharedHostTier segment (host_tier.shared is implied), and stage 0 attaches to the
later stages' segments at start-up (paths, geometry and key seeds exchanged once over the PP group).
In init_load_back, before any stage allocates or loads, stage 0 computes each later stage's keys
for the pages it is about to load and pins them there if all are present and pass their checksums
(`SharedHostTier.pin_present`); if any stage lacks one, the hit becomes a miss, and that decision
goes down the pipeline. A pinned page cannot be evicted or rewritten by anyone, so the later stage
finds exactly the pages stage 0 counted on; it releases the pins after its load.

Stages on different nodes cannot see each other's shared memory: then host hits are switched off
for the pipeline (stage 0 never pins, so every stage misses alike), with a warning.
"""

from __future__ import annotations

import logging
import socket
import types
from typing import List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


class PipelinePeers:
    def __init__(self, cache, params):
        from ..connector.connector import FlexFlowConnector
        from ..connector.shared_host_tier import SharedHostTier

        self.rank = int(params.pp_rank)
        self.size = int(params.pp_size)
        conn = cache.connector
        host = conn.host
        me = {"host": socket.gethostname(), "path": getattr(host, "path", None),
              "page_words": host.page_words, "word_dtype": str(host.word_dtype).replace("torch.", ""),
              "capacity": host.capacity_pages, "verify": host.verify_checksums, "seed": conn._seed.hex(),
              "page_size": conn.page_size}
        infos: List[Optional[dict]] = [None] * self.size
        # start-up, every stage builds its cache at the same point: a collective is safe here
        torch.distributed.all_gather_object(infos, me, group=params.pp_cache_group)
        self.usable = all(i["host"] == me["host"] and i["path"] for i in infos)
        self.peers: List[Tuple[object, object]] = []  # (SharedHostTier, key chain) per later stage
        if not self.usable:
            logger.warning("flexflow: pipeline stages on different nodes or without shared host tiers (%s): "
                           "host hits are off for this pipeline", [(i["host"], bool(i["path"])) for i in infos])
            return
        if self.rank == 0:
            for info in infos[1:]:
                tier = SharedHostTier(info["page_words"], getattr(torch, info["word_dtype"]), info["capacity"],
                                      verify_checksums=info["verify"], path=info["path"], start_reaper=False)
                chain = types.SimpleNamespace(_seed=bytes.fromhex(info["seed"]), page_size=info["page_size"])
                self.peers.append((tier, chain))
        self._ns = FlexFlowConnector.namespace_seed
        self._chain = FlexFlowConnector.chain_keys
        logger.info("flexflow: PP stage %d of %d; %s", self.rank, self.size,
                    f"checks {len(self.peers)} later stage tier(s) before each host hit" if self.rank == 0
                    else "host hits decided by stage 0 after it pinned this stage's pages")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def pin_for_load(self, hit) -> Optional[list]:
        """Stage 0: pin every later stage's pages [device_len, device_len + hit_len) of `hit`
        (a cache._HostHit); None (nothing pinned) if some stage lacks one of them."""
        if not self.usable:
            return None
        ps = None
        pinned = []
        for tier, chain in self.peers:
            ps = chain.page_size
            npages = (hit.device_len + hit.hit_len) // ps
            seed = self._ns(chain, hit.extra_key, hit.cache_salt, hit.bigram)
            keys = self._chain(chain, seed, hit.tokens, npages, hit.bigram)[hit.device_len // ps:]
            try:
                pages = tier.pin_present(keys)
            except Exception:  # noqa: BLE001 - a broken peer segment is a miss
                logger.exception("flexflow: checking PP stage tier %s failed", getattr(tier, "path", "?"))
                pages = None
            if pages is None:
                self.release(pinned)
                return None
            pinned.append((tier, pages))
        return pinned

    @staticmethod
    def release(pinned) -> None:
        for tier, pages in pinned or ():
            tier.unpin_foreign(pages)

    def close(self) -> None:
        for tier, _ in self.peers:
            try:
                tier.close()
            except Exception:  # noqa: BLE001
                pass
        self.peers = []
