import json
import subprocess
import sys

import pytest

from flexflow_sglang.tools.cli.main import main, parse_bytes


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_parse_bytes():
    assert parse_bytes("64MiB") == 64 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(Exception):
        parse_bytes("lots")


def test_select_json(capsys):
    rc, out, _ = run(capsys, "select", "--mock", "dgx-a100", "--src", "gpu0", "--dst", "gpu1", "--bytes", "64MiB",
                     "--load", "gpu0-gpu1=0.85", "--no-split", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["chosen_type"] == "NVLinkRelay" and d["hops"][0] == "gpu0" and d["hops"][-1] == "gpu1"
    assert d["estimated_time_us"] < d["always_direct_time_us"]
    assert d["selector_impl"] in ("compiled", "python")


def test_select_load_with_dashed_names(capsys):
    rc, out, _ = run(capsys, "select", "--mock", "cluster2x8x4", "--src", "n0.gpu0", "--dst", "n1.gpu0",
                     "--bytes", "1GiB", "--load", "shared-storage-storage-switch=0.5", "--json")
    assert rc == 0 and json.loads(out)["data_bytes"] == 1 << 30


def test_select_errors_are_clear(capsys):
    rc, _, err = run(capsys, "select", "--mock", "dgx8", "--src", "gpu0", "--dst", "gpu1", "--bytes", "1MiB",
                     "--load", "gpu0-gpu9=0.5")
    assert rc == 2 and "gpu0-gpu9" in err
    rc, _, err = run(capsys, "select", "--mock", "dgx8", "--src", "gpu0", "--dst", "nosuch", "--bytes", "1MiB")
    assert rc == 2 and "nosuch" in err


def test_topology_json(capsys):
    rc, out, _ = run(capsys, "topology", "--mock", "nvswitch8", "--json")
    d = json.loads(out)
    assert rc == 0 and sum(1 for n in d["nodes"] if n["kind"] == "gpu") == 8


def test_demo_json(capsys):
    rc, out, _ = run(capsys, "demo", "--json")
    res = json.loads(out)
    kinds = {r["decision"]["chosen_type"] for r in res}
    assert {"Direct", "NVLinkRelay", "SplitPath", "CrossNodeRelay", "StorageRelay"} <= kinds


def test_console_script_version():
    out = subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.cli.main", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert "selector core:" in out


def test_bench_selector_json(capsys):
    rc, out, _ = run(capsys, "bench", "selector", "--json", "-n", "2000", "--topologies", "dgx8")
    d = json.loads(out)
    assert rc == 0 and d["results"]["dgx8"]["python"]["median_us"] > 0


def test_passthrough_tools_keep_their_options(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["tier-server", "--help"])
    assert ei.value.code == 0
    assert "--listen" in capsys.readouterr().out
