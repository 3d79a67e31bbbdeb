"""Throughput of the hicache_storage tier (backend/hicache_tier.py) over SGLang's `mooncake` backend
(a mooncake_master on loopback, TCP; one client writes, a second client reads) and its `file`
backend (a temp directory), at several page sizes. Payload bytes per second, headers and CRCs
included in the work, medians of --repeats; every read is checked byte-equal.

    python benchmarks/hicache_tiers.py [--repeats 3] [--backends mooncake,file] [--out runs/hicache]
Writes <out>/hicache_tiers.json. Needs SGLang; `mooncake` also mooncake-transfer-engine-non-cuda and
libibverbs1 (skipped, with the reason, without them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flexflow_sglang.backend.hicache_tier import HiCacheStorageTier  # noqa: E402

SIZES = ((256, 4096), (64 << 10, 256), (1 << 20, 64))  # (page bytes, pages): 256 B = the tiny model's page


def start_master(log_dir):
    from flexflow_sglang.tools.mooncake_master import MooncakeMaster, mooncake_missing
    why = mooncake_missing()
    if why:
        raise RuntimeError(why)
    m = MooncakeMaster(log_dir).start()
    return m, m.address


def keys_of(n, salt: bytes):
    h, out = b"bench" + salt, []
    for i in range(n):
        h = hashlib.blake2b(h + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(h)
    return out


def run(backend, extra, repeats):
    rows = []
    for page, n in SIZES:
        pages = np.random.default_rng(0).integers(0, 256, (n, page), dtype=np.uint8)
        mk = lambda: HiCacheStorageTier(backend, fingerprint="bench", page_nbytes=page,  # noqa: E731
                                        extra_config=extra, staging_mb=128, timeout_ms=60000)
        writer = mk()
        reader = mk() if backend == "mooncake" else writer  # mooncake: a second client reads
        w, r = [], []
        try:
            for rep in range(repeats):
                ks = keys_of(n, f"{backend}{page}{rep}".encode())
                t = time.perf_counter()
                assert writer.put_many(ks, pages) == n
                w.append(n * page / (time.perf_counter() - t) / 1e9)
                out = np.zeros_like(pages)
                t = time.perf_counter()
                assert reader.get_many_into(ks, out) == n
                r.append(n * page / (time.perf_counter() - t) / 1e9)
                assert np.array_equal(out, pages)
        finally:
            writer.close()
            if reader is not writer:
                reader.close()
        row = {"backend": backend, "page_bytes": page, "pages": n, "write_gbps": round(statistics.median(w), 4),
               "read_gbps": round(statistics.median(r), 4)}
        print(f"{backend:8s} page {page:>8d} B x {n:5d}: write {row['write_gbps']:.3f} GB/s  "
              f"read {row['read_gbps']:.3f} GB/s", flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="mooncake,file")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="ff-hicache-bench-")
    results = {"rows": [], "skipped": {}}
    try:
        for backend in a.backends.split(","):
            if backend == "mooncake":
                try:
                    master, addr = start_master(tmp)
                except Exception as e:  # noqa: BLE001
                    results["skipped"]["mooncake"] = f"{type(e).__name__}: {e}"
                    print(f"mooncake skipped: {e}")
                    continue
                try:
                    extra = {"master_server_address": addr, "protocol": "tcp", "device_name": "",
                             "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
                             "global_segment_size": 512 << 20}
                    results["rows"] += run("mooncake", extra, a.repeats)
                finally:
                    master.kill()
            else:
                results["rows"] += run(backend, {"file_storage_path": os.path.join(tmp, backend)}, a.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "hicache_tiers.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
