"""Simulator vs the real-link contention benchmark (docs/contention.md, docs/simulation.md).

Models the three-namespace lab (1 Gbit/s veth links, UDP / TCP background on the direct link,
the benchmark's payload sequence, an application relay pipelining 1 MiB chunks) in the flow-level
simulator and compares throughput per policy with the measured run:

    python benchmarks/sim_vs_real.py --out runs/sim-vs-real --img-dir docs/img     # ~2 s
"""

import argparse
import json
import os
import sys
from dataclasses import asdict

from flexflow_sglang.tools.sim import hosts3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(hosts3.SCENARIOS), help="comma list")
    ap.add_argument("--gap-ms-per-mib", type=float, default=hosts3.LabSettings.gap_ms_per_mib,
                    help="verification gap between transfers, per MiB of the two payloads around it")
    ap.add_argument("--relay-chunk-kib", type=int, default=hosts3.EXECUTOR_CHUNK >> 10,
                    help="the simulated executor's relay chunk (the benchmark's: 1024)")
    ap.add_argument("--no-progress-reports", action="store_true",
                    help="own bytes reported only when a leg completes (not while it runs)")
    ap.add_argument("--udp-fair", action="store_true",
                    help="ablation: UDP background shares max-min fairly (the main study's model) "
                         "instead of keeping its rate")
    ap.add_argument("--img-dir", default=None, help="write sim_vs_real.png here (default: no figure)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    scen = a.scenarios.split(",")
    for sc in scen:
        if sc not in hosts3.SCENARIOS:
            raise SystemExit(f"unknown scenario {sc!r}; choose from {', '.join(hosts3.SCENARIOS)}")
    s = hosts3.LabSettings(gap_ms_per_mib=a.gap_ms_per_mib, relay_chunk_bytes=a.relay_chunk_kib << 10,
                           progress=not a.no_progress_reports, seed=a.seed,
                           udp_fair=a.udp_fair)
    res = hosts3.compare(scen, s=s)
    abl = hosts3.relay_model_ablation(s) if "idle" in scen else {}
    errs = [abs(r["ratio_err"]) for r in res.values()]
    md = ["# Simulator vs real links (hosts3)", "",
          f"`python benchmarks/sim_vs_real.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
          hosts3.table_md(res),
          f"adaptive/always-direct, sim vs real: largest deviation {max(errs):.0%}"
          + "; per scenario: " + ", ".join(f"{k} {r['ratio_err']:+.0%}" for k, r in res.items()), ""]
    if abl:
        md += ["## Relay pipeline model (idle, adaptive)", "", hosts3.relay_model_md(abl)]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"settings": asdict(s), "compare": res, "relay_model": {str(k): v for k, v in abl.items()}},
                  f, indent=1, default=float)
    if a.img_dir:
        os.makedirs(a.img_dir, exist_ok=True)
        md.append(f"figure: {hosts3.plot(res, os.path.join(a.img_dir, 'sim_vs_real.png'))}")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
