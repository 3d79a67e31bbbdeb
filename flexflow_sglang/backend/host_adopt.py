"""Canonical KV on insert: a page the host tier holds replaces the request's own recomputation of it.

Why (issue 20, docs/correctness.md "Host hits equal device hits"): SGLang's `checkpoint` inserts a
request's KV into the radix tree and, for every page the tree already holds, frees the request's
own copy and remaps the request to the tree's. So on a plain server the first computation of a page
is canonical: a later request that recomputes it (the last prompt token is always recomputed, and
decode writes the KV of tokens that an earlier request also generated) decodes on from the tree's
copy, not its own. In bf16 the two copies differ in the last bits (one came from a 1000-token
prefill, the other from a 1-token extend), and greedy decoding can flip a token on that difference.

After `/flush_cache` or a device eviction the tree no longer holds those pages, but the host tier
does (it stored the first computation). Without this module, a request served from the host tier
inserts its own recomputation of the pages past its hit, decodes on from it, and leaves it in the
tree for every later request: host hits then drift from the device hits they replace. With it, the
pages the host tier holds past the tree's match are loaded into the request's own slots right before
SGLang inserts them, so the request and the tree continue from the canonical copy, exactly as they
would on a server whose device pool had never lost it.

Safe: the overwritten slots belong to the request alone (past the tree's match, not yet inserted);
only the host tier is read (memory, never a deep tier: no I/O on the scheduler thread); a failed or
corrupt load writes no slot and the request keeps its own, valid, KV. TP/CP ranks agree on the page count.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

logger = logging.getLogger(__name__)

#: pages looked up per step; doubles while the host tier keeps holding them (a request with nothing
#: in the host tier costs one step of hashing)
FIRST_STEP_PAGES = 8


def adopt_host_pages(cache, req, up_to: int) -> int:
    """Before `RadixCache.checkpoint(req, up_to)` of `cache` (a FlexFlowRadixCache): overwrite the request's own KV of the pages past
    the tree's match that the host tier holds (leading run) with the host copies. Returns the pages
    adopted (rank-agreed)."""
    ps = cache.page_size
    conn = cache.connector
    token_ids = req.full_untruncated_fill_ids[:up_to]
    key = RadixKey(token_ids, req.extra_key, is_bigram=cache.is_eagle,
                   cache_salt=req.cache_salt).page_aligned(ps)
    total_pages = len(key) // ps
    # the device tree's current match (no request: no host lookup, no side effects beyond RadixCache's)
    m = RadixCache.match_prefix(cache, MatchPrefixParams(key=key))
    dev = m.device_prefix_len
    first = max(dev, req.kv.cache_protected_len) // ps
    if first >= total_pages:  # nothing past the tree: identical on every rank, no agreement
        return 0
    bigram = key.is_bigram
    raw = key.raw_token_ids()
    node = m.last_device_node
    prev = cache._chain_end(node, key.extra_key, key.cache_salt, bigram) if first * ps == dev else None
    found, keys = 0, []
    if prev is not None:
        extra = 1 if bigram else 0
        step, end = FIRST_STEP_PAGES, first
        while end < total_pages:
            stop = min(total_pages, end + step)
            more = conn.chain_keys(keys[-1] if keys else prev, raw[end * ps: stop * ps + extra], stop - end, bigram)
            keys.extend(more)
            held = conn.lookup(more, deep=False)
            found += held
            if held < len(more):
                break
            end, step = stop, step * 2
    sync = cache.rank_sync
    # TP/CP ranks run this in lockstep: agree so every shard continues from the same computation. Not
    # across PP stages: their agreement is a message stream from stage 0 in scheduling-call order, and
    # checkpoints run on the result path, which a later stage reaches at another point of that stream;
    # a stage that adopts alone still holds valid KV for its own layers.
    if sync.active and getattr(sync, "pp_group", None) is None:
        cache._m["agreements"] += 1
        found = sync.agree_min([found])[0]
    if found <= 0:
        return 0
    row = req.kv.req_pool_idx
    slots = cache.req_to_token_pool.req_to_token[row, first * ps:(first + found) * ps]
    ok = conn.load(keys[:found], slots).ok
    if not ok:  # nothing was written: the request keeps its own (valid) KV for these pages
        cache._m["adopt_failures"] += 1
        logger.debug("flexflow: %d host pages not adopted for request %s (load failed)", found, req.rid)
        return 0
    cache._m["adopted_pages"] += found
    return found
