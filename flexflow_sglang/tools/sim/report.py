"""Tables (markdown + JSON) and matplotlib figures of a simulation run."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import numpy as np

from .scenarios import EXTRA_LOADS, LOADS as _LOADS, MACHINES

LOADS = _LOADS + EXTRA_LOADS

POLICY_ORDER = ("direct", "adaptive", "adaptive-nosplit", "oracle", "oracle-fast")


def geomean(xs) -> float:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs))) if xs else float("nan")


def _types(d: Dict[str, int]) -> str:
    short = {"Direct": "D", "NVLinkRelay": "NVR", "CrossNodeRelay": "XNR", "SplitPath": "Split",
             "StorageRelay": "Stor"}
    return " ".join(f"{short.get(k, k)}:{v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


def summary(results: Sequence[dict]) -> dict:
    """Aggregates over scenarios: geomean speedups, QoS totals, adaptive-vs-oracle statistics."""
    pols = [p for p in POLICY_ORDER if results and p in results[0]["policies"]]
    out = {"scenarios": len(results), "policies": {}}
    for p in pols:
        sp = [r["policies"][p]["speedup"] for r in results]
        out["policies"][p] = {
            "geomean_speedup": geomean(sp),
            "min_speedup": float(min(sp)),
            "max_speedup": float(max(sp)),
            "qos_violations": int(sum(r["policies"][p]["qos_violations"] for r in results)),
            "qos_throttled": int(sum(r["policies"][p]["qos_throttled"] for r in results)),
            "qos_over_threshold": int(sum(r["policies"][p]["qos_over_threshold"] for r in results)),
            "transfers": int(sum(r["policies"][p]["n"] for r in results)),
        }
    for ref in ("oracle", "oracle-fast"):
        if ref not in pols:
            continue
        for p in ("adaptive", "adaptive-nosplit"):
            if p not in pols:
                continue
            ratios = [r["policies"][ref]["mean_fct_us"] / r["policies"][p]["mean_fct_us"] for r in results]
            # scenarios where the adaptive policy caused no more QoS violations than the reference
            fair = [x for x, r in zip(ratios, results)
                    if r["policies"][p]["qos_violations"] <= r["policies"][ref]["qos_violations"]]
            out[f"{p}_vs_{ref}"] = {
                "geomean": geomean(ratios), "min": float(min(ratios)),
                "within_10pct": int(sum(x >= 0.9 for x in ratios)), "of": len(ratios),
                "geomean_same_or_fewer_qos": geomean(fair), "n_same_or_fewer_qos": len(fair),
                "within_10pct_same_or_fewer_qos": int(sum(x >= 0.9 for x in fair)),
            }
    return out


def scenario_table(results: Sequence[dict]) -> str:
    """One row per scenario."""
    head = ("| machine | load | MiB | adaptive | no-split | oracle | oracle-fast | adaptive/oracle "
            "| QoS viol. direct / adaptive / no-split / oracle | adaptive paths | no-split paths |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|\n")
    rows = []
    for r in results:
        P = r["policies"]
        q = " / ".join(f"{P[p]['qos_violations']}" for p in ("direct", "adaptive", "adaptive-nosplit", "oracle")
                       if p in P)
        n = P["direct"]["n"]
        rows.append(f"| {r['machine']} | {r['load']} | {r['payload_mib']:g} | {P['adaptive']['speedup']:.2f}x "
                    f"| {P['adaptive-nosplit']['speedup']:.2f}x | {P['oracle']['speedup']:.2f}x "
                    f"| {P['oracle-fast']['speedup']:.2f}x | {P['adaptive']['vs_oracle']:.2f} | {q} (of {n}) "
                    f"| {_types(P['adaptive']['types'])} | {_types(P['adaptive-nosplit']['types'])} |")
    return head + "\n".join(rows) + "\n"


def machine_load_table(results: Sequence[dict]) -> str:
    """Geomean over payload sizes per (machine, load); QoS violations summed."""
    groups: Dict[tuple, List[dict]] = defaultdict(list)
    for r in results:
        groups[(r["machine"], r["load"])].append(r)
    head = ("| machine | load | adaptive | no-split | oracle | oracle-fast | adaptive/oracle "
            "| QoS viol. direct / adaptive / no-split / oracle (of N) |\n"
            "|---|---|---:|---:|---:|---:|---:|---|\n")
    rows = []
    order_m = {m: i for i, m in enumerate(MACHINES)}
    order_l = {l: i for i, l in enumerate(LOADS)}
    for (m, l), rs in sorted(groups.items(), key=lambda kv: (order_m.get(kv[0][0], 99), order_l.get(kv[0][1], 99))):
        g = lambda p: geomean([r["policies"][p]["speedup"] for r in rs])
        ratio = geomean([r["policies"]["adaptive"]["vs_oracle"] for r in rs])
        q = " / ".join(str(sum(r["policies"][p]["qos_violations"] for r in rs))
                       for p in ("direct", "adaptive", "adaptive-nosplit", "oracle"))
        n = sum(r["policies"]["direct"]["n"] for r in rs)
        rows.append(f"| {m} | {l} | {g('adaptive'):.2f}x | {g('adaptive-nosplit'):.2f}x | {g('oracle'):.2f}x "
                    f"| {g('oracle-fast'):.2f}x | {ratio:.2f} | {q} ({n}) |")
    return head + "\n".join(rows) + "\n"


def flexflow_table(results: Sequence[dict]) -> str:
    """flexFlow's experiment: the 4xA100 NVLink box, idle and with GPU0-GPU1 at 85%, per payload."""
    rs = sorted([r for r in results if r["machine"] == "dgx-a100" and r["load"] in ("idle", "hot")],
                key=lambda r: (r["load"] != "idle", r["payload_mib"]))
    if not rs:
        return ""
    head = ("| load | MiB | no-split (flexFlow-shaped) | adaptive (default, split on) | oracle "
            "| QoS viol. direct / no-split / adaptive (of N) | adaptive paths |\n|---|---:|---:|---:|---:|---|---|\n")
    rows = []
    for r in rs:
        P = r["policies"]
        rows.append(f"| {r['load']} | {r['payload_mib']:g} | {P['adaptive-nosplit']['speedup']:.2f}x "
                    f"| {P['adaptive']['speedup']:.2f}x | {P['oracle']['speedup']:.2f}x "
                    f"| {P['direct']['qos_violations']} / {P['adaptive-nosplit']['qos_violations']} / "
                    f"{P['adaptive']['qos_violations']} ({P['direct']['n']}) | {_types(P['adaptive']['types'])} |")
    return head + "\n".join(rows) + "\n"


def summary_md(s: dict) -> str:
    lines = ["| policy | geomean speedup | min | max | transfers with QoS violation (throttled / over-thr) |",
             "|---|---:|---:|---:|---|"]
    for p, d in s["policies"].items():
        lines.append(f"| {p} | {d['geomean_speedup']:.2f}x | {d['min_speedup']:.2f}x | {d['max_speedup']:.2f}x "
                     f"| {d['qos_violations']} / {d['transfers']} ({d['qos_throttled']} / {d['qos_over_threshold']}) |")
    lines.append("")
    for k in ("adaptive_vs_oracle", "adaptive-nosplit_vs_oracle", "adaptive_vs_oracle-fast",
              "adaptive-nosplit_vs_oracle-fast"):
        if k in s:
            d = s[k]
            lines.append(f"- {k.replace('_vs_', ' / ')}: geomean {d['geomean']:.3f}, min {d['min']:.3f}, "
                         f"within 10% in {d['within_10pct']}/{d['of']} scenarios; where it caused no more QoS "
                         f"violations than the reference: geomean {d['geomean_same_or_fewer_qos']:.3f}, "
                         f"within 10% in {d['within_10pct_same_or_fewer_qos']}/{d['n_same_or_fewer_qos']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- figures
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, img_dir: str, name: str) -> str:
    """Lay out, write `img_dir/name` (110 dpi), close the figure; returns the path."""
    fig.tight_layout()
    f = os.path.join(img_dir, name)
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return f


def _speedup_grid(results: Sequence[dict], policy: str, machines: List[str], loads: List[str]) -> np.ndarray:
    """Geomean speedup over payloads of `policy`, machines x loads (nan where nothing ran)."""
    M = np.full((len(machines), len(loads)), np.nan)
    for i, m in enumerate(machines):
        for j, l in enumerate(loads):
            M[i, j] = geomean([r["policies"][policy]["speedup"] for r in results
                               if r["machine"] == m and r["load"] == l])
    return M


def _plot_speedup_heatmap(plt, results, machines, loads, img_dir: str, prefix: str) -> str:
    """1. heatmaps: geomean speedup over payloads per machine x load, one panel per policy."""
    pols = ("adaptive", "adaptive-nosplit", "oracle")
    fig, axes = plt.subplots(1, len(pols), figsize=(4.2 * len(pols), 0.45 * len(machines) + 1.8), sharey=True)
    for ax, p in zip(np.atleast_1d(axes), pols):
        M = _speedup_grid(results, p, machines, loads)
        ax.imshow(np.log2(M), cmap="RdYlGn", vmin=-2, vmax=2, aspect="auto")
        for i in range(len(machines)):
            for j in range(len(loads)):
                if np.isfinite(M[i, j]):
                    ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(loads)), loads, rotation=30, ha="right")
        ax.set_yticks(range(len(machines)), machines)
        ax.set_title(f"{p} speedup vs always-direct")
    return _save(plt, fig, img_dir, f"{prefix}_speedup_heatmap.png")


def _plot_flexflow_shape(plt, results, img_dir: str, prefix: str) -> Optional[str]:
    """2. flexFlow's shape: the 4xA100 box, idle and hot, speedup vs payload (None: no such runs)."""
    fx = [r for r in results if r["machine"] == "dgx-a100" and r["load"] in ("idle", "hot")]
    if not fx:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, l in zip(axes, ("idle", "hot")):
        rs = sorted([r for r in fx if r["load"] == l], key=lambda r: r["payload_mib"])
        xs = [r["payload_mib"] for r in rs]
        for p, st in (("adaptive", "o-"), ("adaptive-nosplit", "s-"), ("oracle", "k--")):
            ax.plot(xs, [r["policies"][p]["speedup"] for r in rs], st, label=p)
        if l == "hot":
            ax.axhline(1.88, color="grey", ls=":", label="flexFlow 1.88x")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV payload (MiB)")
        ax.set_title(f"4xA100 NVLink, {l}" + (" (GPU0-GPU1 at 85%)" if l == "hot" else ""))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup vs always-direct")
    axes[1].legend(fontsize=8)
    return _save(plt, fig, img_dir, f"{prefix}_flexflow_shape.png")


def _plot_vs_oracle(plt, results, machines, loads, img_dir: str, prefix: str) -> str:
    """3. adaptive / oracle per scenario (hollow: the adaptive run caused QoS violations the oracle avoided)."""
    fig, ax = plt.subplots(figsize=(10, 3.8))
    colors = dict(zip(LOADS, ("tab:green", "tab:red", "tab:purple", "tab:blue", "tab:orange", "tab:brown")))
    for k, l in enumerate(loads):
        rs = [r for r in results if r["load"] == l]
        xs = np.array([machines.index(r["machine"]) + (k - (len(loads) - 1) / 2) * 0.15
                       + (np.log2(r["payload_mib"]) - 4) * 0.012 for r in rs])
        ys = np.array([r["policies"]["adaptive"]["vs_oracle"] for r in rs])
        worse = np.array([r["policies"]["adaptive"]["qos_violations"] > r["policies"]["oracle"]["qos_violations"]
                          for r in rs], dtype=bool)
        ax.scatter(xs[~worse], ys[~worse], s=16, color=colors.get(l), label=l)
        ax.scatter(xs[worse], ys[worse], s=16, facecolors="none", edgecolors=colors.get(l))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.9, color="grey", ls=":", lw=0.8)
    ax.set_yscale("log", base=2)
    ax.set_xticks(range(len(machines)), machines, rotation=20, ha="right")
    ax.set_ylabel("oracle FCT / adaptive FCT")
    ax.set_title("adaptive vs QoS-aware oracle per scenario (dotted: within 10%; hollow: adaptive violated QoS, "
                 "oracle did not)", fontsize=9)
    ax.legend(fontsize=8, ncol=len(loads))
    ax.grid(alpha=0.3)
    return _save(plt, fig, img_dir, f"{prefix}_vs_oracle.png")


def _qos_violation_pct(results: Sequence[dict], policy: str, load: str) -> float:
    """Percentage of `policy`'s transfers under `load` (all machines, payloads) with a QoS violation."""
    rs = [r for r in results if r["load"] == load]
    v = sum(r["policies"][policy]["qos_violations"] for r in rs)
    n = sum(r["policies"][policy]["n"] for r in rs)
    return 100.0 * v / max(n, 1)


def _plot_qos(plt, results, loads, img_dir: str, prefix: str) -> str:
    """4. QoS violations per load and policy."""
    pols = [p for p in POLICY_ORDER if p in results[0]["policies"]]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    w = 0.8 / len(pols)
    for k, p in enumerate(pols):
        fr = [_qos_violation_pct(results, p, l) for l in loads]
        ax.bar(np.arange(len(loads)) + (k - (len(pols) - 1) / 2) * w, fr, w, label=p)
    ax.set_xticks(range(len(loads)), loads)
    ax.set_ylabel("% transfers with a QoS violation")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, img_dir, f"{prefix}_qos.png")


def plot_all(results: Sequence[dict], img_dir: str, prefix: str = "sim") -> List[str]:
    """The run's four figures under `img_dir` (`<prefix>_speedup_heatmap`, `_flexflow_shape` when the
    4xA100 box ran idle or hot, `_vs_oracle`, `_qos`); returns their paths in that order."""
    os.makedirs(img_dir, exist_ok=True)
    plt = _plt()
    machines = [m for m in MACHINES if any(r["machine"] == m for r in results)]
    loads = [l for l in LOADS if any(r["load"] == l for r in results)]
    files = [_plot_speedup_heatmap(plt, results, machines, loads, img_dir, prefix),
             _plot_flexflow_shape(plt, results, img_dir, prefix),
             _plot_vs_oracle(plt, results, machines, loads, img_dir, prefix),
             _plot_qos(plt, results, loads, img_dir, prefix)]
    return [f for f in files if f is not None]
