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

import os
import re
import stat as _stat
import struct
from typing import Optional, Tuple

from .base import CHECKSUM_CRC32, CHECKSUM_HASH64, page_checksum

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
