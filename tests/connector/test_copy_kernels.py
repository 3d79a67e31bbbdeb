"""Compiled fused copy+checksum kernels vs their torch twin: identical bytes, identical sums, and the
checksum catches a flipped bit and swapped words (issue 15 part 2)."""
import pytest
import torch

from flexflow_sglang.connector import KVLayout
from flexflow_sglang.connector import copy_kernels
from flexflow_sglang.connector.copy_kernels import PageCopier, hash_rows, kernels_available, page_hash

pytestmark = pytest.mark.skipif(not kernels_available(), reason="flexflow_sglang._copy_kernels not built")


@pytest.fixture(autouse=True, params=["regular", "streaming"])
def store_kind(request, monkeypatch):
    """Every test here runs with the kernels' regular stores and with their streaming stores (which
    moves larger than the cache take: STREAMING_MIN_BYTES); same bytes, same sums either way."""
    monkeypatch.setattr(copy_kernels, "STREAMING_MIN_BYTES", 0 if request.param == "streaming" else 1 << 62)
    return request.param


def _pool(page_size, layers=3, heads=2, head_dim=8, dtype=torch.float16, mla=False, pages=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = pages * page_size
    mk = lambda: torch.randn((rows, heads, head_dim), generator=g).to(dtype)  # noqa: E731
    bufs = [(mk(),) if mla else (mk(), mk()) for _ in range(layers)]
    return bufs, KVLayout.from_buffers(bufs, page_size, "mla" if mla else "mha")


@pytest.mark.parametrize("page_size,dtype,mla", [(1, torch.float16, False), (4, torch.bfloat16, False),
                                                  (16, torch.float32, False), (4, torch.float16, True)])
def test_gather_and_scatter_match_the_twin(page_size, dtype, mla):
    bufs, layout = _pool(page_size, dtype=dtype, mla=mla)
    cp = PageCopier(layout)
    assert cp.compiled and cp.hashable
    dev = torch.tensor([7, 2, 5, 3, 9])
    host_pages = [4, 0, 1, 6, 2]
    a = torch.zeros((8, layout.page_words), dtype=layout.word_dtype)
    b = torch.zeros_like(a)
    sa = cp.gather(dev, a, host_pages)
    sb = cp.gather_twin(dev, b, host_pages)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    assert torch.equal(hash_rows(a, host_pages), sa) and torch.equal(page_hash(a[host_pages]), sa)
    assert len(set(sa.tolist())) == len(host_pages)  # distinct pages, distinct hashes
    # load back into other pages with both paths: same device bytes, checksums pass
    before = [[t.clone() for t in layer] for layer in bufs]
    assert cp.scatter(a, host_pages, [1, 8, 10, 11, 0], expect=sa) == -1
    got = [[t.clone() for t in layer] for layer in bufs]
    for layer, orig in zip(bufs, before):
        for t, o in zip(layer, orig):
            t.copy_(o)
    assert cp.scatter_twin(a, host_pages, [1, 8, 10, 11, 0], expect=sa) == -1
    for layer, g in zip(bufs, got):
        for t, x in zip(layer, g):
            assert torch.equal(t.view(torch.uint8), x.view(torch.uint8))
    ps = page_size
    for layer in bufs:  # the loaded pages equal the stored ones
        for t in layer:
            for s, d in zip(dev.tolist(), [1, 8, 10, 11, 0]):
                assert torch.equal(t[s * ps:(s + 1) * ps].view(torch.uint8), t[d * ps:(d + 1) * ps].view(torch.uint8))


def test_checksum_catches_a_flipped_bit_and_swapped_words():
    bufs, layout = _pool(4)
    cp = PageCopier(layout)
    host = torch.zeros((6, layout.page_words), dtype=layout.word_dtype)
    sums = cp.gather(torch.tensor([1, 2, 3]), host, [0, 1, 2])
    w64 = host.view(torch.int64)
    for mutate in ("flip", "swap", "swap_segments"):
        h = host.clone()
        v = h.view(torch.int64)
        if mutate == "flip":
            v[1, 5] ^= 1 << 17
        elif mutate == "swap":
            v[1, 3], v[1, 9] = w64[1, 9].clone(), w64[1, 3].clone()
            assert not torch.equal(v[1], w64[1])
        else:  # K and V segments of layer 0 exchanged: same words, other positions
            n = layout.seg_words[0] * h.element_size() // 8
            v[1, :n], v[1, n:2 * n] = w64[1, n:2 * n].clone(), w64[1, :n].clone()
        assert cp.scatter(h, [0, 1, 2], [4, 5, 6], expect=sums) == 1, mutate
        assert cp.scatter_twin(h, [0, 1, 2], [4, 5, 6], expect=sums) == 1, mutate
    # the old wrapping word sum could not see a swap
    h = host.clone().view(torch.int64)
    h[2, 0], h[2, 1] = w64[2, 1].clone(), w64[2, 0].clone()
    assert h[2].sum() == w64[2].sum() and not torch.equal(page_hash(h.view(host.dtype)[2:3]), sums[2:3])


def test_no_sums_and_bad_indices():
    _, layout = _pool(1)
    cp = PageCopier(layout)
    host = torch.zeros((4, layout.page_words), dtype=layout.word_dtype)
    assert cp.gather(torch.tensor([1, 2]), host, [0, 3], with_sums=False) is None
    assert cp.scatter(host, [0, 3], torch.tensor([5, 6])) == -1
    with pytest.raises(IndexError, match="host page"):
        cp.gather(torch.tensor([1]), host, [4])
    with pytest.raises(IndexError, match="device page"):
        cp.scatter(host, [0], torch.tensor([layout.num_device_pages]))
    with pytest.raises(ValueError, match="differ in length|device pages for"):
        cp.gather(torch.tensor([1, 2]), host, [0])
    # a host buffer the kernels cannot address goes to the twin, same result
    odd = torch.zeros((4, layout.page_words), dtype=layout.word_dtype).t().contiguous().t()
    assert not cp.usable(odd, True)
    s1 = cp.gather(torch.tensor([1, 2]), odd, [0, 3])
    assert torch.equal(s1, cp.gather(torch.tensor([1, 2]), host, [0, 3]))


def test_bench_kernels_small():
    from flexflow_sglang.tools.bench.host_tier_bench import kernel_run
    res = kernel_run(num_tokens=64, layers=2, heads=2, head_dim=16, page_sizes=(1, 16), repeats=1, progress=False)
    assert res["kernels_compiled"] and set(res["page_sizes"]) == {"1", "16"}
    for m in res["page_sizes"].values():
        assert m["compiled"] and m["roundtrip_equal"] and m["store_ratio"] >= 0 and m["twin_load_ratio"] >= 0


def test_pages_in_any_order_report_in_the_callers_order():
    """The kernels walk pages in device-slot order (faster on scattered slots); sums and the first bad
    page still come back in the order the caller gave the pages."""
    bufs, layout = _pool(1, pages=16)
    cp = PageCopier(layout)
    host = torch.zeros((8, layout.page_words), dtype=layout.word_dtype)
    dev, rows = [9, 3, 14, 1, 6], [2, 7, 0, 5, 1]
    sums = cp.gather(torch.tensor(dev), host, rows)
    assert torch.equal(sums, hash_rows(host, rows))  # sums[i] is the hash of page i as given
    twin = torch.zeros_like(host)
    assert torch.equal(cp.gather_twin(torch.tensor(dev), twin, rows), sums) and torch.equal(twin, host)
    h = host.clone()
    h.view(torch.int64)[rows[3], 0] ^= 1  # pages 3 (device slot 1, walked first) and 1 corrupt
    h.view(torch.int64)[rows[1], 2] ^= 1
    assert cp.scatter(h, rows, torch.tensor([4, 12, 2, 8, 11]), expect=sums) == 1
    assert cp.scatter_twin(h, rows, torch.tensor([4, 12, 2, 8, 11]), expect=sums) == 1
    assert cp.scatter(host, rows, torch.tensor([4, 12, 2, 8, 11]), expect=sums) == -1
    for layer in bufs:  # and every page landed where its caller sent it
        for t in layer:
            for s, d in zip(dev, [4, 12, 2, 8, 11]):
                assert torch.equal(t[s].view(torch.uint8), t[d].view(torch.uint8))


def test_streaming_and_regular_stores_give_the_same_bytes_and_sums(store_kind):
    """The raw kernels with nt on and off, one source: identical rows, sums and device pages."""
    from flexflow_sglang import _copy_kernels as ck
    import numpy as np
    bufs, layout = _pool(1, layers=2, heads=4, head_dim=16, dtype=torch.float32, pages=40)
    cp = PageCopier(layout)
    dev = np.array([17, 3, 29, 8, 11, 36], dtype=np.int64)
    rows = np.array([5, 0, 3, 1, 4, 2], dtype=np.int64)
    out = {}
    for nt in (False, True):
        host = torch.zeros((6, layout.page_words), dtype=layout.word_dtype)
        sums = np.empty(6, dtype=np.int64)
        ck.gather(cp._seg_ptr, cp._seg_stride, cp._seg_nbytes, dev, host.data_ptr(), layout.page_nbytes, rows,
                  sums, 2, nt)
        out[nt] = (host, sums)
    assert torch.equal(out[False][0], out[True][0]) and (out[False][1] == out[True][1]).all()
    host, sums = out[True]
    flags = np.zeros(6, dtype=np.uint8)
    dst = np.array([20, 21, 22, 23, 24, 25], dtype=np.int64)
    assert ck.scatter(host.data_ptr(), layout.page_nbytes, rows, cp._seg_ptr, cp._seg_stride, cp._seg_nbytes,
                      dst, sums, 2, flags, True) == -1
    for layer in bufs:
        for t in layer:
            assert torch.equal(t[torch.from_numpy(dev)], t[torch.from_numpy(dst)])
    host.view(torch.int64)[rows[4], 1] ^= 1 << 40  # page 4 corrupt: caught on the streaming path too
    assert ck.scatter(host.data_ptr(), layout.page_nbytes, rows, cp._seg_ptr, cp._seg_stride, cp._seg_nbytes,
                      dst, sums, 2, flags, True) == 4
