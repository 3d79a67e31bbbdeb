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
