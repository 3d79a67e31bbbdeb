"""Start and talk to a real SGLang server (``python -m sglang.launch_server``) from tests/benchmarks.

::

    from .server_utils import SGLangServer, generate, flush_cache

    with SGLangServer(model_path, log_path="runs/server.log", radix_cache_backend="flexflow",
                      flexflow_config="configs/cpu.yaml") as srv:
        out = generate(srv.url, "the radix cache", max_new_tokens=8)
        flush_cache(srv.url)

On a machine without a CUDA GPU the server gets the CPU environment of
:func:`flexflow_sglang.tools.cpu_support.cpu_server_env` (``sgl_kernel`` stand-in, CPU engine) and the
CPU flags ``--device cpu --attention-backend torch_native --sampling-backend pytorch``.

Readiness is polled on ``GET /model_info``, never ``/health``: ``/health`` runs a one-token
generation, which leaves a BOS token in the radix tree (page size 1) and, polled with short
client timeouts, piles generations up and doubles the start-up time.

The server runs in its own process group (new session); :meth:`SGLangServer.stop` sends SIGTERM
(launcher first, then the group) and SIGKILL after a grace period -- always by PID / group id.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterable, Mapping, Optional, Sequence

import requests

from .cpu_support import cpu_server_env, cuda_available
from flexflow_sglang.errors import FlexFlowError

__all__ = [
    "ServerStartError",
    "SGLangServer",
    "find_free_port",
    "generate",
    "flush_cache",
    "model_info",
    "tail_file",
]

LOG_TAIL_LINES = 40


class ServerStartError(FlexFlowError, RuntimeError):
    """The SGLang server exited or did not become ready in time (message holds the log tail)."""


#: fallback when /proc/sys/net/ipv4/ip_local_port_range cannot be read (Linux's default)
_DEFAULT_EPHEMERAL = (32768, 60999)
#: lowest port handed out; below the ephemeral range there are ~22k candidates on Linux defaults
_LOWEST_FIXED_PORT = 10000


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, chosen *below* the kernel's ephemeral range.

    Why not the kernel's choice for port 0: a server binds its port seconds after it is picked
    (SGLang binds its HTTP port only after the scheduler is up), and meanwhile every ``bind(0)`` and
    outgoing ``connect`` in the machine draws from the ephemeral range - NIXL/UCX listeners, tier
    servers, client sockets. CI once lost a server that way: another listener took the picked port,
    accepted SGLang's own post-warm-up request, and uvicorn's bind failed (exit 3). A random port
    below that range is only ever taken by another explicit pick. Falls back to ``bind(0)`` when the
    range leaves no room below it."""
    import random
    low, _ = _ephemeral_range()
    rng = random.Random(os.getpid() ^ time.time_ns())
    if low - _LOWEST_FIXED_PORT >= 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST_FIXED_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def tail_file(path: str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a text file ('' if it cannot be read)."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return "".join(collections.deque(f, maxlen=n))
    except OSError:
        return ""


class SGLangServer:
    """``python -m sglang.launch_server`` as a managed subprocess (context manager).

    Parameters:
        model_path: checkpoint directory (e.g. from ``cpu_support.tiny_model``).
        log_path: file that receives the server's stdout and stderr (created, appended to).
        port: TCP port; ``None`` picks a free one.
        extra_args: further ``launch_server`` arguments, appended last (they win on repeats).
        env: environment overrides on top of ``os.environ`` (+ the CPU environment when no GPU);
            a value of ``None`` removes the variable.
        radix_cache_backend: ``--radix-cache-backend`` name; ``None`` = plain SGLang server.
        flexflow_config: path exported as ``FLEXFLOW_CONFIG`` for the flexflow backend.
        tp_size, pp_size, dp_size: ``--tp-size``, ``--pp-size``, ``--dp-size``; on CPU with more
            than one rank (tp * pp * dp) ``SGLANG_CPU_OMP_THREADS_BIND`` is set to one core per rank
            (``"0|1"`` for 2) unless given in ``env``.
        page_size, chunked_prefill_size: passed through when not ``None``.
        max_total_tokens: KV pool size in tokens (default 4096; always given, see the CPU notes).
        timeout: seconds to wait for readiness.
        host: bind address (default 127.0.0.1).
        cpu: force (True) or forbid (False) the CPU set-up; ``None`` = auto (no CUDA GPU).
        mem_fraction_static, max_running_requests: defaults 0.05 and 8 on CPU, SGLang's own on GPU.
        python: interpreter for the launcher (default: this one).
        stop_grace: seconds between SIGTERM and SIGKILL in :meth:`stop`.
    """

    def __init__(
        self,
        model_path: str,
        log_path: str,
        port: Optional[int] = None,
        extra_args: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, Optional[str]]] = None,
        radix_cache_backend: Optional[str] = None,
        flexflow_config: Optional[str] = None,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_size: int = 1,
        page_size: Optional[int] = None,
        chunked_prefill_size: Optional[int] = None,
        max_total_tokens: Optional[int] = 4096,
        timeout: float = 240.0,
        host: str = "127.0.0.1",
        cpu: Optional[bool] = None,
        mem_fraction_static: Optional[float] = None,
        max_running_requests: Optional[int] = None,
        python: Optional[str] = None,
        stop_grace: float = 15.0,
        attention_backend: Optional[str] = None,
    ):
        self.model_path = os.fspath(model_path)
        self.log_path = os.path.abspath(os.fspath(log_path))
        self.host = host
        self.port = int(port) if port is not None else find_free_port(host)
        self.extra_args = list(extra_args or [])
        self.env_overrides = dict(env or {})
        self.radix_cache_backend = radix_cache_backend
        self.flexflow_config = os.path.abspath(os.fspath(flexflow_config)) if flexflow_config else None
        self.tp_size = int(tp_size)
        self.pp_size = int(pp_size)
        self.dp_size = int(dp_size)
        self.page_size = page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.max_total_tokens = max_total_tokens
        self.timeout = float(timeout)
        self.cpu = (not cuda_available()) if cpu is None else bool(cpu)
        self.mem_fraction_static = mem_fraction_static
        # CPU default: SGLang's torch_native; flexflow_sdpa (backend/prefix_sdpa.py) skips the
        # cached prefix's queries as GPU backends do
        self.attention_backend = attention_backend or ("torch_native" if self.cpu else None)
        self.max_running_requests = max_running_requests
        self.python = python or sys.executable
        self.stop_grace = float(stop_grace)
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    # ------------------------------------------------------------------ configuration
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def build_command(self) -> list:
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--host", self.host,
            "--port", str(self.port),
            "--skip-server-warmup",
        ]
        if self.cpu:
            cmd += ["--device", "cpu", "--sampling-backend", "pytorch"]
        if self.attention_backend:
            cmd += ["--attention-backend", self.attention_backend]
        mem_fraction = self.mem_fraction_static
        if mem_fraction is None and self.cpu:
            mem_fraction = 0.05
        if mem_fraction is not None:
            cmd += ["--mem-fraction-static", str(mem_fraction)]
        max_running = self.max_running_requests
        if max_running is None and self.cpu:
            max_running = 8
        if max_running is not None:
            cmd += ["--max-running-requests", str(max_running)]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.tp_size != 1:
            cmd += ["--tp-size", str(self.tp_size)]
        if self.pp_size != 1:
            cmd += ["--pp-size", str(self.pp_size)]
        if self.dp_size != 1:
            cmd += ["--dp-size", str(self.dp_size)]
        if self.page_size is not None:
            cmd += ["--page-size", str(self.page_size)]
        if self.chunked_prefill_size is not None:
            cmd += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.radix_cache_backend:
            cmd += ["--radix-cache-backend", self.radix_cache_backend]
        return cmd + self.extra_args

    def build_env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.flexflow_config:
            env["FLEXFLOW_CONFIG"] = self.flexflow_config
        ranks = self.tp_size * self.pp_size * self.dp_size
        if self.cpu and ranks > 1:
            ncpu = os.cpu_count() or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % ncpu) for r in range(ranks))
        for k, v in self.env_overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
        # last, so that a PYTHONPATH override keeps the sgl_kernel stand-in in front
        return cpu_server_env(env, force_cpu=self.cpu)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "SGLangServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server already running (pid {self.proc.pid})")
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        cmd = self.build_command()
        env = self.build_env()
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            log.write(("\n### flexflow SGLangServer: " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,  # own session => own process group (pgid = pid)
            )
        try:
            self.wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def wait_ready(self, t0: Optional[float] = None) -> None:
        """Poll ``GET /model_info`` until 200; raise :class:`ServerStartError` on exit/timeout."""
        t0 = time.perf_counter() if t0 is None else t0
        deadline = t0 + self.timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(self._failure(f"exited with status {rc} during start-up"))
            try:
                r = requests.get(self.url + "/model_info", timeout=5)
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.perf_counter() > deadline:
                raise ServerStartError(
                    self._failure(f"not ready after {self.timeout:.0f} s (GET /model_info)"))
            time.sleep(0.5)

    def _failure(self, what: str) -> str:
        tail = tail_file(self.log_path, LOG_TAIL_LINES)
        return (f"SGLang server (pid {self.pid}, {self.url}, model {self.model_path}) {what}.\n"
                f"Log: {self.log_path}\n--- last {LOG_TAIL_LINES} log lines ---\n{tail}"
                f"--- end of log ---")

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail_log(self, n: int = LOG_TAIL_LINES) -> str:
        return tail_file(self.log_path, n)

    def stop(self, grace: Optional[float] = None) -> Optional[int]:
        """Stop the server; returns the launcher's exit status (None if never started).

        SIGTERM goes to the launcher PID first: it drains and takes its scheduler/detokenizer down
        itself (its SIGTERM watchdog polls every 5 s, so this takes 0.3-6 s). Signalling the whole
        group at once instead makes the launcher see its scheduler "crash" and sit in a 5 s
        crash-diagnostics sleep. If the launcher is still up after ``grace`` s the whole process
        group gets SIGTERM, and 5 s later SIGKILL; stragglers of the group are killed last.
        Everything is addressed by PID / process-group id, never by name.
        """
        if self.proc is None:
            return None
        grace = self.stop_grace if grace is None else grace
        pgid = self.proc.pid  # start_new_session: the launcher leads its own group
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    _signal_group(pgid, signal.SIGKILL)
                    self.proc.wait(timeout=30)
        # Children (scheduler, detokenizer) normally exit with the launcher; give stragglers of the
        # same group a moment, then kill them.
        end = time.monotonic() + 3.0
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            time.sleep(1.0)
            _signal_group(pgid, signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SGLangServer(url={self.url!r}, pid={self.pid}, backend={self.radix_cache_backend!r})"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` is still running (zombies waiting to be reaped by
    PID 1 do not count: they hold no resources)."""
    if os.path.isdir("/proc/self"):
        return bool(_live_group_members(pgid))
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _live_group_members(pgid: int) -> list:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # fields after the ")" that closes the command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            pids.append(int(name))
    return pids


# ---------------------------------------------------------------------- HTTP helpers
def generate(
    url: str,
    text: Optional[str] = None,
    max_new_tokens: int = 16,
    *,
    input_ids: Optional[Iterable[int]] = None,
    sampling_params: Optional[Mapping] = None,
    timeout: float = 300.0,
    session: Optional[requests.Session] = None,
    **extra,
) -> dict:
    """POST ``/generate`` greedily (temperature 0, ``ignore_eos``) and return the JSON dict
    (``text``, ``output_ids``, ``meta_info`` with ``prompt_tokens``, ``cached_tokens``,
    ``cached_tokens_details``, ``e2e_latency``). ``sampling_params`` entries override the
    defaults; ``extra`` keys go into the request body."""
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text= or input_ids=")
    sp = {"temperature": 0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True}
    sp.update(sampling_params or {})
    body = {"sampling_params": sp, **extra}
    if text is not None:
        body["text"] = text
    else:
        body["input_ids"] = list(input_ids)
    r = (session or requests).post(url.rstrip("/") + "/generate", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}/generate -> HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def flush_cache(url: str, wait_s: float = 60.0, timeout: Optional[float] = None) -> str:
    """POST ``/flush_cache``; SGLang waits up to ``wait_s`` for running requests to finish.
    Raises ``RuntimeError`` unless the server answers 200."""
    r = requests.post(url.rstrip("/") + "/flush_cache", params={"timeout": wait_s},
                      timeout=timeout if timeout is not None else wait_s + 30)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}/flush_cache -> HTTP {r.status_code}: {r.text.strip()[:500]}")
    return r.text


def model_info(url: str, timeout: float = 10.0) -> dict:
    """GET ``/model_info`` (cheap: no generation, unlike ``/health``)."""
    r = requests.get(url.rstrip("/") + "/model_info", timeout=timeout)
    r.raise_for_status()
    return r.json()


def flexflow_metrics(url: str, timeout: float = 10.0) -> dict:
    """The backend's `flexflow_*` series from GET /metrics (served with --enable-metrics), labels
    dropped and values summed over label sets (TP ranks). Raises requests' errors."""
    text = requests.get(url.rstrip("/") + "/metrics", timeout=timeout).text
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("flexflow_") and " " in line:
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
    return out
