"""Canonical KV on insert (backend/host_adopt.py): after a flush, a request served from the host tier
continues from the host's copy of the pages it recomputes, as it would from the device tree.

The fake forward here writes *different* bytes when it recomputes a page (as bf16 does: a 1-token
extend rounds differently from the prefill that first computed the token), so the test can tell the
request's own copy from the canonical one.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from ffcache_env import make_env, serve

pytestmark = pytest.mark.filterwarnings("ignore")


def _perturbing(env):
    """env.write_kv that adds 1.0 to every row it writes: a 'recomputation' that differs in value."""
    orig = env.write_kv

    def write(ids, slots, start):
        orig(ids, slots, start)
        for bufs in env.buffers():
            for buf in bufs:
                buf[slots.long()] += 1.0

    return write


def _flush(env):
    """Scheduler.flush_cache: tree reset, then the pools are cleared."""
    env.tree.reset()
    env.req_pool.clear()
    env.alloc.clear()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("adopt", [True, False])
def test_recomputed_pages_take_the_host_copy(page_size, adopt, monkeypatch):
    env = make_env(page_size=page_size, size=128, dtype=torch.bfloat16)
    try:
        ids = list(range(3, 3 + 6 * page_size))  # whole pages: the last page is recomputed (key limit)
        first = serve(env, "a", ids)
        assert first.prefix_len == 0 and env.connector.host.used_pages == len(ids) // page_size
        _flush(env)  # the device tree is empty, the host tier keeps every page
        if not adopt:  # the behaviour before the fix: the request keeps its own recomputation
            monkeypatch.setattr("flexflow_sglang.backend.cache.adopt_host_pages", lambda *a, **k: 0)
        env.write_kv = _perturbing(env)
        second = serve(env, "b", ids)
        # the host hit covers every page but the last (SGLang always recomputes the last token)
        assert second.loaded == len(ids) - page_size and second.kv_ok
        m = env.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        path = env.tree.path_device_indices(m.last_device_node)
        assert len(path) == len(ids)
        # the tree now holds, for every page, the first computation (canonical) or the recomputation
        assert env.check_kv(ids, path) is adopt
        assert env.tree.metrics()["adopted_pages"] == (1 if adopt else 0)
        assert env.idle_ok()
    finally:
        env.close()


def test_adoption_failure_keeps_the_request_s_own_kv(monkeypatch):
    """A corrupt host page is not adopted: the request keeps its (valid) own KV, nothing leaks."""
    env = make_env(page_size=1, size=64, dtype=torch.bfloat16)
    try:
        ids = list(range(5, 17))
        serve(env, "a", ids)
        _flush(env)
        host = env.connector.host
        page = host.page_of(env.connector.page_keys(ids)[-1])
        host.words[page].add_(1)  # the last page (the one the request will recompute) is corrupt
        env.write_kv = _perturbing(env)
        second = serve(env, "b", ids)
        assert second.loaded == len(ids) - 1 and second.kv_ok
        m = env.tree.metrics()
        assert m["adopted_pages"] == 0 and m["adopt_failures"] == 1
        assert env.idle_ok()
    finally:
        env.close()
