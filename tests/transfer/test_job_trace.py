"""transfer.trace_path: the opt-in timeline of finished background jobs (transfer/trace.py)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest

from flexflow_sglang.config import config_from_dict
from flexflow_sglang.monitor import NodeAgent
from flexflow_sglang.selector import PathSelector, SelectorConfig
from flexflow_sglang.topology import LinkType, NodeKind, Topology
from flexflow_sglang.transfer import Job, JobTrace, engine_from_config


def _engine(tmp_path, max_jobs=100):
    t = Topology("t")
    t.add_node("gpu0", NodeKind.GPU)
    t.add_node("cpu0", NodeKind.CPU)
    t.add_link("gpu0", "cpu0", LinkType.PCIE, 10.0)
    agent = NodeAgent(t, source="mock")
    cfg = config_from_dict({"transfer": {"trace_path": str(tmp_path / "jobs"), "trace_max_jobs": max_jobs}}, "<test>")
    return engine_from_config(PathSelector(t, agent, SelectorConfig()), agent, cfg.transfer)


def test_each_finished_job_is_one_line_with_its_timeline(tmp_path):
    eng = _engine(tmp_path)
    try:
        gate = threading.Event()
        t0 = time.time()
        assert eng.submit(Job("write_through", lambda j: gate.wait(5) and time.sleep(0.05), nbytes=4096))
        assert eng.submit(Job("fetch", lambda j: 1 / 0))
        gate.set()
        assert eng.drain(5)
        eng.poll()
    finally:
        eng.close()
    path = tmp_path / f"jobs.{os.getpid()}.jsonl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # owner-only
    rows = {r["kind"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(rows) == {"write_through", "fetch"}
    wt = rows["write_through"]
    assert wt["state"] == "done" and wt["nbytes"] == 4096 and wt["thread"].startswith("ff-transfer")
    assert t0 - 1 <= wt["t_submit"] <= wt["t_start"] <= wt["t_end"] <= time.time() + 1  # wall clock
    assert wt["wall_ms"] >= 40 and wt["queued_ms"] >= 0
    assert rows["fetch"]["state"] == "failed"
    assert eng.stats()["trace_written"] == 2 and eng.stats()["trace_dropped"] == 0


def test_the_trace_is_bounded_and_off_by_default(tmp_path):
    eng = _engine(tmp_path, max_jobs=3)
    try:
        for _ in range(5):
            assert eng.submit(Job("spill", lambda j: None))
        assert eng.drain(5)
    finally:
        eng.close()
    assert len((tmp_path / f"jobs.{os.getpid()}.jsonl").read_text().splitlines()) == 3
    assert eng.stats()["trace_dropped"] == 2
    default = config_from_dict({}, "<test>").transfer
    assert default.trace_path is None


def test_a_bad_trace_path_fails_at_start_naming_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / f"link.{os.getpid()}.jsonl").symlink_to(target)  # never followed
    with pytest.raises(ValueError, match="transfer.trace_path.*link"):
        JobTrace(str(tmp_path / "link"))
    with pytest.raises(ValueError, match="transfer.trace_path"):
        JobTrace(str(tmp_path / "no-such-dir" / "jobs"))
