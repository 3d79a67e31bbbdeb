"""Local storage tier, slab layout (`storage_tier.layout: slabs`): pages live in the slots of a few
large preallocated files instead of one file per page.

Why: with one file per page every stored page costs a file creation, a reservation, a rename and,
at eviction, a deletion. On the dev VM's ext4 (no journal) a creation right after many deletions
walks the recently freed inodes (`recently_deleted` in the kernel, seen with `perf`): 64-140 us per
128 KiB page file on a quiet file system, 400-750 us after a few thousand deletions, against ~30 us
to write the same bytes into one big file. Slots make a stored page one positioned write of its
payload, header and use stamp into space reserved when its slab was created; eviction frees a slot
and deletes nothing. LMCache and Mooncake keep chunks of many pages per storage object for the same
reason.

Layout (docs/tiers.md), beside the directory rules of the files layout (mode 0700, `.lock`):
  <path>/slab-NNNN.kvs   mode 0600, preallocated, `slots` page slots:
    [0, 64)                    superblock: "FFSL" | u16 version | u16 64 | u32 slots | u64 page_nbytes |
                               u64 data offset | 16s fingerprint hash | 16s zero | u32 CRC32(sb[:60])
    [64, 64 + 64 * slots)      slot headers: the files layout's page header (storage_files.py), whose
                               name id says which page the slot holds; all-zero = empty
    [.., + 8 * slots)          use stamps (u64, ns): the LRU order that survives a restart
    [data offset, + P * slots) payloads (the data offset is 4 KiB aligned)

Crash safety without renames: a slot is written payload first, then header and stamp; its header
carries the payload's 64-bit hash, so a torn or half-reused slot fails verification (a miss, never a
wrong page). An evicted slot is not cleared (it is rewritten by the next store, and until then holds a
valid page for its own key); a discarded or corrupt one has its header zeroed so it does not return
after a restart. Reads verify every page as the files layout does.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat as _stat
import struct
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import storage as _storage
from .base import page_checksum, page_digests, release_nixl
from .storage import StorageTier
from .storage_files import HDR, MAGIC, build_header, first_headers, parse_header, rows_to_write

log = logging.getLogger("flexflow_sglang.tiers.storage")

SB_MAGIC = b"FFSL"
SB_VERSION = 1
SUPERBLOCK = struct.Struct("<4sHHIQQ16s16sI")
SB = SUPERBLOCK.size  # 64
assert SB == 64
STAMP = 8
#: a slab holds this many bytes of payload at most (fewer when the capacity is smaller): one file
#: creation per 2,048 pages of 128 KiB, and a fallocate short enough to run under the tier's lock
SLAB_BYTES = 256 << 20
#: and at most this many slots (small pages): the slot table a start-up reads per slab stays ~1 MiB
MAX_SLOTS_PER_SLAB = 16384
_SLAB_RE = re.compile(r"^slab-(\d{4,9})\.kvs$")
_NID = slice(36, 52)  # the header's name id (storage_files.HEADER: 4s H H I Q 16s [16s] 8s I)


def build_superblock(slots: int, page_nbytes: int, data_off: int, fp_hash: bytes) -> bytes:
    head = SUPERBLOCK.pack(SB_MAGIC, SB_VERSION, SB, slots, page_nbytes, data_off, fp_hash, b"\0" * 16, 0)
    return head[:60] + struct.pack("<I", page_checksum(head[:60]))


def parse_superblock(raw: bytes, fp_hash: bytes, file_size: int) -> Tuple[Optional[Tuple[int, int, int]], str]:
    """((slots, page_nbytes, data offset), "") for a well-formed slab of ours, else (None, why)."""
    if len(raw) < SB:
        return None, "short superblock"
    magic, ver, hlen, slots, pn, data_off, fph, _, crc = SUPERBLOCK.unpack(raw[:SB])
    if magic != SB_MAGIC:
        return None, "bad magic"
    if ver != SB_VERSION or hlen != SB:
        return None, f"foreign slab version {ver}"
    if page_checksum(raw[:60]) != crc:
        return None, "superblock checksum"
    if fph != fp_hash:
        return None, "foreign fingerprint"
    if slots < 1 or pn < 1 or data_off < SB + slots * (HDR + STAMP):
        return None, f"bad geometry (slots {slots}, page_nbytes {pn}, data offset {data_off})"
    if file_size != data_off + slots * pn:
        return None, f"size {file_size} != {data_off + slots * pn}"
    return (slots, pn, data_off), ""


class _Slab:
    __slots__ = ("idx", "name", "fd", "slots", "P", "data_off")

    def __init__(self, idx: int, name: str, fd: int, slots: int, P: int, data_off: int):
        self.idx, self.name, self.fd, self.slots, self.P, self.data_off = idx, name, fd, slots, P, data_off

    def hdr_off(self, s: int) -> int:
        return SB + s * HDR

    def stamp_off(self, s: int) -> int:
        return SB + self.slots * HDR + s * STAMP

    def page_off(self, s: int) -> int:
        return self.data_off + s * self.P


class SlabStorageTier(StorageTier):
    """StorageTier whose pages are slots of preallocated slab files (see the module docstring).
    Same protocol, locks, counters, directory rules and backends (NIXL POSIX moves the payloads;
    headers and stamps go in one compiled call); `layout` says which one a tier is."""

    layout = "slabs"

    def __init__(self, *args, slab_bytes: int = SLAB_BYTES, **kwargs):
        if not isinstance(slab_bytes, int) or slab_bytes < 1:
            raise ValueError(f"storage tier slab_bytes must be a positive int, got {slab_bytes!r}")
        self._slab_bytes = slab_bytes
        self._slabs: Dict[int, _Slab] = {}
        self._loc: Dict[str, Tuple[int, int]] = {}  # page name -> (slab, slot), indexed or being written
        self._free: List[Tuple[int, int]] = []       # empty slots, popped from the end
        self._P: Optional[int] = None                # the slot size, fixed by the first slab
        self._foreign_files = 0
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ geometry
    def _slot_bytes(self) -> int:
        return HDR + STAMP + (self._P or 0)

    def _slot_limit(self) -> int:
        return self.capacity_bytes // self._slot_bytes() if self._P else 0

    @staticmethod
    def peek_page_nbytes(path: str) -> Optional[int]:
        """page_nbytes of the first well-formed slab in `path` (None if there is none)."""
        for raw, _ in first_headers(path, _SLAB_RE, SB_MAGIC):  # a superblock is header-sized
            return struct.unpack_from("<Q", raw, 12)[0]
        return None

    # ------------------------------------------------------------------ start-up
    def _open_slab(self, nm: str) -> Optional[int]:
        """fd of slab `nm` if it is a regular file of ours (mode tightened; refused read-only)."""
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(self.path, nm), flags)
        except OSError as e:
            if e.errno == errno.ELOOP:
                self._odd(nm, "a symbolic link")
            return None
        st = os.fstat(fd)
        why = ("not a regular file" if not _stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}, not {os.getuid()}" if st.st_uid != os.getuid() else "")
        if why:
            os.close(fd)
            self._odd(nm, why)
            return None
        if not self._owner_only(fd, nm, st.st_mode):
            os.close(fd)
            return None
        return fd

    def _scan(self) -> None:
        self._last_stamp = 0
        found: List[Tuple[int, str, Tuple[int, int]]] = []
        with os.scandir(self.path) as it:
            names = sorted(e.name for e in it)
        for nm in names:
            m = _SLAB_RE.match(nm)
            if m is None:
                if nm.endswith(".kv") or nm.startswith(".tmp."):
                    self._foreign_files += 1
                continue
            fd = self._open_slab(nm)
            if fd is None:
                continue
            geo, why = parse_superblock(os.pread(fd, SB, 0), self._fp, os.fstat(fd).st_size)
            if geo is None or (self.page_nbytes is not None and geo[1] != self.page_nbytes) or \
                    (self._P is not None and geo[1] != self._P):
                why = why or f"page_nbytes {geo[1]}, this tier's is {self.page_nbytes or self._P}"
                os.close(fd)
                self._c["scan_dropped"] += 1
                if self.read_only:
                    log.info("storage tier: ignoring slab %s at start (%s; read-only)", nm, why)
                else:
                    log.info("storage tier: dropping slab %s at start (%s)", nm, why)
                    self._unlink(nm)
                continue
            slots, P, data_off = geo
            self._P = P
            slab = _Slab(int(m.group(1)), nm, fd, slots, P, data_off)
            self._slabs[slab.idx] = slab
            table = os.pread(fd, slots * (HDR + STAMP), SB)
            if len(table) != slots * (HDR + STAMP):  # shrank since the size check: read as empty
                table = bytes(slots * (HDR + STAMP))
            heads = np.frombuffer(table, dtype=np.uint8, count=slots * HDR).reshape(slots, HDR)
            stamps = np.frombuffer(table, dtype="<u8", offset=slots * HDR)
            used = np.flatnonzero((heads[:, :4] == np.frombuffer(MAGIC, np.uint8)).all(axis=1))
            free = np.ones(slots, dtype=bool)
            for s in used.tolist():
                raw = heads[s].tobytes()
                head, why = parse_header(raw, self._fp, raw[_NID], P)
                if head is None:
                    self._c["scan_dropped"] += 1
                    continue
                found.append((int(stamps[s]), raw[_NID].hex() + ".kv", (slab.idx, s)))
                free[s] = False
            self._free.extend((slab.idx, int(s)) for s in np.flatnonzero(free)[::-1])
        found.sort()
        size = self._slot_bytes()
        for stamp, nm, loc in found:
            old = self._loc.get(nm)
            if old is not None:  # the same page in two slots (a crash between stores): keep the newer
                self._index.pop(nm)
                self._used -= size
                self._free.append(old)
            self._index[nm] = size
            self._loc[nm] = loc
            self._used += size
            self._last_stamp = max(self._last_stamp, stamp)
        if not self.read_only:
            while self._used > self.capacity_bytes and self._index:  # the capacity was lowered
                self._drop(next(iter(self._index)), corrupt=False, unlink=False)
                self._c["evictions"] += 1
        if self._foreign_files:
            log.warning("storage tier %s: %d entries of the files layout (one file per page) are not read by "
                        "the slabs layout and are left in place", self.path, self._foreign_files)
        if self._index:
            log.info("storage tier %s: %d pages in %d slabs from an earlier run", self.path, len(self._index),
                     len(self._slabs))

    # ------------------------------------------------------------------ slots
    def _new_slab(self, slots: int) -> Optional[_Slab]:
        """Create, reserve and stamp a slab of `slots` slots (under the lock). None when the disk is
        full (degraded mode) or the file cannot be created (counted as a failure)."""
        idx = max(self._slabs, default=-1) + 1
        nm = f"slab-{idx:04d}.kvs"
        P = self._P
        data_off = -(-(SB + slots * (HDR + STAMP)) // 4096) * 4096
        size = data_off + slots * P
        fd = -1
        try:
            fd = os.open(os.path.join(self.path, nm),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)
            _storage._preallocate(fd, size)  # a full disk shows up here, never inside a page write
            os.ftruncate(fd, size)
            os.pwrite(fd, build_superblock(slots, P, data_off, self._fp), 0)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
                self._unlink(nm)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._enter_disk_full(0)
            else:
                log.warning("storage tier: cannot %s %s (%d bytes): %s", "reserve" if fd >= 0 else "create",
                            nm, size, e.strerror)
                self._c["failures"] += 1
            return None
        slab = _Slab(idx, nm, fd, slots, P, data_off)
        self._slabs[idx] = slab
        self._free.extend((idx, s) for s in range(slots - 1, -1, -1))  # popped from slot 0 up
        return slab

    def _take_slots(self, n: int, protect) -> List[Tuple[int, int]]:
        """Up to n empty slots (under the lock): free ones, then a new slab while the capacity has
        room, then the LRU pages' slots (never one of `protect`)."""
        got: List[Tuple[int, int]] = []
        limit = self._slot_limit()
        per_slab = max(1, min(MAX_SLOTS_PER_SLAB, self._slab_bytes // self._P))
        allocated = sum(s.slots for s in self._slabs.values())
        in_use = len(self._index) + len(self._writing)
        while len(got) < n and in_use + len(got) < limit:
            if self._free:
                got.append(self._free.pop())
            elif allocated < limit:
                slab = self._new_slab(min(per_slab, limit - allocated))
                if slab is None:
                    break
                allocated += slab.slots
            else:
                break
        while len(got) < n:  # full: evict, least recently used first
            victim = next((nm for nm in self._index if nm not in protect), None)
            if victim is None:
                break
            self._drop(victim, corrupt=False, unlink=False)  # its slot is rewritten now
            self._c["evictions"] += 1
            got.append(self._free.pop())
        return got

    def _clear_slot(self, loc: Tuple[int, int]) -> None:
        """Zero a slot's header, so a discarded or corrupt page does not come back after a restart."""
        slab = self._slabs.get(loc[0])
        if slab is None or self.read_only:
            return
        try:
            os.pwrite(slab.fd, bytes(HDR), slab.hdr_off(loc[1]))
        except OSError as e:
            log.warning("storage tier: cannot clear slot %d of %s: %s", loc[1], slab.name, e.strerror)

    def _drop(self, nm: str, corrupt: bool, unlink: bool = True) -> None:
        """Forget page `nm` (under the lock) and free its slot; `unlink`: also zero its header."""
        size = self._index.pop(nm, None)
        if size is not None:
            self._used -= size
            loc = self._loc.pop(nm, None)
            if loc is not None:
                if unlink:
                    self._clear_slot(loc)
                self._free.append(loc)
        if corrupt:
            self._c["corrupt_dropped"] += 1

    def _unclaim(self, nms: List[str]) -> None:
        for nm in nms:
            size = self._writing.pop(nm, None)
            if size is not None:
                self._used -= size
                loc = self._loc.pop(nm, None)
                if loc is not None:
                    self._free.append(loc)
            self._cancelled.discard(nm)

    # ------------------------------------------------------------------ I/O
    def _io(self, write: bool, ops: Sequence[Tuple[int, int, int, int]]) -> Optional[OSError]:
        """(fd, file offset, address, length) transfers in order; None when all were whole."""
        if not ops:
            return None
        fb = _storage._fb
        if fb is not None:
            a = np.array(ops, dtype=np.int64)
            k, err = fb.transfer_at(np.ascontiguousarray(a[:, 0]), np.ascontiguousarray(a[:, 1]),
                                    np.ascontiguousarray(a[:, 2]).view(np.uint64), np.ascontiguousarray(a[:, 3]),
                                    len(ops), write)
            return None if k == len(ops) else OSError(err, os.strerror(err))
        import ctypes
        for fd, off, addr, n in ops:  # the Python twin: the same transfers, one system call each
            buf = (ctypes.c_char * n).from_address(addr)
            try:
                got = os.pwrite(fd, buf, off) if write else os.preadv(fd, [buf], off)
            except OSError as e:
                return e
            if got != n:
                return OSError(errno.EIO, "short transfer")
        return None

    def _nixl_pages(self, op: str, slabs_fds: List[int], offs: List[int], data: np.ndarray, n: int) -> bool:
        """Payload i <-> file slabs_fds[i] at offs[i], through NIXL (files registered per call)."""
        a, bk = self._agent, self._bk
        stride, P = data.strides[0], data.shape[1]
        fregs = dreg = h = None
        try:
            size = {s.fd: s.page_off(s.slots) for s in self._slabs.values()}
            uniq = sorted(set(slabs_fds))
            fregs = a.register_memory([(0, size[fd], fd, "") for fd in uniq], "FILE", backends=[bk])
            dreg = a.register_memory([(data.ctypes.data, (n - 1) * stride + P, 0, "")], "DRAM", backends=[bk])
            loc = [(data.ctypes.data + i * stride, P, 0) for i in range(n)]
            rem = [(offs[i], P, slabs_fds[i]) for i in range(n)]
            h = a.initialize_xfer(op, a.get_xfer_descs(loc, "DRAM"), a.get_xfer_descs(rem, "FILE"),
                                  a.name, backends=[bk])
            st = _storage.post_xfer(a, h)
            if st == "PROC":
                st = _storage.wait_xfers(a, [h], None)[0]
            return st == "DONE"
        except Exception as e:  # NIXL's nixl*Error types share no base: the caller falls back
            log.debug("storage tier NIXL %s failed: %r", op, e)
            return False
        finally:
            release_nixl(a, h, fregs, dreg)

    def _move_pages(self, write: bool, locs: List[Tuple[int, int]], data: np.ndarray,
                    extra: List[Tuple[int, int, int, int]]) -> Optional[OSError]:
        """Payload i <-> slot locs[i], plus the `extra` small transfers (headers, stamps): after
        the payloads when writing (a slot's header lands last), before them when reading."""
        n = len(locs)
        slabs = [self._slabs[s] for s, _ in locs]
        fds = [sl.fd for sl in slabs]
        offs = [sl.page_off(s) for sl, (_, s) in zip(slabs, locs)]
        if not write:
            err = self._io(False, extra)
            if err is not None:
                return err
        if self._agent is not None:
            if self._nixl_pages("WRITE" if write else "READ", fds, offs, data, n):
                return self._io(True, extra) if write else None
            self._nixl_failed("write" if write else "read")
        stride, P = data.strides[0], data.shape[1]
        ops = [(fds[i], offs[i], data.ctypes.data + i * stride, P) for i in range(n)]
        return self._io(write, ops + extra if write else ops)

    # ------------------------------------------------------------------ protocol
    # put_many is StorageTier's: chunk by chunk, _claim (slots) under the lock, _write without it
    def _check_page_size(self, P: int) -> None:
        want = self.page_nbytes or self._P
        if want is not None and P != want:
            raise ValueError(f"storage tier page_nbytes is {want}, got pages of {P}")
        self._P = P  # the slot size: fixed by the slabs found, else by the first put

    def _claim(self, names: List[str], size: int, idx, seen: set) -> List[int]:
        """Under the lock: the pages at `idx` to write (_todo), each given a slot (_take_slots)."""
        todo = self._todo(names, idx, seen)
        if not todo:
            return []
        slots = self._take_slots(len(todo), set(names))
        todo = todo[:len(slots)]
        size = self._slot_bytes()
        for i, loc in zip(todo, slots):
            self._writing[names[i]] = size
            self._loc[names[i]] = loc
        self._used += len(todo) * size
        return todo

    def _write(self, todo: List[int], names: List[str], pages: np.ndarray, size: int) -> None:
        """Write the claimed pages into their slots, then publish them (or give the slots back)."""
        t0 = time.perf_counter()
        claimed = [names[i] for i in todo]
        P = pages.shape[1]
        src = rows_to_write(pages, todo)
        sums = page_digests(src, len(todo))
        published = 0
        try:
            with self._lock:
                locs = [self._loc[nm] for nm in claimed]
            first = self._reserve_stamps(len(claimed))
            stamps = np.arange(first, first + len(claimed), dtype=np.uint64)
            hdr = np.empty((len(claimed), HDR), dtype=np.uint8)
            for j, nm in enumerate(claimed):
                hdr[j] = np.frombuffer(build_header(P, self._fp, bytes.fromhex(nm[:32]), sums[j]), np.uint8)
            extra = []
            for j, (s, slot) in enumerate(locs):
                sl = self._slabs[s]
                extra.append((sl.fd, sl.hdr_off(slot), hdr.ctypes.data + j * HDR, HDR))
                extra.append((sl.fd, sl.stamp_off(slot), stamps.ctypes.data + j * STAMP, STAMP))
            with self._io_lock:
                if self._closed:
                    return
                err = self._move_pages(True, locs, src, extra)
                if err is None and self.fsync:  # before the pages count as stored
                    for fd in {self._slabs[s].fd for s, _ in locs}:
                        os.fdatasync(fd)
            if err is not None:
                with self._lock:
                    if err.errno in (errno.ENOSPC, errno.EDQUOT):
                        self._enter_disk_full(0)
                    else:
                        log.warning("storage tier slab write failed: %s", err)
                        self._c["failures"] += 1
                return
            with self._lock:
                for nm, loc in zip(claimed, locs):
                    if self._closed or nm in self._cancelled:
                        self._clear_slot(loc)  # discarded while it was written
                        continue
                    self._writing.pop(nm, None)
                    self._index[nm] = self._slot_bytes()
                    published += 1
                if self.fsync:
                    self._c["fsyncs"] += len({s for s, _ in locs})
                self._c["pages_written"] += published
                self._c["bytes_written"] += published * P
                self._c["write_s"] += time.perf_counter() - t0
        finally:
            with self._lock:
                self._unclaim(claimed)  # whatever was not published: its slot goes back

    def _get_locked(self, keys: List[bytes], out: np.ndarray, P: int, size: int) -> int:
        """get_many_into's body under the tier's locks: the leading indexed pages, read from their
        slots and verified; the first bad one is dropped and ends the run."""
        if self._closed:
            return 0
        if self._P is not None and P != self._P:
            self._c["size_mismatch"] += 1
            return 0
        names: List[str] = []
        for k in keys:
            nm = self._name(k)
            if nm not in self._index:
                break
            names.append(nm)
        n = len(names)
        t0 = time.perf_counter()
        k = 0
        if n:
            locs = [self._loc[nm] for nm in names]
            hdr = self._ensure_hdr_buf(n)
            hdr[:n] = 0
            extra = [(self._slabs[s].fd, self._slabs[s].hdr_off(slot), hdr.ctypes.data + i * HDR, HDR)
                     for i, (s, slot) in enumerate(locs)]
            err = self._move_pages(False, locs, out, extra)
            if err is not None:
                log.warning("storage tier slab read failed: %s", err)
                self._c["failures"] += 1
                n = 0
            k = self._verified_run(names, hdr, out, n, P)
            if k and not self.read_only:  # use stamps: the LRU order a restart sees
                first = max(time.time_ns(), self._last_stamp + 1)
                self._last_stamp = first + k - 1
                stamps = np.arange(first, first + k, dtype=np.uint64)
                self._io(True, [(self._slabs[s].fd, self._slabs[s].stamp_off(slot), stamps.ctypes.data + i * STAMP,
                                 STAMP) for i, (s, slot) in enumerate(locs[:k])])
        self._count_read(t0, k, len(keys), P)
        return k

    def stats(self) -> dict:
        c = super().stats()
        c.update(layout=self.layout, slabs=len(self._slabs), free_slots=len(self._free),
                 foreign_files=self._foreign_files)
        return c

    def close(self) -> None:
        super().close()
        with self._lock, self._io_lock:
            for slab in self._slabs.values():
                try:
                    os.close(slab.fd)
                except OSError:
                    pass
            self._slabs.clear()
