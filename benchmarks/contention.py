#!/usr/bin/env python
"""Contention benchmark: does adaptive routing pay on real (namespaced, tc-capped) links?

    sudo python benchmarks/contention.py --out runs/contention [--quick] [--update-doc docs/contention.md]

See docs/contention.md. The implementation lives in flexflow_sglang/tools/bench/contention/.
"""

import sys

from flexflow_sglang.tools.bench.contention import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
