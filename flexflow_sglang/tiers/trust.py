"""Shared-secret trust mode of the remote tier (docs/tiers.md, "Trust model").

One secret, known to every tier server and client of a deployment, gives three things:
* control channel: every frame carries a 16-byte HMAC-SHA256 tag over (sender role, sequence
  number, header, body, blob). HELLO / HELLO_OK are keyed with a key derived from the secret and
  bind both sides' fresh nonces; every later frame uses a session key derived from those nonces, so
  a frame cannot be forged, replayed, reordered or moved to another connection;
* page MAC: the writer sends an HMAC-SHA256 (truncated to 16 bytes) of (page key, page bytes) with
  every page (several pages in parallel threads: hashlib releases the GIL); the
  server stores it next to the page and returns it with every lookup; the reader checks it. A server
  or a NIXL peer without the secret that rewrites a page (and its CRC) turns it into a miss;
* keyed page keys (connector): the prefix hash chain starts from a seed keyed with the secret, so
  whoever sees keys (a tier server, the network) cannot confirm a guessed prompt prefix.

The secret comes from a file (owner-only, 16..4096 bytes; surrounding whitespace is stripped) or
from the FLEXFLOW_TIER_SECRET environment variable (the value itself, >= 16 bytes).
FLEXFLOW_TIER_SECRET_FILE names a file when no path is given explicitly.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import List, Optional, Sequence

from ..errors import ConfigError

ENV_SECRET = "FLEXFLOW_TIER_SECRET"
ENV_SECRET_FILE = "FLEXFLOW_TIER_SECRET_FILE"
TAG_LEN = 16
MAC_LEN = 16
NONCE_LEN = 16
MIN_SECRET = 16
MAX_SECRET = 4096


def read_secret_file(path: str) -> bytes:
    """The secret in `path`; ConfigError (one line, names the file) unless it is a regular file
    of ours, not readable by group/other, holding 16..4096 bytes."""
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"secret file {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"secret file {path!r}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"secret file {path!r} has mode {st.st_mode & 0o777:o}: "
                              "it must not be readable by group or others (chmod 600)")
        if st.st_size > MAX_SECRET + 64:
            raise ConfigError(f"secret file {path!r}: {st.st_size} bytes, at most {MAX_SECRET} allowed")
        data = os.read(fd, MAX_SECRET + 65).strip()
    finally:
        os.close(fd)
    if not MIN_SECRET <= len(data) <= MAX_SECRET:
        raise ConfigError(f"secret file {path!r}: secret of {len(data)} bytes, must be {MIN_SECRET}..{MAX_SECRET}")
    return data


def load_secret(path: Optional[str] = None, env: Optional[dict] = None) -> Optional[bytes]:
    """Secret from `path`, else $FLEXFLOW_TIER_SECRET, else $FLEXFLOW_TIER_SECRET_FILE; None if none."""
    env = os.environ if env is None else env
    if path:
        return read_secret_file(path)
    val = env.get(ENV_SECRET)
    if val:
        b = val.strip().encode("utf-8", "surrogateescape")
        if not MIN_SECRET <= len(b) <= MAX_SECRET:
            raise ConfigError(f"${ENV_SECRET}: secret of {len(b)} bytes, must be {MIN_SECRET}..{MAX_SECRET}")
        return b
    if env.get(ENV_SECRET_FILE):
        return read_secret_file(env[ENV_SECRET_FILE])
    return None


def derive(secret: bytes, label: bytes, size: int = 32) -> bytes:
    return hmac.new(secret, b"ffkv-" + label, hashlib.sha256).digest()[:size]


def page_key_secret(secret: Optional[bytes]) -> bytes:
    """Key of the connector's page-key seed (b"" = unkeyed, the default chain)."""
    return derive(secret, b"pagekey") if secret else b""


class FrameAuth:
    """Per-connection state of the authenticated control channel (role "c" client, "s" server)."""

    def __init__(self, secret: bytes, role: str):
        if role not in ("c", "s"):
            raise ValueError("role must be 'c' or 's'")
        self._hello_key = derive(secret, b"hello")
        self._secret = secret
        self.role = role.encode()
        self.peer = b"s" if role == "c" else b"c"
        self.key = self._hello_key
        self.send_seq = 0
        self.recv_seq = 0
        self.nonce = os.urandom(NONCE_LEN)

    def _tag(self, who: bytes, seq: int, data: bytes) -> bytes:
        return hmac.new(self.key, who + seq.to_bytes(8, "big") + data, hashlib.sha256).digest()[:TAG_LEN]

    def seal(self, data: bytes) -> bytes:
        t = self._tag(self.role, self.send_seq, data)
        self.send_seq += 1
        return t

    def check(self, data: bytes, tag: bytes) -> bool:
        ok = hmac.compare_digest(self._tag(self.peer, self.recv_seq, data), tag)
        if ok:
            self.recv_seq += 1
        return ok

    def start_session(self, client_nonce: bytes, server_nonce: bytes) -> None:
        """After HELLO / HELLO_OK: every later frame uses the session key of these two nonces."""
        self.key = derive(self._secret, b"session" + client_nonce + server_nonce)


class PageMac:
    """HMAC-SHA256/128 over (page key, page bytes): with SHA-NI the fastest keyed hash hashlib has."""

    _PAR_MIN_BYTES = 64 << 10

    def __init__(self, secret: bytes):
        self._h = hmac.new(derive(secret, b"page"), b"ffkv-pagemac", hashlib.sha256)

    def mac(self, key: bytes, page) -> bytes:
        h = self._h.copy()  # the keyed state, computed once
        h.update(len(key).to_bytes(1, "big") + key)
        h.update(memoryview(page).cast("B"))
        return h.digest()[:MAC_LEN]

    def macs(self, keys: Sequence[bytes], pages, rows: Optional[Sequence[int]] = None) -> List[bytes]:
        """MAC of keys[j] with pages[rows[j]] (rows default 0..n-1), several pages in parallel."""
        rows = list(range(len(keys)) if rows is None else rows)
        if len(rows) < 2 or pages.shape[1] < self._PAR_MIN_BYTES or (os.cpu_count() or 1) < 2:
            return [self.mac(keys[j], pages[r]) for j, r in enumerate(rows)]
        from .base import _get_pool  # the CRC32 threads
        return list(_get_pool().map(lambda jr: self.mac(keys[jr[0]], pages[jr[1]]), enumerate(rows)))
