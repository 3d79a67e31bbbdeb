"""A table of bad configs and bad flags: every one is a single line naming the file, key, value and
allowed range (or the flag), exit code 2, never a traceback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flexflow_sglang import ConfigError, load_config
from flexflow_sglang.tools.cli.main import main as flexflow

from tier_helpers import REPO, requires_nixl, tier_env

BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))

BAD_CONFIGS = [
    ("selector:\n  w_hops: 0.1\nselector:\n  w_hops: 0.2\n", ["duplicate key 'selector'", "line 3"]),
    ("storage_tier:\n  path: /a\n  path: /b\n", ["duplicate key 'path'"]),
    ("storage_tier:\n  capacity_gb: .inf\n", ["storage_tier.capacity_gb", "inf", "finite", "16777216"]),
    ("host_tier:\n  capacity_gb: .nan\n", ["host_tier.capacity_gb", "nan", "finite"]),
    ("remote_tier:\n  timeout_ms: 1.0e+300\n", ["remote_tier.timeout_ms", "3600000"]),
    ("remote_tier:\n  timeout_ms: 1e300\n", ["remote_tier.timeout_ms", "number"]),  # YAML 1.1: a string
    ("remote_tier:\n  retry_after_s: 1.0e+6\n", ["remote_tier.retry_after_s", "86400"]),
    ("storage_tier:\n  capacity_gb: 1.0e+300\n", ["storage_tier.capacity_gb"]),
    ("selector:\n  w_bandwidth: .inf\n", ["selector.w_bandwidth", "finite"]),
    ("remote_tier:\n  peers: [n1]\n", ["remote_tier.peers", "'n1'", "host:port"]),
    ("remote_tier:\n  peers: ['10.0.0.1:99999']\n", ["remote_tier.peers", "99999"]),
    ("remote_tier:\n  peers: 10.0.0.1:7300\n", ["remote_tier.peers", "list"]),
    ("remote_tier:\n  listen: garbage\n", ["remote_tier.listen", "host:port"]),
    ("remote_tier:\n  keyed_page_keys: true\n", ["keyed_page_keys", "needs a secret"]),
    ("remote_tier:\n  secret_file: /nonexistent/secret\n", ["remote_tier.secret_file", "No such file"]),
    ("storage_tier:\n  read_only: maybe\n", ["storage_tier.read_only", "true or false"]),
    ("storage_tier:\n  fsync: 1\n", ["storage_tier.fsync", "true or false"]),
    (BOMB, ["aliases"]),
    ("a: [" * 5000 + "]" * 5000 + "\n", []),
    ("selector: [unclosed\n", ["not valid YAML"]),
    (b"log_level: \xff\xfe\n", ["not valid UTF-8", "byte 11"]),
    ({1: 2}, []),
]


def write(tmp_path, data, name="bad.yaml"):
    p = tmp_path / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    elif isinstance(data, str):
        p.write_text(data)
    else:
        p.write_text("? [1, 2]\n: 3\n")  # a non-scalar key
    return str(p)


@pytest.mark.parametrize("data,needles", BAD_CONFIGS, ids=range(len(BAD_CONFIGS)))
def test_bad_config_is_one_short_line(tmp_path, capsys, monkeypatch, data, needles):
    monkeypatch.delenv("FLEXFLOW_TIER_SECRET", raising=False)
    monkeypatch.delenv("FLEXFLOW_TIER_SECRET_FILE", raising=False)
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert p in msg and "\n" not in msg and len(msg) < 600, msg
    for n in needles:
        assert n in msg, msg
    assert flexflow(["config", "check", p]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and p in err


def test_secret_file_with_loose_mode_is_refused_by_config_check(tmp_path, capsys):
    sf = tmp_path / "s"
    sf.write_text("x" * 32)
    os.chmod(sf, 0o644)
    p = write(tmp_path, f"remote_tier:\n  secret_file: {sf}\n  keyed_page_keys: true\n")
    assert flexflow(["config", "check", p]) == 2
    assert "chmod 600" in capsys.readouterr().err
    os.chmod(sf, 0o600)
    assert flexflow(["config", "check", p]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: ") and "keyed page keys on" in out


def test_commands_fall_back_to_flexflow_config(tmp_path, capsys, monkeypatch):
    bad = write(tmp_path, "selector:\n  w_hops: 1\nselector: {}\n")
    monkeypatch.setenv("FLEXFLOW_CONFIG", bad)
    for argv in (["config", "check"], ["topology"], ["select", "--src", "gpu0", "--dst", "gpu1", "--bytes", "1MiB"],
                 ["tier-server"], ["quickstart", "--workdir", str(tmp_path / "qs")]):
        assert flexflow(argv) == 2, argv
        err = capsys.readouterr().err
        assert bad in err and "duplicate key" in err and err.count("\n") == 1, (argv, err)
    good = write(tmp_path, "topology:\n  source: mock\n  mock: nvswitch8\n", "good.yaml")
    monkeypatch.setenv("FLEXFLOW_CONFIG", good)
    assert flexflow(["topology", "--json"]) == 0
    assert '"gpu7"' in capsys.readouterr().out  # the env file's topology, not the default mock
    assert flexflow(["topology", "--mock", "single", "--json"]) == 0  # an explicit choice still wins
    assert '"gpu7"' not in capsys.readouterr().out


BAD_FLAGS = [
    (["--capacity-gb", "-1"], "--capacity-gb"), (["--capacity-gb", "nan"], "--capacity-gb"),
    (["--capacity-gb", "1e12"], "(0, 4096]"), (["--capacity-gb", "inf"], "finite"),
    (["--listen", "garbage"], "--listen"), (["--listen", "127.0.0.1:99999"], "0..65535"),
    (["--listen", "127.0.0.1:"], "--listen"), (["--listen", ":80"], "--listen"),
    (["--page-nbytes", "-5"], "[64, 268435456]"), (["--page-nbytes", "1"], "--page-nbytes"),
    (["--page-nbytes", "4096x"], "--page-nbytes"), (["--relay-peers", "n1"], "NODE=host:port"),
    (["--relay-peers", "n1=nohost"], "'n1=nohost'"), (["--relay-peers", "=1.2.3.4:5"], "--relay-peers"),
    (["--lease-ttl-s", "0"], "--lease-ttl-s"), (["--idle-timeout-s", "-1"], "--idle-timeout-s"),
    (["--frame-timeout-s", "nan"], "--frame-timeout-s"), (["--max-conns", "0"], "--max-conns"),
    (["--storage-capacity-gb", "inf"], "--storage-capacity-gb"), (["--log-level", "LOUD"], "--log-level"),
    (["--secret-file", "/nonexistent"], "No such file"), (["--no-such-flag"], "unrecognized"),
    (["--capacity-gb", "0.001", "--page-nbytes", "4194304"], "larger than --capacity-gb"),
]


@pytest.mark.parametrize("argv,needle", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_tier_server_flag_is_one_line(capsys, monkeypatch, argv, needle):
    monkeypatch.delenv("FLEXFLOW_CONFIG", raising=False)
    try:
        rc = flexflow(["tier-server", *argv])
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and needle in err, err


@pytest.mark.nixl
@requires_nixl
def test_port_in_use_is_one_line(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.cli.main", "tier-server", "--listen",
                            f"127.0.0.1:{port}", "--capacity-gb", "0.01"], capture_output=True, text=True,
                           timeout=60, cwd=REPO, env=tier_env({"FLEXFLOW_CONFIG": ""}))
    finally:
        s.close()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr.lower(), r.stderr
