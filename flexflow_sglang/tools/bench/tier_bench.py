"""Throughput of the deep tiers against their raw baselines, measured in the same run.

    run(page_nbytes=1 MiB, n_pages=64, repeats=5) -> dict
    python -m flexflow_sglang.tools.bench.tier_bench [--page-kib 1024] [--pages 64] [--repeats 5] [--json]
    flexflow bench tiers ...

* storage: StorageTier.put_many / get_many_into (NIXL POSIX, header + 64-bit page hash, temp file + rename,
  index) against a plain Python write/read of the same bytes, one file per page, same directory.
  `--beside-python N`: N alternating rounds of the same writes while another thread runs Python (as
  SGLang's scheduler thread does), with the compiled per-batch file calls and with their Python twin.
  `--slab-backends`: the slab layout through NIXL POSIX and through `os`, write and read GB/s, idle
  and beside a thread running Python (alternating per repeat).
  `--layouts files,slabs`: the storage tier's layouts side by side (alternating per repeat), first
  with room, then full (each tier holds one repeat's pages, so every store evicts): write and read
  GB/s, the writer's CPU per page, and slabs / files.
* remote: RemoteTier.put_many / get_many_into against one tier server process, against a raw NIXL
  UCX WRITE / READ of the same bytes (same descriptor shape: one descriptor per page) from a
  bare agent to a bare target process. Both over loopback, both polled with 1 ms sleeps.
* hicache_storage (issue 18): HiCacheStorageTier over SGLang's `file` backend (a temp directory)
  and its `mooncake` backend (a `mooncake_master` on loopback, TCP; one client writes, a second
  reads), the same pages; ratios against the raw NIXL UCX transfer of the remote section. A
  backend that cannot run here is skipped with the reason (`hicache_<name>_skipped`).
Ratios are tier / baseline (1.0 = no overhead). Each figure is the median of `repeats`; reads
run on a warm page cache (storage) and warm connections (remote) on both sides.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from flexflow_sglang.tiers.base import load_nixl, make_agent, page_checksums, page_digests, post_xfer, wait_xfers


def _median_gbps(nbytes: int, times) -> float:
    return nbytes / statistics.median(times) / 1e9


def _bench_storage(root: str, P: int, n: int, repeats: int) -> dict:
    from flexflow_sglang.tiers.storage import StorageTier
    rng = np.random.default_rng(1)
    pages = rng.integers(0, 256, size=(n, P), dtype=np.uint8)
    out = np.empty_like(pages)
    tdir, pdir = os.path.join(root, "tier"), os.path.join(root, "plain")
    os.makedirs(pdir, exist_ok=True)
    tier = StorageTier(tdir, capacity_bytes=(n * (P + 64)) * (repeats + 2), fingerprint="bench")
    try:
        tw, tr, pw, pr = [], [], [], []
        keys = None
        for rep in range(repeats + 1):  # round 0 warms up (first-touch, agent, dentries)
            keys = [os.urandom(32) for _ in range(n)]
            t = time.perf_counter()
            stored = tier.put_many(keys, pages)
            dt = time.perf_counter() - t
            assert stored == n, f"storage tier stored {stored}/{n}"
            t = time.perf_counter()
            for i in range(n):
                with open(os.path.join(pdir, f"{rep}-{i}"), "wb") as f:
                    f.write(memoryview(pages[i]))
            dp = time.perf_counter() - t
            if rep:
                tw.append(dt)
                pw.append(dp)
        for rep in range(repeats + 1):
            t = time.perf_counter()
            got = tier.get_many_into(keys, out)
            dt = time.perf_counter() - t
            assert got == n and np.array_equal(out, pages), "storage tier read back wrong bytes"
            t = time.perf_counter()
            for i in range(n):
                with open(os.path.join(pdir, f"{repeats}-{i}"), "rb") as f:
                    f.readinto(memoryview(out[i]))
            dp = time.perf_counter() - t
            if rep:
                tr.append(dt)
                pr.append(dp)
        nb = n * P
        r = dict(storage_backend=tier.stats()["backend"],
                 storage_write_gbps=_median_gbps(nb, tw), plain_write_gbps=_median_gbps(nb, pw),
                 storage_read_gbps=_median_gbps(nb, tr), plain_read_gbps=_median_gbps(nb, pr))
        r["storage_write_ratio"] = r["storage_write_gbps"] / r["plain_write_gbps"]
        r["storage_read_ratio"] = r["storage_read_gbps"] / r["plain_read_gbps"]
        return r
    finally:
        tier.close()


def _bench_layouts(root: str, P: int, n: int, repeats: int, layouts, full: bool) -> dict:
    """The storage tier's layouts side by side (tiers/storage_slabs.py): each repeat stores n new
    pages into every layout in turn (the order alternating), then reads them back. `full`: each tier
    holds exactly n pages, so from the second repeat on every store evicts (a full tier's steady
    state). Medians of write and read GB/s and of the writing thread's CPU per page, per layout."""
    from flexflow_sglang.tiers.storage import StorageTier
    from flexflow_sglang.tiers.storage_slabs import SlabStorageTier
    cls = {"files": StorageTier, "slabs": SlabStorageTier}
    pages = np.random.default_rng(4).integers(0, 256, size=(n, P), dtype=np.uint8)
    out = np.empty_like(pages)
    cap = n * (P + 72) if full else n * (P + 72) * (repeats + 2)
    tiers = {m: cls[m](os.path.join(root, f"layout-{m}-{'full' if full else 'room'}"), capacity_bytes=cap,
                       fingerprint="bench") for m in layouts}
    rec = {m: {"w": [], "cpu": [], "r": []} for m in layouts}
    try:
        for rep in range(repeats + 1):  # round 0 warms up (slab creation, agent, dentries)
            keys = [os.urandom(32) for _ in range(n)]
            for m in (layouts if rep % 2 == 0 else layouts[::-1]):
                t, c = time.perf_counter(), time.thread_time()
                stored = tiers[m].put_many(keys, pages)
                dt, dc = time.perf_counter() - t, time.thread_time() - c
                assert stored == n, f"{m} layout stored {stored}/{n}"
                t = time.perf_counter()
                got = tiers[m].get_many_into(keys, out)
                dr = time.perf_counter() - t
                assert got == n and np.array_equal(out, pages), f"{m} layout read back wrong bytes"
                if rep:
                    rec[m]["w"].append(dt)
                    rec[m]["cpu"].append(dc)
                    rec[m]["r"].append(dr)
        tag = "full_" if full else ""
        r = {}
        for m in layouts:
            r[f"layout_{tag}{m}_write_gbps"] = _median_gbps(n * P, rec[m]["w"])
            r[f"layout_{tag}{m}_read_gbps"] = _median_gbps(n * P, rec[m]["r"])
            r[f"layout_{tag}{m}_write_cpu_us_per_page"] = statistics.median(rec[m]["cpu"]) / n * 1e6
            r[f"layout_{tag}{m}_evictions"] = tiers[m].stats()["evictions"]
        if "files" in layouts and "slabs" in layouts:
            r[f"layout_{tag}slabs_over_files_write"] = (r[f"layout_{tag}slabs_write_gbps"]
                                                      / r[f"layout_{tag}files_write_gbps"])
            r[f"layout_{tag}slabs_over_files_read"] = (r[f"layout_{tag}slabs_read_gbps"]
                                                     / r[f"layout_{tag}files_read_gbps"])
        return r
    finally:
        for t in tiers.values():
            t.close()


def _bench_storage_beside_python(root: str, P: int, n: int, repeats: int) -> dict:
    """Storage-tier writes while another thread runs Python (as SGLang's scheduler thread does between
    torch ops): with the compiled per-batch file calls (_file_batch) and with their Python twin, which
    re-acquires the GIL after every per-file system call. Median wall seconds for n pages, each mode."""
    from flexflow_sglang.tiers import storage as storage_mod
    from flexflow_sglang.tiers.storage import StorageTier
    compiled = storage_mod._fb
    pages = np.random.default_rng(2).integers(0, 256, size=(n, P), dtype=np.uint8)
    modes = [("compiled", compiled), ("python", None)] if compiled is not None else [("python", None)]
    times: dict = {m: [] for m, _ in modes}
    halt = _python_spinner()
    try:
        for rep in range(repeats):
            for m, fb in modes:  # alternating, so that drift on a noisy machine hits both
                storage_mod._fb = fb
                tier = StorageTier(os.path.join(root, f"busy-{m}-{rep}"), capacity_bytes=n * (P + 64) * 2,
                                   fingerprint="bench")
                try:
                    keys = [os.urandom(32) for _ in range(n)]
                    t = time.perf_counter()
                    assert tier.put_many(keys, pages) == n, "storage tier stored fewer pages beside Python"
                    times[m].append(time.perf_counter() - t)
                finally:
                    tier.close()
    finally:
        storage_mod._fb = compiled
        halt()
    r = {f"beside_python_write_s_{m}": statistics.median(v) for m, v in times.items()}
    if "compiled" in times:
        r["beside_python_twin_over_compiled"] = r["beside_python_write_s_python"] / r["beside_python_write_s_compiled"]
    return r


def _python_spinner():
    """A thread running pure Python (as SGLang's scheduler thread does between torch ops): it holds
    the GIL until the interpreter's switch interval makes it let go. Returns its stop()."""
    import threading
    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    th = threading.Thread(target=spin, name="bench-python-spin", daemon=True)
    th.start()

    def halt():
        stop.set()
        th.join()
    return halt


def _bench_slab_backends(root: str, P: int, n: int, repeats: int) -> dict:
    """The slab layout through NIXL POSIX and through the `os` backend, idle and beside a thread
    running Python. Every NIXL call releases the GIL and has to win it back, and POSIX's transfer
    does its I/O inside both the post and the status polls; `os` moves a whole batch in one
    compiled call. So beside Python, what a batch costs is mostly how often it waits for the GIL.
    Write and read GB/s (median of `repeats`, the backends alternating per repeat)."""
    from flexflow_sglang.tiers.storage_slabs import SlabStorageTier
    if load_nixl()[0] is None:
        return {"slab_backends_skipped": "NIXL not installed: no POSIX backend to compare with os"}
    pages = np.random.default_rng(3).integers(0, 256, size=(n, P), dtype=np.uint8)
    out = np.empty_like(pages)
    res: dict = {}
    for busy in (False, True):
        halt = _python_spinner() if busy else None
        try:
            times = {(b, d): [] for b in ("posix", "os") for d in ("write", "read")}
            for rep in range(repeats):
                for b in ("posix", "os") if rep % 2 == 0 else ("os", "posix"):
                    tier = SlabStorageTier(os.path.join(root, f"slab-{b}-{int(busy)}-{rep}"),
                                           capacity_bytes=n * (P + 4096) * 2, backend=b, fingerprint="bench")
                    try:
                        keys = [os.urandom(32) for _ in range(n)]
                        t = time.perf_counter()
                        assert tier.put_many(keys, pages) == n, f"slab tier ({b}) stored fewer pages"
                        times[(b, "write")].append(time.perf_counter() - t)
                        t = time.perf_counter()
                        got = tier.get_many_into(keys, out)
                        times[(b, "read")].append(time.perf_counter() - t)
                        assert got == n and np.array_equal(out, pages), f"slab tier ({b}) read back wrong bytes"
                        assert tier.stats()["backend"] == ("os" if b == "os" else "nixl-posix"), tier.stats()["backend"]
                    finally:
                        tier.close()
        finally:
            if halt:
                halt()
        tag = "beside_python" if busy else "idle"
        for (b, d), v in times.items():
            res[f"slabs_{tag}_{b}_{d}_gbps"] = round(_median_gbps(n * P, v), 3)
        for d in ("write", "read"):
            res[f"slabs_{tag}_os_over_posix_{d}"] = round(res[f"slabs_{tag}_os_{d}_gbps"]
                                                          / res[f"slabs_{tag}_posix_{d}_gbps"], 3)
    return res


def _spawn(argv, ready_timeout: float = 60.0):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env={**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")})
    t0 = time.monotonic()
    while True:
        line = p.stdout.readline()
        if not line:
            p.kill()
            p.wait()
            raise RuntimeError(f"{argv[2:4]} exited before it was ready")
        if line.startswith((b"READY", b"{")):
            return p, line.decode().strip()
        if time.monotonic() - t0 > ready_timeout:
            p.kill()
            p.wait()
            raise RuntimeError("helper process not ready in time")


def _stop(p) -> None:
    try:
        p.terminate()
        p.wait(timeout=5)
    except Exception:
        p.kill()
        p.wait()


def _raw_target(nbytes: int) -> int:
    """Bare NIXL target: register a buffer, print its metadata, progress until stdin closes."""
    import select
    a = make_agent("ffbench-raw-target-%d" % os.getpid(), ["UCX"])
    buf = np.zeros(nbytes, dtype=np.uint8)
    a.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    print(json.dumps({"md": a.get_agent_metadata().hex(), "addr": buf.ctypes.data}), flush=True)
    while True:
        a.get_new_notifs()
        r, _, _ = select.select([sys.stdin], [], [], 0.001)
        if r and not sys.stdin.buffer.read1(4096):
            return 0


def _bench_remote(P: int, n: int, repeats: int, timeout_ms: float) -> dict:
    from flexflow_sglang.tiers.remote import RemoteTier
    rng = np.random.default_rng(2)
    pages = rng.integers(0, 256, size=(n, P), dtype=np.uint8)
    out = np.empty_like(pages)
    cap_gb = max(n * P * (repeats + 2) / (1 << 30), 0.01)
    srv, line = _spawn([sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--capacity-gb",
                        f"{cap_gb:.4f}", "--page-nbytes", str(P)])
    raw, rline = _spawn([sys.executable, "-m", "flexflow_sglang.tools.bench.tier_bench", "--raw-target", str(n * P)])
    tier = RemoteTier([line.split()[1]], timeout_ms=timeout_ms, retry_after_s=1.0)
    agent = None
    try:
        tw, tr, rw, rr = [], [], [], []
        keys = None
        for rep in range(repeats + 1):
            keys = [os.urandom(32) for _ in range(n)]
            t = time.perf_counter()
            stored = tier.put_many(keys, pages)
            dt = time.perf_counter() - t
            assert stored == n, f"remote tier stored {stored}/{n}: {tier.stats()}"
            if rep:
                tw.append(dt)
        for rep in range(repeats + 1):
            t = time.perf_counter()
            got = tier.get_many_into(keys, out)
            dt = time.perf_counter() - t
            assert got == n and np.array_equal(out, pages), f"remote tier read {got}/{n}"
            if rep:
                tr.append(dt)
        # raw NIXL UCX, same bytes, one descriptor per page
        info = json.loads(rline)
        agent = make_agent("ffbench-raw-%d" % os.getpid(), ["UCX"])
        peer = agent.add_remote_agent(bytes.fromhex(info["md"]))
        src = pages
        reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        oreg = agent.register_memory([(out.ctypes.data, out.nbytes, 0, "")], "DRAM")
        loc_w = agent.get_xfer_descs(np.array([(src.ctypes.data + i * P, P, 0) for i in range(n)], np.uint64), "DRAM")
        loc_r = agent.get_xfer_descs(np.array([(out.ctypes.data + i * P, P, 0) for i in range(n)], np.uint64), "DRAM")
        rem = agent.get_xfer_descs(np.array([(info["addr"] + i * P, P, 0) for i in range(n)], np.uint64), "DRAM")

        def xfer(op, loc):
            h = agent.initialize_xfer(op, loc, rem, peer)
            st = post_xfer(agent, h)
            if st == "PROC":
                st = wait_xfers(agent, [h], time.monotonic() + 30)[0]
            h.release()
            assert st == "DONE", f"raw NIXL {op}: {st}"

        for times, op, loc in ((rw, "WRITE", loc_w), (rr, "READ", loc_r)):
            for rep in range(repeats + 1):
                t = time.perf_counter()
                xfer(op, loc)
                if rep:
                    times.append(time.perf_counter() - t)
        assert np.array_equal(out, pages), "raw NIXL read back wrong bytes"
        agent.deregister_memory(reg)
        agent.deregister_memory(oreg)
        nb = n * P
        r = dict(remote_write_gbps=_median_gbps(nb, tw), raw_ucx_write_gbps=_median_gbps(nb, rw),
                 remote_read_gbps=_median_gbps(nb, tr), raw_ucx_read_gbps=_median_gbps(nb, rr),
                 remote_timeouts=tier.stats()["timeouts"])
        r["remote_write_ratio"] = r["remote_write_gbps"] / r["raw_ucx_write_gbps"]
        r["remote_read_ratio"] = r["remote_read_gbps"] / r["raw_ucx_read_gbps"]
        return r
    finally:
        tier.close()
        agent = None
        for p in (raw, srv):
            try:
                p.stdin.close()
            except Exception:
                pass
            _stop(p)


def _hicache_pair(backend: str, P: int, n: int, rounds: int, root: str):
    """(writer, reader, stop) for one SGLang HiCache backend; Mooncake reads with a second client."""
    from flexflow_sglang.backend.hicache_tier import HiCacheStorageTier
    stop = []
    if backend == "mooncake":
        from flexflow_sglang.tools.mooncake_master import MooncakeMaster, mooncake_missing
        why = mooncake_missing()
        if why:
            raise RuntimeError(why)
        master = MooncakeMaster(root).start()
        stop.append(master.kill)
        # every round writes new keys: the writer's segment holds them all (no eviction mid-run)
        extra = master.extra_config(segment_mb=max(64, ((rounds + 1) * n * (P + 64) >> 20) + 1))
    else:
        extra = {"file_storage_path": os.path.join(root, backend)}
    staging = max(1.0, n * (P + 64) / 2**20)

    def make():
        return HiCacheStorageTier(backend, fingerprint="bench", page_nbytes=P, extra_config=extra,
                                  staging_mb=staging, timeout_ms=60000)
    try:
        writer = make()
        reader = make() if backend == "mooncake" else writer
    except BaseException:
        for f in stop:
            f()
        raise
    return writer, reader, stop


def _bench_hicache(backend: str, P: int, n: int, repeats: int, root: str) -> dict:
    writer, reader, stop = _hicache_pair(backend, P, n, repeats + 1, root)
    pages = np.random.default_rng(4).integers(0, 256, size=(n, P), dtype=np.uint8)
    out = np.empty_like(pages)
    tw, tr = [], []
    try:
        for rep in range(repeats + 1):  # round 0 warms up (connections, segments, dentries)
            keys = [os.urandom(32) for _ in range(n)]
            t = time.perf_counter()
            stored = writer.put_many(keys, pages)
            dt_w = time.perf_counter() - t
            assert stored == n, f"hicache {backend} stored {stored}/{n}: {writer.stats()}"
            t = time.perf_counter()
            got = reader.get_many_into(keys, out)
            dt_r = time.perf_counter() - t
            assert got == n and np.array_equal(out, pages), f"hicache {backend} read {got}/{n}"
            if rep:
                tw.append(dt_w)
                tr.append(dt_r)
    finally:
        writer.close()
        if reader is not writer:
            reader.close()
        for f in stop:
            f()
    nb = n * P
    return {f"hicache_{backend}_write_gbps": _median_gbps(nb, tw), f"hicache_{backend}_read_gbps": _median_gbps(nb, tr)}


def _hicache_section(res: dict, backends, P: int, n: int, repeats: int) -> None:
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="ffbench-hicache-") as root:
            try:
                res.update(_bench_hicache(backend, P, n, repeats, root))
            except Exception as e:  # noqa: BLE001 - a backend missing here is reported, the rest still runs
                res[f"hicache_{backend}_skipped"] = f"{type(e).__name__}: {e}"[:300]
                continue
        for op in ("write", "read"):
            raw = res.get(f"raw_ucx_{op}_gbps")
            if raw:
                res[f"hicache_{backend}_{op}_ratio"] = res[f"hicache_{backend}_{op}_gbps"] / raw


def run(page_nbytes: int = 1 << 20, n_pages: int = 64, repeats: int = 5, storage_dir: Optional[str] = None,
        storage: bool = True, remote: bool = True, timeout_ms: float = 10000.0, hicache=(),
        beside_python: int = 0, layouts=(), slab_backends: bool = False) -> dict:
    """Returns throughputs (GB/s, 1e9) and tier/baseline ratios; keys are listed in the module doc.
    beside_python: that many alternating rounds of storage writes beside a thread running Python.
    layouts: storage layouts (files, slabs) measured side by side, with room and full.
    slab_backends: the slab layout through NIXL POSIX and `os`, idle and beside a thread running Python."""
    from . import measured_commit
    res = dict(commit=measured_commit(), page_nbytes=page_nbytes, n_pages=n_pages, repeats=repeats,
               bytes=page_nbytes * n_pages,
               ucx_tls=os.environ.get("UCX_TLS", "(default)"), nixl=load_nixl()[0] is not None)
    probe = np.random.default_rng(3).integers(0, 256, size=(n_pages, page_nbytes), dtype=np.uint8)
    t = time.perf_counter()
    page_checksums(probe, n_pages)
    res["crc32_gbps"] = probe.nbytes / (time.perf_counter() - t) / 1e9  # wire version 1 sums, for comparison
    t = time.perf_counter()
    page_digests(probe, n_pages)
    res["hash64_gbps"] = probe.nbytes / (time.perf_counter() - t) / 1e9  # storage payload and wire (v2) sums
    del probe
    if storage:
        with tempfile.TemporaryDirectory(prefix="ffbench-", dir=storage_dir) as root:
            res.update(_bench_storage(root, page_nbytes, n_pages, repeats))
            if beside_python:
                res.update(_bench_storage_beside_python(root, page_nbytes, n_pages, beside_python))
            if layouts:
                for full in (False, True):
                    res.update(_bench_layouts(root, page_nbytes, n_pages, repeats, list(layouts), full))
            if slab_backends:
                res.update(_bench_slab_backends(root, page_nbytes, n_pages, repeats))
    if remote:
        if res["nixl"]:
            res.update(_bench_remote(page_nbytes, n_pages, repeats, timeout_ms))
        else:
            res["remote_skipped"] = "nixl is not importable"
    _hicache_section(res, hicache, page_nbytes, n_pages, repeats)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flexflow bench tiers", description=__doc__.split("\n")[0])
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="parent directory for the storage files (default: $TMPDIR)")
    ap.add_argument("--no-storage", action="store_true")
    ap.add_argument("--no-remote", action="store_true")
    ap.add_argument("--hicache", default="file,mooncake",
                    help="SGLang HiCache storage backends to measure through hicache_storage, side by side "
                         "('' for none; one that cannot run here is skipped with the reason)")
    ap.add_argument("--beside-python", type=int, default=0, metavar="ROUNDS",
                    help="also time storage writes beside a thread running Python (the GIL contention of "
                         "SGLang's scheduler thread), compiled per-batch file calls vs their Python twin")
    ap.add_argument("--layouts", default="",
                    help="storage tier layouts to compare side by side, e.g. 'files,slabs' (each with room, "
                         "then full so that every store evicts)")
    ap.add_argument("--slab-backends", action="store_true",
                    help="the slab layout through NIXL POSIX and through `os`, idle and beside a thread running "
                         "Python (alternating per repeat)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--raw-target", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.raw_target is not None:
        return _raw_target(a.raw_target)
    r = run(a.page_kib * 1024, a.pages, a.repeats, a.dir, not a.no_storage, not a.no_remote,
            hicache=[b for b in a.hicache.split(",") if b], beside_python=a.beside_python,
            layouts=[m for m in a.layouts.split(",") if m], slab_backends=a.slab_backends)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        for k, v in r.items():
            print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
