"""The real model (SmolLM2-135M-Instruct, bf16) on the real SGLang server: host hits equal device hits.

For each server mode the flexflow server runs the chat prompt set (shared system prompts and
multi-turn conversations, `data/chat_prompts.jsonl`) through `verify_outputs --phase test`: R1, R2d
(device hit, no flush), `/flush_cache`, R2 (host hit), judged like with like against a plain server
with the same flags (R1 vs its R1, R2 vs its R2 and vs R2d at equal cached lengths). With
`FLEXFLOW_KV_DUMP_DIR` the backend also dumps, per request, the prefix KV the forward pass will read:
every host-loaded prefix must equal, byte for byte, the device prefix of the same tokens that R2d
read before the flush (issue 20's test; docs/correctness.md has the cause and the figures).

Which modes run the real model in CI, and why: page size 1 (the default), page 4 with chunked prefill
(prefixes split across chunks and pages), TP=2 (two shards, rank-agreed loads), concurrency 3 (R2s
of one family race, so prefixes are stitched from device and host pages; judged on the KV the
forward pass reads, since batch composition alone moves bf16 outputs) and `--attention-backend
flexflow_sdpa` (a hit's forward attends only the new tokens' queries). Each case runs the three conversations
and one family (16 prompts; the multi-turn part is where a recomputed page is shared by the next turn,
and `python benchmarks/bf16_drift.py` runs any prompt set outside CI); each costs one flexflow server start (~25 s on 2 cores) and 3 requests per
prompt, plus a plain server for its baseline; the tiny model keeps the wider matrix (small host tier,
deeper tiers, PP, DP, PD) fast.
"""

import json
import re

import pytest

from server_helpers import (CHAT_PROMPTS, REAL_MAX_TOTAL_TOKENS, REAL_MEM_FRACTION, compare_kv_dumps, verify,
                            write_config)

pytestmark = pytest.mark.server

#: the three conversations and one system-prompt family (16 of the 28 prompts) where CI time matters
SUBSET = "chat0,chat1,chat2,sys1"
CASES = {  # server flags, concurrency, prompt groups (None: all 28)
    "page1": (dict(), 1, SUBSET),
    "page4-chunked": (dict(page_size=4, chunked_prefill_size=128), 1, SUBSET),
    "tp2": (dict(tp_size=2), 1, SUBSET),
    "page1-concurrent": (dict(), 3, SUBSET),
    # the prefix-aware CPU attention (backend/prefix_sdpa.py): a host hit's forward computes only the
    # new tokens' queries; judged against a plain server with the same backend
    "page1-flexflow-sdpa": (dict(attention_backend="flexflow_sdpa"), 1, SUBSET),
}


@pytest.mark.timeout(1800)  # the plain baseline (a session fixture) is timed with the first case
@pytest.mark.parametrize("case", list(CASES))
def test_real_model_host_hits_equal_device_hits(case, real_model, real_baselines, start_server, tmp_path):
    server_args, concurrency, groups = CASES[case]
    sel = ["--groups", groups] if groups else []
    baseline = real_baselines(CHAT_PROMPTS, groups, **server_args)
    dump = tmp_path / "kv"
    cfg = write_config(tmp_path, case, host_tier={"capacity_gb": 1.0})
    srv = start_server(real_model, name=f"real-{case}", radix_cache_backend="flexflow", flexflow_config=cfg,
                       max_total_tokens=REAL_MAX_TOTAL_TOKENS, mem_fraction_static=REAL_MEM_FRACTION,
                       env={"FLEXFLOW_KV_DUMP_DIR": str(dump)},
                       **server_args)
    report = tmp_path / "report.json"
    rc, stdout, stderr, last = verify("--phase", "test", "--url", srv.url, "--prompts", CHAT_PROMPTS,
                                      "--baseline", baseline, "--out", str(report),
                                      "--concurrency", str(concurrency), *sel)
    if concurrency == 1:
        assert last == "Total mismatches: 0", stdout + stderr + srv.tail_log()
        assert rc == 0
    else:
        # Batch composition changes bf16 results on CPU (the GEMMs are not batch-invariant): the PLAIN
        # server at concurrency 3 differs from its own sequential run in 2 of these 16 prompts at equal
        # cached lengths (R1, no flexflow involved; measured, docs/correctness.md). So here the
        # outputs are reported, and the promise is checked where it lives: every prefix the forward
        # pass read after a host load - stitched from device and host pages or not - equals,
        # byte for byte, the device KV of the same tokens (the dump comparison below).
        assert rc in (0, 1) and re.fullmatch(r"Total mismatches: \d+", last or ""), stdout + stderr + srv.tail_log()
        print(f"{case}: {last} against the sequential baseline (batch-composition drift, not judged)")
    rep = json.loads(report.read_text())
    r2 = [p["r2"] for p in rep["prompts"].values()]
    host, device = sum(r["host_cached"] for r in r2), sum(r["device_cached"] for r in r2)
    prompt = sum(r["prompt_tokens"] for r in r2)
    if concurrency == 1:
        assert host >= 0.8 * prompt, stdout  # R2 really came from the host tier
    else:
        # racing R2s: once one member of a conversation loaded the shared history from the host
        # tier, its siblings find it on the device (measured: 39 % host, 61 % device, 99.6 % cached)
        assert host + device >= 0.8 * prompt and host >= 0.25 * prompt, (host, device, prompt, stdout)
    kv = compare_kv_dumps(dump)
    assert kv["mismatched"] == 0, kv["details"]
    assert kv["compared"] >= len(r2) // 2, kv  # most host loads had a device twin to compare with
    if concurrency > 1:
        assert kv["stitched"] >= 1, kv  # a prefix made of device and host pages was checked too
