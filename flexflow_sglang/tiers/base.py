"""Shared pieces of the deep KV tiers: the tier interface (KVTier), page helpers, checksums, NIXL loading.

A tier stores fixed-size KV pages under 32-byte keys. The connector computes the keys from the
prefix chain plus a model/layout fingerprint; a tier never interprets them and never builds a
file name or a wire field from request content.
"""
from __future__ import annotations

import abc
import hashlib
import logging
import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("flexflow_sglang.tiers")

try:  # the compiled kernels: many-row CRC32 and the 64-bit page hash (numpy / zlib without them)
    from .. import _copy_kernels as _ck
except ImportError:  # pragma: no cover - depends on the build
    _ck = None


class KVTier(abc.ABC):
    """A KV tier below host memory (storage, remote, or one a user registers: tiers/registry.py).

    Units and shapes:
      * a key is the connector's 32-byte chained page key (`bytes`, 1..64 bytes accepted): it names
        the KV of one page *and everything before it*, so the leading pages of a key list form a
        prefix. A tier never interprets keys and never builds a file name or wire field from them.
      * a page is the KV of `page_size` tokens over all layers, K and V, in the connector's host
        layout: one row of a 2-D uint8 array `[n, page_nbytes]` (a numpy array or a CPU torch tensor,
        C-contiguous rows; `as_pages` views either as numpy without copying).
      * counts are pages; byte counters in `stats()` are bytes.

    Implementations verify their own data (`get_many_into` counts only pages it loaded *and*
    verified; a corrupt page ends the leading run), never raise for a miss, and are safe to call
    from several threads (the transfer engine's workers and the scheduler thread).

    The connector consults its tiers in list order after the host tier, promotes what a tier returns
    into the host tier, spills host-tier LRU victims into the first tier, and copies freshly stored
    pages into every tier whose `write_through` is true.
    """

    #: short tier name used in metrics, logs and the connector's hit counts ("storage", "remote", ...);
    #: unique among a connector's tiers. `create_tier` fills in the registered name when it is empty.
    name: str = ""
    #: topology node where the tier's bytes live (e.g. "nvme0"): tier I/O is routed host node <-> node.
    #: None: not in the topology (the transfer engine then moves the pages without a routed path).
    node: Optional[str] = None
    #: set by the connector from the config: copy every page the host tier stores here too (else the
    #: tier only receives host-tier evictions, when it is the first deep tier)
    write_through: bool = False
    #: the Router of a tier that routes its own I/O (RemoteTier.route_with installs tiers/routing.py's)
    _router: Any = None

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """Number of leading `keys` the tier holds now (pages; 0..len(keys)). A failure is 0."""

    @abc.abstractmethod
    def put_many(self, keys: Sequence[bytes], pages) -> int:
        """Store row `pages[i]` (`page_nbytes` uint8 bytes) under `keys[i]` for i < len(keys); pages
        already held may be skipped. Returns how many leading keys are held afterwards (pages)."""

    @abc.abstractmethod
    def get_many_into(self, keys: Sequence[bytes], out) -> int:
        """Fill row `out[i]` (writable uint8 `[>= len(keys), page_nbytes]`) with the page of `keys[i]`;
        returns k, the leading pages loaded *and* verified: rows `out[:k]` are valid, later rows are
        undefined. A miss, timeout or corrupt page ends the run (never an exception for a miss)."""

    @abc.abstractmethod
    def discard(self, keys: Sequence[bytes]) -> None:
        """Forget these keys (missing keys are ignored)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters for metrics and logs (pages held, bytes read/written in bytes, hits, misses,
        failures, ...); the connector shows "backend", "path", "capacity_bytes" and "peers" when
        present. Must not raise for a closed tier, and must not wait for the tier's I/O: the
        metrics export calls it on SGLang's scheduler thread (snapshot the counters instead)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (files, agents, connections). Idempotent; later calls are misses."""

    # ------------------------------------------------------------------ optional, with defaults
    def clear(self) -> None:
        """Forget every page (the connector calls it after a weight update: the KV is stale).
        Default: nothing, for tiers whose pages outlive the process and are shared with others."""

    def route_with(self, selector, local_node: Optional[str], *, engine=None) -> bool:
        """Route this tier's own I/O with `selector` (a PathSelector) from `local_node` (this
        process's topology node), opening tickets on `engine` (the connector's TransferEngine).
        Returns True when the tier now routes itself. Default: False, the tier does not route: the
        transfer engine routes and chunks its batches (transfer/legs.py)."""
        return False

    @property
    def can_route(self) -> bool:
        """True when this tier's class implements `route_with`."""
        return type(self).route_with is not KVTier.route_with

    @property
    def routes_itself(self) -> bool:
        """True once `route_with` installed a router: the engine hands it whole batches, unchunked."""
        return self._router is not None

    def holds_locally(self, keys: Sequence[bytes]) -> Optional[List[bool]]:
        """Per key: does the tier hold it, answered from local state without I/O or a wait (the
        scheduler thread asks before spilling host-tier victims: a page the tier already holds
        needs no copy and no write). None: this tier cannot tell cheaply (then every victim spills).
        A stale True costs a future miss, never wrong KV (reads verify)."""
        return None


# ---------------------------------------------------------------------------------------------
# pages
# ---------------------------------------------------------------------------------------------

def as_pages(x, n: int, *, writable: bool = False, what: str = "pages") -> np.ndarray:
    """View `x` (uint8 numpy array or CPU torch tensor, shape [>=n, page_nbytes], C-contiguous
    rows) as a 2-D uint8 numpy array without copying. Raises ValueError on anything else."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{what}: tier pages must be CPU tensors, got device {x.device}")
        if x.dtype != torch.uint8:
            raise ValueError(f"{what}: dtype must be uint8, got {x.dtype}")
        x = x.detach().numpy()  # shares memory
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{what}: expected a uint8 numpy array or CPU tensor, got {type(x).__name__}")
    if x.dtype != np.uint8 or x.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D uint8 array [n, page_nbytes], got {x.dtype} {x.shape}")
    if x.shape[0] < n:
        raise ValueError(f"{what}: {x.shape[0]} rows for {n} keys")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: rows must be C-contiguous")
    if writable and not x.flags.writeable:
        raise ValueError(f"{what}: output buffer is read-only")
    return x


def check_keys(keys: Sequence[bytes]) -> List[bytes]:
    out = []
    for k in keys:
        if not isinstance(k, (bytes, bytearray, memoryview)):
            raise TypeError(f"tier keys must be bytes, got {type(k).__name__}")
        k = bytes(k)
        if not 1 <= len(k) <= 64:
            raise ValueError(f"tier key length must be 1..64 bytes (32 expected), got {len(k)}")
        out.append(k)
    return out


# ---------------------------------------------------------------------------------------------
# lookups on a thread that must not wait (SGLang's scheduler thread decodes for every request)
# ---------------------------------------------------------------------------------------------

_lookup_ctx = threading.local()


class no_wait_lookups:
    """Within this context (on this thread), a tier whose lookup would first wait for its own I/O
    lock (held by an engine worker for a whole transfer over a slow link) answers 0 instead: a miss
    now, never a stalled scheduler thread. The connector's scheduler-thread lookup uses it."""

    def __enter__(self):
        _lookup_ctx.depth = getattr(_lookup_ctx, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _lookup_ctx.depth -= 1


def lookups_must_not_wait() -> bool:
    return getattr(_lookup_ctx, "depth", 0) > 0


# ---------------------------------------------------------------------------------------------
# checksums: CRC32 (zlib, ~2 GiB/s per core here, releases the GIL) over the page payload.
# Several pages are summed in parallel threads. It detects truncation, torn writes, bit rot and
# misdirected transfers; it is not a MAC (the tiers trust their own directory and peers).
# ---------------------------------------------------------------------------------------------

CHECKSUM_CRC32 = 1   # zlib's CRC32 (storage files written before the 64-bit page hash; wire sums)
CHECKSUM_HASH64 = 2  # the host tier's 64-bit page hash (connector/copy_kernels.py): ~8x CRC32's speed
HASH_K = np.uint64(0x9E3779B97F4A7C15)
HASH_C = np.uint64(0xBF58476D1CE4E5B9)
_PAR_MIN_BYTES = 256 << 10
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def page_checksum(buf) -> int:
    if isinstance(buf, np.ndarray) and not buf.flags.c_contiguous:
        buf = np.ascontiguousarray(buf)  # a strided view: CRC32 is over the bytes in order
    return zlib.crc32(memoryview(buf).cast("B")) & 0xFFFFFFFF


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                       thread_name_prefix="ff-tier-crc")
        return _pool


_native_crc: Optional[Tuple[Any, int]] = None   # (the compiled module, zlib's crc32 address), or (None, 0)


def _native_crc32() -> Tuple[Any, int]:
    """The compiled many-rows CRC32 and the address of zlib's crc32, once; (None, 0) without them.
    Checked against zlib.crc32 on a known buffer before it is trusted (a foreign libz with another
    signature would otherwise corrupt every checksum silently)."""
    global _native_crc
    if _native_crc is not None:
        return _native_crc
    found: Tuple[Any, int] = (None, 0)
    try:
        import ctypes
        import ctypes.util
        ck = _ck
        if ck is None:
            raise ImportError("flexflow_sglang._copy_kernels is not built")
        libz = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        addr = ctypes.cast(libz.crc32, ctypes.c_void_p).value or 0
        probe = np.frombuffer(bytes(range(256)) * 67, dtype=np.uint8).reshape(2, -1).copy()
        out = np.zeros(2, dtype=np.int64)
        ck.crc32_rows(addr, probe.ctypes.data, probe.strides[0], probe.shape[1],
                      np.arange(2, dtype=np.int64), out)
        if [int(v) & 0xFFFFFFFF for v in out] == [page_checksum(probe[0]), page_checksum(probe[1])]:
            found = (ck, addr)
        else:  # pragma: no cover - a libz that disagrees with Python's zlib
            log.warning("native CRC32 disagrees with zlib.crc32; tier checksums use zlib per page")
    except (ImportError, OSError, AttributeError, ValueError) as e:
        log.info("native CRC32 unavailable (%s); tier checksums use zlib per page", e)
    _native_crc = found
    return found


def page_checksums(pages: np.ndarray, n: int, rows: Optional[Sequence[int]] = None) -> List[int]:
    """CRC32 of rows 0..n-1 (or of `rows`) of a 2-D uint8 array.

    One compiled call for all rows (the GIL is released once, not once per page), several rows in
    parallel for large pages; zlib per page, in a thread pool, where the kernel is not built."""
    rows = range(n) if rows is None else rows
    if len(rows) == 0:
        return []
    ck, addr = _native_crc32()
    if ck is not None and pages.ndim == 2 and pages.dtype == np.uint8 and pages.strides[1] == 1:
        idx = np.fromiter(rows, dtype=np.int64, count=len(rows))
        if idx.min() < 0 or idx.max() >= pages.shape[0]:
            raise IndexError(f"page_checksums: row out of range 0..{pages.shape[0] - 1}")
        out = np.empty(len(idx), dtype=np.int64)
        threads = 1 if pages.shape[1] < _PAR_MIN_BYTES else max(1, min(4, os.cpu_count() or 1))
        ck.crc32_rows(addr, pages.ctypes.data, pages.strides[0], pages.shape[1], idx, out, threads)
        return [int(v) & 0xFFFFFFFF for v in out]
    if len(rows) == 1 or pages.shape[1] < _PAR_MIN_BYTES or (os.cpu_count() or 1) < 2:
        return [page_checksum(pages[i]) for i in rows]
    return list(_get_pool().map(lambda i: page_checksum(pages[i]), rows))


def hash64_twin(b8: np.ndarray) -> np.ndarray:
    """The 64-bit page hash of each row of a 2-D uint8 array -> uint64[n], in numpy: the reference
    the compiled kernel (_copy_kernels.hash_rows) must match. Rows that are not a
    multiple of 32 bytes are hashed as if zero-padded to one."""
    if b8.shape[1] % 32:
        b8 = np.pad(b8, ((0, 0), (0, 32 - b8.shape[1] % 32)))
    r = np.ascontiguousarray(b8).view(np.uint64).reshape(b8.shape[0], -1, 4)
    nb = r.shape[1]
    with np.errstate(over="ignore"):
        a = r.sum(axis=1, dtype=np.uint64)                                   # [n, 4]
        w = (nb - np.arange(nb, dtype=np.uint64))[None, :, None]             # nb - b
        b = (r * w).sum(axis=1, dtype=np.uint64)                             # [n, 4], wraps
        x = np.concatenate([a, b], axis=1) ^ (np.arange(1, 9, dtype=np.uint64) * HASH_K)
        y = x * HASH_C
        y ^= y >> np.uint64(32)
        return y.sum(axis=1, dtype=np.uint64)


def page_digests(pages: np.ndarray, n: int, rows: Optional[Sequence[int]] = None) -> List[int]:
    """The 64-bit page hash (CHECKSUM_HASH64, unsigned) of rows 0..n-1 (or of `rows`) of a 2-D
    uint8 array: one compiled call with the GIL released (rows of any stride, a multiple of 32 B
    long), else the numpy twin. The deep tiers' payload checksum: one vectorised read per page,
    where zlib's CRC32 runs at ~4 GB/s and was a third of a storage read's CPU time."""
    rows = range(n) if rows is None else rows
    if len(rows) == 0:
        return []
    idx = np.fromiter(rows, dtype=np.int64, count=len(rows))
    if idx.min() < 0 or idx.max() >= pages.shape[0]:
        raise IndexError(f"page_digests: row out of range 0..{pages.shape[0] - 1}")
    ck = _ck
    if (ck is not None and pages.ndim == 2 and pages.dtype == np.uint8 and pages.strides[1] == 1
            and pages.shape[1] % 32 == 0):  # unaligned rows are fine: the kernel loads with memcpy
        out = np.empty(len(idx), dtype=np.int64)
        ck.hash_rows(pages.ctypes.data, pages.strides[0], pages.shape[1], idx, out)
        return [int(v) for v in out.view(np.uint64)]
    return [int(v) for v in hash64_twin(np.asarray(pages)[idx])]


def payload_checksums(pages: np.ndarray, algos: Sequence[int]) -> List[Optional[int]]:
    """Row i's checksum under algos[i] (CHECKSUM_CRC32 or CHECKSUM_HASH64; None for another),
    each algorithm in one call over its rows: a storage read verifies files of both formats."""
    out: List[Optional[int]] = [None] * len(algos)
    for algo, fn in ((CHECKSUM_CRC32, page_checksums), (CHECKSUM_HASH64, page_digests)):
        rows = [i for i, a in enumerate(algos) if a == algo]
        if rows:
            for i, v in zip(rows, fn(pages, len(rows), rows)):
                out[i] = v
    return out


def key_id(key: bytes, fp_hash: bytes, digest_size: int = 16) -> bytes:
    """Keyed hash of a tier key: used for file names and index entries (never the raw key)."""
    return hashlib.blake2b(key, digest_size=digest_size, key=fp_hash, person=b"ffkv-tier").digest()


def fingerprint_hash(fingerprint: str) -> bytes:
    return hashlib.blake2b(fingerprint.encode("utf-8"), digest_size=16, person=b"ffkv-fp").digest()


# ---------------------------------------------------------------------------------------------
# rendezvous (highest-random-weight) hashing
# ---------------------------------------------------------------------------------------------

def rendezvous_rank(key: bytes, peers: Sequence[str]) -> List[int]:
    """Indices of `peers`, best first, for `key`. Adding or removing one peer only moves the keys
    that peer wins/won (1/n of them); ties are impossible in practice (64-bit weights)."""
    ws = []
    for i, p in enumerate(peers):
        h = hashlib.blake2b(key, digest_size=8, key=p.encode("utf-8")[:64], person=b"ffkv-hrw").digest()
        ws.append((int.from_bytes(h, "little"), i))
    ws.sort(reverse=True)
    return [i for _, i in ws]


# ---------------------------------------------------------------------------------------------
# NIXL
# ---------------------------------------------------------------------------------------------

_nixl_cache: Optional[Tuple[object, object, str]] = None


def _import_nixl_api():
    """The `nixl` meta package picks its nixl_cuXX wheel from the CUDA version of torch; with a
    CPU-only torch (version.cuda is None) it falls back to *importing torch* (~1.7 s per process,
    most of a tier server's start-up). When torch is not loaded yet and exactly one backend wheel
    is installed, import that wheel directly: it is the one the meta package would pick."""
    import importlib
    import importlib.util
    if "torch" not in sys.modules:
        found = [m for m in ("nixl_cu13", "nixl_cu12", "nixl_rocm") if importlib.util.find_spec(m)]
        if len(found) == 1:
            api = importlib.import_module(found[0] + "._api")
            return api.nixl_agent, api.nixl_agent_config
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore
    return nixl_agent, nixl_agent_config


def skip_ucx_rdma_modules_without_devices(env=os.environ, sysfs: str = "/sys/class/infiniband") -> bool:
    """On a host with no RDMA device, keep UCX from loading its InfiniBand modules
    (UCX_MODULES=^ib,rdmacm) unless the user set UCX_MODULES. Why: once libibverbs1 is installed
    (Mooncake needs it even for TCP), the UCX bundled with NIXL loads uct_ib, whose bundled
    libnl-route segfaults in its exit-time destructor: every process that used NIXL then exits with
    SIGSEGV (seen: the tier server's clean 'port in use' exit became -11). Without a device the ib
    modules have nothing to drive, so nothing is lost. Returns True when it set the variable."""
    if "UCX_MODULES" in env:
        return False
    try:
        if os.listdir(sysfs):
            return False
    except OSError:
        pass  # no sysfs class at all: no RDMA device either
    env["UCX_MODULES"] = "^ib,rdmacm"
    return True


def load_nixl():
    """(nixl_agent, nixl_agent_config, "") when nixl imports, else (None, None, reason).
    Sets NIXL_LOG_LEVEL=WARN unless the caller set it (NIXL logs to stdout by default)."""
    global _nixl_cache
    if _nixl_cache is None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        skip_ucx_rdma_modules_without_devices()
        try:
            _nixl_cache = (*_import_nixl_api(), "")
        except Exception as e:  # ImportError, missing shared libraries, ...
            _nixl_cache = (None, None, f"{type(e).__name__}: {e}")
    return _nixl_cache


def make_agent(name: str, backends: Sequence[str] = ()):
    """A NIXL agent without the progress thread (it spins a whole core); callers poll."""
    nixl_agent, nixl_agent_config, why = load_nixl()
    if nixl_agent is None:
        raise ImportError(f"nixl is not importable: {why}")
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    for b in backends:
        agent.create_backend(b)
    return agent


def unique_agent_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{os.urandom(4).hex()}"


class XferTimeout(Exception):
    pass


def wait_xfers(agent, handles: Sequence, deadline: Optional[float], poll_s: float = 0.001) -> List[str]:
    """Poll every handle until each is DONE or ERR, or until `deadline` (time.monotonic()).
    Returns the final states ("DONE", "ERR", or "PROC" for those still running at the deadline).
    A NIXL exception from check_xfer_state counts as "ERR"."""
    states = ["PROC"] * len(handles)
    first = True
    while True:
        pending = False
        for i, h in enumerate(handles):
            if states[i] != "PROC":
                continue
            try:
                states[i] = agent.check_xfer_state(h)
            except Exception as e:
                log.debug("check_xfer_state raised %r", e)
                states[i] = "ERR"
            if states[i] == "PROC":
                pending = True
        if not pending:
            return states
        if deadline is not None and time.monotonic() >= deadline:
            return states
        # first re-check quickly: small transfers finish within microseconds
        time.sleep(0.0001 if first else poll_s)
        first = False


def release_nixl(agent, handle, *regs) -> None:
    """Release a finished transfer's handle and its registrations (None entries skipped); a failure
    here only leaks, so it is logged and never raised."""
    for obj, fn in ((handle, agent.release_xfer_handle), *((r, agent.deregister_memory) for r in regs)):
        if obj is not None:
            try:
                fn(obj)
            except Exception as e:  # pragma: no cover  (NIXL errors share no base)
                log.debug("NIXL cleanup: %r", e)


def post_xfer(agent, handle) -> str:
    try:
        return agent.transfer(handle)
    except Exception as e:
        log.debug("transfer() raised %r", e)
        return "ERR"
