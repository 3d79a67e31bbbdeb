"""The README's main command, end to end: `flexflow quickstart` on the real model (SmolLM2) through
/v1/chat/completions: the follow-up's shared history comes from the host tier and its answer equals
the device-hit answer."""

import json
import os
import subprocess
import sys

import pytest

from server_helpers import repo_env

pytestmark = pytest.mark.server


def test_quickstart_chats_and_shows_a_host_tier_hit(real_model, sglang_ready, tmp_path):
    # the session's model directory is reused: make-model finds it complete and skips the build
    env = repo_env({"FLEXFLOW_MODELS_DIR": os.path.dirname(real_model)})
    env.pop("FLEXFLOW_CONFIG", None)
    if os.path.basename(real_model) != "SmolLM2-135M-Instruct":
        pytest.skip(f"real model directory {real_model} is not under its preset name")
    p = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.cli.main", "quickstart", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "OK: the shared history came from the host tier" in p.stdout
    res = json.load(open(tmp_path / "quickstart.json"))
    assert "Paris" in res["answer"], res["answer"]
    assert res["host_tokens"] > 0 and res["host_tokens"] >= 0.5 * res["prompt_tokens"], res
    assert res["same_cached_length"] and res["host_tokens_host_hit"] >= res["cached_tokens_host_hit"] - 1, res
    assert res["identical_output"] and res["follow_up_answer_host_hit"] == res["follow_up_answer_device_hit"]
    assert res["server_stopped"]
