"""Make PyPI's (CUDA) torchvision 0.28.0 importable beside CPU torch -- a documented install step.

Usage::

    python -m flexflow_sglang.tools.cpu_support.patch_torchvision [--file PATH] [--check] [--dry-run]

Why: SGLang imports ``torchvision.transforms`` at start-up. PyPI's torchvision 0.28.0 is a CUDA
build whose ``_C.so`` cannot load beside CPU torch; its ``_meta_registrations.py`` then fails at
the two unconditional ``@torch.library.register_fake("torchvision::nms")`` / ``("torchvision::qnms")``
decorators with ``RuntimeError: operator torchvision::nms does not exist`` (every other fake
registration in that file already checks ``torchvision.extension._has_ops()``). This gives those
two lines the same guard. Text models never need torchvision's C++ ops.

Idempotent: it does nothing when the lines are already guarded, or when ``import torchvision``
already works (e.g. a ``+cpu`` build from PyTorch's index). Only used on CPU-only set-ups.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional, Tuple

META_FILE = "_meta_registrations.py"

_UNGUARDED = re.compile(
    r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)[ \t]*$', re.MULTILINE
)
_GUARDED = re.compile(
    r'^@\(torch\.library\.register_fake\("torchvision::(q?nms)"\) '
    r"if torchvision\.extension\._has_ops\(\) else \(lambda f: f\)\)[ \t]*$",
    re.MULTILINE,
)
_REPLACEMENT = (
    r'@(torch.library.register_fake("torchvision::\1") '
    r"if torchvision.extension._has_ops() else (lambda f: f))"
)


def patch_text(text: str) -> Tuple[str, int]:
    """Return ``(new_text, n_lines_changed)``; already-guarded lines are left alone."""
    return _UNGUARDED.subn(_REPLACEMENT, text)


def count_guarded(text: str) -> int:
    return len(_GUARDED.findall(text))


def patch_file(path: str, dry_run: bool = False) -> int:
    """Guard the unconditional registrations in ``path`` in place; returns lines changed (0 = no-op)."""
    with open(path, "r", encoding="utf-8", newline="") as f:
        text = f.read()
    new_text, n = patch_text(text)
    if n == 0 or dry_run:
        return n
    compile(new_text, path, "exec")  # never write a file that does not parse
    mode = os.stat(path).st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=".patch-", suffix=".py", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new_text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return n


def find_meta_registrations() -> Optional[str]:
    """Path of the installed torchvision's ``_meta_registrations.py`` (without importing it)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), META_FILE)
    return path if os.path.exists(path) else None


def torchvision_imports(python: str = sys.executable, module: str = "torchvision") -> Tuple[bool, str]:
    """Try ``import <module>`` in a fresh interpreter; returns (ok, last line of stderr)."""
    proc = subprocess.run(
        [python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300
    )
    err = proc.stderr.strip().splitlines()
    return proc.returncode == 0, (err[-1] if err else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flexflow_sglang.tools.cpu_support.patch_torchvision",
        description="Guard torchvision's unconditional nms/qnms fake-op registrations (idempotent).",
    )
    ap.add_argument("--file", help="patch this _meta_registrations.py instead of the installed one")
    ap.add_argument("--check", action="store_true", help="only report; exit 1 if a patch is needed")
    ap.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    args = ap.parse_args(argv)

    path = args.file
    if path is None:
        path = find_meta_registrations()
        if path is None:
            print("patch_torchvision: torchvision (or its _meta_registrations.py) is not installed; nothing to do")
            return 0
    with open(path, encoding="utf-8") as f:
        text = f.read()
    _, pending = patch_text(text)
    guarded = count_guarded(text)
    if pending == 0:
        state = f"already patched ({guarded} guarded line(s))" if guarded else "no unconditional nms/qnms registrations"
        print(f"patch_torchvision: {path}: {state}; nothing to do")
        return 0
    if args.file is None:
        ok, _ = torchvision_imports()
        if ok:
            print(f"patch_torchvision: torchvision imports fine; leaving {path} unchanged")
            return 0
    if args.check or args.dry_run:
        print(f"patch_torchvision: {path}: {pending} unconditional registration(s) need the guard")
        return 1 if args.check else 0
    n = patch_file(path)
    print(f"patch_torchvision: {path}: guarded {n} line(s) (torchvision::nms/qnms register_fake)")
    if args.file is None:
        ok, err = torchvision_imports(module="torchvision.transforms")
        if not ok:
            print(f"patch_torchvision: import torchvision.transforms still fails: {err}", file=sys.stderr)
            return 1
        print("patch_torchvision: import torchvision.transforms now works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
