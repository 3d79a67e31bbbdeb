"""page_checksums: one compiled call for many pages must give zlib's CRC32 (the tiers' wire and
file format) for every row, row subset and page size, and fall back to zlib where it cannot apply."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from flexflow_sglang.tiers import base


def _zlib(a, rows):
    return [zlib.crc32(a[i].tobytes()) & 0xFFFFFFFF for i in rows]


@pytest.mark.parametrize("page_bytes", [1, 96, 23040, 300 << 10])  # below and above the parallel threshold
def test_native_crc_equals_zlib_for_all_and_selected_rows(page_bytes):
    rng = np.random.default_rng(page_bytes)
    a = rng.integers(0, 256, (9, page_bytes), dtype=np.uint8)
    assert base.page_checksums(a, 9) == _zlib(a, range(9))
    assert base.page_checksums(a, 3, [8, 0, 4]) == _zlib(a, [8, 0, 4])
    assert base.page_checksums(a, 0) == []


def test_native_crc_is_active_where_the_kernels_are_built():
    try:
        from flexflow_sglang import _copy_kernels  # noqa: F401
    except ImportError:
        pytest.skip("compiled kernels not built")
    ck, addr = base._native_crc32()
    assert ck is not None and addr != 0


def test_a_flipped_bit_changes_the_sum():
    a = np.zeros((2, 4096), dtype=np.uint8)
    before = base.page_checksums(a, 2)
    a[1, 1234] ^= 0x10
    after = base.page_checksums(a, 2)
    assert after[0] == before[0] and after[1] != before[1]


def test_rows_out_of_range_are_refused_not_read():
    a = np.zeros((4, 64), dtype=np.uint8)
    if base._native_crc32()[0] is None:
        pytest.skip("compiled kernels not built (zlib path indexes numpy, which raises itself)")
    with pytest.raises(IndexError, match="row out of range"):
        base.page_checksums(a, 1, [4])
    with pytest.raises(IndexError, match="row out of range"):
        base.page_checksums(a, 1, [-1])


def test_strided_pages_fall_back_to_zlib():
    rng = np.random.default_rng(7)
    wide = rng.integers(0, 256, (5, 256), dtype=np.uint8)
    view = wide[:, ::2]  # rows not contiguous: the compiled call cannot take them
    assert base.page_checksums(view, 5) == [zlib.crc32(np.ascontiguousarray(r)) & 0xFFFFFFFF for r in view]


# ---- the 64-bit page hash (CHECKSUM_HASH64): the storage tier's payload checksum ----

@pytest.mark.parametrize("page_bytes", [32, 4096, 4096 + 123, 128 << 10])  # kernel sizes and one for the twin only
def test_page_digests_equal_the_twin_for_all_selected_and_strided_rows(page_bytes):
    rng = np.random.default_rng(page_bytes)
    buf = rng.integers(0, 256, (7, page_bytes + 64), dtype=np.uint8)
    a = buf[:, 64:]  # rows whose stride is not their length (a header before each page)
    want = [int(v) for v in base.hash64_twin(np.ascontiguousarray(a))]
    assert base.page_digests(a, 7) == want
    assert base.page_digests(a, 3, [6, 0, 3]) == [want[6], want[0], want[3]]
    assert base.page_digests(np.ascontiguousarray(a), 7) == want
    assert base.page_digests(a, 0) == []
    with pytest.raises(IndexError):
        base.page_digests(a, 1, [7])


def test_the_compiled_page_hash_is_used_where_built():
    if base._ck is None:
        pytest.skip("compiled kernels not built")
    assert hasattr(base._ck, "hash_rows")


@pytest.mark.parametrize("page_bytes", [4096, 4096 + 123])
def test_a_flipped_bit_or_two_swapped_words_change_the_digest(page_bytes):
    a = np.random.default_rng(1).integers(0, 256, (3, page_bytes), dtype=np.uint8)
    before = base.page_digests(a, 3)
    a[1, 1234] ^= 0x10
    w = a[2, :4096].view(np.uint64)
    w[[5, 9]] = w[[9, 5]]  # same lane (5 and 9 are both lane 1): only the weighted sums can see it
    w[[100, 101]] = w[[101, 100]]  # neighbouring lanes
    after = base.page_digests(a, 3)
    assert after[0] == before[0] and after[1] != before[1] and after[2] != before[2]


def test_payload_checksums_verify_each_row_by_its_algorithm():
    a = np.random.default_rng(2).integers(0, 256, (4, 4096), dtype=np.uint8)
    got = base.payload_checksums(a, [base.CHECKSUM_CRC32, base.CHECKSUM_HASH64, 0, base.CHECKSUM_HASH64])
    assert got[0] == _zlib(a, [0])[0]
    assert got[1] == base.page_digests(a, 1, [1])[0] and got[3] == base.page_digests(a, 1, [3])[0]
    assert got[2] is None  # an unknown algorithm never verifies
