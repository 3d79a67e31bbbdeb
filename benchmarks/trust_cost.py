"""What shared-secret mode costs, side by side in one run: page MAC (HMAC-SHA256/128) against the
CRC32 every page already gets, and RemoteTier put/get against two tier servers on loopback, one
plain and one with --secret-file (HMAC per frame + MAC per page).

    python benchmarks/trust_cost.py [--pages 64] [--page-kib 256] [--repeats 5] [--out runs/trust]
Writes <out>/trust_cost.json. Medians of --repeats; the machine's other load shows up as noise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flexflow_sglang.tiers.base import page_checksum  # noqa: E402
from flexflow_sglang.tiers.remote import RemoteTier  # noqa: E402
from flexflow_sglang.tiers.trust import PageMac  # noqa: E402


def med(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def server(tmp, P, secret_file=None):
    ready = os.path.join(tmp, f"ready{int(bool(secret_file))}")
    argv = [sys.executable, "-m", "flexflow_sglang.tiers.tier_server", "--listen", "127.0.0.1:0",
            "--capacity-gb", "0.5", "--page-nbytes", str(P), "--ready-file", ready]
    if secret_file:
        argv += ["--secret-file", secret_file]
    p = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "FLEXFLOW_CONFIG": ""},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while not os.path.exists(ready):
        if p.poll() is not None or time.monotonic() - t0 > 60:
            raise SystemExit("tier server did not start")
        time.sleep(0.02)
    return p, json.load(open(ready))["listen"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "trust"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    P, n = a.page_kib * 1024, a.pages
    nb = P * n
    secret = os.urandom(32)
    pages = np.random.default_rng(0).integers(0, 256, size=(n, P), dtype=np.uint8)
    keys = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]
    pm = PageMac(secret)
    crc_s = med(lambda: [page_checksum(pages[i]) for i in range(n)], a.repeats)
    mac_s = med(lambda: [pm.mac(keys[i], pages[i]) for i in range(n)], a.repeats)
    res = {"command": " ".join(["python", "benchmarks/trust_cost.py", *sys.argv[1:]]),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "page_nbytes": P, "pages": n, "crc32_gbps": nb / crc_s / 1e9, "page_mac_gbps": nb / mac_s / 1e9}
    print(f"one core: CRC32 {res['crc32_gbps']:.2f} GB/s, page MAC (HMAC-SHA256/128) {res['page_mac_gbps']:.2f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        sf = os.path.join(tmp, "secret")
        with open(sf, "wb") as f:
            f.write(secret.hex().encode())
        os.chmod(sf, 0o600)
        procs = []
        try:
            for mode, s_file, s in (("plain", None, None), ("secret", sf, secret.hex().encode())):
                p, addr = server(tmp, P, s_file)
                procs.append(p)
                t = RemoteTier([addr], timeout_ms=10000, retry_after_s=1, secret=s)
                out = np.empty_like(pages)
                assert t.put_many(keys, pages) == n and t.get_many_into(keys, out) == n  # warm
                put_s = med(lambda: (t.discard(keys), t.put_many(keys, pages)), a.repeats)
                get_s = med(lambda: t.get_many_into(keys, out), a.repeats)
                assert np.array_equal(out, pages)
                t.close()
                res[mode] = {"put_gbps": nb / put_s / 1e9, "get_gbps": nb / get_s / 1e9}
                print(f"{mode:6}: put {res[mode]['put_gbps']:.2f} GB/s, get {res[mode]['get_gbps']:.2f} GB/s", flush=True)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    res["secret_over_plain"] = {k: res["secret"][k] / res["plain"][k] for k in ("put_gbps", "get_gbps")}
    print(json.dumps(res["secret_over_plain"]))
    with open(os.path.join(a.out, "trust_cost.json"), "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
