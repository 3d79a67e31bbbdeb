"""The storage tier's batch file creation and publishing (tiers/storage_files.py): the compiled
helpers (csrc/flexflow_sglang/_file_batch.pyx, one GIL release per batch) and their Python twin give
the same files, modes, sizes, stamps and failures, and never leave a descriptor open."""
from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest

from flexflow_sglang.tiers import storage as storage_mod
from flexflow_sglang.tiers.storage import StorageTier
from flexflow_sglang.tiers.storage_files import CREATE_OPEN, CREATE_RESERVE, create_files, publish_files, rows_to_write

try:
    from flexflow_sglang import _file_batch
except ImportError:  # pragma: no cover - FLEXFLOW_REQUIRE_COMPILED=1 (CI) makes this a failure
    _file_batch = None

if os.environ.get("FLEXFLOW_REQUIRE_COMPILED") == "1":
    assert _file_batch is not None, "the _file_batch extension is not built"


def _fallocate(fd, size):
    os.posix_fallocate(fd, 0, size)


@pytest.fixture(params=["compiled", "python"])
def fb(request):
    if request.param == "compiled":
        if _file_batch is None:
            pytest.skip("the _file_batch extension is not built")
        return _file_batch
    return None


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_create_then_publish_gives_owner_only_files_of_the_reserved_size_stamped_in_order(tmp_path, fb):
    before = _open_fds()
    tmps = [f".tmp.{i:032x}.abcd1234" for i in range(5)]
    finals = [f"{i:032x}.kv" for i in range(5)]
    fds, err, step = create_files(fb, str(tmp_path), tmps, 4096, _fallocate)
    assert err is None and step == 0 and len(fds) == 5
    for fd, nm in zip(fds, tmps):
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096 and stat.S_ISREG(st.st_mode)
        assert os.path.samestat(st, os.stat(tmp_path / nm))
        os.pwrite(fd, nm.encode(), 0)
    first = 1_700_000_000_123_456_789
    k, rerr = publish_files(fb, str(tmp_path), fds, tmps, finals, first)
    assert (k, rerr) == (5, None)
    assert sorted(os.listdir(tmp_path)) == finals  # every temp name renamed into place
    for i, nm in enumerate(finals):
        st = os.stat(tmp_path / nm)
        assert st.st_mtime_ns == first + i and stat.S_IMODE(st.st_mode) == 0o600
        assert (tmp_path / nm).read_bytes()[:len(tmps[i])] == tmps[i].encode()
    assert _open_fds() == before  # publish closed every descriptor


def test_create_stops_at_an_existing_name_and_keeps_the_files_before_it(tmp_path, fb):
    (tmp_path / "b").write_bytes(b"someone else's")
    before = _open_fds()
    fds, err, step = create_files(fb, str(tmp_path), ["a", "b", "c"], 64, _fallocate)
    assert len(fds) == 1 and step == CREATE_OPEN and err.errno == errno.EEXIST and err.filename == str(tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == b"someone else's"  # O_EXCL: never truncated
    assert not (tmp_path / "c").exists()
    k, _ = publish_files(fb, str(tmp_path), fds, ["a"], ["A"], -1)
    assert k == 1 and (tmp_path / "A").exists() and _open_fds() == before


def test_create_never_follows_a_link(tmp_path, fb):
    target = tmp_path / "elsewhere"
    os.symlink(target, tmp_path / "x")
    fds, err, step = create_files(fb, str(tmp_path), ["x"], 64, _fallocate)
    assert fds == [] and step == CREATE_OPEN and err.errno == errno.EEXIST and not target.exists()


def test_publish_stops_at_a_failed_rename_and_still_closes_everything(tmp_path, fb):
    before = _open_fds()
    tmps = ["t0", "t1", "t2"]
    fds, err, _ = create_files(fb, str(tmp_path), tmps, 64, _fallocate)
    assert err is None
    (tmp_path / "F1").mkdir()
    (tmp_path / "F1" / "occupied").write_bytes(b"x")  # renaming a file over a non-empty dir fails
    k, rerr = publish_files(fb, str(tmp_path), fds, tmps, ["F0", "F1", "F2"], -1)
    assert k == 1 and rerr.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST) and rerr.filename == str(tmp_path / "t1")
    assert (tmp_path / "F0").is_file() and (tmp_path / "t1").exists() and (tmp_path / "t2").exists()
    assert not (tmp_path / "F2").exists()  # nothing after the failure is renamed
    assert _open_fds() == before


def test_a_failed_reserve_removes_the_file_it_created(tmp_path):
    """The twin's reserve hook fails with ENOSPC: the file it was for is closed and removed."""
    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    before = _open_fds()
    fds, err, step = create_files(None, str(tmp_path), ["a"], 64, full)
    assert fds == [] and step == CREATE_RESERVE and err.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == [] and _open_fds() == before


@pytest.mark.parametrize("compiled", [True, False])
def test_a_tier_whose_directory_vanished_counts_a_failure_and_loses_nothing_else(tmp_path, monkeypatch, compiled):
    if compiled and _file_batch is None:
        pytest.skip("the _file_batch extension is not built")
    if not compiled:
        monkeypatch.setattr(storage_mod, "_fb", None)
    monkeypatch.setattr(storage_mod, "load_nixl", lambda: (None, None, "disabled by test"))
    t = StorageTier(str(tmp_path / "kv"), capacity_gb=0.01)
    keys = [bytes([i]) * 32 for i in range(4)]
    pages = np.arange(4 * 256, dtype=np.uint8).reshape(4, 256)
    assert t.put_many(keys[:2], pages[:2]) == 2
    for nm in os.listdir(t.path):  # the directory (not the tier's lock file) disappears under it
        os.unlink(os.path.join(t.path, nm))
    os.rmdir(t.path)
    assert t.put_many(keys[2:], pages[2:]) == 0  # a miss later, never an exception
    s = t.stats()
    assert s["failures"] >= 1 and s["pages_written"] == 2 and s["used_bytes"] == 2 * (64 + 256)
    t.close()


def test_compiled_write_pages_writes_header_and_payload_and_stops_at_a_failed_write(tmp_path):
    if _file_batch is None:
        pytest.skip("the _file_batch extension is not built")
    hdr = np.arange(3 * 8, dtype=np.uint8).reshape(3, 8)
    data = np.random.default_rng(0).integers(0, 256, size=(3, 40), dtype=np.uint8)
    fds = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"")
        fds.append(os.open(p, os.O_RDONLY if i == 2 else os.O_WRONLY))  # file 2 cannot be written
    try:
        k, err = _file_batch.write_pages(np.asarray(fds, dtype=np.int64), 3, hdr.ctypes.data, 8,
                                         data.ctypes.data, data.strides[0], 40)
    finally:
        for fd in fds:
            os.close(fd)
    assert (k, err) == (2, errno.EBADF)
    for i in range(2):
        assert (tmp_path / f"f{i}").read_bytes() == hdr[i].tobytes() + data[i].tobytes()
    assert (tmp_path / "f2").read_bytes() == b""


def test_rows_to_write_views_one_ascending_run_and_copies_anything_else():
    """put_many's later chunks are one ascending run of rows: written from a view, not a 16 MiB copy;
    rows with gaps (pages the tier already held) are gathered into a contiguous copy."""
    pages = np.arange(10 * 8, dtype=np.uint8).reshape(10, 8)
    run = rows_to_write(pages, [3, 4, 5, 6])
    assert np.shares_memory(run, pages) and run.flags.c_contiguous and np.array_equal(run, pages[3:7])
    for todo in ([3, 5, 6], [6, 5, 4], [2, 2, 3]):
        got = rows_to_write(pages, todo)
        assert not np.shares_memory(got, pages) and got.flags.c_contiguous
        assert np.array_equal(got, pages[todo])
