"""The storage tier's directory: created owner-only, checked, and locked by one writer at a time
(flock on <path>/.lock), or opened read-only under a shared lock. Both layouts (page files and slabs)
start here (tiers/storage.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import stat as _stat

from ..errors import FlexFlowError
from .storage_files import _open_regular

log = logging.getLogger("flexflow_sglang.tiers.storage")


class StorageTierError(FlexFlowError):
    """The storage directory cannot be used (owned by someone else, locked by another process)."""


def prepare_dir(path: str) -> int:
    """Create `path` (0700) or check it is a directory of ours, tighten its mode, and take the
    writer's exclusive lock. Returns the lock file's descriptor (held for the tier's life)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise StorageTierError(f"storage tier directory {path}: cannot create it ({e.strerror}); "
                               "for a read-only copy set storage_tier.read_only: true") from None
    st = os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise StorageTierError(f"storage tier path {path} is not a directory")
    if st.st_uid != os.getuid():
        raise StorageTierError(f"storage tier directory {path} is owned by uid {st.st_uid}, not {os.getuid()}")
    try:
        if st.st_mode & 0o077:
            log.warning("storage tier directory %s had mode %o; setting 0700", path, st.st_mode & 0o777)
            os.chmod(path, 0o700)
        lock_fd = os.open(os.path.join(path, ".lock"),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        raise StorageTierError(f"storage tier directory {path} is not writable ({e.strerror}); "
                               "to serve its pages without writing set storage_tier.read_only: true") from None
    return _locked(lock_fd, fcntl.LOCK_EX, f"storage tier directory {path} is in use by another process")


def prepare_dir_read_only(path: str) -> int:
    """Read-only: the directory must exist; nothing is created or changed. A shared lock on an
    existing .lock keeps a writer from starting beside us (and us beside a writer). Returns the
    lock's descriptor, or -1 when there is no lock file (e.g. a copy on read-only media)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StorageTierError(f"storage tier directory {path} (read-only): {e.strerror}") from None
    if not _stat.S_ISDIR(st.st_mode):
        raise StorageTierError(f"storage tier path {path} is not a directory")
    if st.st_mode & 0o077:
        log.warning("storage tier directory %s (read-only) has mode %o: other users can see its "
                    "files; read-only mode does not change it", path, st.st_mode & 0o777)
    fd, _ = _open_regular(os.path.join(path, ".lock"))
    if fd is None:
        return -1  # nobody writes here
    return _locked(fd, fcntl.LOCK_SH, f"storage tier directory {path} is being written by another process")


def _locked(fd: int, mode: int, busy: str) -> int:
    """`fd` under flock `mode`, without waiting; closed and StorageTierError(busy) if another holds it."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StorageTierError(busy) from None
    return fd
