"""Flow-level simulation study of KV routing policies (same as `flexflow bench simulate`).

    python benchmarks/simulate.py --out runs/sim --img-dir docs/img      # the full study (docs/simulation.md)
    python benchmarks/simulate.py --out runs/sim-quick --quick           # smoke subset, seconds
"""

import sys

from flexflow_sglang.tools.sim.study import main

if __name__ == "__main__":
    sys.exit(main())
