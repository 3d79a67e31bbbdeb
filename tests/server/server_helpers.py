"""Helpers shared by the tests in tests/server (paths, subprocess environment)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS_FILE = REPO_ROOT / "flexflow_sglang" / "data" / "prompts.jsonl"


def repo_env(extra=None) -> dict:
    """Environment for ``python -m flexflow_sglang...`` subprocesses (source tree importable)."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra or {})
    return env
