"""Local storage tier: KV pages as files in a private directory, moved by NIXL (POSIX backend).

Layout (see docs/tiers.md):
  <path>/                     mode 0700, one owning process at a time (flock on <path>/.lock)
  <path>/<32 hex>.kv          one file per page, mode 0600: 64-byte header + payload
  <path>/.tmp.<32 hex>.<rnd>  a write in progress; renamed into place when complete

File name = blake2b-128(key, key=blake2b(fingerprint)) in hex: never built from request content,
and the same key under another fingerprint lands elsewhere. The header: storage_files.py.
Reads and writes go through NIXL's POSIX backend (DRAM <-> FILE). Without nixl the tier falls
back to os.preadv/pwritev (logged once; stats()["backend"] says which one is active). GDS is
created only when torch.cuda is available and libcufile loads; GDS_MT never.

The index (name -> size, in LRU order) is rebuilt at start by scanning headers, so pages stored
by an earlier process are hits. Anything that fails validation (truncated, corrupt, foreign
version, foreign fingerprint, wrong size, vanished) is a miss, is deleted, and is counted.

Odd entries: only regular files owned by us are pages. A directory, FIFO, socket, device or symlink
with a page name is skipped and logged (`odd_skipped`), never opened in blocking mode (every open is
O_NONBLOCK | O_NOFOLLOW and checked with fstat before a byte is read), so one bad entry can neither
hang nor take down the tier. A page file with group/other permission bits is tightened to 0600 and
logged (`modes_tightened`); in read-only mode it is refused instead.

read_only=True serves the pages already there and writes nothing (no temp files, no deletions, no
mode changes, a shared lock when .lock exists). fsync=True makes put_many's return a durability
promise (file + directory fsync before the rename is reported); without it a power loss may lose
recently written pages, which the next start then drops as truncated: a miss, never a wrong page.

Around this module: storage_dir.py creates, checks and locks the directory (both layouts);
storage_files.py holds the page file's header and the batched per-file system calls (create,
publish, open a read run; compiled in _file_batch, with Python twins); storage_slabs.py is the
slab layout, a subclass of this tier.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import stat as _stat
import struct
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np

from .base import (KVTier, as_pages, check_keys, fingerprint_hash, key_id, load_nixl, make_agent,
                   page_digests, payload_checksums, post_xfer, release_nixl, unique_agent_name, wait_xfers)
from .storage_dir import StorageTierError, prepare_dir, prepare_dir_read_only  # noqa: F401 (re-exported)
from .storage_files import (CREATE_OPEN, HDR, MAGIC, _NAME_RE, _open_regular, build_header,  # noqa: F401 (re-exported)
                            create_files, first_headers, open_leading, parse_header, publish_files, rows_to_write,
                            write_pages)

log = logging.getLogger("flexflow_sglang.tiers.storage")

try:  # the per-file system calls of a batch, GIL released once (csrc/flexflow_sglang/_file_batch.pyx)
    from .. import _file_batch as _fb
except ImportError:  # pragma: no cover - depends on the build; the Python twin does the same
    _fb = None

_GIB = 1 << 30
#: put_many claims, writes and publishes pages in chunks of this many bytes
WRITE_CHUNK_BYTES = 16 << 20


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks up front so a full disk shows up as ENOSPC here, before any
    transfer. Tests replace this function to simulate a full disk."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # filesystem without fallocate: ENOSPC then surfaces at write time
        raise


def _gds_usable() -> Tuple[bool, str]:
    """GDS needs a GPU and cuFile. Checked cheaply first (libcufile), torch only after."""
    lib = ctypes.util.find_library("cufile")
    try:
        ctypes.CDLL(lib or "libcufile.so.0")
    except OSError:
        return False, "libcufile is not loadable"
    try:
        import torch  # noqa: F401  (only reached when cuFile exists)
        if not torch.cuda.is_available():
            return False, "torch.cuda is not available"
    except Exception as e:  # importing torch / probing CUDA fails in many ways; any of them means no GDS
        return False, f"torch unavailable ({type(e).__name__})"  # the caller logs this reason
    return True, ""


class StorageTier(KVTier):
    """KVTier over a local directory. Thread-safe (one lock; NIXL calls are serialized)."""

    name = "storage"
    #: the transfer engine moves this tier's pages in chunks of at least this many bytes: every
    #: call pays a fixed cost (NIXL registration, one status poll per batch of descriptors, each a
    #: GIL re-acquisition behind SGLang's scheduler thread), so 4 MiB chunks of 1-token pages made a
    #: 1,024-page prefetch 32 calls. One path only (local disk): a larger chunk costs no split share.
    io_chunk_bytes = 256 << 20

    @staticmethod
    def peek_page_nbytes(path: str) -> Optional[int]:
        """page_nbytes of the first well-formed page file in `path` (None if there is none).
        Lets a restarted tier server size its slots before any client has said hello."""
        for raw, size in first_headers(path, _NAME_RE, MAGIC):
            pn = struct.unpack_from("<Q", raw, 12)[0]
            if size == HDR + pn:
                return pn
        return None

    def __init__(self, path: str, capacity_gb: float = 10.0, backend: str = "auto",
                 eviction: str = "lru", fingerprint: str = "", page_nbytes: Optional[int] = None,
                 node: str = "nvme0", capacity_bytes: Optional[int] = None,
                 disk_full_retry_s: float = 60.0, read_only: bool = False, fsync: bool = False):
        if backend not in ("auto", "posix", "gds", "os"):
            raise ValueError(f"storage_tier.backend must be auto|posix|gds|os, got {backend!r}")
        if eviction != "lru":
            raise ValueError(f"storage_tier.eviction must be 'lru', got {eviction!r}")
        self.node = node
        self.path = os.path.abspath(os.path.expanduser(path))
        cap = capacity_bytes if capacity_bytes is not None else capacity_gb * _GIB
        if not isinstance(cap, (int, float)) or cap != cap or not 0 <= cap <= 1 << 60:
            raise ValueError(f"storage tier capacity must be in [0, 2^60] bytes, got {cap!r}")
        self.capacity_bytes = int(cap)
        self.read_only = bool(read_only)
        self.fsync = bool(fsync)
        self.page_nbytes = page_nbytes
        self.fingerprint = fingerprint
        self._fp = fingerprint_hash(fingerprint)
        self._disk_full_retry_s = disk_full_retry_s
        # _lock: the index, _used, _writing, counters; held by reads for their I/O, never by a
        # write's file I/O. _io_lock (taken after _lock, never the other way): the NIXL agent, the
        # shared header buffer and the use stamps, held by a write only to fill its headers and
        # move its payloads (page cache speed), so a prefetch never waits on a write's file
        # creation, fallocate, fsync or rename (kv128k multi-turn: reads waited 28 s of 33 s).
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()
        self._writing: Dict[str, int] = {}   # names a put is writing (claimed; size reserved in _used)
        self._cancelled: set = set()          # of those, discarded meanwhile: not published
        self._closed = False
        self._index: "OrderedDict[str, int]" = OrderedDict()  # name -> file size, LRU first
        self._used = 0
        self._degraded_until = 0.0
        self._warned_full = False
        self._c: Dict[str, float] = dict(
            hits=0, misses=0, bytes_read=0, bytes_written=0, pages_written=0, failures=0,
            corrupt_dropped=0, scan_dropped=0, size_mismatch=0, evictions=0, disk_full=0, writes_skipped=0,
            nixl_fallbacks=0, odd_skipped=0, modes_tightened=0, read_only_skipped=0, fsyncs=0,
            read_s=0.0, write_s=0.0)
        self._prepare_dir()
        self._agent = None
        self._bk = "os"
        self._hdr_buf = None
        self._hdr_reg = None
        self._init_backend(backend)
        self._scan()

    # ------------------------------------------------------------------ setup
    def _prepare_dir(self) -> None:
        self._lock_fd = prepare_dir_read_only(self.path) if self.read_only else prepare_dir(self.path)

    def _init_backend(self, requested: str) -> None:
        if requested == "os":  # chosen: batched preadv/pwritev, no NIXL agent (faster from page cache)
            log.info("storage tier %s: os backend (system calls, no NIXL)", self.path)
            return
        nixl_agent, _, why = load_nixl()
        if nixl_agent is None:
            log.warning("nixl is not importable (%s): storage tier %s uses plain os reads/writes",
                        why, self.path)
            return
        agent = make_agent(unique_agent_name("ffstore"))
        if requested in ("auto", "gds"):
            ok, reason = _gds_usable()
            if ok:
                try:
                    agent.create_backend("GDS")
                    self._agent, self._bk = agent, "GDS"
                except Exception as e:  # NIXL's nixl*Error types share no base below Exception
                    log.warning("storage tier: NIXL GDS backend failed (%r); using POSIX", e)
            elif requested == "gds":
                log.warning("storage tier: backend=gds requested but %s; using NIXL POSIX", reason)
        if self._agent is None:
            agent.create_backend("POSIX")
            self._agent, self._bk = agent, "POSIX"
        log.info("storage tier %s: NIXL %s backend", self.path, self._bk)

    def _odd(self, nm: str, why: str) -> None:
        """An entry with a page (or temp) name that is not a regular file of ours: skipped, never
        deleted (it is not ours to remove), logged once per entry and counted."""
        self._c["odd_skipped"] += 1
        log.warning("storage tier %s: skipping %s (%s)", self.path, nm, why)

    def _scan(self) -> None:
        entries = []
        uid = os.getuid()
        with os.scandir(self.path) as it:
            for e in it:
                nm = e.name
                is_tmp = nm.startswith(".tmp.")
                if not is_tmp and not _NAME_RE.match(nm):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished
                if not _stat.S_ISREG(st.st_mode):
                    self._odd(nm, f"not a regular file: {_stat.filemode(st.st_mode)}")
                    continue
                if st.st_uid != uid:
                    self._odd(nm, f"owned by uid {st.st_uid}, not {uid}")
                    continue
                if is_tmp:
                    if not self.read_only:
                        self._unlink(nm)  # a write that never completed (crash); we hold the dir lock
                    continue
                reason = self._check_file(nm)
                if reason == "odd":
                    continue
                if reason:
                    self._c["scan_dropped"] += 1
                    if self.read_only:
                        log.info("storage tier: ignoring %s at start (%s; read-only)", nm, reason)
                    else:
                        log.info("storage tier: dropping %s at start (%s)", nm, reason)
                        self._unlink(nm)
                    continue
                entries.append((st.st_mtime_ns, nm, st.st_size))
        entries.sort()
        self._last_stamp = max([e[0] for e in entries] + [0])
        for _, nm, size in entries:
            self._index[nm] = size
            self._used += size
        if not self.read_only:
            self._evict_to(self.capacity_bytes, protect=())
        if entries:
            log.info("storage tier %s: %d pages (%d bytes) from an earlier run", self.path,
                     len(self._index), self._used)

    def _check_file(self, nm: str) -> str:
        """"" when `nm` is a valid page, "odd" when it was skipped as not ours, else why it is bad."""
        fd, why = _open_regular(os.path.join(self.path, nm))
        if fd is None:
            if why.startswith("not a regular"):  # swapped between scandir and open
                self._odd(nm, why)
                return "odd"
            return why
        try:
            st = os.fstat(fd)
            if not self._owner_only(fd, nm, st.st_mode):
                return "odd"
            raw = os.pread(fd, HDR, 0)
            _, reason = parse_header(raw, self._fp, bytes.fromhex(nm[:32]), self.page_nbytes)
            if reason:
                return reason
            pn = struct.unpack_from("<Q", raw, 12)[0]
            if st.st_size != HDR + pn:
                return f"size {st.st_size} != {HDR + pn}"
            return ""
        finally:
            os.close(fd)

    def _owner_only(self, fd: int, nm: str, mode: int) -> bool:
        """An entry with group/other permission bits is set to 0600 (logged, counted); in read-only
        mode it is refused instead (False, skipped as odd)."""
        if not mode & 0o077:
            return True
        if self.read_only:
            self._odd(nm, f"mode {mode & 0o777:o} is readable by others; refused in read-only mode")
            return False
        os.fchmod(fd, 0o600)
        self._c["modes_tightened"] += 1
        log.warning("storage tier %s: %s had mode %o; set to 0600", self.path, nm, mode & 0o777)
        return True

    # ------------------------------------------------------------------ helpers
    def _name(self, key: bytes) -> str:
        return key_id(key, self._fp).hex() + ".kv"

    def _unlink(self, nm: str) -> None:
        try:
            os.unlink(os.path.join(self.path, nm))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("storage tier: cannot delete %s: %s", nm, e)

    def _drop(self, nm: str, corrupt: bool, unlink: bool = True) -> None:
        size = self._index.pop(nm, None)
        if size is not None:
            self._used -= size
        if unlink and not self.read_only:
            self._unlink(nm)
        if corrupt:
            self._c["corrupt_dropped"] += 1

    def _evict_to(self, limit: int, protect) -> bool:
        """Evict LRU files until used <= limit, skipping `protect`. True if it got there."""
        if self._used <= limit:
            return True
        for nm in list(self._index.keys()):
            if self._used <= limit:
                break
            if nm in protect:
                continue
            self._drop(nm, corrupt=False)
            self._c["evictions"] += 1
        return self._used <= limit

    def _ensure_hdr_buf(self, n: int) -> np.ndarray:
        if self._hdr_buf is None or self._hdr_buf.shape[0] < n:
            if self._hdr_reg is not None:
                self._agent.deregister_memory(self._hdr_reg)
                self._hdr_reg = None
            self._hdr_buf = np.zeros((max(n, 64), HDR), dtype=np.uint8)
            if self._agent is not None:
                self._hdr_reg = self._agent.register_memory(
                    [(self._hdr_buf.ctypes.data, self._hdr_buf.nbytes, 0, "")], "DRAM", backends=[self._bk])
        return self._hdr_buf

    def _nixl_io(self, op: str, fds: List[int], size: int, hdr: np.ndarray, data: np.ndarray, n: int,
                 headers: bool = True) -> bool:
        """One NIXL transfer for n files: header i <-> hdr[i] (unless `headers` is False: they
        were moved already) and payload i <-> data[i]."""
        a, bk = self._agent, self._bk
        P = data.shape[1]
        fregs = dreg = h = None
        try:
            fregs = a.register_memory([(0, size, fd, "") for fd in fds], "FILE", backends=[bk])
            dreg = a.register_memory([(data.ctypes.data, n * P, 0, "")], "DRAM", backends=[bk])
            loc, rem = [], []
            hb, db = hdr.ctypes.data, data.ctypes.data
            for i, fd in enumerate(fds):
                if headers:
                    loc.append((hb + i * HDR, HDR, 0))
                    rem.append((0, HDR, fd))
                loc.append((db + i * P, P, 0))
                rem.append((HDR, P, fd))
            h = a.initialize_xfer(op, a.get_xfer_descs(loc, "DRAM"), a.get_xfer_descs(rem, "FILE"),
                                  a.name, backends=[bk])
            st = post_xfer(a, h)
            if st == "PROC":
                st = wait_xfers(a, [h], None)[0]
            return st == "DONE"
        except Exception as e:  # NIXL's nixl*Error types share no base: the caller falls back (_nixl_failed)
            log.debug("storage tier NIXL %s failed: %r", op, e)
            return False
        finally:
            release_nixl(a, h, fregs, dreg)

    def _nixl_failed(self, what: str) -> None:
        self._c["nixl_fallbacks"] += 1
        if self._bk == "GDS":
            log.warning("storage tier: GDS %s failed; switching to NIXL POSIX", what)
            try:
                if self._hdr_reg is not None:
                    self._agent.deregister_memory(self._hdr_reg)
            except Exception as e:  # NIXL errors share no base; the GDS registration is dropped anyway
                log.debug("storage tier: deregister GDS header buffer: %r", e)
            self._hdr_reg = None
            self._hdr_buf = None
            self._agent.create_backend("POSIX")
            self._bk = "POSIX"

    # ------------------------------------------------------------------ protocol
    def holds_locally(self, keys: List[bytes]) -> Optional[List[bool]]:
        """Index membership per key (no I/O lock, as contains_prefix)."""
        if self._closed:
            return None
        index, name = self._index, self._name
        return [name(k) in index for k in check_keys(keys)]

    def contains_prefix(self, keys: List[bytes]) -> int:
        """Leading keys in the index. Without the I/O lock: SGLang's scheduler thread asks this while
        a worker holds the lock for a whole chunk of file I/O, and it must not wait for the disk.
        Each membership test is one atomic dict lookup under the GIL; an answer that a concurrent
        drop makes stale ends as a short read in get_many_into, i.e. a miss, never wrong KV."""
        keys = check_keys(keys)
        if self._closed:
            return 0
        index, name = self._index, self._name
        n = 0
        for k in keys:
            if name(k) not in index:
                break
            n += 1
        return n

    def get_many_into(self, keys: List[bytes], out) -> int:
        keys = check_keys(keys)
        if not keys:
            return 0
        out = as_pages(out, len(keys), writable=True, what="out")
        P = out.shape[1]
        size = HDR + P
        with self._lock, self._io_lock:
            return self._get_locked(keys, out, P, size)

    def _get_locked(self, keys: List[bytes], out: np.ndarray, P: int, size: int) -> int:
        """get_many_into's body, under the tier's locks."""
        if self._closed:
            return 0
        names = []
        for k in keys:
            nm = self._name(k)
            if nm not in self._index:
                break
            names.append(nm)
        fds: List[int] = []
        t0 = time.perf_counter()
        stamped = 0
        try:
            fds = self._open_leading(names, size)  # a vanished, odd or mis-sized file ends the run
            n = len(fds)
            hdr = self._ensure_hdr_buf(n)
            if n:
                ok = False
                # compiled: the headers (and without NIXL the payloads too) in one call, GIL
                # released once; NIXL then moves only the payloads (half the descriptors, and
                # NIXL POSIX progresses a batch of descriptors per status poll)
                native = _fb is not None and out.strides[1] == 1
                fd_arr = np.asarray(fds, dtype=np.int64) if native else None
                if self._agent is not None:
                    if native:
                        _fb.read_pages(fd_arr, n, hdr.ctypes.data, HDR, 0, 0, P, False)
                    ok = self._nixl_io("READ", fds, size, hdr, out, n, headers=not native)
                    if not ok:
                        self._nixl_failed("read")
                if not ok and native:
                    _fb.read_pages(fd_arr, n, hdr.ctypes.data, HDR, out.ctypes.data, out.strides[0], P, True)
                elif not ok:
                    for i, fd in enumerate(fds):
                        try:
                            os.preadv(fd, [memoryview(hdr[i]), memoryview(out[i])], 0)
                        except OSError as e:
                            log.debug("storage tier pread: %s", e)
                            hdr[i, :4] = 0  # fails validation below
            k = self._verified_run(names, hdr, out, n, P)
            stamped = k
        finally:
            self._stamp_and_close(fds, stamped)
        self._count_read(t0, k, len(keys), P)
        return k

    def _verified_run(self, names: List[str], hdr: np.ndarray, out: np.ndarray, n: int, P: int) -> int:
        """Under the lock, after a read of pages `names[:n]` (headers in `hdr`, payloads in `out`):
        how many leading pages pass their header and payload checks. The first that fails is
        dropped (corrupt) and ends the run; the ones that pass become the most recently used."""
        heads = [parse_header(hdr[i], self._fp, bytes.fromhex(names[i][:32]), P) for i in range(n)]
        sums = payload_checksums(out, [h[0][0] if h[0] else 0 for h in heads])
        k = 0
        for i in range(n):
            want, reason = heads[i]
            if reason or want[1] != sums[i]:
                log.info("storage tier: dropping %s (%s)", names[i], reason or "payload checksum")
                self._drop(names[i], corrupt=True)
                break
            k += 1
        for i in range(k):
            self._index.move_to_end(names[i])
        return k

    def _count_read(self, t0: float, k: int, n_keys: int, P: int) -> None:
        self._c["read_s"] += time.perf_counter() - t0
        self._c["hits"] += k
        self._c["misses"] += n_keys - k
        self._c["bytes_read"] += k * P

    def put_many(self, keys: List[bytes], pages) -> int:
        """Stores the pages it does not have yet. Returns the number of leading keys the tier holds
        after the call (pages already present count).

        Chunk by chunk (WRITE_CHUNK_BYTES): claim the names and reserve their bytes under the lock,
        write the files without it (_io_lock only while payloads move), publish under it. A
        concurrent put of the same pages skips the claimed ones (its count then stops there)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        pages = as_pages(pages, len(keys))
        P = pages.shape[1]
        size = HDR + P
        with self._lock:
            if self._closed:
                return 0
            self._check_page_size(P)
            names = [self._name(k) for k in keys]
            if self.read_only:
                n = 0
                while n < len(names) and names[n] in self._index:
                    n += 1
                self._c["read_only_skipped"] += sum(1 for nm in names if nm not in self._index)
                return n
        seen: set = set()
        step = max(1, WRITE_CHUNK_BYTES // size)
        for start in range(0, len(names), step):
            with self._lock:
                if self._closed:
                    return 0
                todo = self._claim(names, size, range(start, min(len(names), start + step)), seen)
            if todo:
                self._write(todo, names, pages, size)
        with self._lock:
            n = 0
            for nm in names:
                if nm not in self._index:
                    break
                n += 1
            return n

    def _check_page_size(self, P: int) -> None:
        """put_many's pages are P bytes each: a ValueError when this tier's pages are another size."""
        if self.page_nbytes is not None and P != self.page_nbytes:
            raise ValueError(f"storage tier page_nbytes is {self.page_nbytes}, got pages of {P}")

    def _todo(self, names: List[str], idx, seen: set) -> List[int]:
        """Under the lock: the pages at `idx` a put must write (absent, not being written by another
        put, not earlier in this one; the ones held are refreshed in the LRU). None while writes are
        off after a full disk (counted as skipped)."""
        todo: List[int] = []
        for i in idx:
            nm = names[i]
            if nm in self._index:
                self._index.move_to_end(nm)
            elif nm not in seen and nm not in self._writing:
                seen.add(nm)
                todo.append(i)
        if todo and time.monotonic() < self._degraded_until:
            self._c["writes_skipped"] += len(todo)
            return []
        return todo

    def _claim(self, names: List[str], size: int, idx, seen: set) -> List[int]:
        """Under the lock: the pages at `idx` to write (_todo), room made and reserved for them,
        their names marked as being written."""
        todo = self._todo(names, idx, seen)
        if todo:
            protect = set(names)
            fit = max(0, self.capacity_bytes // size)
            todo = todo[:fit]
            while todo and not self._evict_to(self.capacity_bytes - len(todo) * size, protect):
                todo.pop()
        for i in todo:
            self._writing[names[i]] = size
        self._used += len(todo) * size
        return todo

    def _unclaim(self, nms: List[str]) -> None:
        """Under the lock: names claimed by _claim that will not be published."""
        for nm in nms:
            size = self._writing.pop(nm, None)
            if size is not None:
                self._used -= size
            self._cancelled.discard(nm)

    def _write(self, todo: List[int], names: List[str], pages: np.ndarray, size: int) -> None:
        """Write the claimed pages `todo` to temp files, rename them into place, then publish them
        in the index. Runs without the tier's lock; every claimed name is published or unclaimed."""
        P = size - HDR
        t0 = time.perf_counter()
        claimed = [names[i] for i in todo]
        src = rows_to_write(pages, todo)
        sums = page_digests(src, len(todo))
        # one random draw for the batch: os.urandom releases the GIL, so one per file waits for it per file
        rnd = os.urandom(4 * len(claimed)).hex()
        tmp_names = [f".tmp.{nm[:32]}.{rnd[8 * i:8 * i + 8]}" for i, nm in enumerate(claimed)]
        renamed: List[str] = []
        full, n_full = False, 0
        # file creation and publishing: one compiled call each for the batch when built (_fb), so the
        # worker does not wait for the GIL after every system call while the scheduler runs Python
        fds, err, step = create_files(_fb, self.path, tmp_names, size, _preallocate)
        tmps: List[Tuple[int, str, str]] = list(zip(fds, tmp_names, claimed))  # (fd, tmp name, final name)
        open_fds = list(fds)
        try:
            if err is not None:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    full = True
                else:  # the pages before it are still written; the rest are a future miss
                    what = "create" if step == CREATE_OPEN else "reserve space for"
                    log.warning("storage tier: cannot %s %s: %s", what, err.filename, err.strerror)
                    with self._lock:
                        self._c["failures"] += 1
            n = len(tmps)
            n_full = len(claimed) - n if full else 0
            if n and not self._write_payloads(tmps, src, sums, size, n):
                for _, tmp, _ in tmps:
                    self._unlink(tmp)
                return
            if self.fsync:  # the data, before the name that makes it a page
                for fd, _, _ in tmps:
                    os.fsync(fd)
            first = self._reserve_stamps(n) if n else -1
            open_fds = []  # publish_files closes them, whatever happens
            k, rerr = publish_files(_fb, self.path, fds, tmp_names[:n], claimed[:n], first)
            renamed = claimed[:k]
            if rerr is not None:
                log.warning("storage tier: cannot rename %s into place: %s", rerr.filename, rerr.strerror)
                for tmp in tmp_names[k:n]:
                    self._unlink(tmp)
                with self._lock:
                    self._c["failures"] += 1
            if self.fsync and n:  # the renames themselves
                dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            with self._lock:
                published = 0
                for nm in renamed:
                    if self._closed or nm in self._cancelled:
                        self._unlink(nm)  # discarded (or the tier closed) while it was written
                        continue
                    self._writing.pop(nm, None)
                    self._index[nm] = size
                    published += 1
                if self.fsync and n:
                    self._c["fsyncs"] += n + 1
                self._c["pages_written"] += published
                self._c["bytes_written"] += published * P
                self._c["write_s"] += time.perf_counter() - t0
        except BaseException:  # also KeyboardInterrupt & co.: never leave temp files behind; re-raised
            for _, tmp, nm in tmps:
                if nm not in renamed:
                    self._unlink(tmp)
            raise
        finally:
            for fd in open_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            with self._lock:
                self._unclaim(claimed)  # whatever was not published: its reservation goes back
                if full:
                    self._enter_disk_full(n_full)

    def _write_payloads(self, tmps: List[Tuple[int, str, str]], src: np.ndarray, sums, size: int,
                        n: int) -> bool:
        """Headers and payloads into the n open temp files (under _io_lock: the NIXL agent and the
        header buffer are shared with reads); publish_files stamps them. False: failed (counted) or
        closed; the caller removes the temp files."""
        P = size - HDR
        with self._io_lock:
            if self._closed:
                return False
            hdr = self._ensure_hdr_buf(n)
            for j, (_, _, nm) in enumerate(tmps):
                hdr[j] = np.frombuffer(build_header(P, self._fp, bytes.fromhex(nm[:32]), sums[j]), np.uint8)
            ok, err = False, None
            if self._agent is not None:
                ok = self._nixl_io("WRITE", [t[0] for t in tmps], size, hdr, src, n)
                if not ok:
                    self._nixl_failed("write")
            if not ok:
                err = write_pages(_fb, [t[0] for t in tmps[:n]], [t[1] for t in tmps[:n]], hdr, src, size)
            if err is None:
                return True
        with self._lock:  # after _io_lock is released: the lock order is _lock -> _io_lock
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                self._enter_disk_full(0)
            else:
                log.warning("storage tier write failed: %s", err)
                self._c["failures"] += 1
        return False

    def _open_leading(self, names: List[str], size: int) -> List[int]:
        """Open the leading page files of `names` that are regular files of ours of `size` bytes
        (storage_files.open_leading); the first that is not ends the run and is dealt with here."""
        fds, end = open_leading(_fb, self.path, names, size)
        if end is not None:
            self._end_of_run(*end, size)
        return fds

    def _end_of_run(self, nm: str, why: str, st_size: int, size: int) -> None:
        """File `nm` ends a read run: why it could not be opened (`why`), or its size."""
        if why:  # vanished, or swapped for a FIFO/dir/link: forget it, delete no odd entry
            odd = why.startswith("not a regular")
            if odd:
                self._odd(nm, why)
            self._drop(nm, corrupt=True, unlink=not odd)
        elif st_size == self._index.get(nm):  # intact, but the caller's page size differs
            self._c["size_mismatch"] += 1
        else:                                 # truncated or rewritten behind our back
            self._drop(nm, corrupt=True)

    def _stamp_and_close(self, fds: List[int], n_stamp: int) -> None:
        """Use-stamp the first n_stamp files (LRU order that survives a restart) and close all."""
        if not fds:
            return
        if self.read_only:
            n_stamp = 0
        first = max(time.time_ns(), self._last_stamp + 1)
        if n_stamp:
            self._last_stamp = first + n_stamp - 1
        if _fb is not None:
            _fb.stamp_and_close(np.asarray(fds, dtype=np.int64), len(fds), n_stamp, first)
            return
        for i, fd in enumerate(fds):
            if i < n_stamp:
                try:
                    os.utime(fd, ns=(first + i, first + i))
                except OSError:
                    pass
            os.close(fd)

    def _reserve_stamps(self, n: int) -> int:
        """The first of n strictly increasing use stamps (mtime, ns) for files written now, so the
        LRU order, even within one batch, survives a restart: the start-up scan sorts by mtime."""
        with self._io_lock:
            first = max(time.time_ns(), self._last_stamp + 1)
            self._last_stamp = first + n - 1
        return first

    def _enter_disk_full(self, skipped: int) -> None:
        self._c["disk_full"] += 1
        self._c["writes_skipped"] += skipped
        self._degraded_until = time.monotonic() + self._disk_full_retry_s
        if not self._warned_full:
            self._warned_full = True
            log.warning("storage tier %s: disk full (ENOSPC); writes disabled, retrying every %.0f s "
                        "(counted in stats()['disk_full'])", self.path, self._disk_full_retry_s)

    def discard(self, keys: List[bytes]) -> None:
        keys = check_keys(keys)
        with self._lock:
            if self._closed:
                return
            for k in keys:
                nm = self._name(k)
                if nm in self._index:
                    self._drop(nm, corrupt=False)  # read-only: forgotten, the file stays
                elif nm in self._writing:
                    self._cancelled.add(nm)  # being written: dropped when its write ends

    def stats(self) -> dict:
        """A snapshot without the I/O lock (the metrics export runs on SGLang's scheduler thread and
        must not wait for a worker's disk I/O): counters are copied in one atomic dict copy, so a
        snapshot may lag a transfer in progress by its own counts, never more."""
        raw = dict(self._c)
        c = {k: (int(v) if k not in ("read_s", "write_s") else v) for k, v in raw.items()}
        c.update(
            name=self.name, node=self.node, path=self.path,
            backend=("nixl-" + self._bk.lower()) if self._agent is not None else "os",
            pages=len(self._index), used_bytes=self._used, capacity_bytes=self.capacity_bytes,
            read_only=self.read_only, fsync=self.fsync,
            bytes=int(raw["bytes_read"] + raw["bytes_written"]),
            write_degraded=time.monotonic() < self._degraded_until,
            read_gbps=(raw["bytes_read"] / raw["read_s"] / 1e9) if raw["read_s"] else 0.0,
            write_gbps=(raw["bytes_written"] / raw["write_s"] / 1e9) if raw["write_s"] else 0.0,
            closed=self._closed)
        return c

    def close(self) -> None:
        with self._lock, self._io_lock:
            if self._closed:
                return
            self._closed = True
            if self._agent is not None and self._hdr_reg is not None:
                try:
                    self._agent.deregister_memory(self._hdr_reg)
                except Exception as e:  # NIXL errors share no base; closing drops the agent anyway
                    log.debug("storage tier: deregister at close: %r", e)
            self._hdr_reg = None
            self._agent = None
            if self._lock_fd < 0:
                return
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:  # a finalizer must not raise (and may run at interpreter exit, modules half gone)
            pass
