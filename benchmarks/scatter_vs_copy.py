"""Why host-tier loads trail a plain copy on CPU: torch's scatter (index_copy_) vs gather
(index_select) vs slice copies vs a contiguous copy_, same bytes, side by side.
    python benchmarks/scatter_vs_copy.py [--pages 512] [--page-kib 4]"""
import argparse
import time

import torch


def gbps(fn, nbytes, n=20):
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return nbytes / sorted(ts)[n // 2] / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-kib", type=int, default=4)
    a = ap.parse_args()
    words = a.page_kib * 512  # int16 words per page segment
    pool = torch.zeros(8 * a.pages, words, dtype=torch.int16)
    rows = torch.randint(0, 1000, (a.pages, 16 * words), dtype=torch.int16)  # host pages: 16 segments
    src = rows[:, 3 * words:4 * words]  # one segment: strided view
    idx = torch.randperm(8 * a.pages - 1)[:a.pages] + 1
    nb = a.pages * words * 2
    flat_a, flat_b = torch.empty(a.pages * words, dtype=torch.int16), torch.empty(a.pages * words, dtype=torch.int16)
    out = torch.empty(a.pages, words, dtype=torch.int16)
    print(f"{a.pages} pages x {a.page_kib} KiB, torch threads {torch.get_num_threads()}")
    print(f"contiguous copy_           {gbps(lambda: flat_b.copy_(flat_a), nb):6.1f} GB/s")
    print(f"gather index_select        {gbps(lambda: torch.index_select(pool, 0, idx, out=out), nb):6.1f} GB/s")
    print(f"scatter index_copy_        {gbps(lambda: pool.index_copy_(0, idx, src), nb):6.1f} GB/s")
    print(f"slice copy_, strided src   {gbps(lambda: pool[1:1 + a.pages].copy_(src), nb):6.1f} GB/s")


if __name__ == "__main__":
    main()
