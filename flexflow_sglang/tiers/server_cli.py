"""Command line of the tier server (`flexflow tier-server`, `python -m flexflow_sglang.tiers.tier_server`).

Every flag is validated before anything starts: a bad value is one line naming the flag, the value
and the allowed range, exit code 2, no traceback; so are a port in use, a capacity that cannot be
mapped and a bad secret file.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys

from .tier_server import (_GIB, MAX_CAPACITY_GB, MAX_PAGE_NBYTES, MIN_PAGE_NBYTES, TierServer,
                          _parse_relay_peers)
from .wire import parse_hostport

log = logging.getLogger("flexflow_sglang.tiers.server")
_DOC = "Tier server: serve this node's KV pages to peers' remote tiers (docs/tiers.md)."


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage block) and exit 2."""

    def error(self, message):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message}\n")


def _num(lo: float, hi: float, kind=float, lo_open: bool = True):
    """argparse type: a finite number in (lo, hi] (or [lo, hi] when lo_open is False)."""
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or (isinstance(v, float) and not math.isfinite(v)) or v > hi or v < lo or (lo_open and v == lo):
            what = "an integer" if kind is int else "a finite number"
            rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if kind is int else f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what} in {rng}")
        return v
    return conv


def _hostport(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv=None) -> int:
    prog = "flexflow tier-server"
    ap = _Parser(prog=prog, description=_DOC)
    ap.add_argument("--config", default=None,
                    help="flexflow YAML config (default $FLEXFLOW_CONFIG): remote_tier.listen and "
                         "remote_tier.secret_file are the defaults of --listen and --secret-file")
    ap.add_argument("--listen", default=None, type=_hostport, help="host:port (default 127.0.0.1:0)")
    ap.add_argument("--capacity-gb", type=_num(0, MAX_CAPACITY_GB), default=1.0, help="host buffer size in GiB")
    ap.add_argument("--page-nbytes", type=_num(MIN_PAGE_NBYTES, MAX_PAGE_NBYTES, int, lo_open=False), default=None,
                    help=f"slot size, {MIN_PAGE_NBYTES}..{MAX_PAGE_NBYTES} (default: the first client's; "
                         "set it on a shared server)")
    ap.add_argument("--storage-path", default=None, help="back the buffer with a storage tier here")
    ap.add_argument("--storage-capacity-gb", type=_num(0, 1 << 20), default=10.0)
    ap.add_argument("--storage-read-only", action="store_true", help="serve the storage tier's pages, write none")
    ap.add_argument("--storage-fsync", action="store_true", help="fsync each stored page (survives power loss)")
    ap.add_argument("--storage-layout", choices=("files", "slabs"), default="files",
                    help="that storage tier's layout: one file per page, or slots in preallocated slab files")
    ap.add_argument("--lease-ttl-s", type=_num(0, 3600), default=30.0)
    ap.add_argument("--idle-timeout-s", type=_num(0, 86400), default=60.0,
                    help="close a connection that sends no frame for this long (default 60)")
    ap.add_argument("--frame-timeout-s", type=_num(0, 600), default=10.0,
                    help="close a connection that takes longer for one frame, or to read a reply (default 10)")
    ap.add_argument("--max-conns", type=_num(1, 65536, int, lo_open=False), default=64)
    ap.add_argument("--verify-puts", action="store_true", help="CRC-check written pages at COMMIT")
    ap.add_argument("--node", default=None, help="topology node name reported to clients")
    ap.add_argument("--no-relay", action="store_true", help="refuse RELAY_GET/RELAY_PUT (ERROR)")
    ap.add_argument("--relay-peers", default=None,
                    help="NODE=host:port,...: owners' addresses as seen from here (and the only owners relayed for)")
    ap.add_argument("--relay-retry-after-s", type=_num(0, 86400), default=10.0)
    ap.add_argument("--secret-file", default=None,
                    help="shared-secret mode (HMAC per frame, MAC per page); also $FLEXFLOW_TIER_SECRET[_FILE]")
    ap.add_argument("--ready-file", default=None, help="write {'listen': host:port, 'pid'} here when ready")
    ap.add_argument("--log-level", default="WARNING", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    def fail(msg: str) -> int:
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2

    try:
        relay_peers = _parse_relay_peers(a.relay_peers)
    except ValueError as e:
        return fail(str(e))
    cap = int(a.capacity_gb * _GIB)
    if a.page_nbytes and a.page_nbytes > cap:
        return fail(f"--page-nbytes {a.page_nbytes} is larger than --capacity-gb {a.capacity_gb:g}")
    from ..errors import FlexFlowError
    from .trust import load_secret
    cfg_path = a.config or os.environ.get("FLEXFLOW_CONFIG") or None
    try:
        if cfg_path:
            from ..config import load_config
            rt = load_config(cfg_path).remote_tier
            a.listen = a.listen or rt.listen
            a.secret_file = a.secret_file or rt.secret_file
        a.listen = a.listen or "127.0.0.1:0"
        secret = load_secret(a.secret_file)
    except FlexFlowError as e:
        return fail(" ".join(str(e).split()))
    try:
        srv = TierServer(a.listen, cap, a.page_nbytes, a.storage_path, a.storage_capacity_gb, a.lease_ttl_s,
                         a.verify_puts, a.node, max_conns=a.max_conns, relay=not a.no_relay,
                         relay_peers=relay_peers, relay_retry_after_s=a.relay_retry_after_s,
                         idle_timeout_s=a.idle_timeout_s, frame_timeout_s=a.frame_timeout_s, secret=secret,
                         storage_read_only=a.storage_read_only, storage_fsync=a.storage_fsync,
                         storage_layout=a.storage_layout)
    except (FlexFlowError, ValueError) as e:
        return fail(str(e))
    except OSError as e:  # bind (address in use, not ours), mmap (no memory)
        return fail(f"cannot start on {a.listen} with {a.capacity_gb:g} GiB: {e.strerror or e}")
    host = parse_hostport(a.listen)[0]
    if host not in ("127.0.0.1", "localhost", "::1") and not a.page_nbytes:
        log.warning("tier server listens on %s without --page-nbytes: the first client fixes the page size "
                    "for everyone", a.listen)
    if host not in ("127.0.0.1", "localhost", "::1") and secret is None:
        log.warning("tier server listens on %s without a shared secret: anyone who can reach it can read "
                    "and write pages (docs/tiers.md, trust model)", a.listen)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: srv.stop())
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"listen": srv.address, "pid": os.getpid(), "node": srv.node}, fh)
        os.replace(tmp, a.ready_file)
    print(f"READY {srv.address}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
