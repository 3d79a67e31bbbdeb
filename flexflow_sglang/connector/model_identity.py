"""Which weights a KV page was computed with, as part of the page-key fingerprint.

The storage, remote and Mooncake tiers outlive a server, so a page key must change whenever the KV
for the same tokens would: the model path and revision alone do not, when a checkpoint directory is
overwritten in place (a fine-tune saved over its base, a re-quantised export). `weights_digest`
samples the content of every weight file (its size and 1 MiB at its start, middle and end) and
config.json, so:
- changed weights give new keys (old pages are never found: a miss, not a wrong token);
- two nodes holding the same checkpoint (copied, downloaded separately: different mtimes and
  paths) compute the same digest, so instances still share KV through a deep tier.
It reads a few MiB per weight file once at start (an 8B model in 4 shards: ~12 MiB).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

#: files whose bytes decide the KV: weights in every format SGLang loads, and the architecture
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".npz")
CONFIG_FILES = ("config.json",)
SAMPLE_BYTES = 1 << 20
#: subfolder depth searched for weight files (some exports keep shards one level down)
MAX_DEPTH = 2


def local_model_dir(model_path: Optional[str], revision: Optional[str] = None) -> Optional[str]:
    """The local directory holding the checkpoint: the path itself, or a Hugging Face hub id's
    cached snapshot (no network: local_files_only). None when neither is found."""
    if not model_path:
        return None
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(repo_id=model_path, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a hub id, not cached, or no huggingface_hub: no digest
        return None


def _weight_files(root: str) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        depth = os.path.relpath(dirpath, root).count(os.sep) + (dirpath != root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < MAX_DEPTH else []
        for name in filenames:
            if name.endswith(WEIGHT_SUFFIXES) or (dirpath == root and name in CONFIG_FILES):
                out.append(os.path.join(dirpath, name))
    return sorted(out)


def _sample(path: str) -> Tuple[int, bytes]:
    """(size, blake2b of up to three 1 MiB windows: start, middle, end)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        starts = sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)})
        for s in starts:
            f.seek(s)
            h.update(f.read(SAMPLE_BYTES))
    return size, h.digest()


def weights_digest(model_path: Optional[str], revision: Optional[str] = None) -> Optional[str]:
    """Hex digest of the checkpoint's weight files (relative names, sizes, sampled content) and
    config.json; None when the model is not a local directory or cached hub snapshot, or has no
    weight file (a dummy-weights server): the fingerprint then relies on path and revision."""
    root = local_model_dir(model_path, revision)
    if root is None:
        return None
    files = _weight_files(root)
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in files):
        return None
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        try:
            size, sample = _sample(path)
        except OSError as e:
            logger.warning("flexflow: cannot read %s for the weights fingerprint (%s); "
                           "pages stored by this server will not be shared with others", path, e)
            size, sample = -1, repr(e).encode()
        h.update(os.path.relpath(path, root).encode() + b"\0" + str(size).encode() + b"\0" + sample)
    return h.hexdigest()
