"""Shared-secret mode: who may talk to a tier server, replayed frames, and page poisoning with the
page MAC off (the poisoned page is served: the threat) and on (it is a miss)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from flexflow_sglang.errors import ConfigError
from flexflow_sglang.tiers.base import page_digests
from flexflow_sglang.tiers.remote import RemoteTier
from flexflow_sglang.tiers.trust import FrameAuth, load_secret, page_key_secret, read_secret_file
from flexflow_sglang.tiers.wire import MsgType, read_frame, write_frame

from fault_helpers import closed, conn, keys_for, pages_for, rpc
from tier_helpers import requires_nixl

P = 4096
SECRET = b"correct horse battery staple 14"


def secret_file(tmp_path, data=SECRET, mode=0o600):
    p = tmp_path / "secret"
    p.write_bytes(data + b"\n")
    os.chmod(p, mode)
    return str(p)


def client(addr, secret=None):
    return RemoteTier([addr], timeout_ms=3000, retry_after_s=30, secret=secret)


def test_secret_file_rules(tmp_path, monkeypatch):
    assert read_secret_file(secret_file(tmp_path)) == SECRET
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret_file(secret_file(tmp_path, mode=0o644))
    with pytest.raises(ConfigError, match="16..4096"):
        read_secret_file(secret_file(tmp_path, data=b"short"))
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret_file(str(tmp_path / "fifo"))  # and it did not block
    monkeypatch.setenv("FLEXFLOW_TIER_SECRET", "x" * 20)
    assert load_secret() == b"x" * 20
    monkeypatch.setenv("FLEXFLOW_TIER_SECRET", "tiny")
    with pytest.raises(ConfigError, match="FLEXFLOW_TIER_SECRET"):
        load_secret()
    assert page_key_secret(None) == b"" and len(page_key_secret(SECRET)) == 32


def test_frame_auth_rejects_replay_and_tamper():
    c, s = FrameAuth(SECRET, "c"), FrameAuth(SECRET, "s")
    data = b"frame bytes"
    tag = c.seal(data)
    assert s.check(data, tag)
    assert not s.check(data, tag)           # replayed: the sequence number moved on
    t2 = c.seal(data)
    assert not s.check(data + b"x", t2)     # altered
    other = FrameAuth(b"another secret of 16+ bytes", "s")
    assert not other.check(data, FrameAuth(SECRET, "c").seal(data))




@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_only_secret_holders_are_served(tier_server, tmp_path):
    sf = secret_file(tmp_path)
    srv = tier_server("--page-nbytes", str(P), "--secret-file", sf)
    ks, pg = keys_for(3, b"auth"), pages_for(3, P)
    good = client(srv.addr, SECRET)
    assert good.put_many(ks, pg) == 3
    out = np.zeros_like(pg)
    assert good.get_many_into(ks, out) == 3 and np.array_equal(out, pg)
    good.close()
    for secret, needle in ((None, "secret"), (b"a wrong secret, 16+ bytes", "authentication")):
        t = client(srv.addr, secret)
        assert t.contains_prefix(ks) == 0 and t.get_many_into(ks, np.zeros_like(pg)) == 0
        assert needle in t.stats()["peers"][srv.addr]["down_reason"], t.stats()["peers"]
        t.close()
    # a raw peer without the secret learns nothing (no agent metadata) and is closed
    s = conn(srv.addr)
    f = rpc(s, MsgType.HELLO, {"client": "evil", "page_nbytes": P})
    assert f.type == MsgType.ERROR and not f.blob and closed(s)
    s.close()
    # a replayed frame on an authenticated connection ends it
    s = conn(srv.addr)
    auth = FrameAuth(SECRET, "c")
    write_frame(s, MsgType.HELLO, {"client": "c", "page_nbytes": P, "nonce": auth.nonce.hex()},
                deadline=time.monotonic() + 5, auth=auth)
    f = read_frame(s, time.monotonic() + 5, auth=auth)
    assert f.type == MsgType.HELLO_OK and f.body["auth"] == 1
    auth.start_session(auth.nonce, bytes.fromhex(f.body["nonce"]))
    seq = auth.send_seq
    assert rpc(s, MsgType.PING, auth=auth).type == MsgType.PONG
    auth.send_seq = seq  # resend the same PING (same tag): a replay
    write_frame(s, MsgType.PING, {}, deadline=time.monotonic() + 5, auth=auth)
    assert closed(s)
    s.close()
    st = client(srv.addr, SECRET)
    assert st.server_stats(srv.addr)["auth_failures"] >= 2
    st.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mac", [False, True])
def test_page_poisoning(inproc_server, mac):
    """A page rewritten in the server's buffer together with a matching CRC (what a malicious server,
    or a NIXL peer writing into the buffer, can do). MAC off: the reader takes the poisoned page.
    MAC on: it is a miss and dropped."""
    secret = SECRET if mac else None
    srv = inproc_server(page_nbytes=P, secret=secret)
    ks, pg = keys_for(2, b"poison"), pages_for(2, P)
    t = client(srv.address, secret)
    try:
        assert t.put_many(ks, pg) == 2
        with srv.lock:
            slot = srv.index[ks[1]]
            srv.pages[slot] = 0x41
            srv.slot_sum[slot] = page_digests(srv.pages, 1, [slot])[0]
        out = np.zeros_like(pg)
        got = t.get_many_into(ks, out)
        if mac:
            assert got == 1 and t.stats()["corrupt_dropped"] == 1
            assert np.array_equal(out[0], pg[0])
        else:
            assert got == 2 and (out[1] == 0x41).all()  # the threat the MAC closes
    finally:
        t.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_mac_mode_refuses_puts_without_macs(inproc_server):
    srv = inproc_server(page_nbytes=P, secret=SECRET)
    s = conn(srv.address)
    auth = FrameAuth(SECRET, "c")
    write_frame(s, MsgType.HELLO, {"client": "c", "page_nbytes": P, "nonce": auth.nonce.hex()},
                deadline=time.monotonic() + 5, auth=auth)
    f = read_frame(s, time.monotonic() + 5, auth=auth)
    auth.start_session(auth.nonce, bytes.fromhex(f.body["nonce"]))
    k = keys_for(1, b"nomac")
    f = rpc(s, MsgType.PUT, {"klen": 32, "n": 1, "sums": [0]}, k[0], auth=auth)
    assert f.type == MsgType.ERROR
    s.close()
