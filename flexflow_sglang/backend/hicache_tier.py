"""SGLang's HiCache storage backends as a flexflow deep tier (`hicache_storage`, docs/tiers.md).

SGLang 0.5.23 ships L3 stores behind one interface, `HiCacheStorage`
(sglang/srt/mem_cache/hicache_storage.py: batch exists / get / set), created by name in
`storage/backend_factory.py`: `file`, `mooncake`, `nixl`, `hf3fs`, `aibrix`, ... This module wraps
any of them as a `KVTier`, so the transfer engine moves flexflow pages into and out of them like
into the storage or remote tier. What stays flexflow's:

* the keys: a backend key is `ffkv1-` + hex(blake2b-128(page key, key=fingerprint hash)): it never
  contains request content, and another model/layout/shard fingerprint never shares an object;
* integrity: each object is the storage tier's 64-byte header (magic, version, page size,
  fingerprint hash, key id, payload checksum, header CRC) followed by the page. A get verifies
  all of it in key order; the first page that fails ends the run (a shorter hit), is counted by
  reason and dropped from the backend where the backend can delete (else quarantined: a miss);
* when to read and write, and the path: the connector's engine jobs (never SGLang's scheduler
  thread for bytes), chunked and routed host node <-> the tier's node, which reports the observed
  bandwidth to the NodeAgent.

What the backend does on its own: placement, replication, eviction, membership (Mooncake's master
and segments; the file backend's LRU evictor).

How the bytes go: the backend's batch API. SGLang's `mooncake` backend is set up by SGLang
(config, setup, warm-up, buffer registration) and then driven through its MooncakeDistributedStore
(`batch_is_exist` / `batch_put_from` / `batch_get_into` on a registered staging buffer): those
return a code per key, whereas SGLang's `MooncakeStore.batch_set` reports success when the master
is down (its exists answer -900 counts as present). Every other backend goes through
`batch_exists` / `batch_set(keys, values=[row tensors])` / `batch_get(keys, target_locations=[row
tensors])`, which is what `file` (and the backends built like it) implement.

Bounded waits: every backend call runs on the tier's one I/O thread and is waited for at most
`timeout_ms`; a call that times out or fails (an exception, a Mooncake RPC error) marks the tier
down for `retry_after_s`, during which every call is an immediate miss; while a timed-out call is
still running, nothing else is sent. A backend that cannot start raises one error naming the
backend (the connector logs it and serves without the tier).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError, FlexFlowError
from ..tiers.base import KVTier, as_pages, check_keys, fingerprint_hash, key_id, page_digests, payload_checksums
from ..tiers.storage import HDR, build_header, parse_header

log = logging.getLogger("flexflow_sglang.backend.hicache_tier")

#: the registry name (backend/plugin.py registers it; config: `hicache_storage:` or an `extra_tiers` entry)
TIER_NAME = "hicache_storage"
KEY_PREFIX = "ffkv1-"
#: backends whose bytes stay on this host's disks: the tier's default topology node is the NVMe
LOCAL_DISK_BACKENDS = ("file", "nixl", "hf3fs", "sim")
#: Mooncake result codes (mooncake-store ErrorCode) that mean "no such object" rather than a failure
_MC_NOT_FOUND = -704
_MC_HAS_LEASE = -706
_MC_BUFFER_TOO_SMALL = -600
_QUARANTINE_MAX = 65536
_WARN_FIRST = 20


class HiCacheTierError(FlexFlowError):
    """A HiCache storage backend cannot be used (not installed, cannot start, bad options)."""


# ---------------------------------------------------------------------------------------------
# backend I/O flavours: per-key codes, so a partial batch is a shorter run, never a lie
#   exists -> [1 held | 0 absent | <0 error];  put -> [0 stored | <0 error];
#   get -> [>=0 loaded | -704 absent | <0 error]
# ---------------------------------------------------------------------------------------------

class _GenericIO:
    """`HiCacheStorage` batch API with one CPU uint8 tensor per object (the `file` backend's shape)."""

    kind = "hicache-batch"

    def __init__(self, backend):
        self.backend = backend

    def prepare(self, staging) -> None:
        pass

    def exists(self, names: List[str]) -> List[int]:
        n = int(self.backend.batch_exists(names) or 0)
        n = max(0, min(n, len(names)))
        return [1] * n + [0] * (len(names) - n)

    def put(self, names: List[str], staging, replace: Sequence[bool]) -> List[int]:
        """Store staging row i (a [len(names), object bytes] uint8 tensor) under names[i]."""
        rows = list(staging.unbind(0))
        if any(replace):
            self.remove([nm for nm, r in zip(names, replace) if r])
        ok = self.backend.batch_set(names, values=rows)
        if ok is True:
            return [0] * len(names)
        held = self.exists(names)  # partial: whatever is there now, in order
        return [0 if h == 1 else -1 for h in held]

    def get(self, names: List[str], staging) -> List[int]:
        """Read names[i] into staging row i."""
        rows = list(staging.unbind(0))
        try:
            res = self.backend.batch_get(names, target_locations=rows)
        except Exception:  # noqa: BLE001 - e.g. the file backend's short read: key by key
            return self._get_each(names, rows)
        return _codes_from_get(res, len(names))

    def _get_each(self, names, rows) -> List[int]:
        out = []
        for nm, row in zip(names, rows):
            try:
                r = self.backend.get(nm, row)
            except Exception:  # noqa: BLE001
                r = None
            ok = r is not None and r is not False
            out.append(0 if ok else _MC_NOT_FOUND)
            if not ok:
                break
        return out + [_MC_NOT_FOUND] * (len(names) - len(out))

    def remove(self, names: List[str]) -> bool:
        return False

    def clear(self) -> bool:
        return False

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


class _FileIO(_GenericIO):
    """SGLang's `file` backend: as generic, plus deleting one object (its file) for dropped pages."""

    kind = "hicache-file"

    def remove(self, names: List[str]) -> bool:
        b = self.backend
        done = True
        for nm in names:
            try:
                os.remove(os.path.join(b.file_path, f"{b._get_suffixed_key(nm)}.bin"))
            except FileNotFoundError:
                pass
            except OSError:
                done = False
            mc = getattr(b, "metadata_cache", None)
            if mc is not None:
                mc.remove(b._get_suffixed_key(nm))
        return done


class _MooncakeIO(_GenericIO):
    """SGLang's `mooncake` backend: its MooncakeDistributedStore, zero-copy from a registered buffer."""

    kind = "hicache-mooncake"

    def __init__(self, backend):
        super().__init__(backend)
        self.store = backend.store

    def prepare(self, staging) -> None:
        self.backend.register_buffer(staging)  # SGLang's wrapper: store.register_buffer(ptr, size)

    def exists(self, names):
        return [int(x) for x in self.store.batch_is_exist(names)]

    @staticmethod
    def _ptrs(staging):
        base, stride, size = int(staging.data_ptr()), int(staging.stride(0)), int(staging.shape[1])
        return [base + i * stride for i in range(staging.shape[0])], [size] * staging.shape[0]

    def put(self, names, staging, replace):
        ptrs, sizes = self._ptrs(staging)
        if any(replace):  # a page dropped as bad but not removable (lease): overwrite it
            idx = [i for i, r in enumerate(replace) if r]
            up = self.store.batch_upsert_from([names[i] for i in idx], [ptrs[i] for i in idx],
                                              [sizes[i] for i in idx])
            codes = [0] * len(names)
            for j, i in enumerate(idx):
                codes[i] = int(up[j])
            rest = [i for i, r in enumerate(replace) if not r]
            if rest:
                res = self.store.batch_put_from([names[i] for i in rest], [ptrs[i] for i in rest],
                                                [sizes[i] for i in rest])
                for j, i in enumerate(rest):
                    codes[i] = int(res[j])
            return codes
        return [int(x) for x in self.store.batch_put_from(names, ptrs, sizes)]

    def get(self, names, staging):
        ptrs, sizes = self._ptrs(staging)
        return [int(x) for x in self.store.batch_get_into(names, ptrs, sizes)]

    def remove(self, names):
        ok = True
        for nm in names:
            rc = int(self.store.remove(nm))
            if rc not in (0, _MC_NOT_FOUND):
                ok = False
        return ok

    def clear(self) -> bool:
        return False  # shared with other servers: never remove_all

    def close(self) -> None:
        self.store.close()  # unmounts this client's segment (its objects leave the store)


def _codes_from_get(res, n: int) -> List[int]:
    if isinstance(res, bool):
        return [0 if res else _MC_NOT_FOUND] * n
    if isinstance(res, int):  # leading count
        k = max(0, min(res, n))
        return [0] * k + [_MC_NOT_FOUND] * (n - k)
    out = []
    for r in list(res)[:n]:
        out.append(0 if (r is not None and r is not False) else _MC_NOT_FOUND)
    return out + [_MC_NOT_FOUND] * (n - len(out))


def _io_for(backend) -> _GenericIO:
    store = getattr(backend, "store", None)
    if store is not None and hasattr(store, "batch_put_from") and hasattr(store, "batch_get_into"):
        return _MooncakeIO(backend)
    if hasattr(backend, "file_path") and hasattr(backend, "_get_suffixed_key"):
        return _FileIO(backend)
    return _GenericIO(backend)


# ---------------------------------------------------------------------------------------------
# building a backend outside HiCache
# ---------------------------------------------------------------------------------------------

def _probe_tcp(addr: str, timeout_s: float) -> str:
    """'' when host:port accepts a TCP connection within timeout_s, else why not."""
    host, _, port = str(addr).rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return ""
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def create_backend(backend: str, extra_config: Optional[Mapping[str, Any]] = None, *,
                   connect_timeout_s: float = 2.0):
    """An SGLang HiCacheStorage backend by name, through SGLang's StorageBackendFactory, for a
    single-writer flexflow tier: no host pool (flexflow stages its own bytes), storage rank 0 of 1
    (the flexflow fingerprint in every key already names the shard), MLA-style single objects per
    page (no per-rank K/V split). Raises HiCacheTierError naming the backend on any failure."""
    extra = dict(extra_config or {})
    if backend == "mooncake":
        import importlib.util
        if importlib.util.find_spec("mooncake") is None:
            raise HiCacheTierError("hicache_storage backend 'mooncake': the mooncake package is not installed "
                                   "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 and the "
                                   "Debian package libibverbs1, or .ci/setup-cpu.sh)")
        master = extra.get("master_server_address")
        if master and not extra.get("client_server_address"):
            why = _probe_tcp(master, connect_timeout_s)
            if why:  # Mooncake itself would retry setup for ~90 s before giving up
                raise HiCacheTierError(f"hicache_storage backend 'mooncake': master {master} is unreachable ({why})")
        # Mooncake retries a failed client set-up 20 times (~4.6 s each); a process that set nothing keeps 2
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except Exception as e:  # noqa: BLE001
        raise HiCacheTierError(f"hicache_storage backend {backend!r}: SGLang's storage backends cannot be "
                               f"imported: {type(e).__name__}: {e}") from e
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name=None, extra_config=extra)
    try:
        return StorageBackendFactory.create_backend(backend, cfg, None)
    except Exception as e:  # noqa: BLE001 - ImportError, ValueError (unknown name), RuntimeError (set-up)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise HiCacheTierError(f"hicache_storage backend {backend!r} could not start: {type(e).__name__}: "
                               f"{msg[:300]}") from e


# ---------------------------------------------------------------------------------------------
# the tier
# ---------------------------------------------------------------------------------------------

class HiCacheStorageTier(KVTier):
    """KVTier over one SGLang HiCacheStorage backend (see the module docstring). Thread-safe: one
    lock serializes calls (they share the staging buffer), one I/O thread runs backend calls."""

    def __init__(self, backend: str, *, fingerprint: str, page_nbytes: int,
                 extra_config: Optional[Mapping[str, Any]] = None, node: Optional[str] = None,
                 name: Optional[str] = None, timeout_ms: float = 2000.0, retry_after_s: float = 5.0,
                 staging_mb: float = 16.0, max_batch_objects: int = 512, backend_obj: Any = None):
        if not isinstance(backend, str) or not backend:
            raise ConfigError(f"hicache_storage.backend must be a backend name, got {backend!r}")
        if not isinstance(page_nbytes, int) or page_nbytes <= 0:
            raise ConfigError(f"hicache_storage: page_nbytes must be a positive int, got {page_nbytes!r}")
        if not isinstance(max_batch_objects, int) or isinstance(max_batch_objects, bool) or max_batch_objects < 1:
            raise ConfigError(f"hicache_storage.max_batch_objects must be an int >= 1, got {max_batch_objects!r}")
        self.backend_name = backend
        self.name = name or (f"hicache_{backend}" if backend.replace("_", "").isalnum() else "hicache")
        self.node = node if node is not None else ("nvme0" if backend in LOCAL_DISK_BACKENDS else None)
        self.page_nbytes = int(page_nbytes)
        self.obj_nbytes = HDR + self.page_nbytes
        self.fingerprint = fingerprint
        self._fp = fingerprint_hash(fingerprint)
        self.timeout_s = max(0.001, float(timeout_ms) / 1000.0)
        self.retry_after_s = max(0.0, float(retry_after_s))
        self._lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0
        self._down_reason = ""
        self._inflight = None
        self._warned = 0
        self._quarantine: "OrderedDict[str, None]" = OrderedDict()
        self._c: Dict[str, float] = {k: 0 for k in (
            "lookups", "lookup_pages", "gets", "hits", "misses", "puts", "pages_written", "pages_skipped",
            "bytes_read", "bytes_written", "read_s", "write_s", "corrupt_dropped", "foreign_dropped",
            "size_mismatch", "backend_errors", "timeouts", "down_skipped", "busy_skipped", "removed",
            "quarantined", "discards")}
        self.backend = backend_obj if backend_obj is not None else create_backend(backend, extra_config)
        self._io = _io_for(self.backend)
        import torch  # the backends take torch tensors; the connector has torch loaded already
        rows = max(1, int(staging_mb * (1 << 20)) // self.obj_nbytes)
        self._staging = torch.zeros((rows, self.obj_nbytes), dtype=torch.uint8)
        self._np = self._staging.numpy()
        # one backend call carries at most max_batch_objects objects (and never more than the
        # staging buffer holds): Mooncake's TCP transport queues 1,024 transfers per peer and fails
        # the rest; a CI-like run saw a ~1,600-object page-1 get overflow it and leave that client failing
        # every transfer for minutes after
        self._cap = min(rows, max_batch_objects)
        try:
            self._io.prepare(self._staging)
        except Exception as e:  # noqa: BLE001
            self._close_backend()
            raise HiCacheTierError(f"hicache_storage backend {backend!r}: registering the staging buffer "
                                   f"failed: {type(e).__name__}: {e}") from e
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ff-{self.name}-io")
        log.info("flexflow: deep tier %s: SGLang HiCache backend %r via %s, node %s, object %d B (page %d B + "
                 "%d B header), staging %d objects", self.name, backend, self._io.kind, self.node,
                 self.obj_nbytes, self.page_nbytes, HDR, rows)

    # ------------------------------------------------------------------ helpers
    def _names(self, keys: Sequence[bytes]) -> List[str]:
        return [KEY_PREFIX + key_id(k, self._fp).hex() for k in keys]

    def _warn(self, msg: str, *args) -> None:
        self._warned += 1
        if self._warned <= _WARN_FIRST or self._warned % 1000 == 0:
            log.warning("flexflow: deep tier %s: " + msg, self.name, *args)

    def _mark_down(self, why: str) -> None:
        self._down_until = time.monotonic() + self.retry_after_s
        self._down_reason = why
        self._warn("%s; every call is a miss for %.1f s", why, self.retry_after_s)

    def _ready(self) -> bool:
        """May a backend call start now (caller holds self._lock)? Not when closed, while a timed-out
        call still runs (it owns the staging buffer) or while the tier is down; counted."""
        if self._closed:
            return False
        if self._inflight is not None and not self._inflight.done():
            self._c["busy_skipped"] += 1
            return False
        if time.monotonic() < self._down_until:
            self._c["down_skipped"] += 1
            return False
        return True

    def _call(self, what: str, fn, *args):
        """Run fn(*args) on the I/O thread, wait at most timeout_s. None: a miss (counted, logged).
        Caller holds self._lock."""
        if not self._ready():
            return None
        fut = self._pool.submit(fn, *args)
        self._inflight = fut
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._c["timeouts"] += 1
            self._mark_down(f"{what} took longer than {self.timeout_s * 1000:.0f} ms")
        except Exception as e:  # noqa: BLE001
            self._c["backend_errors"] += 1
            self._mark_down(f"{what} failed: {type(e).__name__}: {e}")
        return None

    def _codes_ok(self, what: str, codes, n: int, absent: tuple) -> Optional[List[int]]:
        """Per-key codes, or None (and the tier marked down) when the backend answered an error."""
        if codes is None:
            return None
        codes = list(codes)[:n]
        if len(codes) < n:
            codes += [_MC_NOT_FOUND] * (n - len(codes))
        bad = [c for c in codes if c < 0 and c not in absent]
        if bad:
            self._c["backend_errors"] += 1
            self._mark_down(f"{what}: backend error code {bad[0]}")
        return codes

    def _quarantined(self, name: str) -> bool:
        return name in self._quarantine

    def _drop(self, names: List[str]) -> None:
        """Pages that failed verification: delete from the backend, else remember them as misses."""
        try:
            removed = self._io.remove(names)
        except Exception:  # noqa: BLE001
            removed = False
        if removed:
            self._c["removed"] += len(names)
            for nm in names:
                self._quarantine.pop(nm, None)
            return
        for nm in names:
            self._quarantine[nm] = None
            self._quarantine.move_to_end(nm)
            self._c["quarantined"] += 1
        while len(self._quarantine) > _QUARANTINE_MAX:
            self._quarantine.popitem(last=False)

    # ------------------------------------------------------------------ KVTier
    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        keys = check_keys(keys)
        if not keys:
            return 0
        names = self._names(keys)
        if not self._lock.acquire(timeout=self.timeout_s):
            self._c["busy_skipped"] += 1
            return 0
        try:
            self._c["lookups"] += 1
            codes = self._codes_ok("exists", self._call("exists", self._io.exists, names), len(names), ())
            if codes is None:
                return 0
            n = 0
            for nm, c in zip(names, codes):
                if c != 1 or self._quarantined(nm):
                    break
                n += 1
            self._c["lookup_pages"] += n
            return n
        finally:
            self._lock.release()

    def put_many(self, keys: Sequence[bytes], pages) -> int:
        keys = check_keys(keys)
        n = len(keys)
        if n == 0:
            return 0
        src = as_pages(pages, n)
        if src.shape[1] != self.page_nbytes:
            raise ValueError(f"{self.name}: pages of {src.shape[1]} B, tier page size {self.page_nbytes} B")
        names = self._names(keys)
        if not self._lock.acquire(timeout=self.timeout_s):
            self._c["busy_skipped"] += 1
            return 0
        try:
            self._c["puts"] += 1
            done = 0
            cap = self._cap
            while done < n and self._ready():
                m = min(cap, n - done)
                sl = slice(done, done + m)
                part = names[sl]
                crcs = page_digests(src[sl], m)
                for i in range(m):
                    nid = bytes.fromhex(part[i][len(KEY_PREFIX):])
                    self._np[i, :HDR] = np.frombuffer(build_header(self.page_nbytes, self._fp, nid, crcs[i]),
                                                      dtype=np.uint8)
                self._np[:m, HDR:] = src[sl]
                replace = [self._quarantined(nm) for nm in part]
                t0 = time.perf_counter()
                codes = self._codes_ok("put", self._call("put", self._io.put, part, self._staging[:m], replace), m, ())
                if codes is None:
                    break
                k = 0
                for c in codes:
                    if c != 0:
                        break
                    k += 1
                self._c["write_s"] += time.perf_counter() - t0
                self._c["bytes_written"] += k * self.obj_nbytes
                self._c["pages_written"] += k
                for nm in part[:k]:
                    self._quarantine.pop(nm, None)
                done += k
                if k < m:
                    break
            self._c["pages_skipped"] += n - done
            return done
        finally:
            self._lock.release()

    def get_many_into(self, keys: Sequence[bytes], out) -> int:
        keys = check_keys(keys)
        n = len(keys)
        if n == 0:
            return 0
        dst = as_pages(out, n, writable=True, what="out")
        if dst.shape[1] != self.page_nbytes:
            raise ValueError(f"{self.name}: out rows of {dst.shape[1]} B, tier page size {self.page_nbytes} B")
        names = self._names(keys)
        if not self._lock.acquire(timeout=self.timeout_s):
            self._c["busy_skipped"] += 1
            self._c["misses"] += n
            return 0
        try:
            self._c["gets"] += 1
            done = 0
            cap = self._cap
            while done < n:
                m = min(cap, n - done)
                part = names[done:done + m]
                lead = 0
                for nm in part:
                    if self._quarantined(nm):
                        break
                    lead += 1
                if lead == 0:
                    break
                part = part[:lead]
                t0 = time.perf_counter()
                codes = self._codes_ok("get", self._call("get", self._io.get, part, self._staging[:lead]), lead,
                                       (_MC_NOT_FOUND, _MC_BUFFER_TOO_SMALL))
                if codes is None:
                    break
                k = self._verify(part, codes, dst, done)
                self._c["read_s"] += time.perf_counter() - t0
                self._c["bytes_read"] += k * self.obj_nbytes
                done += k
                if k < m:
                    break
            self._c["hits"] += done
            self._c["misses"] += n - done
            return done
        finally:
            self._lock.release()

    def _verify(self, names: List[str], codes: List[int], dst: np.ndarray, at: int) -> int:
        """Leading staging rows that hold our verified page: copied into dst[at:]; the first bad one
        ends the run (dropped from the backend, counted by reason)."""
        k = 0
        for i, (nm, c) in enumerate(zip(names, codes)):
            if c == _MC_BUFFER_TOO_SMALL:
                self._c["size_mismatch"] += 1
                self._warn("object %s is larger than %d B: a miss", nm, self.obj_nbytes)
                self._drop([nm])
                break
            if c < 0 or (c > 0 and c != self.obj_nbytes):
                if c > 0:
                    self._c["size_mismatch"] += 1
                    self._drop([nm])
                break
            row = self._np[i]
            csum, why = parse_header(row[:HDR], self._fp, bytes.fromhex(nm[len(KEY_PREFIX):]), self.page_nbytes)
            if csum is None:
                key = "foreign_dropped" if why in ("foreign fingerprint", "name mismatch") or \
                    why.startswith("page_nbytes") or why.startswith("foreign format") else "corrupt_dropped"
                self._c[key] += 1
                self._warn("object %s failed its header check (%s): a miss, dropped", nm, why)
                self._drop([nm])
                break
            if payload_checksums(row[HDR:].reshape(1, -1), [csum[0]])[0] != csum[1]:
                self._c["corrupt_dropped"] += 1
                self._warn("object %s failed its payload checksum: a miss, dropped", nm)
                self._drop([nm])
                break
            dst[at + i] = row[HDR:]
            k += 1
        return k

    def discard(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        if not keys:
            return
        names = self._names(keys)
        with self._lock:
            self._c["discards"] += len(names)
            self._drop(names)

    def clear(self) -> None:
        """After a weight update the pages are stale for this server, but the store is shared with
        other servers (which may run the old weights): nothing is removed from the backend. The
        connector rotates its page-key seed on clear(), so this server never asks for them again."""

    def stats(self) -> dict:
        c = dict(self._c)
        out = {k: (round(v, 6) if isinstance(v, float) else int(v)) for k, v in c.items()}
        out.update(backend=self._io.kind if hasattr(self, "_io") else "none", hicache_backend=self.backend_name,
                   node=self.node, page_nbytes=self.page_nbytes, object_nbytes=self.obj_nbytes,
                   down=time.monotonic() < self._down_until, down_reason=self._down_reason,
                   quarantine=len(self._quarantine), closed=self._closed,
                   read_gbps=round(c["bytes_read"] / c["read_s"] / 1e9, 4) if c["read_s"] > 0 else 0.0,
                   write_gbps=round(c["bytes_written"] / c["write_s"] / 1e9, 4) if c["write_s"] > 0 else 0.0)
        return out

    def _close_backend(self) -> None:
        try:
            io = getattr(self, "_io", None)
            if io is not None:
                io.close()
            else:
                close = getattr(self.backend, "close", None)
                if callable(close):
                    close()
        except Exception:  # noqa: BLE001
            log.debug("closing the %s backend raised", self.backend_name, exc_info=True)

    def close(self) -> None:
        if not self._lock.acquire(timeout=self.timeout_s):
            self._closed = True  # a call is stuck in the backend: later calls are misses, the thread ends with it
            return
        try:
            if self._closed:
                return
            self._closed = True
        finally:
            self._lock.release()
        self._pool.shutdown(wait=False)
        if self._inflight is None or self._inflight.done():  # never pull the store from under a stuck call
            self._close_backend()


# ---------------------------------------------------------------------------------------------
# the registered factory
# ---------------------------------------------------------------------------------------------

def hicache_factory(ctx, options: Mapping[str, Any]) -> HiCacheStorageTier:
    """The registered tier `hicache_storage` (tiers/registry.py). `options`: the keys of the config
    section `hicache_storage` (config.HiCacheStorageTierConfig, checked by the same rules; `enabled`
    and `write_through` are the connector's): `backend` (an SGLang storage backend name),
    `extra_config` (its HiCacheStorageConfig.extra_config), `node`, `timeout_ms`, `retry_after_s`,
    `staging_mb`, `max_batch_objects`. For the `file` backend the directory (`extra_config.file_storage_path`, default
    /tmp/hicache) gets the per-rank subdirectory ctx.rank_dir, both created owner-only."""
    from ..config import section_from_options
    cfg = section_from_options("hicache_storage", options, "hicache_storage options")
    for key, hi in (("timeout_ms", 600_000), ("retry_after_s", 3600), ("staging_mb", 4096)):
        if getattr(cfg, key) > hi:
            raise ConfigError(f"hicache_storage.{key} = {getattr(cfg, key)!r}: at most {hi}")
    extra = dict(cfg.extra_config)
    if cfg.backend == "file":
        root = os.path.expanduser(str(extra.get("file_storage_path") or "/tmp/hicache"))
        path = os.path.join(root, ctx.rank_dir)
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.makedirs(path, mode=0o700, exist_ok=True)
        extra["file_storage_path"] = path
    return HiCacheStorageTier(cfg.backend, fingerprint=ctx.fingerprint_text, page_nbytes=ctx.page_nbytes,
                              extra_config=extra, node=cfg.node or ctx.node, timeout_ms=cfg.timeout_ms,
                              retry_after_s=cfg.retry_after_s, staging_mb=cfg.staging_mb,
                              max_batch_objects=cfg.max_batch_objects)
