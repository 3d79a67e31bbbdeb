"""benchmarks/file_churn.py runs end to end on a few files and reports every figure it promises."""
from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_file_churn_reports_page_files_against_slot_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("file_churn", os.path.join(ROOT, "benchmarks", "file_churn.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out"
    assert mod.main(["--dir", str(tmp_path), "--files", "8", "--page-kib", "4", "--out", str(out)]) == 0
    res = json.loads((out / "file_churn.json").read_text())
    cpu = res["cpu_us_per_page"]
    assert set(cpu) == {"as_found", "after_deleting", "slot_writes"} and all(v >= 0 for v in cpu.values())
    assert res["files"] == 8 and res["page_bytes"] == 4 * 1024 + 64 and res["commit"]
    assert set(res["over_slot_writes"]) == {"as_found", "after_deleting"}
    # nothing is left behind under --dir but the output
    assert sorted(os.listdir(tmp_path)) == ["out"]
