"""CPU-only support for running the real SGLang 0.5.23 server in development and CI.

Everything in this sub-package is a stand-in that is used **only when no CUDA GPU is present**
(``torch.cuda.is_available()`` is False). On a GPU machine the real ``sglang-kernel`` wheel and
a CUDA torchvision are used and nothing here is put on the path.

Contents:

* ``sgl_kernel_standin/sgl_kernel`` -- a pure-torch stand-in for the CUDA-only ``sgl_kernel``
  package. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports exactly eight names from it at module
  level; only ``assign_req_to_token_pool_cpu`` (called on every decode step) is implemented, the
  seven speculative-decoding / KV-move helpers raise ``NotImplementedError``. It registers no
  ``torch.ops.sgl_kernel`` op, so SGLang never switches to its Intel AMX kernels.
* ``patch_torchvision`` -- an idempotent install step (``python -m
  flexflow_sglang.tools.cpu_support.patch_torchvision``) that guards the two unconditional fake-op
  registrations that stop PyPI's CUDA torchvision 0.28.0 from importing beside CPU torch.
* ``tiny_model`` -- builds a tiny random Llama plus a locally trained byte-level BPE tokenizer
  (no model hub), deterministic for a seed.
* :func:`cpu_server_env` -- the environment to launch SGLang with on a CPU-only machine.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping, Optional

#: Directory that holds the ``sgl_kernel`` stand-in package (put on PYTHONPATH on CPU).
STANDIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgl_kernel_standin")

__all__ = ["STANDIN_DIR", "cuda_available", "cpu_server_env"]


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device (False when torch is missing)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement of the server
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken CUDA driver set-ups
        return False


def cpu_server_env(
    base_env: Optional[Mapping[str, str]] = None, *, force_cpu: Optional[bool] = None
) -> dict:
    """Return an environment dict for launching SGLang (server, ``Engine`` or ``sglang serve``).

    ``base_env`` defaults to ``os.environ``; it is copied, never modified. When no CUDA GPU is
    present (or ``force_cpu`` is True) the copy gets:

    * ``SGLANG_USE_CPU_ENGINE=1`` -- selects SGLang's CPU platform (without it start-up fails
      with ``No module named 'vllm'``);
    * ``PYTHONPATH`` prepended with :data:`STANDIN_DIR` so ``import sgl_kernel`` finds the
      stand-in in the launcher and in the spawned scheduler/detokenizer processes;
    * ``NIXL_LOG_LEVEL=WARN`` (unless already set).

    On a CUDA machine (``force_cpu`` False or auto-detected GPU) the copy is returned unchanged.
    """
    env: MutableMapping[str, str] = dict(os.environ if base_env is None else base_env)
    use_cpu = (not cuda_available()) if force_cpu is None else bool(force_cpu)
    if not use_cpu:
        return dict(env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [STANDIN_DIR] + [p for p in parts if os.path.abspath(p) != STANDIN_DIR]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return dict(env)
