"""Shell scripts and the Dockerfile cannot run here (no Docker engine, no GPU); lint what can be linted
and keep the Docker path consistent with the CPU path."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = [".ci/run", ".ci/setup-cpu.sh", "docker/quickstart.sh", "benchmarks/gpu/run.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, script)], check=True)


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    subprocess.run(["shellcheck", *[os.path.join(ROOT, s) for s in SCRIPTS]], check=True)


def test_dockerfile_consistent_with_cpu_path():
    df = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    constraints = open(os.path.join(ROOT, ".ci", "constraints-cpu.txt")).read()
    sglang_pin = re.search(r"^sglang==(\S+)", constraints, re.M).group(1)
    nixl_pin = re.search(r"^nixl==(\S+)", constraints, re.M).group(1)
    assert f"sglang:v{sglang_pin}" in df, "base image must carry the SGLang version we pin for CPU"
    assert f"nixl=={nixl_pin}" in df
    for path in re.findall(r"^COPY (\S+) ", df, re.M):
        for p in path.split():
            assert os.path.exists(os.path.join(ROOT, p)), p
    assert "--radix-cache-backend" in df and "FLEXFLOW_CONFIG" in df
    cfg = re.search(r"FLEXFLOW_CONFIG=/opt/flexflow/(\S+)", df).group(1)
    assert os.path.exists(os.path.join(ROOT, cfg))


def test_gpu_script_dry_run(tmp_path):
    """benchmarks/gpu/run.sh cannot meet a GPU here: its driver must at least run every step's CPU logic."""
    import json
    env = {**os.environ, "OUT": str(tmp_path)}
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "run.sh"), "--dry-run"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.load(open(tmp_path / "gpu_bench.json"))
    steps = summary["steps"]
    assert set(steps) == {"host_tier", "peer_relay_split", "verify_outputs", "layerwise"}
    assert "error" not in steps["layerwise"] and steps["layerwise"]["prefix_tokens"] == 4096
    assert steps["host_tier"]["with_checksums"]["roundtrip_equal"]
    assert steps["peer_relay_split"]["relay_bytes_ok"]
    assert steps["peer_relay_split"]["selector_decision"]["chosen_type"] in ("NVLinkRelay", "SplitPath")


def test_wheel_carries_core_configs_and_plugin(tmp_path):
    """`pip install flexflow-sglang` must bring the compiled core, the shipped configs (the defaults are
    read from configs/default.yaml), the CPU stand-in, the prompt set and the SGLang entry point."""
    import sys
    import zipfile
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (whl,) = tmp_path.glob("flexflow_sglang-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert any(n.startswith("flexflow_sglang/_selector_core") and n.endswith(".so") for n in names)
    for need in ("flexflow_sglang/configs/default.yaml", "flexflow_sglang/tools/data/prompts.jsonl",
                 "flexflow_sglang/tools/cpu_support/sgl_kernel_standin/sgl_kernel/__init__.py"):
        assert need in names, need
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(whl).read(ep).decode()
    assert "[sglang.srt.plugins]" in text and "flexflow = flexflow_sglang.backend.plugin:register" in text
