"""Wire format of the remote tier's control channel, and rendezvous placement (no NIXL needed)."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from flexflow_sglang.tiers import wire
from flexflow_sglang.tiers.base import rendezvous_rank
from flexflow_sglang.tiers.wire import (HEADER, MAGIC, MAX_BLOB, MAX_JSON, WIRE_VERSION, MsgType,
                                        WireError, decode_frame, encode_frame, pack_keys, read_frame,
                                        unpack_keys, write_frame)


@pytest.mark.parametrize("mtype", list(MsgType))
def test_roundtrip_every_type(mtype):
    keys = [os.urandom(32) for _ in range(5)]
    klen, blob = pack_keys(keys)
    body = {"klen": klen, "n": 5, "pin": True, "sums": [1, 2, 3, 4, 2**32 - 1], "s": "é"}
    f = decode_frame(encode_frame(mtype, body, blob))
    assert f.type == mtype and f.body == body and f.blob == blob
    assert unpack_keys(f.body, f.blob) == keys


def test_header_layout_is_explicit():
    data = encode_frame(MsgType.PING, {})
    magic, ver, t, flags, jlen, blen = struct.unpack(">4sBBHII", data[:16])
    assert (magic, ver, t, flags, blen) == (b"FFTW", WIRE_VERSION, MsgType.PING, 0, 0)
    assert data[16:16 + jlen] == b"{}"


def _hdr(magic=MAGIC, ver=WIRE_VERSION, t=int(MsgType.PING), jlen=2, blen=0):
    return HEADER.pack(magic, ver, t, 0, jlen, blen)


@pytest.mark.parametrize("raw, msg", [
    (_hdr(magic=b"XXXX") + b"{}", "bad magic"),
    (_hdr(magic=b"\x80\x03}q") + b"{}", "bad magic"),                 # a pickle stream is not a frame
    (_hdr(ver=1) + b"{}", "unsupported wire version"),                # version 1 carried CRC32 page sums
    (_hdr(ver=3) + b"{}", "unsupported wire version"),
    (_hdr(ver=0) + b"{}", "unsupported wire version"),
    (_hdr(t=99) + b"{}", "unknown message type"),
    (_hdr(jlen=MAX_JSON + 1), "oversized"),
    (_hdr(blen=MAX_BLOB + 1), "oversized"),
    (_hdr(jlen=4) + b"[1] ", "must be an object"),
    (_hdr(jlen=3) + b"{x}", "bad JSON"),
    (_hdr(jlen=2) + b"\xff\xfe", "bad JSON"),
    (_hdr(jlen=2) + b"{", "frame length"),
    (b"FFTW\x01", "short header"),
])
def test_rejects_bad_frames(raw, msg):
    with pytest.raises(WireError, match=msg):
        decode_frame(raw)


def test_encode_refuses_oversized_and_nan():
    with pytest.raises(WireError):
        encode_frame(MsgType.PUT, {}, b"x" * 11, max_blob=10)
    with pytest.raises(ValueError):
        encode_frame(MsgType.PUT, {"x": float("nan")})


def test_key_packing_validation():
    with pytest.raises(WireError):
        pack_keys([b"a" * 32, b"b" * 31])
    with pytest.raises(WireError):
        pack_keys([b"a" * 65])
    with pytest.raises(WireError):
        unpack_keys({"klen": 32, "n": 2}, b"x" * 63)
    with pytest.raises(WireError):
        unpack_keys({"klen": 0, "n": 0}, b"")
    with pytest.raises(WireError):
        unpack_keys({"klen": "32", "n": 1}, b"x" * 32)
    assert unpack_keys({"klen": 32, "n": 0}, b"") == []


def test_stream_io_timeout_close_and_oversize():
    a, b = socket.socketpair()
    try:
        write_frame(a, MsgType.LOOKUP, {"klen": 32, "n": 1, "pin": False}, b"k" * 32)
        f = read_frame(b, time.monotonic() + 1)
        assert f.type == MsgType.LOOKUP and f.blob == b"k" * 32
        # nothing to read: the deadline holds
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            read_frame(b, time.monotonic() + 0.2)
        assert time.monotonic() - t0 < 1.0
        # half a frame, then silence: still bounded
        a.sendall(encode_frame(MsgType.PING, {"pad": "x" * 100})[:20])
        with pytest.raises(TimeoutError):
            read_frame(b, time.monotonic() + 0.2)
        # an oversized header is refused before any body is read
        a2, b2 = socket.socketpair()
        a2.sendall(_hdr(blen=1 << 30))
        with pytest.raises(WireError, match="oversized"):
            read_frame(b2, time.monotonic() + 1, max_blob=1 << 20)
        a2.close()
        b2.close()
    finally:
        a.close()
    with pytest.raises(ConnectionError):
        read_frame(b, time.monotonic() + 1)
    b.close()


def test_parse_hostport():
    assert wire.parse_hostport("127.0.0.1:5") == ("127.0.0.1", 5)
    assert wire.parse_hostport("[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":5", "h:", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            wire.parse_hostport(bad)


def test_rendezvous_is_stable_and_balanced():
    peers = [f"10.0.0.{i}:7000" for i in range(4)]
    keys = [os.urandom(32) for _ in range(4000)]
    own = [peers[rendezvous_rank(k, peers)[0]] for k in keys]
    counts = {p: own.count(p) for p in peers}
    assert min(counts.values()) > 800, counts  # ~1000 each
    # removing one peer moves only the keys it owned; adding it back restores them
    fewer = peers[:3]
    own2 = [fewer[rendezvous_rank(k, fewer)[0]] for k in keys]
    moved = sum(1 for a, b in zip(own, own2) if a != b)
    assert moved == counts[peers[3]]
    assert all(b == a for a, b in zip(own, own2) if a != peers[3])
    # the second choice with all peers equals the first choice without the first
    for k in keys[:200]:
        r = rendezvous_rank(k, peers)
        without = [p for p in peers if p != peers[r[0]]]
        assert without[rendezvous_rank(k, without)[0]] == peers[r[1]]


def test_ucx_rdma_modules_are_skipped_only_without_rdma_devices(tmp_path):
    # with libibverbs1 installed and no RDMA device, UCX's ib modules crash NIXL processes at exit
    from flexflow_sglang.tiers.base import skip_ucx_rdma_modules_without_devices as skip
    empty = tmp_path / "infiniband"
    empty.mkdir()
    env = {}
    assert skip(env, str(empty)) and env["UCX_MODULES"] == "^ib,rdmacm"
    env = {}
    assert skip(env, str(tmp_path / "absent")) and env["UCX_MODULES"] == "^ib,rdmacm"
    (empty / "mlx5_0").mkdir()  # a real device: UCX keeps its InfiniBand transports
    env = {}
    assert not skip(env, str(empty)) and "UCX_MODULES" not in env
    env = {"UCX_MODULES": "^cma"}  # the user's choice wins
    assert not skip(env, str(tmp_path / "absent")) and env["UCX_MODULES"] == "^cma"
