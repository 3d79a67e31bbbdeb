"""A/B of two versions of the compiled copy + checksum kernels (csrc/flexflow_sglang/_copy_kernels.pyx),
side by side in one process: both are built from source into a scratch folder, then each round runs
a plain `copy_` of the same bytes, base and candidate (order alternating per round) on the same
random scattered device pages, so machine noise hits both alike. Checks that both give the same page
hashes (a kernel change must not change the stored checksums) and the same bytes.

    python benchmarks/copy_kernels_ab.py --base 878f353 [--candidate WORKTREE|REV] [--pages-sizes 1,16,64]
        [--rounds 15] [--out runs/copy-kernels-ab]

Shape: the kv128k preset's KV (16 layers x 8 KV heads x 128, float32 = 128 KB per token), 1024 tokens
= 128 MiB per move, torch threads 2. Writes result.json and a plot (ratio to copy_ per page size).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from flexflow_sglang.connector.copy_kernels import PageCopier
from flexflow_sglang.connector.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
PYX = "csrc/flexflow_sglang/_copy_kernels.pyx"


def _source(rev: str) -> str:
    if rev == "WORKTREE":
        return (ROOT / PYX).read_text()
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{PYX}"], check=True,
                          capture_output=True, text=True).stdout


def _build(sources: dict, where: Path):
    """Cythonize and compile each {module_name: pyx text} with the package's flags (-O3 -fopenmp)."""
    for name, text in sources.items():
        (where / f"{name}.pyx").write_text(text)
    setup = where / "setup_ab.py"
    setup.write_text(
        "from setuptools import setup, Extension\nfrom Cython.Build import cythonize\n"
        f"names = {list(sources)!r}\n"
        "setup(ext_modules=cythonize([Extension(n, [n + '.pyx'], extra_compile_args=['-O3', '-fopenmp'],"
        " extra_link_args=['-fopenmp']) for n in names], quiet=True, language_level=3))\n")
    subprocess.run([sys.executable, str(setup), "build_ext", "--inplace", "-q"], cwd=where, check=True,
                   stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(where))
    import importlib
    return {n: importlib.import_module(n) for n in sources}


def _one_page_size(mods: dict, page: int, rounds: int, tokens: int, threads: int, seed: int) -> dict:
    from tqdm import tqdm
    layers, heads, dim, es = 16, 8, 128, 4
    npg = tokens // page
    dev_pages = 3 * npg + 1
    bufs = [torch.empty((dev_pages * page, heads, dim), dtype=torch.float32).normal_() for _ in range(2 * layers)]
    # the segment tables exactly as the connector builds them for these buffers (KVLayout -> PageCopier)
    layout = KVLayout.from_buffers([(bufs[2 * i], bufs[2 * i + 1]) for i in range(layers)], page)
    copier = PageCopier(layout)
    seg_ptr, seg_stride, seg_nbytes = copier._seg_ptr, copier._seg_stride, copier._seg_nbytes
    row = layout.page_nbytes
    assert row == 2 * layers * page * heads * dim * es
    host = torch.zeros((npg, row), dtype=torch.uint8)
    a = torch.empty(npg * row, dtype=torch.uint8).random_(0, 255)
    b = torch.zeros_like(a)
    b.copy_(a)
    rng = np.random.default_rng(seed)
    hp = np.ascontiguousarray(rng.permutation(npg), dtype=np.int64)
    names = list(mods)
    rec = {n: {"store": [], "load": []} for n in names}
    same_sums = same_bytes = True
    for r in tqdm(range(rounds + 1), desc=f"copy-kernels A/B (page {page})", leave=False):
        perm = rng.permutation(dev_pages - 1) + 1
        src = np.ascontiguousarray(perm[:npg], dtype=np.int64)
        dst = np.ascontiguousarray(perm[npg:2 * npg], dtype=np.int64)
        sums_of = {}
        for n in (names if r % 2 == 0 else names[::-1]):
            m = mods[n]
            sums = np.empty(npg, dtype=np.int64)
            t0 = time.perf_counter()
            b.copy_(a)
            c1 = time.perf_counter() - t0
            t0 = time.perf_counter()
            m.gather(seg_ptr, seg_stride, seg_nbytes, src, host.data_ptr(), row, hp, sums, threads)
            ts = time.perf_counter() - t0
            flags = np.zeros(npg, dtype=np.uint8)
            t0 = time.perf_counter()
            a.copy_(b)
            c2 = time.perf_counter() - t0
            t0 = time.perf_counter()
            bad = m.scatter(host.data_ptr(), row, hp, seg_ptr, seg_stride, seg_nbytes, dst, sums, threads, flags)
            tl = time.perf_counter() - t0
            if bad != -1:
                raise RuntimeError(f"{n}: page {bad} failed its own checksum on load")
            sums_of[n] = sums
            if r:  # round 0 warms up
                rec[n]["store"].append(c1 / ts)
                rec[n]["load"].append(c2 / tl)
        same_sums &= all(np.array_equal(sums_of[names[0]], s) for s in sums_of.values())
        same_bytes &= all(torch.equal(buf[dst[:8] * page], buf[src[:8] * page]) for buf in bufs[:4])
    out = {"page_size": page, "same_hashes": bool(same_sums), "roundtrip_equal": bool(same_bytes)}
    for n in names:
        out[n] = {k: round(statistics.median(v), 3) for k, v in rec[n].items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the base kernels")
    ap.add_argument("--candidate", default="WORKTREE", help="git revision, or WORKTREE (default)")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/copy-kernels-ab")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ck-ab-") as tmp:
        mods = _build({"ck_base": _source(a.base), "ck_candidate": _source(a.candidate)}, Path(tmp))
        results = [_one_page_size(mods, int(p), a.rounds, a.tokens, a.threads, a.seed)
                   for p in a.page_sizes.split(",")]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {"base": a.base, "candidate": a.candidate, "head": commit, "rounds": a.rounds, "tokens": a.tokens,
           "shape": "16 layers x 8 KV heads x 128, float32 (kv128k)", "threads": a.threads,
           "load_average": os.getloadavg()[0], "results": results}
    (out / "result.json").write_text(json.dumps(doc, indent=2))
    print(f"copy kernels A/B: base {a.base} vs candidate {a.candidate} (HEAD {commit}); "
          "ratio = plain copy_ time / kernel time, checksums on, median of rounds")
    for r in results:
        print(f"  page {r['page_size']:>3}: base store {r['ck_base']['store']:.2f}x load {r['ck_base']['load']:.2f}x"
              f"   candidate store {r['ck_candidate']['store']:.2f}x load {r['ck_candidate']['load']:.2f}x"
              f"   same hashes {r['same_hashes']}, round trip equal {r['roundtrip_equal']}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = np.arange(len(results))
        for i, (n, d) in enumerate((("ck_base", "store"), ("ck_base", "load"), ("ck_candidate", "store"),
                                    ("ck_candidate", "load"))):
            ax.bar(xs + (i - 1.5) * 0.2, [r[n][d] for r in results], 0.2, label=f"{n[3:]} {d}")
        ax.axhline(0.9, color="k", ls="--", lw=0.8)
        ax.set_xticks(xs, [f"page {r['page_size']}" for r in results])
        ax.set_ylabel("x plain copy_ (higher is better)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "copy_kernels_ab.png", dpi=120)
    except ImportError:
        pass
    ok = all(r["same_hashes"] and r["roundtrip_equal"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
