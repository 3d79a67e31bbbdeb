"""Diagnostic: dump a request's prefix KV as the scheduler sees it, to compare host hits with device hits.

Off unless ``FLEXFLOW_KV_DUMP_DIR`` is set in the scheduler's environment. Then, per request attempt:
- a **device hit** (match_prefix found ``n`` tokens in the device tree) writes ``device`` records of
  the KV in those ``n`` device slots;
- a **host hit** writes a ``loaded`` record of the KV in the slots of the whole prefix (device part
  + loaded part) right after init_load_back returned, i.e. what the forward pass will read.

Records read SGLang's pool buffers directly (``k_buffer`` / ``v_buffer`` / ``kv_buffer`` per layer),
not the connector's page views, so a layout bug in the connector cannot hide itself. Each record is
two files: ``<name>.bin`` (raw bytes: for each token, for each layer, each buffer's row) and
``<name>.json`` (tokens hash, length, kind, rank, dtype, row bytes); owner-only, no pickle. The
tests compare ``device`` and ``loaded`` records of the same token prefix byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from array import array
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ENV = "FLEXFLOW_KV_DUMP_DIR"
_seq = 0
_lock = threading.Lock()


def dump_dir() -> Optional[str]:
    return os.environ.get(ENV) or None


def tokens_hash(tokens) -> str:
    raw = array("q", list(tokens)).tobytes()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _buffers(kvcache):
    if hasattr(kvcache, "k_buffer"):
        return [(k, v) for k, v in zip(kvcache.k_buffer, kvcache.v_buffer)]
    return [(kv,) for kv in kvcache.kv_buffer]


def gather_rows(kvcache, slots: torch.Tensor) -> bytes:
    """Token-major bytes of the KV at `slots`: token t, then layer l, then buffer b's row."""
    slots = torch.as_tensor(slots).to(torch.long).cpu()
    parts = []
    for bufs in _buffers(kvcache):
        for b in bufs:
            rows = b.index_select(0, slots.to(b.device)).contiguous().cpu()
            parts.append(rows.view(torch.uint8).reshape(len(slots), -1))
    if not parts:
        return b""
    return torch.cat(parts, dim=1).contiguous().numpy().tobytes()


def write_record(kind: str, tokens, slots: torch.Tensor, kvcache, rank: int = 0, **extra) -> Optional[str]:
    """Write one record; returns its base path (None when dumping is off or failed)."""
    root = dump_dir()
    if root is None or len(slots) == 0:
        return None
    global _seq
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        data = gather_rows(kvcache, slots)
        n = len(slots)
        with _lock:
            _seq += 1
            seq = _seq
        h = tokens_hash(tokens[:n])
        base = os.path.join(root, f"r{rank}-p{os.getpid()}-{seq:06d}-{kind}-{h}-{n}")
        fd = os.open(base + ".bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        meta = {"kind": kind, "tokens_hash": h, "tokens": n, "rank": rank, "seq": seq, "pid": os.getpid(),
                "row_bytes": len(data) // n, "dtype": str(_buffers(kvcache)[0][0].dtype), **extra}
        fd = os.open(base + ".json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f)
        return base
    except Exception:  # noqa: BLE001 - a diagnostic must never break serving
        logger.exception("flexflow: KV dump to %s failed", root)
        return None


def read_records(root: str) -> list:
    """[(meta, bytes)] of every record under `root`, in write order."""
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(root, name)) as f:
            meta = json.load(f)
        with open(os.path.join(root, name[:-5] + ".bin"), "rb") as f:
            out.append((meta, f.read()))
    out.sort(key=lambda r: (r[0]["pid"], r[0]["seq"]))
    return out
