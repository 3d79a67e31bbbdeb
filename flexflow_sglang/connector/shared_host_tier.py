"""SharedHostTier: one host tier per node, in a shared-memory segment, used by every process that
serves the same model shard (data-parallel ranks of one server, other servers on the node).

Same interface as HostTier (the connector only picks the class), plus `first_changed`, which the
connector calls after copying pages out: a page another process rewrote during the copy makes the
load a miss.

Segment: /dev/shm/flexflow-kv-<uid>-<hash>, mode 0600, hash over the model/layout/shard fingerprint
and the geometry (page words, word size, capacity), so different models, TP shards or PP stages
never share one. Layout: a header with the process table, per-page metadata arrays, a free-page
stack, a hash index (two candidate buckets of 8 ways per key; keys are already 32-byte hashes), and
the page rows. All metadata changes happen under flock() on the segment's file descriptor: the
kernel drops the lock when its holder dies, so a SIGKILLed process never leaves it held.

Page life cycle, per page: FREE -> WRITING (reserved by one process, owner pid + start time
recorded, invisible to lookups) -> READY (published by commit, after the bytes are written and
checksummed) -> FREE (evicted, discarded, cleared). Each transition bumps the page's generation.
- A process killed mid-write leaves its pages WRITING: they were never visible. Whoever next runs
  short of pages (or attaches) finds the owner dead (pid gone or pid reused by a process with
  another start time) and frees them.
- Readers do not lock pages while copying (a copy can be long). They record each page's
  generation at lookup and compare after the copy (`first_changed`): a writer bumps the
  generation, under the lock, before it touches the bytes, so an unchanged generation proves the
  copy saw only the published bytes. Checksums are verified as in HostTier.
- Eviction is LRU over READY pages by a shared clock; pages a caller protects are skipped.

Segment lifetime: every attached process is in the table; the last one to close unlinks the
segment. A detached reaper (stdlib only, own session, so it outlives the server's process group)
unlinks it once every registered process is dead, for the case where the last one was SIGKILLed.
A segment found with no live process at attach is re-initialised (its pages might predate new
weights at the same model path).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import subprocess
import sys
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .host_tier import contiguous_runs

logger = logging.getLogger(__name__)

MAGIC = 0x31564B5746465846  # "FXFFWKV1"
VERSION = 1
SHM_DIR = "/dev/shm"
PREFIX = "flexflow-kv-"
MAX_PROCS = 256
WAYS = 8
HEADER_BYTES = 4096 + MAX_PROCS * 16
# RETIRED: dropped from the index while a background job of some process still reads it (pinned);
# freed when the last pin goes
FREE, WRITING, READY, RETIRED = 0, 1, 2, 3

# header words (u64 / i64)
H_MAGIC, H_VERSION, H_STATE, H_PAGE_WORDS, H_WORD_SIZE, H_CAPACITY, H_NBUCKETS, H_CLOCK, \
    H_FREE_TOP, H_READY, H_REAPER_PID, H_REAPER_START, H_EVICTIONS, H_RECLAIMED, H_FRESH = range(15)
H_PROCS = 512  # word offset of the process table: (pid, start time) pairs


def proc_start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (0 if it does not exist): with the pid it names
    one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    try:
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return 0


def alive(pid: int, start: int) -> bool:
    return pid > 0 and start > 0 and proc_start_time(pid) == start


def segment_name(fingerprint: str, page_words: int, word_size: int, capacity_pages: int) -> str:
    h = hashlib.blake2b(repr((fingerprint, page_words, word_size, capacity_pages, VERSION)).encode(),
                        digest_size=10).hexdigest()
    return f"{PREFIX}{os.getuid()}-{h}"


def _layout(capacity: int, page_words: int, word_size: int) -> Dict[str, Tuple[int, int]]:
    """name -> (byte offset, byte length) of every region, data rows 4 KiB aligned."""
    nb = 1
    while nb * WAYS < 2 * capacity:
        nb *= 2
    regions, off = {}, HEADER_BYTES
    for name, nbytes in (("state", 4 * capacity), ("gen", 8 * capacity), ("owner", 16 * capacity),
                         ("stamp", 8 * capacity), ("sums", 8 * capacity), ("pins", 4 * capacity),
                         ("pin_owner", 16 * capacity), ("keys", 32 * capacity),
                         ("free", 8 * capacity), ("table", 8 * nb * WAYS)):
        off = (off + 63) // 64 * 64
        regions[name] = (off, nbytes)
        off += nbytes
    off = (off + 4095) // 4096 * 4096
    regions["data"] = (off, capacity * page_words * word_size)
    regions["_nbuckets"] = (nb, 0)
    regions["_total"] = (off + capacity * page_words * word_size, 0)
    return regions


class SharedHostTier:
    name = "host"
    shared = True
    #: its checksum is a word sum over shared memory, not copy_kernels' hash: loads verify in a
    #: separate pass and also check generations (first_changed)
    fused_hash = False

    def __init__(self, page_words: int, word_dtype: torch.dtype, capacity_pages: int, *, node: Optional[str] = None,
                 verify_checksums: bool = True, pin_memory: bool = False, fingerprint: str = "",
                 shm_dir: Optional[str] = None, start_reaper: bool = True, path: Optional[str] = None):
        if capacity_pages < 1:
            raise ValueError(f"host tier capacity must be at least one page, got {capacity_pages}")
        self.node = node
        self.page_words = page_words
        self.word_dtype = word_dtype
        self.capacity_pages = capacity_pages
        self.verify_checksums = verify_checksums
        wsize = torch.empty((), dtype=word_dtype).element_size()
        self.page_nbytes = wsize * page_words
        shm_dir = shm_dir or os.environ.get("FLEXFLOW_SHM_DIR") or SHM_DIR  # tests point it elsewhere
        # `path`: attach to an existing segment only (a pipeline stage checking another stage's tier)
        self.attach_only = path is not None
        self.path = path or os.path.join(shm_dir, segment_name(fingerprint, page_words, wsize, capacity_pages))
        self.pid, self.start = os.getpid(), proc_start_time(os.getpid())
        self.evictions = 0
        self.checksum_failures = 0
        self._reads: Dict[int, int] = {}  # page -> generation this process saw it READY with
        self._my_pins: Dict[int, int] = {}  # page -> pins this process holds
        self._closed = False
        self._fd = -1
        if not self.attach_only:
            self._gc_stale()
        self._attach()
        self.pinned = False
        if pin_memory and torch.cuda.is_available():  # register the mapping once in this process
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self.words.data_ptr(), self.words.numel() * wsize, 0)
                self.pinned = int(getattr(rc, "value", rc)) == 0
            except Exception:  # noqa: BLE001 - unpinned copies still work, only slower
                logger.exception("flexflow: could not register the shared host tier with CUDA")
        if start_reaper:
            self._ensure_reaper()
        logger.info("flexflow: shared host tier %s (%d pages of %d B, %d process(es) attached)", self.path,
                    capacity_pages, self.page_nbytes, self.attached_processes())

    # ----------------------------------------------------------------- attach / detach
    def _gc_stale(self) -> None:
        """Unlink this user's segments in the same directory whose every process and reaper are dead
        (all of them killed at once): the next tier to start cleans up after them."""
        d = os.path.dirname(self.path)
        mine = f"{PREFIX}{os.getuid()}-"
        try:
            names = [n for n in os.listdir(d) if n.startswith(mine) and os.path.join(d, n) != self.path]
        except OSError:
            return
        need = (H_PROCS + 2 * MAX_PROCS) * 8
        for n in names:
            path = os.path.join(d, n)
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or st.st_size < need:
                    continue
                h = np.frombuffer(os.pread(fd, need, 0), dtype=np.int64)
                if h[H_MAGIC] != MAGIC:
                    continue
                procs = h[H_PROCS:].reshape(MAX_PROCS, 2)
                if alive(int(h[H_REAPER_PID]), int(h[H_REAPER_START])) or \
                        any(alive(int(p), int(t)) for p, t in procs if p > 0):
                    continue
                if os.stat(path).st_ino == st.st_ino:
                    os.unlink(path)
                    logger.info("flexflow: removed stale shared host tier %s (no live process)", path)
            except OSError:  # locked by a live process, or gone meanwhile
                pass
            finally:
                os.close(fd)

    def _attach(self) -> None:
        cap, wsize = self.capacity_pages, self.page_nbytes // self.page_words
        lay = _layout(cap, self.page_words, wsize)
        total = lay["_total"][0]
        for _ in range(10):  # retried when the file was unlinked between open and lock
            flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | (0 if self.attach_only else os.O_CREAT)
            fd = os.open(self.path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
                try:
                    same = os.stat(self.path).st_ino == st.st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    raise PermissionError(f"shared host tier {self.path}: owned by uid {st.st_uid} with mode "
                                          f"{oct(st.st_mode & 0o777)}; expected uid {os.getuid()}, mode 0600")
                fresh = st.st_size == 0
                if self.attach_only and (fresh or st.st_size != total):
                    raise ValueError(f"shared host tier {self.path}: not a segment of this geometry")
                if fresh:
                    os.ftruncate(fd, total)
                elif st.st_size != total:
                    raise ValueError(f"shared host tier {self.path}: size {st.st_size} B, expected {total} B")
                self._map(fd, lay)
                h = self._h
                if self.attach_only and (h[H_MAGIC] != MAGIC or h[H_STATE] != 1):
                    raise ValueError(f"shared host tier {self.path}: not initialised")
                if not self.attach_only and (fresh or h[H_MAGIC] != MAGIC or h[H_STATE] != 1
                                             or not self._any_alive()):
                    self._init_segment(lay, fresh)
                elif (h[H_PAGE_WORDS], h[H_WORD_SIZE], h[H_CAPACITY]) != (self.page_words, wsize, cap):
                    raise ValueError(f"shared host tier {self.path}: geometry {tuple(h[H_PAGE_WORDS:H_CAPACITY + 1])} "
                                     f"!= ({self.page_words}, {wsize}, {cap})")
                else:
                    self._reclaim_dead()
                self._register()
                fcntl.flock(fd, fcntl.LOCK_UN)
                self._fd = fd
                return
            except BaseException:
                self._unmap()
                os.close(fd)
                raise
        raise OSError(errno.EAGAIN, f"shared host tier {self.path} kept being replaced while attaching")

    def _map(self, fd: int, lay) -> None:
        self._mm = mmap.mmap(fd, lay["_total"][0], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        buf = self._mm

        def arr(name, dtype, shape=None):
            off, n = lay[name]
            a = np.frombuffer(buf, dtype=dtype, count=n // np.dtype(dtype).itemsize, offset=off)
            return a.reshape(shape) if shape else a

        cap = self.capacity_pages
        self._nb = lay["_nbuckets"][0]
        self._h = np.frombuffer(buf, dtype=np.int64, count=H_PROCS + 2 * MAX_PROCS, offset=0)
        self._procs = self._h[H_PROCS:].reshape(MAX_PROCS, 2)
        self._state = arr("state", np.int32)
        self._gen = arr("gen", np.int64)
        self._owner = arr("owner", np.int64, (cap, 2))
        self._stamp = arr("stamp", np.int64)
        self._sums_np = arr("sums", np.int64)
        self._pins = arr("pins", np.int32)
        self._pin_owner = arr("pin_owner", np.int64, (cap, 2))
        self._keys = arr("keys", np.uint64, (cap, 4))
        self._free = arr("free", np.int64)
        self._table = arr("table", np.int64, (self._nb, WAYS))
        off, n = lay["data"]
        self.words = torch.frombuffer(buf, dtype=self.word_dtype, count=cap * self.page_words,
                                      offset=off).view(cap, self.page_words)

    def _unmap(self) -> None:
        for a in ("_h", "_procs", "_state", "_gen", "_owner", "_stamp", "_sums_np", "_pins", "_pin_owner", "_keys", "_free", "_table"):
            if hasattr(self, a):
                delattr(self, a)
        self.words = torch.empty((0, self.page_words), dtype=self.word_dtype)
        mm = getattr(self, "_mm", None)
        self._mm = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor view still exists somewhere: the mapping goes with it
                pass

    def _init_segment(self, lay, fresh: bool) -> None:
        """A fresh (ftruncated, all-zero) segment needs only its header: every array's zero is its
        empty state, and pages are handed out from the never-used range [H_FRESH, capacity) before
        the free stack, so start-up touches no page of metadata. A stale segment is zeroed."""
        cap = self.capacity_pages
        h = self._h
        h[:] = 0
        if not fresh:
            for a in (self._state, self._gen, self._owner, self._stamp, self._pins, self._pin_owner, self._table):
                a[...] = 0
        h[H_PAGE_WORDS], h[H_WORD_SIZE], h[H_CAPACITY] = self.page_words, self.page_nbytes // self.page_words, cap
        h[H_NBUCKETS] = self._nb
        h[H_VERSION] = VERSION
        h[H_MAGIC] = MAGIC
        h[H_STATE] = 1

    def _any_alive(self) -> bool:
        return any(alive(int(p), int(s)) for p, s in self._procs if p > 0)

    def _register(self) -> None:
        procs = self._procs
        for i in range(MAX_PROCS):
            p, s = int(procs[i, 0]), int(procs[i, 1])
            if p <= 0 or not alive(p, s):
                procs[i] = (self.pid, self.start)
                self._slot = i  # one slot per attachment (a process may attach twice, e.g. tests)
                return
        raise RuntimeError(f"shared host tier {self.path}: more than {MAX_PROCS} processes attached")

    def attached_processes(self) -> int:
        if self._closed:
            return 0
        with self._locked():
            return sum(1 for p, s in self._procs if p > 0 and alive(int(p), int(s)))

    def _ensure_reaper(self) -> None:
        with self._locked():
            h = self._h
            if alive(int(h[H_REAPER_PID]), int(h[H_REAPER_START])):
                return
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_reaper.py")
        try:  # it forks and its parent exits at once; the reaper registers itself in the header
            subprocess.run([sys.executable, "-I", "-S", script, self.path], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           close_fds=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            logger.exception("flexflow: no reaper for %s (it is still unlinked by the last process to close)",
                             self.path)

    class _Lock:
        __slots__ = ("fd",)

        def __init__(self, fd):
            self.fd = fd

        def __enter__(self):
            fcntl.flock(self.fd, fcntl.LOCK_EX)

        def __exit__(self, *exc):
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _locked(self) -> "_Lock":
        if self._closed:
            raise RuntimeError("shared host tier is closed")
        return self._Lock(self._fd)

    # ----------------------------------------------------------------- index
    def _key_array(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(len(keys), 4)

    def _find(self, K: np.ndarray) -> np.ndarray:
        """Page of each key row (READY only), -1 where absent. Caller holds the lock."""
        if len(K) == 0:
            return np.empty(0, dtype=np.int64)
        mask = np.uint64(self._nb - 1)
        cand = np.concatenate((self._table[K[:, 0] & mask], self._table[K[:, 1] & mask]), axis=1) - 1  # (n, 16)
        safe = np.maximum(cand, 0)
        hit = (cand >= 0) & (self._state[safe] == READY) & (self._keys[safe] == K[:, None, :]).all(axis=2)
        first = hit.argmax(axis=1)
        rows = np.arange(len(K))
        return np.where(hit[rows, first], cand[rows, first], -1)

    def _unindex(self, pages: Iterable[int]) -> None:
        t = self._table
        mask = self._nb - 1
        for p in pages:
            k = self._keys[p]
            for b in (int(k[0]) & mask, int(k[1]) & mask):
                w = np.flatnonzero(t[b] == p + 1)
                if len(w):
                    t[b, w[0]] = 0
                    break

    def _index(self, p: int, k: np.ndarray) -> bool:
        t = self._table
        mask = self._nb - 1
        for b in (int(k[0]) & mask, int(k[1]) & mask):
            w = np.flatnonzero(t[b] == 0)
            if len(w):
                t[b, w[0]] = p + 1
                return True
        return False  # both buckets full (vanishingly rare at load <= 0.5): not stored

    def _to_free(self, pages: Sequence[int]) -> None:
        if not len(pages):
            return
        pages = np.asarray(pages, dtype=np.int64)
        pinned = self._pins[pages] > 0
        if pinned.any():  # a job still reads them: free when unpinned
            self._state[pages[pinned]] = RETIRED
            self._gen[pages[pinned]] += 1
            pages = pages[~pinned]
            if not len(pages):
                return
        self._state[pages] = FREE
        self._gen[pages] += 1
        top = int(self._h[H_FREE_TOP])
        self._free[top:top + len(pages)] = np.sort(pages)[::-1]
        self._h[H_FREE_TOP] = top + len(pages)

    def _tick(self, n: int) -> np.ndarray:
        c = int(self._h[H_CLOCK])
        self._h[H_CLOCK] = c + n
        return np.arange(c + 1, c + n + 1, dtype=np.int64)

    def _reclaim_dead(self) -> int:
        """Free pages reserved by processes that died before committing (never visible)."""
        writing = np.flatnonzero(self._state == WRITING)
        dead = []
        verdict: Dict[Tuple[int, int], bool] = {}
        for p in writing.tolist():
            owner = (int(self._owner[p, 0]), int(self._owner[p, 1]))
            if owner not in verdict:
                verdict[owner] = alive(*owner)
            if not verdict[owner]:
                dead.append(p)
        self._to_free(dead)
        # pins of dead processes (their jobs died with them)
        pinned = np.flatnonzero(self._pins > 0)
        for p in pinned.tolist():
            owner = (int(self._pin_owner[p, 0]), int(self._pin_owner[p, 1]))
            if owner not in verdict:
                verdict[owner] = alive(*owner)
            if not verdict[owner]:
                self._pins[p] = 0
                if self._state[p] == RETIRED:
                    self._to_free([p])
        self._h[H_RECLAIMED] += len(dead)
        if dead:
            logger.info("flexflow: shared host tier reclaimed %d pages left half-written by dead processes", len(dead))
        return len(dead)

    # ----------------------------------------------------------------- queries
    @property
    def used_pages(self) -> int:
        return int(self._h[H_READY]) if not self._closed else 0

    @property
    def free_pages(self) -> int:
        if self._closed:
            return 0
        return int(self._h[H_FREE_TOP]) + self.capacity_pages - int(self._h[H_FRESH])

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._locked():
            found = self._find(self._key_array(keys))
        miss = np.flatnonzero(found < 0)
        return int(miss[0]) if len(miss) else len(keys)

    def page_of(self, key: bytes) -> Optional[int]:
        with self._locked():
            p = int(self._find(self._key_array([key]))[0])
            if p < 0:
                return None
            self._reads[p] = int(self._gen[p])
        return p

    def pages_of(self, keys: Sequence[bytes]) -> List[Optional[int]]:
        """page_of for every key, under one lock and one lookup."""
        if not keys:
            return []
        with self._locked():
            found = self._find(self._key_array(keys))
            held = found[found >= 0]
            for p, g in zip(held.tolist(), self._gen[held].tolist()):
                self._reads[p] = g
        return [p if p >= 0 else None for p in found.tolist()]

    def pages_for(self, keys: Sequence[bytes]) -> List[int]:
        if not keys:
            return []
        with self._locked():
            found = self._find(self._key_array(keys))
            miss = np.flatnonzero(found < 0)
            pages = found[: int(miss[0]) if len(miss) else len(keys)]
            self._stamp[pages] = self._tick(len(pages))
            for p, g in zip(pages.tolist(), self._gen[pages].tolist()):
                self._reads[p] = g
        return pages.tolist()

    def touch(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if not keys:
            return
        with self._locked():
            found = self._find(self._key_array(keys))
            found = found[found >= 0]
            self._stamp[found] = self._tick(len(found))

    def first_changed(self, pages: Sequence[int]) -> int:
        """Index (into `pages`) of the first page that is no longer the one this process looked up
        (rewritten, evicted or discarded since page_of/pages_for/commit), or -1: call after copying
        the pages out, and treat a non-negative answer as a miss."""
        if not len(pages):
            return -1
        pages = list(pages)
        seen = np.asarray([self._reads.get(p, -1) for p in pages], dtype=np.int64)
        idx = np.asarray(pages, dtype=np.int64)
        with self._locked():
            ok = (self._gen[idx] == seen) & (self._state[idx] == READY)
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else -1

    # ----------------------------------------------------------------- store side
    def reserve(self, n: int, protect: Collection[bytes] = ()) -> Tuple[List[int], List[Tuple[bytes, int]]]:
        """As HostTier.reserve: up to `n` pages this process may write, free ones first, then LRU
        victims (not in `protect`); victims keep their bytes until the caller overwrites them."""
        if n <= 0:
            return [], []
        with self._locked():
            h = self._h
            cap = self.capacity_pages
            if int(h[H_FREE_TOP]) + cap - int(h[H_FRESH]) < n:
                self._reclaim_dead()
            top = int(h[H_FREE_TOP])
            take = min(n, top)
            pages = self._free[top - take:top][::-1].tolist()  # recycled pages first
            h[H_FREE_TOP] = top - take
            fresh = int(h[H_FRESH])
            more = min(n - len(pages), cap - fresh)
            if more > 0:  # then pages never handed out
                pages.extend(range(fresh, fresh + more))
                h[H_FRESH] = fresh + more
            evicted: List[Tuple[bytes, int]] = []
            if len(pages) < n:
                ready = np.flatnonzero((self._state == READY) & (self._pins == 0))
                if protect and len(ready):
                    pk = self._key_array(list(protect))
                    prot = self._find(pk)
                    ready = np.setdiff1d(ready, prot[prot >= 0], assume_unique=False)
                k = min(n - len(pages), len(ready))
                if k:
                    order = np.argpartition(self._stamp[ready], k - 1)[:k] if k < len(ready) else np.arange(len(ready))
                    victims = ready[order]
                    victims = victims[np.argsort(self._stamp[victims], kind="stable")]
                    self._unindex(victims.tolist())
                    for p in victims.tolist():
                        evicted.append((self._keys[p].tobytes(), p))
                    pages.extend(victims.tolist())
                    h[H_READY] -= k
                    h[H_EVICTIONS] += k
                    self.evictions += k
            if pages:
                idx = np.asarray(pages, dtype=np.int64)
                self._state[idx] = WRITING
                self._gen[idx] += 1
                self._owner[idx] = (self.pid, self.start)
        return pages, evicted

    def release(self, pages: Iterable[int]) -> None:
        """Give reserved pages back (a store that failed or was cancelled)."""
        pages = [p for p in pages]
        if not pages or self._closed:
            return
        with self._locked():
            idx = np.asarray(pages, dtype=np.int64)
            mine = (self._state[idx] == WRITING) & (self._owner[idx, 0] == self.pid)
            self._to_free(idx[mine])

    def commit(self, keys: Sequence[bytes], pages: Sequence[int], sums: Optional[torch.Tensor] = None) -> None:
        """Publish reserved, written pages under `keys` (checksums taken before they become visible;
        `sums`: this tier's page_sums of them, taken by whoever wrote them, e.g. an engine worker).
        A key another process published meanwhile keeps that copy; ours goes back to the free list."""
        if not pages:
            return
        keys, pages = list(keys)[: len(pages)], list(pages)
        if not self.verify_checksums:
            sums = None
        elif sums is None or len(sums) != len(pages):
            sums = self.page_sums(pages)  # our own reserved pages: no lock
        K = self._key_array(keys)
        with self._locked():
            existing = self._find(K)
            dup, new = [], 0
            stamps = self._tick(len(pages))
            published: Dict[bytes, int] = {}
            for i, p in enumerate(pages):
                if self._state[p] != WRITING or self._owner[p, 0] != self.pid:
                    continue  # not ours any more (cannot happen while we live); never publish it
                old = int(existing[i]) if existing[i] >= 0 else published.get(keys[i], -1)
                if old >= 0:  # already published (by another process, or earlier in this call)
                    dup.append(p)
                    self._stamp[old] = stamps[i]
                    continue
                self._keys[p] = K[i]
                if not self._index(p, K[i]):
                    dup.append(p)
                    continue
                if sums is not None:
                    self._sums_np[p] = int(sums[i])
                self._stamp[p] = stamps[i]
                self._gen[p] += 1
                self._state[p] = READY  # last: the page becomes visible with its bytes and checksum
                self._reads[p] = int(self._gen[p])
                published[keys[i]] = p
                new += 1
            self._h[H_READY] += new
            self._to_free(dup)

    # ----------------------------------------------------------------- pins (background readers)
    def pin(self, pages: Iterable[int]) -> None:
        """Keep `pages` from eviction and reuse by every process until unpinned. The first pinner is
        recorded as the owner: if it dies, the pin goes with it (a second process pinning the same
        page at the same time then loses its protection early; the connector pins only pages it has
        just committed, so that does not happen)."""
        pages = list(pages)
        if not pages:
            return
        with self._locked():
            for p in pages:
                if self._pins[p] == 0:
                    self._pin_owner[p] = (self.pid, self.start)
                self._pins[p] += 1
                self._my_pins[p] = self._my_pins.get(p, 0) + 1

    def unpin(self, pages: Iterable[int]) -> None:
        pages = [p for p in pages if self._my_pins.get(p, 0) > 0]
        if not pages or self._closed:
            return
        with self._locked():
            self._unpin_locked(pages)

    def _unpin_locked(self, pages: Iterable[int]) -> None:
        for p in pages:
            c = self._my_pins.get(p, 0) - 1
            if c > 0:
                self._my_pins[p] = c
            else:
                self._my_pins.pop(p, None)
            if self._pins[p] > 0:
                self._pins[p] -= 1
            if self._pins[p] == 0 and self._state[p] == RETIRED:
                self._to_free([p])

    @property
    def pinned_pages(self) -> int:
        return len(self._my_pins)

    def pin_present(self, keys: Sequence[bytes]) -> Optional[List[int]]:
        """Pin the pages of `keys` for another process to load, if every one is present and passes
        its checksum; else pin nothing and return None. The pins are handed over: whoever loads
        the pages releases them with `unpin_foreign` (pipeline stage 0 pins a later stage's pages
        before it decides a host hit; the stage unpins them after its load). If this process dies
        first, its pins are dropped with it."""
        if not keys:
            return []
        K = self._key_array(keys)
        with self._locked():
            found = self._find(K)
            if (found < 0).any():
                return None
            for p in found.tolist():
                if self._pins[p] == 0:
                    self._pin_owner[p] = (self.pid, self.start)
                self._pins[p] += 1
        pages = found.tolist()
        if self.verify_checksums:  # pinned: nobody rewrites them while we read
            idx = np.asarray(pages, dtype=np.int64)
            if (self.page_sums(pages).numpy() != self._sums_np[idx]).any():
                self.checksum_failures += 1
                self.unpin_foreign(pages)
                return None
        return pages

    def unpin_foreign(self, pages: Iterable[int]) -> None:
        """Release pins another process handed over (see pin_present)."""
        pages = list(pages)
        if not pages or self._closed:
            return
        with self._locked():
            for p in pages:
                if self._pins[p] > 0:
                    self._pins[p] -= 1
                if self._pins[p] == 0 and self._state[p] == RETIRED:
                    self._to_free([p])

    # ----------------------------------------------------------------- checksums
    def page_sums(self, pages: Sequence[int]) -> torch.Tensor:
        out = torch.empty(len(pages), dtype=torch.int64)
        w = self.words
        wide = w.view(torch.int64) if self.page_nbytes % 8 == 0 and w.dtype != torch.int64 else w
        for i0, i1, start in contiguous_runs(list(pages)):
            torch.sum(wide[start:start + (i1 - i0)], dim=1, dtype=torch.int64, out=out[i0:i1])
        return out

    def first_bad_page(self, pages: Sequence[int]) -> int:
        """Index of the first page whose bytes fail their checksum, or that changed since this
        process looked it up; -1 if none."""
        if not pages:
            return -1
        if self.verify_checksums:
            got = self.page_sums(pages).numpy()
            idx = np.asarray(list(pages), dtype=np.int64)
            with self._locked():
                want = self._sums_np[idx].copy()
            bad = np.flatnonzero(got != want)
            if len(bad):
                changed = self.first_changed([pages[int(bad[0])]])
                if changed < 0:  # same page, same generation, other bytes: real corruption
                    self.checksum_failures += 1
                return int(bad[0])
        return self.first_changed(pages)

    # ----------------------------------------------------------------- maintenance
    def discard(self, keys: Iterable[bytes]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        with self._locked():
            found = self._find(self._key_array(keys))
            found = np.unique(found[found >= 0])
            self._unindex(found.tolist())
            self._to_free(found)
            self._h[H_READY] -= len(found)
        return len(found)

    def clear(self) -> None:
        """Forget every published page (pages being written stay reserved by their writers)."""
        with self._locked():
            ready = np.flatnonzero(self._state == READY)
            self._table[:] = 0
            self._to_free(ready)
            self._h[H_READY] = 0

    def stats(self) -> Dict[str, int]:
        if self._closed:
            return {"capacity_pages": 0, "used_pages": 0, "shared": 1}
        with self._locked():
            h = self._h
            procs = sum(1 for p, s in self._procs if p > 0 and alive(int(p), int(s)))
            st = {"capacity_pages": self.capacity_pages, "used_pages": int(h[H_READY]),
                  "free_pages": int(h[H_FREE_TOP]) + self.capacity_pages - int(h[H_FRESH]),
                  "page_nbytes": self.page_nbytes,
                  "used_bytes": int(h[H_READY]) * self.page_nbytes,
                  "capacity_bytes": self.capacity_pages * self.page_nbytes, "evictions": self.evictions,
                  "segment_evictions": int(h[H_EVICTIONS]), "reclaimed_pages": int(h[H_RECLAIMED]),
                  "checksum_failures": self.checksum_failures, "pinned": int(self.pinned), "shared": 1,
                  "pages_pinned_by_jobs": int((self._pins > 0).sum()),
                  "attached_processes": procs}
        return st

    def close(self) -> None:
        """Detach; the last live process unlinks the segment. Pages this process had reserved but
        not committed go back to the free list. Idempotent."""
        if self._closed:
            return
        try:
            with self._locked():
                self._unpin_locked([p for p, c in list(self._my_pins.items()) for _ in range(c)])
                mine = np.flatnonzero((self._state == WRITING) & (self._owner[:, 0] == self.pid))
                self._to_free(mine)
                if tuple(self._procs[self._slot]) == (self.pid, self.start):
                    self._procs[self._slot] = (0, 0)
                if not self._any_alive():
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                if self.pinned:
                    try:
                        torch.cuda.cudart().cudaHostUnregister(self.words.data_ptr())
                    except Exception:  # noqa: BLE001
                        pass
        finally:
            self._closed = True
            self._reads.clear()
            self._unmap()
            os.close(self._fd)
            self._fd = -1
            self.capacity_pages = 0

    def __del__(self):  # a tier dropped without close(): still detach (best effort)
        try:
            if not self._closed and self._fd >= 0:
                self.close()
        except Exception:  # noqa: BLE001
            pass
