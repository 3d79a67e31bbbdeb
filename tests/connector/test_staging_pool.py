"""StagingPool: a buffer is handed out again only when no tensor, view or numpy array of it is
alive; the pool stays within its byte cap; with torch's use count missing it allocates every time."""

from __future__ import annotations

import gc

import pytest
import torch

from flexflow_sglang.connector import staging as staging_mod
from flexflow_sglang.connector.staging import StagingPool

pytestmark = pytest.mark.skipif(staging_mod._use_count is None, reason="torch without _storage_Use_Count")


def _pool(cap_pages=64, min_pages=8):
    return StagingPool(page_words=32, word_dtype=torch.float32, cap_bytes=cap_pages * 128, min_pages=min_pages)


def test_a_dropped_buffer_is_reused_and_a_held_one_never():
    p = _pool()
    a = p.take(5)
    assert a.shape == (5, 32) and p.stats()["staging_allocated"] == 1
    b = p.take(5)  # a is held: a second buffer
    assert b.data_ptr() != a.data_ptr() and p.stats()["staging_allocated"] == 2
    ptr = a.data_ptr()
    del a
    gc.collect()
    c = p.take(3)
    assert c.data_ptr() == ptr and p.stats()["staging_reused"] == 1


@pytest.mark.parametrize("keep", ["slice", "uint8_view", "numpy"])
def test_any_view_of_a_buffer_keeps_it_in_use(keep):
    p = _pool()
    a = p.take(8)
    held = {"slice": lambda t: t[2:4], "uint8_view": lambda t: t.view(torch.uint8),
            "numpy": lambda t: t.numpy()}[keep](a)
    ptr = a.data_ptr()
    del a
    b = p.take(8)
    assert b.data_ptr() != ptr  # what `held` reads or writes is never handed to another job
    del held, b
    gc.collect()
    assert p.take(8).data_ptr() in (ptr, p._bufs[1].data_ptr())


def test_the_pool_stays_within_its_cap_and_outgrown_buffers_make_room():
    p = _pool(cap_pages=64, min_pages=8)
    a = p.take(8)
    del a
    big = p.take(60)  # 8 + 60 > 64: the free 8-row buffer is dropped to make room
    assert p.stats()["staging_pool_bytes"] == 60 * 128 and p.stats()["staging_pool_buffers"] == 1
    over = p.take(10)  # the 60-row buffer is held and 60 + 10 > 64: unpooled
    assert p.stats()["staging_unpooled"] == 1 and p.stats()["staging_pool_bytes"] <= 64 * 128
    assert over.shape == (10, 32) and big.shape == (60, 32)


def test_without_the_use_count_every_take_allocates(monkeypatch):
    monkeypatch.setattr(staging_mod, "_use_count", None)
    monkeypatch.setattr(staging_mod, "_free", lambda b: False)
    p = _pool()
    assert p.cap_bytes == 0
    a = p.take(4)
    del a
    p.take(4)
    assert p.stats()["staging_unpooled"] == 2 and p.stats()["staging_pool_buffers"] == 0
