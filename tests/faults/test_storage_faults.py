"""Odd entries in the storage directory: only regular files of ours are pages; nothing blocks, nothing
takes the tier down; loose modes are tightened (or refused read-only); read-only and fsync modes."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading

import numpy as np
import pytest

from flexflow_sglang.tiers import storage as storage_mod
from flexflow_sglang.tiers.storage import StorageTier, StorageTierError

from fault_helpers import keys_for, pages_for
from tier_helpers import requires_nixl

pytestmark = pytest.mark.timeout(60)
P = 4096 + 64


def bounded(fn, limit_s=5.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks past limit_s."""
    out = {}

    def run():
        try:
            out["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            out["e"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"blocked for more than {limit_s} s"
    if "e" in out:
        raise out["e"]
    return out["v"]


def make(path, **kw):
    kw.setdefault("capacity_gb", 0.05)
    kw.setdefault("fingerprint", "faults")
    return StorageTier(str(path), **kw)


def page_name(t, key):
    return t._name(key)


def stored(tmp_path, n=3):
    d = tmp_path / "kv"
    t = make(d)
    ks, pg = keys_for(n), pages_for(n, P)
    assert t.put_many(ks, pg) == n
    return d, t, ks, pg


def test_directory_named_like_a_page(tmp_path):
    d, t, ks, pg = stored(tmp_path)
    t.close()
    (d / ("ab" * 16 + ".kv")).mkdir()
    t = bounded(lambda: make(d))
    st = t.stats()
    assert st["odd_skipped"] == 1 and st["pages"] == 3
    assert (d / ("ab" * 16 + ".kv")).is_dir()  # not ours to delete
    out = np.zeros_like(pg)
    assert t.get_many_into(ks, out) == 3 and np.array_equal(out, pg)
    t.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "socket"])
def test_special_files_named_like_pages_at_start(tmp_path, kind):
    d, t, ks, pg = stored(tmp_path)
    t.close()
    odd = d / ("cd" * 16 + ".kv")
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "symlink":
        os.symlink(d / page_name(t, ks[0]), odd)  # a link to a real page: still not followed
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(odd))
        s.close()
    t = bounded(lambda: make(d))
    assert t.stats()["odd_skipped"] == 1 and t.stats()["pages"] == 3
    assert os.path.lexists(odd)
    t.close()


@pytest.fixture(params=["compiled", "python"])
def file_calls(request, monkeypatch):
    """The per-file system calls of a read batch: compiled (_file_batch, GIL released once) or their
    Python twin (no build); both must treat every odd entry the same way."""
    if request.param == "python":
        monkeypatch.setattr(storage_mod, "_fb", None)
    elif storage_mod._fb is None:
        pytest.skip("compiled _file_batch not built")
    return request.param


def test_fifo_swapped_in_for_a_stored_page_does_not_block(tmp_path, file_calls):
    d, t, ks, pg = stored(tmp_path, 4)
    victim = d / page_name(t, ks[2])
    victim.unlink()
    os.mkfifo(victim)
    out = np.zeros_like(pg)
    assert bounded(lambda: t.get_many_into(ks, out)) == 2  # leading pages up to the FIFO
    assert np.array_equal(out[:2], pg[:2])
    assert t.stats()["odd_skipped"] == 1 and stat.S_ISFIFO(os.lstat(victim).st_mode)
    assert t.contains_prefix(ks) == 2  # forgotten: the tier stays up and serves the rest
    # a directory swapped in the same way
    v2 = d / page_name(t, ks[1])
    v2.unlink()
    v2.mkdir()
    assert bounded(lambda: t.get_many_into(ks, out)) == 1
    t.close()


@pytest.mark.nixl
@requires_nixl
def test_fifo_at_start_of_tier_server(tmp_path, tier_server):
    """`flexflow tier-server --storage-path` with a FIFO and a directory named like pages starts."""
    d = tmp_path / "srvkv"
    d.mkdir(mode=0o700)
    os.mkfifo(d / ("ef" * 16 + ".kv"))
    (d / ("01" * 16 + ".kv")).mkdir()
    (d / (".tmp." + "23" * 16 + ".x")).mkdir()  # a directory named like a temp file: left alone
    srv = tier_server("--storage-path", str(d), "--page-nbytes", "4096", wait_s=20)
    assert srv.alive()
    assert "skipping" in open(srv.log).read()


def test_loose_mode_is_tightened_and_said(tmp_path, caplog):
    d, t, ks, pg = stored(tmp_path)
    t.close()
    f = d / page_name(t, ks[1])
    os.chmod(f, 0o644)
    with caplog.at_level("WARNING", logger="flexflow_sglang.tiers.storage"):
        t = make(d)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert t.stats()["modes_tightened"] == 1 and "0600" in caplog.text
    assert t.get_many_into(ks, np.zeros_like(pg)) == 3
    t.close()


def test_read_only_mode_writes_nothing(tmp_path):
    d, t, ks, pg = stored(tmp_path)
    t.close()
    bad = d / page_name(t, ks[2])
    with open(bad, "r+b") as fh:  # corrupt one payload: read-only mode must not delete it
        fh.seek(200)
        fh.write(b"\xff" * 8)
    (d / (".tmp." + "45" * 16 + ".ab")).write_bytes(b"partial")
    loose = d / page_name(t, ks[1])
    os.chmod(loose, 0o640)
    before = sorted(os.listdir(d))
    mtimes = {n: os.stat(d / n).st_mtime_ns for n in before}
    ro = make(d, read_only=True)
    assert ro.stats()["read_only"] is True
    assert ro.stats()["odd_skipped"] == 1  # the loose file is refused, not chmod'ed
    out = np.zeros_like(pg)
    assert ro.get_many_into(ks, out) == 1 and np.array_equal(out[0], pg[0])
    more = keys_for(2, b"new")
    assert ro.put_many(more, pages_for(2, P, 9)) == 0 and ro.stats()["read_only_skipped"] == 2
    ro.discard(ks[:1])
    ro.close()
    assert sorted(os.listdir(d)) == before
    assert {n: os.stat(d / n).st_mtime_ns for n in before} == mtimes
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o640


def test_read_only_shares_with_readers_but_not_a_writer(tmp_path):
    d, t, ks, pg = stored(tmp_path)
    with pytest.raises(StorageTierError, match="written by another process"):
        make(d, read_only=True)
    t.close()
    a, b = make(d, read_only=True), make(d, read_only=True)  # two readers: fine
    with pytest.raises(StorageTierError, match="in use"):
        make(d)
    a.close()
    b.close()


def test_missing_dir_in_read_only_mode_is_one_clear_error(tmp_path):
    with pytest.raises(StorageTierError, match="read-only"):
        make(tmp_path / "absent", read_only=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts a read-only tmpfs)")
def test_read_only_filesystem(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        t = make(mnt / "kv")
        ks, pg = keys_for(2), pages_for(2, P)
        assert t.put_many(ks, pg) == 2
        t.close()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(StorageTierError, match="read_only: true"):
            make(mnt / "kv")
        ro = make(mnt / "kv", read_only=True)
        out = np.zeros_like(pg)
        assert ro.get_many_into(ks, out) == 2 and np.array_equal(out, pg)
        assert ro.put_many(keys_for(1, b"x"), pg[:1]) == 0
        ro.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")
def test_file_of_another_uid_is_skipped(tmp_path):
    d, t, ks, pg = stored(tmp_path)
    t.close()
    f = d / page_name(t, ks[0])
    os.chown(f, 65534, 65534)
    t = make(d)
    assert t.stats()["odd_skipped"] == 1 and t.contains_prefix(ks) == 0
    assert f.exists()
    t.close()


def test_fsync_mode_syncs_files_and_directory(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(storage_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    t = make(tmp_path / "kv", fsync=True)
    ks, pg = keys_for(3), pages_for(3, P)
    assert t.put_many(ks, pg) == 3
    assert len(calls) == 4 and t.stats()["fsyncs"] == 4  # 3 files + the directory, before put_many returns
    t.close()
    calls.clear()
    t = make(tmp_path / "kv2")
    t.put_many(ks, pg)
    assert calls == []  # the default promise: rename without fsync
    t.close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")
def test_file_of_another_uid_swapped_in_while_running_ends_the_read(tmp_path, file_calls):
    d, t, ks, pg = stored(tmp_path, 4)
    f = d / page_name(t, ks[1])
    os.chown(f, 65534, 65534)
    out = np.zeros_like(pg)
    assert bounded(lambda: t.get_many_into(ks, out)) == 1 and np.array_equal(out[:1], pg[:1])
    assert t.stats()["odd_skipped"] == 1 and f.exists()  # skipped and left alone, never read
    t.close()


def test_symlink_swapped_in_is_never_followed(tmp_path, file_calls):
    d, t, ks, pg = stored(tmp_path, 3)
    target = tmp_path / "elsewhere.kv"
    os.replace(d / page_name(t, ks[0]), target)  # a valid page file, moved out of the tier
    os.symlink(target, d / page_name(t, ks[0]))
    out = np.zeros_like(pg)
    assert bounded(lambda: t.get_many_into(ks, out)) == 0  # O_NOFOLLOW: the link is not a page
    assert target.exists() and not out.any()
    t.close()
