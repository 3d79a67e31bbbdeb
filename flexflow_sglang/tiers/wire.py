"""Control-channel wire format of the remote tier (TCP). Explicit and versioned; never pickle.

Frame = 16-byte header + JSON body + binary blob:
    magic  4s  b"FFTW"
    version u8  WIRE_VERSION (1); a peer speaking another version gets an ERROR frame and is closed
    type    u8  MsgType
    flags   u16 0 (reserved)
    json_len u32  length of the UTF-8 JSON object that follows (<= MAX_JSON)
    blob_len u32  length of the raw bytes after the JSON (<= max_blob, default MAX_BLOB)
All integers are big-endian. The JSON body is always an object. Binary payloads (packed keys,
NIXL agent metadata) travel in the blob, never inside the JSON. Keys are packed back to back with
a fixed length given by the body's "klen" (1..64).
"""
from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import List, Optional, Sequence, Tuple

from ..errors import FlexFlowError

MAGIC = b"FFTW"
WIRE_VERSION = 1
HEADER = struct.Struct(">4sBBHII")
HEADER_LEN = HEADER.size  # 16
MAX_JSON = 4 << 20
MAX_BLOB = 16 << 20
MAX_KEY_LEN = 64


class WireError(FlexFlowError, ValueError):
    """A frame is malformed: bad magic, unsupported version, unknown type, oversized, bad body."""


class MsgType(IntEnum):
    HELLO = 1        # c->s {"client", "page_nbytes"}                       -> HELLO_OK
    HELLO_OK = 2     # s->c {"agent", "page_nbytes", "slots", "node"} blob = NIXL agent metadata
    LOOKUP = 3       # c->s {"klen", "n", "pin"} blob = keys                 -> LOOKUP_OK
    LOOKUP_OK = 4    # s->c {"count", "lease", "addrs", "sums"}
    RELEASE = 5      # c->s {"lease", "drop": [i...]}  one-way: the server never answers it
    PUT = 6          # c->s {"klen", "n", "sums"} blob = keys                -> PUT_OK
    PUT_OK = 7       # s->c {"lease", "status": [1 have | 0 write | -1 skip], "addrs": [per 0]}
    COMMIT = 8       # c->s {"lease", "ok": [0/1 per allocated slot]}        -> COMMIT_OK
    COMMIT_OK = 9    # s->c {"stored": [0/1 per allocated slot]}
    DISCARD = 10     # c->s {"klen", "n"} blob = keys                        -> DISCARD_OK
    DISCARD_OK = 11  # s->c {"dropped"}
    STATS = 12       # c->s {}                                               -> STATS_OK
    STATS_OK = 13    # s->c {counters...}
    PING = 14        # c->s {}                                               -> PONG
    PONG = 15
    # CrossNodeRelay (added within version 1: a server that predates them answers ERROR "unknown
    # message type" and closes the connection; clients treat any ERROR here as "relay unsupported").
    # The relay server pulls the pages from `owner` (its own RemoteTier client of that peer) into
    # temporary slots pinned under a get lease; the client READs them and RELEASEs as after LOOKUP.
    RELAY_GET = 16     # c->s {"klen", "n", "owner": host:port, "owner_node", "timeout_ms"} blob = keys
    RELAY_GET_OK = 17  # s->c {"count", "lease", "addrs", "sums", "pull_s", ["error"], ["cold"]}
    # "error": the pull failed (count covers what arrived); "cold": the relay connected to the owner
    # first (its time is no bandwidth measurement). Puts: the client WRITEs into temporary slots;
    # COMMIT on that lease makes the relay check the CRCs and forward the pages to `owner`; COMMIT_OK
    # {"stored", "fwd_s", ["error"], ["cold"]} then means "stored at the owner".
    RELAY_PUT = 18     # c->s {"klen", "n", "sums", "owner", "owner_node", "timeout_ms"} blob = keys
    RELAY_PUT_OK = 19  # s->c {"lease", "status": [0 write | -1 skip], "addrs": [per 0]}
    ERROR = 127      # s->c {"error": str}


RELAY_TYPES = frozenset((MsgType.RELAY_GET, MsgType.RELAY_PUT))


_TYPES = {int(t) for t in MsgType}


@dataclass
class Frame:
    type: MsgType
    body: dict = field(default_factory=dict)
    blob: bytes = b""


def encode_frame(mtype: MsgType, body: Optional[dict] = None, blob: bytes = b"",
                 max_blob: int = MAX_BLOB) -> bytes:
    if int(mtype) not in _TYPES:
        raise WireError(f"unknown message type {mtype}")
    js = json.dumps(body or {}, separators=(",", ":"), allow_nan=False).encode("utf-8")
    blob = bytes(blob)
    if len(js) > MAX_JSON:
        raise WireError(f"JSON body of {len(js)} bytes exceeds {MAX_JSON}")
    if len(blob) > max_blob:
        raise WireError(f"blob of {len(blob)} bytes exceeds {max_blob}")
    return HEADER.pack(MAGIC, WIRE_VERSION, int(mtype), 0, len(js), len(blob)) + js + blob


def decode_header(raw: bytes, max_blob: int = MAX_BLOB) -> Tuple[MsgType, int, int]:
    """(type, json_len, blob_len); raises WireError before anything is allocated for the body."""
    if len(raw) != HEADER_LEN:
        raise WireError(f"short header ({len(raw)} bytes)")
    magic, ver, mtype, flags, jlen, blen = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if ver != WIRE_VERSION:
        raise WireError(f"unsupported wire version {ver} (this side speaks {WIRE_VERSION})")
    if mtype not in _TYPES:
        raise WireError(f"unknown message type {mtype}")
    if jlen > MAX_JSON or blen > max_blob:
        raise WireError(f"oversized frame (json {jlen}, blob {blen}; limits {MAX_JSON}, {max_blob})")
    return MsgType(mtype), jlen, blen


def decode_body(mtype: MsgType, js: bytes, blob: bytes) -> Frame:
    try:
        body = json.loads(js.decode("utf-8")) if js else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"bad JSON body: {e}") from None
    if not isinstance(body, dict):
        raise WireError("JSON body must be an object")
    return Frame(mtype, body, blob)


def decode_frame(data: bytes, max_blob: int = MAX_BLOB) -> Frame:
    """Decode one complete frame from bytes (the stream reader below is what sockets use)."""
    mtype, jlen, blen = decode_header(data[:HEADER_LEN], max_blob)
    if len(data) != HEADER_LEN + jlen + blen:
        raise WireError(f"frame length {len(data)} != {HEADER_LEN + jlen + blen}")
    return decode_body(mtype, data[HEADER_LEN:HEADER_LEN + jlen], data[HEADER_LEN + jlen:])


def _arm_timeout(sock: socket.socket, deadline: Optional[float]) -> None:
    """Socket timeout = what is left until `deadline` (time.monotonic()); None blocks."""
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("control channel timed out")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float]) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _arm_timeout(sock, deadline)
        try:
            r = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise TimeoutError("control channel timed out") from None
        if r == 0:
            raise ConnectionError("peer closed the control channel")
        got += r
    return bytes(buf)


def read_frame(sock: socket.socket, deadline: Optional[float] = None, max_blob: int = MAX_BLOB) -> Frame:
    """Read one frame. Raises TimeoutError (deadline, time.monotonic()), ConnectionError, WireError."""
    mtype, jlen, blen = decode_header(_recv_exact(sock, HEADER_LEN, deadline), max_blob)
    js = _recv_exact(sock, jlen, deadline) if jlen else b""
    blob = _recv_exact(sock, blen, deadline) if blen else b""
    return decode_body(mtype, js, blob)


def write_frame(sock: socket.socket, mtype: MsgType, body: Optional[dict] = None, blob: bytes = b"",
                deadline: Optional[float] = None, max_blob: int = MAX_BLOB) -> None:
    data = encode_frame(mtype, body, blob, max_blob)
    _arm_timeout(sock, deadline)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise TimeoutError("control channel timed out") from None


def pack_keys(keys: Sequence[bytes]) -> Tuple[int, bytes]:
    if not keys:
        return 32, b""
    klen = len(keys[0])
    if not 1 <= klen <= MAX_KEY_LEN:
        raise WireError(f"key length {klen} outside 1..{MAX_KEY_LEN}")
    for k in keys:
        if len(k) != klen:
            raise WireError("all keys of one message must have the same length")
    return klen, b"".join(keys)


def unpack_keys(body: dict, blob: bytes) -> List[bytes]:
    klen, n = body.get("klen"), body.get("n")
    if not isinstance(klen, int) or not isinstance(n, int) or not 1 <= klen <= MAX_KEY_LEN or n < 0:
        raise WireError("bad klen/n")
    if len(blob) != klen * n:
        raise WireError(f"key blob of {len(blob)} bytes != {n} x {klen}")
    return [blob[i * klen:(i + 1) * klen] for i in range(n)]


def int_list(body: dict, name: str, n: Optional[int] = None) -> List[int]:
    v = body.get(name)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise WireError(f"'{name}' must be a list of integers")
    if n is not None and len(v) != n:
        raise WireError(f"'{name}' has {len(v)} entries, expected {n}")
    return v


def parse_hostport(s: str) -> Tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {s!r}")
    return host.strip("[]"), int(port)
