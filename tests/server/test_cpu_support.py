"""Unit tests (no server): CPU environment, the sgl_kernel stand-in, the torchvision patch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from flexflow_sglang.tools import cpu_support
from flexflow_sglang.tools.cpu_support import STANDIN_DIR, cpu_server_env
from flexflow_sglang.tools.cpu_support import patch_torchvision as ptv

from server_helpers import repo_env

# ----------------------------------------------------------------------------- cpu_server_env


def test_cpu_env_sets_engine_path_and_nixl_level():
    env = cpu_server_env({"PYTHONPATH": "/a:/b", "FOO": "1"}, force_cpu=True)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [STANDIN_DIR, "/a", "/b"]
    assert env["NIXL_LOG_LEVEL"] == "WARN"
    assert env["FOO"] == "1"
    again = cpu_server_env(env, force_cpu=True)  # idempotent: the stand-in dir appears once
    assert again["PYTHONPATH"] == env["PYTHONPATH"]


def test_cpu_env_does_not_modify_base_and_keeps_nixl_override():
    base = {"NIXL_LOG_LEVEL": "DEBUG"}
    env = cpu_server_env(base, force_cpu=True)
    assert base == {"NIXL_LOG_LEVEL": "DEBUG"}
    assert env["NIXL_LOG_LEVEL"] == "DEBUG"
    assert env["PYTHONPATH"] == STANDIN_DIR


def test_cpu_env_is_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(cpu_support, "cuda_available", lambda: True)
    base = {"PYTHONPATH": "/x"}
    assert cpu_server_env(base) == base
    monkeypatch.setattr(cpu_support, "cuda_available", lambda: False)
    assert cpu_server_env(base)["SGLANG_USE_CPU_ENGINE"] == "1"


def test_cpu_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("FLEXFLOW_TEST_MARK", "42")
    assert cpu_server_env(force_cpu=True)["FLEXFLOW_TEST_MARK"] == "42"


# ----------------------------------------------------------------------------- sgl_kernel stand-in
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def standin():
    """The stand-in loaded under a private name (does not shadow a real sgl_kernel here)."""
    path = os.path.join(STANDIN_DIR, "sgl_kernel", "__init__.py")
    spec = importlib.util.spec_from_file_location("_ff_sgl_kernel_standin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference_assign(req_pool_indices, req_to_token, start, end, out_cache_loc):
    off = 0
    for row, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        if e > s:
            req_to_token[row, s:e] = out_cache_loc[off:off + e - s].to(req_to_token.dtype)
        off += e - s


def test_standin_exports_exactly_the_eight_names(standin):
    assert sorted(standin.__all__) == sorted([
        "assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu",
        "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
        "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
        "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu"])
    for name in standin.__all__:
        assert callable(getattr(standin, name))


def test_standin_unimplemented_raise(standin):
    for name in standin.__all__:
        if name == "assign_req_to_token_pool_cpu":
            continue
        with pytest.raises(NotImplementedError, match=name):
            getattr(standin, name)(1, 2, x=3)


def test_standin_registers_no_torch_ops(standin):
    # SGLang switches to the Intel AMX kernels when this op exists.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


@pytest.mark.parametrize("case", ["decode", "extend", "single", "empty-rows"])
def test_assign_req_to_token_pool_cpu_matches_reference(standin, case):
    g = torch.Generator().manual_seed(1)
    pool_len = 64
    req_to_token = torch.randint(0, 1000, (10, pool_len), dtype=torch.int32, generator=g)
    if case == "decode":  # one new slot per request
        idx = torch.tensor([3, 7, 0], dtype=torch.int64)
        start = torch.tensor([5, 12, 30], dtype=torch.int64)
        end = start + 1
    elif case == "extend":
        idx = torch.tensor([2, 9, 4, 6], dtype=torch.int64)
        start = torch.tensor([0, 10, 3, 63], dtype=torch.int64)
        end = torch.tensor([17, 40, 3, 64], dtype=torch.int64)
    elif case == "single":
        idx = torch.tensor([5], dtype=torch.int64)
        start = torch.tensor([8], dtype=torch.int64)
        end = torch.tensor([20], dtype=torch.int64)
    else:
        idx = torch.tensor([1, 2], dtype=torch.int64)
        start = torch.tensor([4, 9], dtype=torch.int64)
        end = torch.tensor([4, 9], dtype=torch.int64)
    n = int((end - start).clamp(min=0).sum())
    out_cache_loc = torch.randint(1, 5000, (n + 3,), dtype=torch.int64, generator=g)
    expected = req_to_token.clone()
    _reference_assign(idx, expected, start, end, out_cache_loc)
    got = req_to_token.clone()
    assert standin.assign_req_to_token_pool_cpu(idx, got, start, end, out_cache_loc, pool_len) is None
    assert torch.equal(got, expected)
    assert got.dtype == torch.int32


def test_assign_req_to_token_pool_cpu_int32_offsets_and_bounds(standin):
    req_to_token = torch.zeros((4, 8), dtype=torch.int32)
    idx = torch.tensor([1, 3], dtype=torch.int32)
    start = torch.tensor([0, 6], dtype=torch.int32)
    end = torch.tensor([3, 8], dtype=torch.int32)
    loc = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int64)
    standin.assign_req_to_token_pool_cpu(idx, req_to_token, start, end, loc, 8)
    assert req_to_token[1].tolist() == [10, 11, 12, 0, 0, 0, 0, 0]
    assert req_to_token[3].tolist() == [0, 0, 0, 0, 0, 0, 13, 14]
    with pytest.raises(IndexError):
        standin.assign_req_to_token_pool_cpu(idx, req_to_token, start, end + 1, loc, 8)


def test_standin_importable_as_sgl_kernel_from_cpu_env():
    env = cpu_server_env(repo_env(), force_cpu=True)
    proc = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel, torch; assert sgl_kernel.IS_STANDIN; "
         "from sgl_kernel import assign_req_to_token_pool_cpu, fill_bonus_tokens_cpu; "
         "print(sgl_kernel.__file__)"],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(STANDIN_DIR)


# ----------------------------------------------------------------------------- torchvision patch
ORIGINAL_SNIPPET = '''import torch
import torch._custom_ops
import torch.library
import torchvision.extension  # noqa: F401


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)


@torch.library.register_fake("torchvision::roi_align_other")
def other(x):
    return x
'''


def _unpatch(text: str) -> str:
    """Inverse of the patch: the file as shipped on PyPI."""
    import re

    return re.sub(r'^@\(torch\.library\.register_fake\("torchvision::(q?nms)"\) if torchvision\.extension'
                  r'\._has_ops\(\) else \(lambda f: f\)\)$', r'@torch.library.register_fake("torchvision::\1")',
                  text, flags=re.MULTILINE)


def test_patch_text_guards_exactly_nms_and_qnms():
    new, n = ptv.patch_text(ORIGINAL_SNIPPET)
    assert n == 2
    assert ptv.count_guarded(new) == 2
    assert '@torch.library.register_fake("torchvision::roi_align_other")' in new  # untouched
    assert new.count("_has_ops() else (lambda f: f))") == 2
    compile(new, "<patched>", "exec")
    again, n2 = ptv.patch_text(new)
    assert n2 == 0 and again == new


def _installed_or_snippet(tmp_path):
    src = ptv.find_meta_registrations()
    target = tmp_path / "_meta_registrations.py"
    if src is None:
        target.write_text(ORIGINAL_SNIPPET)
    else:
        with open(src, encoding="utf-8") as f:
            target.write_text(_unpatch(f.read()))
    return target


def test_patch_file_idempotent_on_copy_of_installed_file(tmp_path):
    target = _installed_or_snippet(tmp_path)
    target.chmod(0o644)
    original = target.read_text()
    assert ptv.patch_text(original)[1] == 2
    assert ptv.patch_file(str(target), dry_run=True) == 2
    assert target.read_text() == original  # dry run writes nothing
    assert ptv.patch_file(str(target)) == 2
    patched = target.read_text()
    assert ptv.count_guarded(patched) == 2 and ptv.patch_text(patched)[1] == 0
    assert _unpatch(patched) == original  # nothing else changed
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert ptv.patch_file(str(target)) == 0
    assert target.read_text() == patched
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".patch-")]


def test_patch_cli_on_file_is_idempotent(tmp_path):
    target = tmp_path / "_meta_registrations.py"
    target.write_text(ORIGINAL_SNIPPET)
    cmd = [sys.executable, "-m", "flexflow_sglang.tools.cpu_support.patch_torchvision", "--file", str(target)]
    first = subprocess.run(cmd + ["--check"], env=repo_env(), capture_output=True, text=True)
    assert first.returncode == 1 and "need the guard" in first.stdout
    done = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True)
    assert done.returncode == 0 and "guarded 2 line(s)" in done.stdout, done.stderr
    again = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True)
    assert again.returncode == 0 and "already patched" in again.stdout
    assert subprocess.run(cmd + ["--check"], env=repo_env()).returncode == 0
