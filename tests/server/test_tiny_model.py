"""Unit tests (no server): the tiny model builder is deterministic and skips up-to-date dirs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from flexflow_sglang.tools.cpu_support import tiny_model as tm

from server_helpers import repo_env

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pytest.importorskip("torch")


def _digest(d):
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_same_seed_gives_identical_files(tiny_model, tmp_path):
    other = tm.make_tiny_model(tmp_path / "again")
    assert _digest(tiny_model) == _digest(other)
    assert {"config.json", "model.safetensors", "tokenizer.json", tm.MARKER_FILE} <= set(os.listdir(other))


def test_tiny_model_shape_and_tokenizer(tiny_model):
    with open(os.path.join(tiny_model, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (2, 64, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["max_position_embeddings"] == 8192
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("the cache radix tree prefix token").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 7  # BOS + one token per corpus word
    assert tok.decode(ids[1:]) == "the cache radix tree prefix token"
    marker = tm.read_marker(tiny_model)
    assert marker["params"]["seed"] == 0 and marker["num_parameters"] == 122560


def test_rebuild_skipped_when_params_match_and_done_when_they_change(tmp_path):
    d = tmp_path / "m"
    tm.make_tiny_model(d, layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, seed=3)
    weights = d / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    first = _digest(d)
    tm.make_tiny_model(d, layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, seed=3)
    assert weights.stat().st_mtime_ns == mtime  # skipped
    tm.make_tiny_model(d, layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, seed=4)
    second = _digest(d)
    assert second["model.safetensors"] != first["model.safetensors"]  # other seed, other weights
    assert tm.read_marker(d)["params"]["seed"] == 4


def test_invalid_dimensions_rejected(tmp_path):
    with pytest.raises(ValueError, match="multiple of heads"):
        tm.make_tiny_model(tmp_path / "bad", hidden=30, heads=4)
    assert not (tmp_path / "bad").exists()


def test_cli_presets_and_skip(tmp_path):
    assert tm.PRESETS["bench"] == dict(layers=4, hidden=512, intermediate=4096, heads=8, kv_heads=4)
    d = tmp_path / "cli"
    cmd = [sys.executable, "-m", "flexflow_sglang.tools.cpu_support.tiny_model", str(d),
           "--layers", "1", "--hidden", "32", "--intermediate", "64", "--heads", "2", "--kv-heads", "1"]
    p1 = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=300)
    assert p1.returncode == 0, p1.stderr
    assert "built" in p1.stdout
    p2 = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0 and "up to date" in p2.stdout
    with open(d / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 1
