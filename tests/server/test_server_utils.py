"""Unit tests (no SGLang): SGLangServer command/env building, readiness, failures, stop by PID."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from flexflow_sglang.tools.cpu_support import STANDIN_DIR
from flexflow_sglang.tools.server_utils import SGLangServer, ServerStartError, find_free_port

FAKE_SERVER = textwrap.dedent('''
    import http.server, json, os, signal, subprocess, sys, time
    mode, pidfile, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(60):
        print(f"fake log line {i}", flush=True)
    if mode == "crash":
        print("boom: something went wrong", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
    if mode == "hang":
        time.sleep(600)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:  # exit on SIGTERM *without* taking the child down: stop() must kill the straggler
        signal.signal(signal.SIGTERM, lambda *a: os._exit(0))

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"model_path": "fake"}).encode()
            self.send_response(200 if self.path == "/model_info" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


class FakeServer(SGLangServer):
    def __init__(self, tmp_path, mode, **kw):
        self.script = tmp_path / "fake_server.py"
        self.script.write_text(FAKE_SERVER)
        self.pidfile = tmp_path / "child.pid"
        self.mode = mode
        super().__init__("fake-model", log_path=str(tmp_path / "fake.log"), cpu=True, **kw)

    def build_command(self):
        return [sys.executable, str(self.script), self.mode, str(self.pidfile), str(self.port)]

    def child_pid(self):
        return int(self.pidfile.read_text())


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_build_command_cpu_defaults_and_options(tmp_path):
    s = SGLangServer("/m", log_path=str(tmp_path / "l.log"), port=31234, cpu=True, radix_cache_backend="flexflow",
                     page_size=4, chunked_prefill_size=512, extra_args=["--log-level", "warning"])
    cmd = s.build_command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for frag in ("--model-path /m", "--port 31234", "--device cpu", "--attention-backend torch_native",
                 "--sampling-backend pytorch", "--max-total-tokens 4096", "--page-size 4",
                 "--chunked-prefill-size 512", "--radix-cache-backend flexflow", "--mem-fraction-static 0.05",
                 "--skip-server-warmup"):
        assert frag in joined
    assert cmd[-2:] == ["--log-level", "warning"]
    assert s.url == "http://127.0.0.1:31234"
    plain = SGLangServer("/m", log_path="x.log", cpu=False, max_total_tokens=None).build_command()
    assert "--radix-cache-backend" not in plain and "--device" not in plain
    assert "--max-total-tokens" not in plain and "--mem-fraction-static" not in plain


def test_build_env(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    cfg = tmp_path / "ff.yaml"
    s = SGLangServer("/m", log_path="x.log", cpu=True, tp_size=2, flexflow_config=str(cfg),
                     env={"PYTHONPATH": "/extra", "DROP_ME": None, "X": 1})
    monkeypatch.setenv("DROP_ME", "1")
    env = s.build_env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["NIXL_LOG_LEVEL"] == "WARN"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [STANDIN_DIR, "/extra"]
    assert env["FLEXFLOW_CONFIG"] == str(cfg) and env["X"] == "1" and "DROP_ME" not in env
    nproc = os.cpu_count() or 1
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "|".join(str(r % nproc) for r in range(2))
    assert "--tp-size" in s.build_command()
    own = SGLangServer("/m", log_path="x.log", cpu=True, tp_size=2, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|0"})
    assert own.build_env()["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0"
    gpu = SGLangServer("/m", log_path="x.log", cpu=False, tp_size=2).build_env()
    assert "SGLANG_USE_CPU_ENGINE" not in gpu or gpu["SGLANG_USE_CPU_ENGINE"] == os.environ.get("SGLANG_USE_CPU_ENGINE")
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in gpu


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """A picked port is bound seconds later; the kernel's bind(0)/connect never hand out a port
    below the ephemeral range, so another process cannot take it in between (CI saw that race)."""
    import socket

    from flexflow_sglang.tools.server_utils import _ephemeral_range

    low, _ = _ephemeral_range()
    ports = {find_free_port() for _ in range(20)}
    assert len(ports) > 1  # random picks, not one fixed port for every caller
    for port in ports:
        assert 10000 <= port < low, (port, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_free_port_skips_a_port_in_use(monkeypatch):
    import random
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", find_free_port()))
    taken.listen()
    picks = iter([taken.getsockname()[1]] * 5 + [None])

    real = random.Random.randrange

    def rigged(self, a, b):
        p = next(picks)
        return p if p is not None else real(self, a, b)

    monkeypatch.setattr(random.Random, "randrange", rigged)
    try:
        assert find_free_port() != taken.getsockname()[1]
    finally:
        taken.close()


def test_crash_during_startup_reports_log_tail(tmp_path):
    srv = FakeServer(tmp_path, "crash", timeout=60)
    with pytest.raises(ServerStartError) as ei:
        srv.start()
    msg = str(ei.value)
    assert "exited with status 3 during start-up" in msg
    assert "boom: something went wrong" in msg
    assert "fake log line 59" in msg and "fake log line 21\n" in msg  # the last 40 lines ...
    assert "fake log line 20\n" not in msg  # ... and no more
    assert not srv.is_running()


def test_timeout_reports_and_kills_group(tmp_path):
    srv = FakeServer(tmp_path, "hang", timeout=3, stop_grace=2)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"not ready after 3 s \(GET /model_info\)"):
        srv.start()
    assert time.monotonic() - t0 < 30
    assert not srv.is_running() and not _alive(srv.child_pid())


def test_ready_on_model_info_and_stop_kills_stragglers(tmp_path):
    with FakeServer(tmp_path, "ok", timeout=60) as srv:
        assert srv.is_running() and srv.startup_s is not None
        child = srv.child_pid()
        assert _alive(child)
    assert not srv.is_running() and srv.proc.returncode == 0
    assert not _alive(child)


def test_stop_escalates_to_sigkill(tmp_path):
    srv = FakeServer(tmp_path, "stubborn", timeout=60).start()
    child = srv.child_pid()
    t0 = time.monotonic()
    rc = srv.stop(grace=1)
    assert rc == -9 and time.monotonic() - t0 < 20
    assert not _alive(child)
