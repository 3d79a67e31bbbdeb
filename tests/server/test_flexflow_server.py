"""End to end on the real SGLang server (tiny model, CPU): the flexflow backend's outputs byte-equal the
plain server's, and a repeat after /flush_cache is served from the host tier.

A plain server with the same server arguments records the baseline with `python -m
flexflow_sglang.tools.verify_outputs --phase baseline`; each flexflow configuration then runs `--phase test`
(R1 fresh, R2 after /flush_cache) against it:
page size 1, page size 4 with chunked prefill small enough to split long prompts, TP=2 (gloo, one
core per rank), the last two again with layer-wise load-back on, and several concurrent clients with a
host tier smaller than the working set.
"""

import re

import pytest

from server_helpers import MAX_TOTAL_TOKENS, PROMPTS, flexflow_metrics, verify, write_config

pytestmark = pytest.mark.server


CASES = {
    "page1": dict(),
    "page4-chunked": dict(page_size=4, chunked_prefill_size=128),
    "tp2": dict(tp_size=2),
    # layer-wise load-back (issue 15): the forward reads layer i while later layers still load
    "page4-chunked-layerwise": dict(page_size=4, chunked_prefill_size=128),
    "tp2-layerwise": dict(tp_size=2),
}
LAYERWISE = {"page4-chunked-layerwise", "tp2-layerwise"}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_identical_and_host_hits(case, plain_baselines, tiny_model, start_server, tmp_path):
    # the baseline comes from a plain server with the same page size / chunking / TP
    baseline = plain_baselines(**CASES[case])
    cfg = write_config(tmp_path, case, **({"host_tier": {"layerwise_load": True}} if case in LAYERWISE else {}))
    srv = start_server(tiny_model, name=f"flexflow-{case}", radix_cache_backend="flexflow",
                       flexflow_config=cfg, max_total_tokens=MAX_TOTAL_TOKENS,
                       extra_args=["--enable-metrics"], **CASES[case])
    report = str(tmp_path / "report.json")
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", baseline, "--out", report)
    assert last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
    assert rc == 0
    # the backend really moved the bytes: host-tier loads were counted by the connector
    m = flexflow_metrics(srv.url, until=lambda m: any(v > 0 for k, v in m.items() if "bytes_loaded" in k))
    loaded = [v for k, v in m.items() if "load" in k and ("tokens" in k or "bytes" in k)]
    assert loaded and max(loaded) > 0, m
    assert "Tree cache initialized" in open(srv.log_path).read()
    if case in LAYERWISE:  # the host hits really went layer by layer (every rank: summed over tp_rank)
        assert m.get("flexflow_cache_layerwise_load_backs", 0) > 0, m
        assert "layer-wise load: on" in open(srv.log_path).read()


def test_concurrent_clients_small_host_tier(plain_baseline, tiny_model, start_server, tmp_path):
    """Host tier (1024 tokens) far below the working set (~10k tokens): eviction and load-back
    interleave under 4 concurrent clients. Every prefix the forward pass read after a host load must
    equal, byte for byte, the device KV of the same tokens; no request may fail.

    Outputs are reported, not judged: on CPU the float16 GEMMs are not batch-invariant, so a prompt
    prefilled next to different neighbours can flip a near-tie with no backend at all (CI saw
    medium-1 token 6, 234 vs 277, between an R2 and an R2d that both recomputed from 1 cached
    token; the plain server with page 4 + chunking flips the same token). The KV dump is where the
    backend's promise can be checked regardless of batch composition (docs/correctness.md)."""
    from server_helpers import compare_kv_dumps
    dump = tmp_path / "kv"
    cfg = write_config(tmp_path, "small", host_tier={"capacity_tokens": 1024})
    srv = start_server(tiny_model, name="flexflow-small", radix_cache_backend="flexflow", flexflow_config=cfg,
                       max_total_tokens=MAX_TOTAL_TOKENS, extra_args=["--enable-metrics"],
                       env={"FLEXFLOW_KV_DUMP_DIR": str(dump)})
    report = str(tmp_path / "report.json")
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", plain_baseline, "--concurrency", "4", "--no-host-hit",
                                      "--out", report)
    assert rc in (0, 1) and re.fullmatch(r"Total mismatches: \d+", last or ""), stdout + stderr + srv.tail_log()
    assert "request failed" not in stdout and "failed:" not in stdout, stdout + srv.tail_log()
    print(f"small host tier, concurrency 4: {last} against the sequential baseline (batch-composition "
          "drift, not judged)")
    hits = [int(x) for x in re.findall(r"R2 cached=\d+ \(device \d+, host (\d+)\)", stdout)]
    assert hits and any(h > 0 for h in hits), stdout  # some repeats still came from the host tier
    kv = compare_kv_dumps(dump)
    assert kv["mismatched"] == 0, kv["details"]
    assert kv["compared"] >= 1, kv  # at least one host-loaded prefix had a device twin to compare with
    m = flexflow_metrics(srv.url, until=lambda m: any(v > 0 for k, v in m.items() if "evict" in k))
    evicted = [v for k, v in m.items() if "evict" in k]
    assert evicted and max(evicted) > 0, m


def test_layerwise_copy_failure_is_redone_before_the_layer_is_read(plain_baselines, tiny_model, start_server,
                                                                   tmp_path):
    """Layer-wise load-back (host_tier.layerwise_load: true) with the loader thread's copy of layer 1 failing on
    every load (FLEXFLOW_TEST_FAULTS): the forward re-copies that layer before attention reads it, so
    every host hit still decodes the plain server's tokens, and nothing hangs."""
    baseline = plain_baselines(page_size=4, chunked_prefill_size=128)
    srv = start_server(tiny_model, name="flexflow-layer-fault", radix_cache_backend="flexflow",
                       flexflow_config=write_config(tmp_path, "layer-fault", host_tier={"layerwise_load": True}), max_total_tokens=MAX_TOTAL_TOKENS,
                       extra_args=["--enable-metrics"], page_size=4, chunked_prefill_size=128,
                       env={"FLEXFLOW_TEST_FAULTS": "copy_fail_layer=1"})
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", PROMPTS,
                                      "--baseline", baseline, "--out", str(tmp_path / "report.json"))
    assert last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
    assert rc == 0
    m = flexflow_metrics(srv.url, until=lambda m: m.get("flexflow_cache_layerwise_retries", 0) > 0)
    assert m.get("flexflow_cache_layerwise_load_backs", 0) > 0, m
    assert m.get("flexflow_cache_layerwise_retries", 0) >= m["flexflow_cache_layerwise_load_backs"], m
    assert "injected copy failure at layer 1" in open(srv.log_path).read()


def test_bad_config_fails_at_start_with_one_message(tiny_model, sglang_ready, tmp_path):
    """A FLEXFLOW_CONFIG with an out-of-range value stops the server at start-up, and its log names
    the file, the key, the value and what is allowed."""
    from flexflow_sglang.tools.server_utils import ServerStartError, SGLangServer
    bad = tmp_path / "bad.yaml"
    bad.write_text("selector:\n  nvlink_util_threshold: 1.5\n")
    log = tmp_path / "bad-server.log"
    srv = SGLangServer(tiny_model, str(log), radix_cache_backend="flexflow", flexflow_config=str(bad), timeout=180)
    with pytest.raises(ServerStartError):
        with srv:
            pass
    assert not srv.is_running()
    text = log.read_text()
    assert f"invalid flexflow config {bad}: selector.nvlink_util_threshold = 1.5: must be a number in (0, 1]" in text
