"""The PD hooks against SGLang's real registry and classes (HookRegistry applied in a subprocess, so
this test process keeps SGLang unpatched)."""

import os
import subprocess
import sys
import textwrap
import types

import pytest

sglang = pytest.importorskip("sglang", reason="PD hooks target SGLang")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = textwrap.dedent("""
    import json, logging
    logging.basicConfig(level=logging.WARNING)
    from flexflow_sglang.backend.plugin import register
    from sglang.srt.plugins.hook_registry import HookRegistry
    register()
    HookRegistry.apply_hooks()
    from sglang.srt.disaggregation import prefill, decode, utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    out = {}
    for mod in (utils, prefill, decode):
        out[mod.__name__.rsplit(".", 1)[1]] = {
            "nixl_manager": mod.get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER).__name__,
            "nixl_sender": mod.get_kv_class(TransferBackend.NIXL, KVClassType.SENDER).__name__,
            "fake_manager": getattr(mod.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER), "__name__", None),
        }
    cls = prefill.get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER)
    out["subclass_of_nixl"] = [c.__name__ for c in cls.__mro__[1:]]
    out["early_send_wrapped"] = (prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk.__qualname__)
    print("RESULT " + json.dumps(out))
""")


def _probe(tmp_path, pd_yaml):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(pd_yaml)
    env = dict(os.environ, FLEXFLOW_CONFIG=str(cfg), PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    from flexflow_sglang.tools.cpu_support import cpu_server_env
    p = subprocess.run([sys.executable, "-c", PROBE], env=cpu_server_env(env), capture_output=True, text=True,
                       timeout=300)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    import json
    return json.loads(line[7:]), p.stderr


@pytest.mark.nixl
def test_get_kv_class_hook_hands_out_flexflow_manager_everywhere(tmp_path):
    pytest.importorskip("nixl")
    out, err = _probe(tmp_path, "pd:\n  enabled: true\n")
    for mod in ("utils", "prefill", "decode"):  # HookRegistry rebinds the `from ... import` copies too
        assert out[mod]["nixl_manager"] == "FlexFlowNixlKVManager", out
        assert out[mod]["nixl_sender"] == "NixlKVSender", out  # only the manager is replaced
    # FlexFlow's methods are mixed in before SGLang's manager, so super() is SGLang's class
    assert out["subclass_of_nixl"][:2] == ["FlexFlowNixlRails", "NixlKVManager"], out["subclass_of_nixl"]
    assert out["utils"]["fake_manager"] != "FlexFlowNixlKVManager"
    assert "FlexFlow routes only the nixl backend" in err  # said once for a non-nixl backend


@pytest.mark.nixl
def test_pd_disabled_leaves_sglang_classes(tmp_path):
    pytest.importorskip("nixl")
    out, _ = _probe(tmp_path, "pd:\n  enabled: false\n")
    assert all(out[m]["nixl_manager"] == "NixlKVManager" for m in ("utils", "prefill", "decode")), out


def _sched(overlap, flexflow_pending=False):
    tc = types.SimpleNamespace(is_flexflow=True, has_unlanded_loads=lambda: flexflow_pending)
    return types.SimpleNamespace(enable_overlap=overlap, tree_cache=tc)


def test_early_send_hold(monkeypatch, tmp_path):
    from flexflow_sglang.pd import hooks, settings
    cfg = tmp_path / "c.yaml"
    cfg.write_text("pd:\n  enabled: true\n")
    monkeypatch.setenv("FLEXFLOW_CONFIG", str(cfg))
    settings.pd_settings(reload=True)
    try:
        import torch
        req = object()
        s = _sched(overlap=True)
        res = hooks.hold_early_send(s, req, allow_send=True)
        if torch.cuda.is_available():
            assert res is None
        else:  # CPU + overlap: SGLang would build a torch.cuda.Event; the final send covers the prefix
            assert res == ((s, req), {"allow_send": False})
        assert hooks.hold_early_send(_sched(overlap=False), req, allow_send=True) is None
        s = _sched(overlap=False, flexflow_pending=True)
        assert hooks.hold_early_send(s, req, allow_send=True) == ((s, req), {"allow_send": False})
        assert hooks.hold_early_send(s, req, allow_send=False) is None  # already held
    finally:
        monkeypatch.delenv("FLEXFLOW_CONFIG")
        settings.pd_settings(reload=True)


@pytest.mark.nixl
def test_rail_backend_binds_device_and_restores_env(monkeypatch):
    pytest.importorskip("nixl")
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    from flexflow_sglang.pd.nixl_manager import create_rail_backend
    monkeypatch.setenv("UCX_NET_DEVICES", "all")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    agent = nixl_agent("ff-rail-test", nixl_agent_config(backends=[], num_threads=0))
    create_rail_backend(agent, "lo")
    assert os.environ["UCX_NET_DEVICES"] == "all"
    buf = np.zeros(1 << 16, dtype=np.uint8)
    assert agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM") is not None
