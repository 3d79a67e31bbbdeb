"""Parallel layouts on the real SGLang server (tiny model, CPU, one core per rank through
SGLANG_CPU_OMP_THREADS_BIND): pipeline parallelism served by FlexFlowRadixCache on every stage,
and one shared host tier per node for data-parallel ranks and co-located servers.

Each case runs the project's prompt set R1 / flush / R2 (`python -m flexflow_sglang.tools.verify_outputs
--phase test`) against the baseline of a plain server with the same flags: every output equal
(`Total mismatches: 0`) and R2 served from the host tier for at least 80 % of all prompt tokens."""

import json
import os
import re
import signal
import time

import pytest

from server_helpers import MAX_TOTAL_TOKENS, PROMPTS, verify, write_config

pytestmark = pytest.mark.server

MIN_HOST_FRACTION = 0.8


def host_fraction(report_path) -> float:
    """Host-tier tokens of all R2 requests / their prompt tokens."""
    rep = json.load(open(report_path))
    r2 = [p["r2"] for p in rep["prompts"].values() if p.get("r2")]
    return sum(r["host_cached"] + r.get("storage_cached", 0) for r in r2) / max(1, sum(r["prompt_tokens"] for r in r2))


def run_prompt_set(srv, baseline, tmp_path, name="report"):
    report = str(tmp_path / f"{name}.json")
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", baseline, "--out", report)
    assert last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
    assert rc == 0
    return report


@pytest.mark.timeout(1200)  # two PP servers (plain baseline and flexflow) on two cores
def test_pipeline_parallel_served_on_every_stage(plain_baselines, tiny_model, start_server, tmp_path):
    baseline = plain_baselines(pp_size=2)
    srv = start_server(tiny_model, name="flexflow-pp2", radix_cache_backend="flexflow", pp_size=2,
                       flexflow_config=write_config(tmp_path, "pp2"), max_total_tokens=MAX_TOTAL_TOKENS)
    frac = host_fraction(run_prompt_set(srv, baseline, tmp_path))
    assert frac >= MIN_HOST_FRACTION, frac
    log = open(srv.log_path).read()
    # both stages built the flexflow cache (no delegation), each with its own shared-memory tier,
    # and stage 0 checks stage 1's tier before every host hit
    assert "delegating to SGLang's default radix cache" not in log
    assert log.count("FlexFlowRadixCache: page size") == 2, log[-3000:]
    assert "PP stage 0 of 2; checks 1 later stage tier(s)" in log and "PP stage 1 of 2; host hits decided" in log
    segs = segments_in(srv.log_path)
    assert len(segs) == 2, segs
    srv.stop()
    assert wait_gone(segs) == []


# ----------------------------------------------------------------- one host tier per node
def shared_config(tmp_path, name):
    return write_config(tmp_path, name, host_tier={"shared": True})


def segments_in(log_path):
    """/dev/shm segments a server's ranks attached to (from their start-up log lines)."""
    return set(re.findall(r"flexflow: shared host tier (\S+) \(", open(log_path).read()))


def wait_gone(paths, timeout=30.0):
    end = time.time() + timeout
    while any(os.path.exists(p) for p in paths) and time.time() < end:
        time.sleep(0.5)
    return [p for p in paths if os.path.exists(p)]


def scheduler_pids(srv):
    from flexflow_sglang.tools.server_utils import _live_group_members
    out = []
    for pid in _live_group_members(srv.pid):
        try:
            if "scheduler" in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.timeout(1800)  # five server starts on two cores
def test_data_parallel_and_colocated_servers_share_one_host_tier(plain_baselines, tiny_model, start_server, tmp_path):
    """DP=2 with host_tier.shared: R2 lands on either rank and is a host hit (per-rank tiers would
    miss whenever R2 goes to the other rank). A second, independent server of the same model
    attaches to the same segment: its first request of a prefix the DP server computed is a host
    hit. Killing that server (SIGKILL) in the middle of a write burst leaves the DP server serving
    with 0 mismatches; a restarted one attaches again; after all exit nothing stays in /dev/shm."""
    from flexflow_sglang.tools.server_utils import generate
    baseline = plain_baselines(dp_size=2)
    cfg = shared_config(tmp_path, "dp2-shared")
    dp = start_server(tiny_model, name="flexflow-dp2", radix_cache_backend="flexflow", dp_size=2,
                      flexflow_config=cfg, max_total_tokens=MAX_TOTAL_TOKENS)
    frac = host_fraction(run_prompt_set(dp, baseline, tmp_path, "dp2"))
    assert frac >= MIN_HOST_FRACTION, frac
    segs = segments_in(dp.log_path)
    assert len(segs) == 1, segs  # both DP ranks attached to one segment
    (seg,) = segs
    assert os.stat(seg).st_mode & 0o777 == 0o600

    prompts = [json.loads(line) for line in open(PROMPTS)]
    long_prompts = sorted(prompts, key=lambda p: -len(p["text"]))[:4]
    other = start_server(tiny_model, name="flexflow-colocated", radix_cache_backend="flexflow",
                         flexflow_config=cfg, max_total_tokens=MAX_TOTAL_TOKENS)
    assert segments_in(other.log_path) == segs
    # each DP rank is a TP=1 scheduler: the plain DP=2 server's outputs are the single server's too
    expected = json.load(open(baseline))["prompts"]
    first = generate(other.url, long_prompts[0]["text"], max_new_tokens=len(expected[long_prompts[0]["id"]]["output_ids"]))
    assert first["meta_info"]["cached_tokens_details"]["host"] > 0, first["meta_info"]
    assert first["output_ids"] == expected[long_prompts[0]["id"]]["output_ids"]

    # SIGKILL the co-located server's scheduler while it is storing a burst of new prefixes
    import concurrent.futures as cf
    burst = [p["text"] + f" batch {i} decode" * 40 for i, p in enumerate(prompts * 2)]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(generate, other.url, t, max_new_tokens=4, timeout=60) for t in burst]
        time.sleep(1.0)
        for pid in scheduler_pids(other):
            os.kill(pid, signal.SIGKILL)
        for f in futs:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - requests of the killed server fail, as they must
                pass
    other.stop()
    # the DP server keeps serving, byte-equal, from the same tier
    frac = host_fraction(run_prompt_set(dp, baseline, tmp_path, "dp2-after-kill"))
    assert frac >= MIN_HOST_FRACTION, frac
    again = start_server(tiny_model, name="flexflow-restarted", radix_cache_backend="flexflow",
                         flexflow_config=cfg, max_total_tokens=MAX_TOTAL_TOKENS)
    assert segments_in(again.log_path) == segs
    r = generate(again.url, long_prompts[1]["text"], max_new_tokens=len(expected[long_prompts[1]["id"]]["output_ids"]))
    assert r["meta_info"]["cached_tokens_details"]["host"] > 0 and \
        r["output_ids"] == expected[long_prompts[1]["id"]]["output_ids"]
    again.stop()
    dp.stop()
    assert wait_gone(segs) == []
