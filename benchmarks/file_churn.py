"""What a page file costs the file system, beside writing the same bytes into an existing file.

    python benchmarks/file_churn.py [--dir DIR] [--files 2000] [--page-kib 128] [--out runs/file_churn]

The storage tier's files layout stores each page as its own file (create with O_EXCL, fallocate,
write header + payload, rename into place); the slab layout writes the page into a slot of a
preallocated file (tiers/storage_slabs.py). This measures the process CPU per page, in one run and
in this order, on the file system under --dir:

1. `as_found`: --files page files created the files layout's way, in a new directory, with the file
   system as it is;
2. `after_deleting`: the same again in another new directory right after deleting the first one's
   files (what an evicting files-layout tier, or the cleanup of an earlier run, leaves behind: on
   ext4 without a journal the inode allocator then walks the recently freed inodes);
3. `slot_writes`: the same bytes written page by page at increasing offsets of one preallocated file
   (the slab layout's write, without its header bookkeeping).

Ratios are CPU per page over `slot_writes`. The page files of step 2 are removed at the end. Writes
<out>/file_churn.json. Figures depend on the file system and on what ran on it in the last minutes:
run it where the storage tier lives, and compare within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from tqdm import tqdm

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _page_files(d: str, n: int, page: bytes, what: str) -> float:
    """CPU seconds per page to store n pages as page files under d (temp file, fallocate, write,
    rename, close), as the files layout does."""
    os.makedirs(d, mode=0o700)
    c0 = time.process_time()
    for i in tqdm(range(n), desc=what, unit="file", leave=False):
        tmp, final = os.path.join(d, f".tmp.{i:032x}"), os.path.join(d, f"{i:032x}.kv")
        fd = os.open(tmp, _FLAGS, 0o600)
        try:
            os.posix_fallocate(fd, 0, len(page))
            os.pwrite(fd, page, 0)
            os.rename(tmp, final)
        finally:
            os.close(fd)
    return (time.process_time() - c0) / n


def _slot_writes(path: str, n: int, page: bytes) -> float:
    """CPU seconds per page to write n pages at increasing offsets of one preallocated file."""
    fd = os.open(path, _FLAGS, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * len(page))
        c0 = time.process_time()
        for i in tqdm(range(n), desc="slot writes", unit="page", leave=False):
            os.pwrite(fd, page, i * len(page))
        return (time.process_time() - c0) / n
    finally:
        os.close(fd)


def _journal(path: str) -> str:
    """The file system under `path` (type, mount options) and, for ext4, whether it keeps a journal
    (a jbd2 entry in /proc): without one, ext4's inode allocator skips recently freed inodes one by
    one (best effort; "unknown" where findmnt is missing)."""
    try:
        out = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "--target", path], capture_output=True,
                             text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if len(out) < 3:
        return "unknown"
    src, fstype, opts = out[0], out[1], out[2]
    desc = f"{fstype} ({src}, {opts})"
    if fstype == "ext4" and os.path.isdir("/proc/fs/jbd2"):
        dev = os.path.basename(src)
        journal = any(e.startswith(dev + "-") for e in os.listdir("/proc/fs/jbd2"))
        desc += ", journal" if journal else ", no journal"
    return desc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="parent directory on the file system to measure (default: $TMPDIR)")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--page-kib", type=int, default=128)
    ap.add_argument("--out", default="runs/file_churn")
    a = ap.parse_args(argv)
    if a.files < 1 or a.page_kib < 1:
        ap.error("--files and --page-kib must be positive")
    import tempfile
    os.makedirs(a.out, exist_ok=True)
    page = os.urandom(a.page_kib * 1024 + 64)  # header + payload, as a page file holds
    root = tempfile.mkdtemp(prefix="file-churn-", dir=a.dir)
    try:
        as_found = _page_files(os.path.join(root, "a"), a.files, page, "page files (as found)")
        shutil.rmtree(os.path.join(root, "a"))
        after = _page_files(os.path.join(root, "b"), a.files, page, "page files (after deleting)")
        slot = _slot_writes(os.path.join(root, "slab"), a.files, page)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    res = {"command": "python benchmarks/file_churn.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit or "unknown",
           "files": a.files, "page_bytes": len(page), "file_system": _journal(a.dir or tempfile.gettempdir()),
           "cpu_us_per_page": {"as_found": as_found * 1e6, "after_deleting": after * 1e6, "slot_writes": slot * 1e6},
           "over_slot_writes": {"as_found": as_found / max(slot, 1e-9), "after_deleting": after / max(slot, 1e-9)}}
    with open(os.path.join(a.out, "file_churn.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
