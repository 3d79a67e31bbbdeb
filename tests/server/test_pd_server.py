"""PD disaggregation end to end on CPU: a prefill and a decode SGLang server (NIXL transfer backend,
host-memory KV) whose outputs byte-equal the single plain server's, with the KV routed over two
rails by FlexFlow's selector, and the prefill side's flexflow radix cache serving repeats from its
host tier.

Both servers run the real scheduler; requests go to both with a shared bootstrap room
(`verify_outputs --pd-prefill/--pd-bootstrap`, what SGLang's router does). UCX is limited to TCP
so the rails' devices (loopback here) really carry the bytes.
"""

import os

import pytest

from server_helpers import MAX_TOTAL_TOKENS, PROMPTS, flexflow_metrics, verify, write_config

pytestmark = [pytest.mark.server, pytest.mark.nixl]

CPU_DECODE_ARGS = ["--disaggregation-decode-host-receive-threshold", "1",
                   "--disaggregation-decode-retraction-backup", "cpu_tensor"]
PD_ENV = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "error"}


def _start_pd(start_server, tiny_model, cfg, bootstrap_port, trace=None):
    from flexflow_sglang.tools.server_utils import find_free_port  # noqa: F401
    env = dict(PD_ENV, **({"FLEXFLOW_PD_TRACE": trace} if trace else {}))
    prefill = start_server(tiny_model, name="pd-prefill", radix_cache_backend="flexflow", flexflow_config=cfg,
                           max_total_tokens=MAX_TOTAL_TOKENS, env=env, timeout=420,
                           extra_args=["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                                       "nixl", "--disaggregation-bootstrap-port", str(bootstrap_port),
                                       "--enable-metrics"])
    decode = start_server(tiny_model, name="pd-decode", radix_cache_backend="flexflow", flexflow_config=cfg,
                          max_total_tokens=MAX_TOTAL_TOKENS, env=env, timeout=420,
                          extra_args=["--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
                                      "nixl", *CPU_DECODE_ARGS])
    return prefill, decode


@pytest.fixture(scope="module")
def nixl_ok():
    pytest.importorskip("nixl", reason="PD transfers need NIXL (pip install nixl nixl-cu12, see .ci/setup-cpu.sh)")


def test_pd_outputs_identical_rails_used_and_prefill_host_hits(nixl_ok, plain_baseline, tiny_model, start_server,
                                                              tmp_path):
    from flexflow_sglang.pd.stats import load_trace
    from flexflow_sglang.tools.server_utils import find_free_port

    cfg = write_config(tmp_path, "pd", pd={"enabled": True, "policy": "adaptive", "rails": ["lo", "lo"]})
    trace = str(tmp_path / "pd-trace.jsonl")
    bport = find_free_port()
    prefill, decode = _start_pd(start_server, tiny_model, cfg, bport, trace)
    rc, stdout, stderr, last = verify("--phase", "test", "--url", decode.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline, "--no-host-hit",
                                      "--pd-prefill", prefill.url, "--pd-bootstrap", f"127.0.0.1:{bport}")
    assert last == "Total mismatches: 0", stdout + stderr + prefill.tail_log() + decode.tail_log()
    assert rc == 0

    log = open(prefill.log_path).read()
    assert "flexflow PD: NIXL KV manager (prefill), KV memory DRAM, policy adaptive, rails ['lo', 'lo']" in log
    assert "flexflow PD: NIXL KV manager (decode), KV memory DRAM" in open(decode.log_path).read()

    # every KV chunk went through the rails, none failed, and the selector split the large ones
    m = flexflow_metrics(prefill.url, until=lambda m: m.get("flexflow_pd_chunks", 0) >= 28)
    assert m.get("flexflow_pd_failed_chunks", -1) == 0, m
    assert m.get("flexflow_pd_chunks", 0) >= 28, m  # 14 prompts x (R1 + R2)
    assert m.get("flexflow_pd_bytes_per_rail_rail0", 0) > 0 and m.get("flexflow_pd_bytes_per_rail_rail1", 0) > 0, m
    assert m.get("flexflow_pd_bytes_sglang_agent", -1) == 0, m
    recs = load_trace(trace)
    assert len(recs) == m["flexflow_pd_chunks"] and all(r["ok"] for r in recs)
    assert {r["path"] for r in recs} <= {"direct", "split"} and any(r["path"] == "split" for r in recs)
    for r in recs:
        assert sum(leg["bytes"] for leg in r["legs"]) == r["bytes"] > 0
    assert oct(os.stat(trace).st_mode & 0o777) == "0o600"

    # the prefill side's flexflow cache: R2 (after /flush_cache on both) loaded its prefix from the host tier
    hits = flexflow_metrics(prefill.url, until=lambda m: m.get("flexflow_hits_by_tier_host", 0) > 0)
    assert hits.get("flexflow_hits_by_tier_host", 0) > 0 and hits.get("flexflow_bytes_loaded", 0) > 0, hits


def test_pd_primary_policy_and_routing_off(nixl_ok, plain_baseline, tiny_model, start_server, tmp_path):
    """pd.policy primary keeps SGLang's own agent (only the host-memory registration is FlexFlow's):
    outputs still byte-equal, and every chunk is accounted to SGLang's agent."""
    from flexflow_sglang.tools.server_utils import find_free_port

    cfg = write_config(tmp_path, "pd-primary", pd={"enabled": True, "policy": "primary", "rails": ["lo"]})
    bport = find_free_port()
    prefill, decode = _start_pd(start_server, tiny_model, cfg, bport)
    rc, stdout, stderr, last = verify("--phase", "test", "--url", decode.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline, "--no-host-hit",
                                      "--pd-prefill", prefill.url, "--pd-bootstrap", str(bport))
    assert rc == 0 and last == "Total mismatches: 0", stdout + stderr + prefill.tail_log() + decode.tail_log()
    m = flexflow_metrics(prefill.url, until=lambda m: m.get("flexflow_pd_chunks", 0) >= 28)
    assert m.get("flexflow_pd_bytes_sglang_agent", 0) > 0 and m.get("flexflow_pd_failed_chunks", -1) == 0, m
    assert "flexflow_pd_bytes_per_rail_rail0" not in m, m
