"""The storage tier's files: the page header format, page file names and the one safe way to open
an entry (docs/tiers.md). Split from storage.py, which keeps the index, the I/O and the policies.

Header (little-endian, 64 bytes):
  magic "FFKV" | u16 version | u16 header_len=64 | u32 checksum algo | u64 page_nbytes |
  16s fingerprint hash | 16s name id | 8s payload checksum | u32 CRC32(header[:60])
Payload checksum: algo 2 (written since the 64-bit page hash replaced CRC32 here) is the host tier's
page hash, u64; algo 1 is zlib's CRC32 in the first 4 bytes. Reads verify either, so files written
before the change stay readable; an older build drops algo-2 files as corrupt (a miss, never a wrong
page).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat as _stat
import struct
from typing import Callable, List, Optional, Tuple

import numpy as np

from .base import CHECKSUM_CRC32, CHECKSUM_HASH64, page_checksum

log = logging.getLogger("flexflow_sglang.tiers.storage")

MAGIC = b"FFKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHIQ16s16s8sI")
HDR = HEADER.size  # 64
assert HDR == 64
_NAME_RE = re.compile(r"^[0-9a-f]{32}\.kv$")
# every open of an entry: never follow a link, never block (a FIFO opened O_RDONLY would wait for a writer)
_RD_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_regular(path: str) -> Tuple[Optional[int], str]:
    """(fd, "") of a regular file, else (None, why). Never blocks, never follows a link."""
    try:
        fd = os.open(path, _RD_FLAGS)
    except OSError as e:
        return None, f"open: {e.strerror}"
    try:
        st = os.fstat(fd)
    except OSError as e:  # pragma: no cover
        os.close(fd)
        return None, f"fstat: {e.strerror}"
    if not _stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None, f"not a regular file (mode {_stat.filemode(st.st_mode)})"
    if st.st_uid != os.getuid():
        os.close(fd)
        return None, f"not a regular file of ours (owned by uid {st.st_uid})"
    return fd, ""


def first_headers(path: str, name_re, magic: bytes, limit: int = 16):
    """(first 64 bytes, file size) of up to `limit` entries of `path` named by `name_re` that are
    regular files of ours starting with `magic` and carrying a valid CRC32 of bytes 0..59 at 60:
    how a restarted tier server learns its page size before any client has said hello."""
    try:
        names = sorted(n for n in os.listdir(path) if name_re.match(n))
    except OSError:
        return
    for nm in names[:limit]:
        fd, _ = _open_regular(os.path.join(path, nm))
        if fd is None:
            continue
        try:
            raw = os.pread(fd, HDR, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if len(raw) == HDR and raw[:4] == magic and page_checksum(raw[:60]) == struct.unpack_from("<I", raw, 60)[0]:
            yield raw, size


def build_header(page_nbytes: int, fp_hash: bytes, name_id: bytes, checksum: int,
                 algo: int = CHECKSUM_HASH64) -> bytes:
    width = 8 if algo == CHECKSUM_HASH64 else 4
    head = HEADER.pack(MAGIC, FORMAT_VERSION, HDR, algo, page_nbytes, fp_hash, name_id,
                       checksum.to_bytes(width, "little") + b"\0" * (8 - width), 0)
    return head[:60] + struct.pack("<I", page_checksum(head[:60]))


def parse_header(raw, fp_hash: bytes, name_id: bytes,
                 page_nbytes: Optional[int]) -> Tuple[Optional[Tuple[int, int]], str]:
    """((checksum algo, payload checksum), "") when the header is ours, else (None, reason)."""
    raw = bytes(raw)
    if len(raw) < HDR:
        return None, "short header"
    magic, ver, hlen, algo, pn, fph, nid, csum, hcrc = HEADER.unpack(raw[:HDR])
    if magic != MAGIC:
        return None, "bad magic"
    if ver != FORMAT_VERSION or hlen != HDR:
        return None, f"foreign format version {ver}"
    if page_checksum(raw[:60]) != hcrc:
        return None, "header checksum"
    if algo not in (CHECKSUM_CRC32, CHECKSUM_HASH64):
        return None, f"unknown checksum algo {algo}"
    if fph != fp_hash:
        return None, "foreign fingerprint"
    if nid != name_id:
        return None, "name mismatch"
    if page_nbytes is not None and pn != page_nbytes:
        return None, f"page_nbytes {pn} != {page_nbytes}"
    return (algo, int.from_bytes(csum if algo == CHECKSUM_HASH64 else csum[:4], "little")), ""


# ----------------------------------------------------------------------------- batch writes
#: the step of a batch create that failed; the compiled create_files returns the same values (STEP_*)
CREATE_OPEN, CREATE_RESERVE = 1, 2


def _blob(names: List[str]) -> Tuple[np.ndarray, int]:
    """NUL-terminated names at a fixed stride, for the compiled helpers."""
    stride = max(len(nm) for nm in names) + 1
    raw = b"".join(nm.encode().ljust(stride, b"\0") for nm in names)
    return np.frombuffer(raw, dtype=np.uint8), stride


def create_files(fb, dir_path: str, names: List[str], size: int,
                 preallocate: Callable[[int, int], None]) -> Tuple[List[int], Optional[OSError], int]:
    """Create each of `names` under dir_path (O_EXCL, no link followed, mode 0600) and reserve `size`
    bytes, in order, stopping at the first failure. Returns (fds of the leading files created, the
    OSError that stopped it (naming the file's path) or None, its step: CREATE_OPEN or
    CREATE_RESERVE). A file whose reserve failed is closed and removed. `fb`: the compiled _file_batch (one GIL release for the batch) or
    None for this twin, which makes the same calls from Python (`preallocate`: the tier's hook)."""
    if not names:
        return [], None, 0
    if fb is not None:
        blob, stride = _blob(names)
        fds = np.zeros(len(names), dtype=np.int64)
        try:
            dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:  # the directory itself is gone: nothing is created
            return [], e, CREATE_OPEN
        try:
            k, step, err = fb.create_files(dfd, blob, stride, len(names), size, fds)
        finally:
            os.close(dfd)
        e = OSError(err, os.strerror(err), os.path.join(dir_path, names[k])) if k < len(names) else None
        return [int(fd) for fd in fds[:k]], e, step
    out: List[int] = []
    for nm in names:
        path = os.path.join(dir_path, nm)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            return out, e, CREATE_OPEN
        try:
            os.fchmod(fd, 0o600)
            preallocate(fd, size)
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            return out, e, CREATE_RESERVE
        out.append(fd)
    return out, None, 0


def publish_files(fb, dir_path: str, fds: List[int], tmps: List[str], finals: List[str],
                  first_stamp_ns: int) -> Tuple[int, Optional[OSError]]:
    """Stamp file i's mtime with first_stamp_ns + i (< 0: no stamps), rename tmps[i] -> finals[i] in
    order until one rename fails, then close every fd, whatever happened. Returns (files renamed,
    the rename's OSError or None). `fb` as in create_files."""
    n = len(fds)
    if not n:
        return 0, None
    if fb is not None:
        tb, ts = _blob(tmps[:n])
        fb_, fs = _blob(finals[:n])
        try:
            dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:  # the directory itself is gone: nothing can be renamed
            for fd in fds:
                os.close(fd)
            return 0, e
        try:
            k, err = fb.publish_files(dfd, np.asarray(fds, dtype=np.int64), tb, ts, fb_, fs, n, first_stamp_ns)
        except BaseException:
            for fd in fds:  # the call raises only before it starts (bad buffers): nothing is closed yet
                os.close(fd)
            raise
        finally:
            os.close(dfd)
        return k, (OSError(err, os.strerror(err), os.path.join(dir_path, tmps[k])) if err else None)
    k, failed = 0, None
    try:
        for i, fd in enumerate(fds):
            if first_stamp_ns >= 0:
                try:
                    os.utime(fd, ns=(first_stamp_ns + i, first_stamp_ns + i))
                except OSError:
                    pass  # a stamp is an LRU hint
            if failed is None:
                try:
                    os.rename(os.path.join(dir_path, tmps[i]), os.path.join(dir_path, finals[i]))
                    k += 1
                except OSError as e:
                    failed = e
    finally:
        for fd in fds:
            os.close(fd)
    return k, failed


def write_pages(fb, fds: List[int], names: List[str], hdr: np.ndarray, src: np.ndarray,
                size: int) -> Optional[OSError]:
    """Header i (hdr[i], HDR bytes) and payload i (src[i]) into open file fds[i] at offset 0 with
    pwritev: the storage tier's writes without NIXL. One compiled call for the batch when `fb` (the
    built _file_batch) is given, so the worker does not wait for the GIL after every file. Stops at the
    first failed or short write; returns its OSError (naming names[k]) or None."""
    n = len(fds)
    if fb is not None and n and src.strides[1] == 1 and hdr.flags.c_contiguous and hdr.shape[1] == HDR:
        k, e = fb.write_pages(np.asarray(fds, dtype=np.int64), n, hdr.ctypes.data, HDR, src.ctypes.data,
                              src.strides[0], size - HDR)
        return None if k == n else OSError(e, os.strerror(e), names[k])
    for j, fd in enumerate(fds):
        try:
            if os.pwritev(fd, [memoryview(hdr[j]), memoryview(src[j])], 0) != size:
                return OSError(errno.EIO, "short write", names[j])
        except OSError as e:
            return e
    return None


def rows_to_write(pages: np.ndarray, todo: List[int]) -> np.ndarray:
    """The rows `todo` of `pages`, C-contiguous: a view when they are one ascending run (put_many's
    chunks are: chunk k is rows k*step.., so a copy there re-read 16 MiB per chunk for nothing),
    a gathered copy otherwise (rows skipped because the tier holds them already)."""
    if todo and todo[-1] - todo[0] == len(todo) - 1 and todo == list(range(todo[0], todo[-1] + 1)):
        return pages[todo[0]:todo[-1] + 1]
    return np.ascontiguousarray(pages[todo])


def open_leading(fb, dir_path: str, names: List[str], size: int) -> Tuple[List[int], Optional[Tuple[str, str, int]]]:
    """Open the leading page files of `names` that are regular files of ours of `size` bytes, never
    following a link, never blocking. Returns (descriptors, end): `end` is None when every name
    opened, else (name, why, st_size) of the first that did not: `why` says why it could not be
    opened ("" when it opened but its size differs; st_size -1 when unknown). One compiled call with
    the GIL released for the whole batch when `fb` (_file_batch) is built, else the Python twin."""
    if not names:
        return [], None
    n = len(names)
    raw = b"".join(nm.encode().ljust(fb.NAME_STRIDE, b"\0") for nm in names) if fb is not None else b""
    if fb is None or len(raw) != n * fb.NAME_STRIDE:  # (names are 35 bytes; never misalign the blob)
        return _open_leading_py(dir_path, names, size)
    blob = np.frombuffer(raw, dtype=np.uint8)
    fds = np.zeros(n, dtype=np.int64)
    status = np.zeros(n, dtype=np.int64)
    st_size = np.zeros(n, dtype=np.int64)
    try:
        dfd = os.open(dir_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:  # the directory itself is gone: every page is a miss, never an error
        log.warning("storage tier: cannot open %s: %s", dir_path, e.strerror)
        return [], None
    try:
        k = fb.open_regular(dfd, blob, n, os.getuid(), size, fds, status, st_size)
    finally:
        os.close(dfd)
    end = None
    if k < n:
        code = int(status[k])
        if code < 0:
            why = f"open: {os.strerror(-code)}"
        elif code == 2:
            why = "not a regular file"
        elif code == 3:
            why = "not a regular file of ours"
        else:
            why = ""
        end = (names[k], why, int(st_size[k]))
    return [int(fd) for fd in fds[:k]], end


def _open_leading_py(dir_path: str, names: List[str], size: int) -> Tuple[List[int], Optional[Tuple[str, str, int]]]:
    """The Python twin of open_leading: same checks, same outcome."""
    fds: List[int] = []
    for nm in names:
        fd, why = _open_regular(os.path.join(dir_path, nm))
        if fd is None:
            return fds, (nm, why, -1)
        st_size = os.fstat(fd).st_size
        if st_size != size:
            os.close(fd)
            return fds, (nm, "", st_size)
        fds.append(fd)
    return fds, None
