"""Contention benchmark on real links: network namespaces joined by tbf-capped veths, NIXL UCX agents
moving KV-sized payloads, background traffic on the direct link (see docs/contention.md).

`main(argv)` is `python benchmarks/contention.py --out DIR [--quick]`. Needs root, iproute2 and nixl.
"""


def main(argv=None) -> int:
    # imported lazily: the node and traffic programs run as modules of this package, and must start
    # fast (they are spawned mid-run)
    from .run import main as _main
    return _main(argv)


__all__ = ["main"]
