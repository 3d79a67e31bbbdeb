"""Control-channel wire format of the remote tier (TCP). Explicit and versioned; never pickle.

Frame = 16-byte header + JSON body + binary blob:
    magic  4s  b"FFTW"
    version u8  WIRE_VERSION (2); a peer speaking another version gets an ERROR frame and is closed.
                Version 2: every page sum ("sums") is the 64-bit page hash (tiers/base.page_digests,
                unsigned); version 1 carried zlib's CRC32 (~4 GB/s a core, against ~30 GB/s). A
                version-1 peer is refused at its first frame, never fed sums it would misread.
    type    u8  MsgType
    flags   u16 bit 0 (FLAG_MAC): a 16-byte HMAC tag follows the blob (shared-secret mode,
                tiers/trust.py); other bits reserved (0)
    json_len u32  length of the UTF-8 JSON object that follows (<= MAX_JSON)
    blob_len u32  length of the raw bytes after the JSON (<= max_blob, default MAX_BLOB)
All integers are big-endian. The JSON body is always an object. Binary payloads (packed keys,
NIXL agent metadata) travel in the blob, never inside the JSON. Keys are packed back to back with
a fixed length given by the body's "klen" (1..64), at most MAX_KEYS_PER_FRAME per frame.

A tier server reads client frames with tighter limits (SERVER_MAX_JSON, SERVER_MAX_BLOB: what the
largest legal request needs) and two deadlines: the first byte of a frame within the idle timeout,
the rest of the frame within the frame timeout after it (so a silent or slowloris socket is cut).
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
WIRE_VERSION = 2
HEADER = struct.Struct(">4sBBHII")
HEADER_LEN = HEADER.size  # 16
MAX_JSON = 4 << 20
MAX_BLOB = 16 << 20
MAX_KEY_LEN = 64
MAX_KEYS_PER_FRAME = 32768           # one request names at most this many pages (clients truncate)
SERVER_MAX_JSON = 1 << 20            # PUT sums of 32768 keys ~ 360 KB, RELEASE drops ~ 200 KB
SERVER_MAX_BLOB = MAX_KEYS_PER_FRAME * (MAX_KEY_LEN + 16)  # keys + page MACs: 2.5 MiB
FLAG_MAC = 1
TAG_LEN = 16


class WireError(FlexFlowError, ValueError):
    """A frame is malformed: bad magic, unsupported version, unknown type, oversized, bad body."""


class IdleTimeout(TimeoutError):
    """No frame started within the idle deadline (the connection was silent, not slow)."""


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
                 max_blob: int = MAX_BLOB, flags: int = 0) -> bytes:
    if int(mtype) not in _TYPES:
        raise WireError(f"unknown message type {mtype}")
    js = json.dumps(body or {}, separators=(",", ":"), allow_nan=False).encode("utf-8")
    blob = bytes(blob)
    if len(js) > MAX_JSON:
        raise WireError(f"JSON body of {len(js)} bytes exceeds {MAX_JSON}")
    if len(blob) > max_blob:
        raise WireError(f"blob of {len(blob)} bytes exceeds {max_blob}")
    return HEADER.pack(MAGIC, WIRE_VERSION, int(mtype), flags, len(js), len(blob)) + js + blob


def decode_header(raw: bytes, max_blob: int = MAX_BLOB, max_json: int = MAX_JSON) -> Tuple[MsgType, int, int]:
    """(type, json_len, blob_len); raises WireError before anything is allocated for the body."""
    return _decode_header(raw, max_blob, max_json)[:3]


def _decode_header(raw: bytes, max_blob: int, max_json: int) -> Tuple[MsgType, int, int, int]:
    if len(raw) != HEADER_LEN:
        raise WireError(f"short header ({len(raw)} bytes)")
    magic, ver, mtype, flags, jlen, blen = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if ver != WIRE_VERSION:
        raise WireError(f"unsupported wire version {ver} (this side speaks {WIRE_VERSION})")
    if mtype not in _TYPES:
        raise WireError(f"unknown message type {mtype}")
    if jlen > max_json or blen > max_blob:
        raise WireError(f"oversized frame (json {jlen}, blob {blen}; limits {max_json}, {max_blob})")
    if flags & ~FLAG_MAC:
        raise WireError(f"reserved header flags set ({flags:#x})")
    return MsgType(mtype), jlen, blen, flags


def decode_body(mtype: MsgType, js: bytes, blob: bytes) -> Frame:
    try:
        body = json.loads(js.decode("utf-8")) if js else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"bad JSON body: {e}") from None
    except RecursionError:  # [[[[... nested past the interpreter's limit
        raise WireError("bad JSON body: nested too deeply") from None
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


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float]) -> bytearray:
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
    return buf  # no bytes() copy: a 2.5 MiB blob is held once


def read_frame(sock: socket.socket, deadline: Optional[float] = None, max_blob: int = MAX_BLOB, *,
               auth=None, max_json: int = MAX_JSON, idle_deadline: Optional[float] = None,
               frame_s: Optional[float] = None) -> Frame:
    """Read one frame. Raises TimeoutError (deadline, time.monotonic()), ConnectionError, WireError.
    Server side: `idle_deadline` bounds the wait for the frame's first byte (IdleTimeout), then the
    whole frame must arrive within `frame_s`. `auth` (trust.FrameAuth): the frame must carry a valid
    tag; without it, a tagged frame is refused."""
    if idle_deadline is not None:
        try:
            first = _recv_exact(sock, 1, idle_deadline)
        except TimeoutError:
            raise IdleTimeout("connection idle past its deadline") from None
        deadline = time.monotonic() + frame_s if frame_s else None
        raw = bytes(first + _recv_exact(sock, HEADER_LEN - 1, deadline))
    else:
        raw = bytes(_recv_exact(sock, HEADER_LEN, deadline))
    mtype, jlen, blen, flags = _decode_header(raw, max_blob, max_json)
    js = _recv_exact(sock, jlen, deadline) if jlen else b""
    blob = _recv_exact(sock, blen, deadline) if blen else b""
    if flags & FLAG_MAC:
        tag = _recv_exact(sock, TAG_LEN, deadline)
        if auth is None:
            raise WireError("the peer sent an authenticated frame, but no shared secret is configured here")
        if not auth.check(b"".join((raw, js, blob)), tag):
            raise WireError("frame authentication failed (wrong shared secret, replayed or altered frame)")
    elif auth is not None and mtype != MsgType.ERROR:  # an ERROR only ever causes a miss: shown as is
        raise WireError("unauthenticated frame: this side requires the shared secret")
    return decode_body(mtype, js, blob)


def write_frame(sock: socket.socket, mtype: MsgType, body: Optional[dict] = None, blob: bytes = b"",
                deadline: Optional[float] = None, max_blob: int = MAX_BLOB, *, auth=None) -> None:
    data = encode_frame(mtype, body, blob, max_blob, FLAG_MAC if auth is not None else 0)
    if auth is not None:
        data += auth.seal(data)
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


def unpack_keys(body: dict, blob: bytes, trailer: int = 0) -> List[bytes]:
    """The keys of a request. `trailer`: bytes per key that follow the keys in the blob (page MACs)."""
    klen, n = body.get("klen"), body.get("n")
    if (not isinstance(klen, int) or not isinstance(n, int) or isinstance(klen, bool) or isinstance(n, bool)
            or not 1 <= klen <= MAX_KEY_LEN or not 0 <= n <= MAX_KEYS_PER_FRAME):
        raise WireError(f"bad klen/n (klen 1..{MAX_KEY_LEN}, n 0..{MAX_KEYS_PER_FRAME})")
    if len(blob) != (klen + trailer) * n:
        raise WireError(f"key blob of {len(blob)} bytes != {n} x {klen}" + (f" + {n} x {trailer}" if trailer else ""))
    mv = memoryview(blob)
    return [bytes(mv[i * klen:(i + 1) * klen]) for i in range(n)]


def int_list(body: dict, name: str, n: Optional[int] = None) -> List[int]:
    v = body.get(name)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise WireError(f"'{name}' must be a list of integers")
    if len(v) > MAX_KEYS_PER_FRAME:
        raise WireError(f"'{name}' has {len(v)} entries, at most {MAX_KEYS_PER_FRAME}")
    if n is not None and len(v) != n:
        raise WireError(f"'{name}' has {len(v)} entries, expected {n}")
    return v


def parse_hostport(s: str) -> Tuple[str, int]:
    """'host:port' / '[v6]:port' -> (host, port); ValueError naming the value otherwise."""
    if not isinstance(s, str):
        raise ValueError(f"expected host:port, got {s!r}")
    host, sep, port = s.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    bad = (not sep or not host or not port.isascii() or not port.isdigit() or len(port) > 5
           or any(c.isspace() or c in "[]/@" for c in host) or (":" in host and not s.strip().startswith("[")))
    if bad or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port with a port in 0..65535, got {s!r}")
    return host, int(port)
