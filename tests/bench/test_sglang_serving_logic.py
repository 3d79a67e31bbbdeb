"""`flexflow bench sglang-serving` without a server: its log parsing, command line and ratios."""

import pytest

from flexflow_sglang.tools.bench import kv_bytes_per_token_of
from flexflow_sglang.tools.bench import sglang_serving as ss


def test_prefill_tokens_counts_only_lines_after_the_offset(tmp_path):
    log = tmp_path / "server.log"
    early = "[t] Prefill batch, #new-seq: 1, #new-token: 500, #cached-token: 0, token usage: 0.1\n"
    log.write_text(early)
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("[t] Prefill batch, #new-seq: 2, #new-token: 100, #cached-token: 300, token usage: 0.2\n")
        f.write("[t] Decode batch, #running-req: 3, #token: 444\n")
        f.write("[t] Prefill batch, #new-seq: 1, #new-token: 50, #cached-token: 550, token usage: 0.2\n")
    got = ss.prefill_tokens(str(log), offset)
    assert got["new_tokens"] == 150 and got["cached_tokens"] == 850
    assert got["cached_ratio"] == pytest.approx(850 / 1000)
    assert ss.prefill_tokens(str(log), 0)["new_tokens"] == 650


def test_command_is_sglangs_generated_shared_prefix_with_the_workload():
    args = ss.main.__globals__["argparse"].Namespace(
        gsp_num_groups=3, gsp_prompts_per_group=5, gsp_system_prompt_len=700, gsp_question_len=40,
        gsp_output_len=6, max_concurrency=2, seed=9)
    cmd = ss.bench_serving_cmd("http://127.0.0.1:1", "/m", "/o.jsonl", args)
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[1:3] == ["-m", "sglang.bench_serving"]
    assert flags["--dataset-name"] == "generated-shared-prefix" and flags["--num-prompts"] == "15"
    assert flags["--gsp-system-prompt-len"] == "700" and flags["--seed"] == "9" and flags["--output-file"] == "/o.jsonl"


def test_summary_ratios_use_the_last_pass_of_each_round():
    def run(backend, rnd, ttft, thr, ratio):
        first = {"median_ttft_ms": 999.0, "output_throughput": 1.0, "cached_ratio": 0.0}
        last = {"median_ttft_ms": ttft, "mean_ttft_ms": ttft, "p99_ttft_ms": ttft, "output_throughput": thr,
                "request_throughput": thr, "median_itl_ms": 10.0, "cached_ratio": ratio}
        return {"backend": backend, "round": rnd, "ran": True, "passes": [first, last]}
    res = [run("baseline", 0, 400.0, 10.0, 0.2), run("flexflow", 0, 100.0, 20.0, 0.9),
           run("baseline", 1, 500.0, 10.0, 0.2), run("flexflow", 1, 250.0, 10.0, 0.8),
           {"backend": "flexflow", "round": 2, "ran": False, "error": "x"}]
    s = ss.summarize(res)
    assert s["rounds"] == 2
    assert s["last_pass_flexflow_over_plain"]["median_ttft_ms"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["last_pass_flexflow_over_plain"]["output_throughput"] == pytest.approx(1.5)
    assert s["last_pass_cached_ratio"] == {"plain": 0.2, "flexflow": pytest.approx(0.85)}
    assert ss.summarize([res[0]]) == {}


def test_kv_bytes_per_token_follows_the_dtype_sglang_serves(tmp_path):
    import json
    cfg = {"num_attention_heads": 8, "hidden_size": 256, "num_key_value_heads": 8, "head_dim": 128,
           "num_hidden_layers": 16, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # --dtype auto serves a float32 checkpoint in float16 (SGLang's model_config), halving its KV
    assert kv_bytes_per_token_of(str(tmp_path)) == 64 * 1024
    assert kv_bytes_per_token_of(str(tmp_path), "float32") == 128 * 1024
    cfg.update(dtype="bfloat16", num_key_value_heads=3, head_dim=64, num_hidden_layers=30)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_bytes_per_token_of(str(tmp_path)) == 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: 22.5 KB
    assert kv_bytes_per_token_of(str(tmp_path / "missing")) is None


def test_generated_config_is_valid_and_starts_with_an_empty_storage_tier(tmp_path):
    from flexflow_sglang.config import load_config
    stale = tmp_path / "storage-kv" / "old"
    stale.mkdir(parents=True)
    cfg = load_config(ss.write_config(str(tmp_path), 2048, storage=True))
    assert cfg.host_tier.capacity_tokens == 2048 and cfg.storage_tier.enabled
    assert cfg.storage_tier.path == str(tmp_path / "storage-kv") and not stale.exists()
    assert not load_config(ss.write_config(str(tmp_path), 512, storage=False)).storage_tier.enabled


@pytest.mark.parametrize("layout,backend", [("slabs", "os"), ("files", "posix"), ("slabs", "auto")])
def test_generated_config_names_the_storage_layout_and_backend(tmp_path, layout, backend):
    from flexflow_sglang.config import load_config
    st = load_config(ss.write_config(str(tmp_path), 2048, True, layout, backend)).storage_tier
    assert (st.layout, st.backend) == (layout, backend)


def test_storage_backend_flag_rejects_a_backend_the_tier_does_not_know(capsys):
    import argparse

    from flexflow_sglang.tools.bench import add_storage_tier_args
    ap = argparse.ArgumentParser()
    add_storage_tier_args(ap)
    assert ap.parse_args(["--storage-backend", "os"]).storage_backend == "os"
    assert ap.parse_args([]).storage_backend == "auto" and ap.parse_args([]).storage_layout == "slabs"
    with pytest.raises(SystemExit):
        ap.parse_args(["--storage-backend", "gds"])  # needs a GPU: not offered by the CPU benches
    assert "invalid choice" in capsys.readouterr().err


def test_shared_variant_keeps_the_users_config_and_shares_the_host_tier(tmp_path):
    from flexflow_sglang.config import load_config
    base = ss.write_config(str(tmp_path), 4096, storage=False)
    shared = load_config(ss.shared_variant(base, str(tmp_path)))
    per_rank = load_config(base)
    assert shared.host_tier.shared and not per_rank.host_tier.shared
    assert shared.host_tier.capacity_tokens == per_rank.host_tier.capacity_tokens == 4096
    assert shared.host_tier.write_policy == per_rank.host_tier.write_policy


def test_summary_compares_the_shared_tier_with_per_rank_tiers():
    def run(backend, rnd, hit, ttft):
        last = {"tier_hit_ratio": hit, "cached_ratio": hit + 0.05, "mean_ttft_ms": ttft, "median_ttft_ms": ttft,
                "output_throughput": 5.0}
        return {"backend": backend, "round": rnd, "ran": True, "passes": [{"tier_hit_ratio": 0.0}, last]}
    res = [run("flexflow", 0, 0.2, 300.0), run("flexflow-shared", 0, 0.5, 150.0),
           run("flexflow", 1, 0.25, 200.0), run("flexflow-shared", 1, 0.45, 200.0)]
    s = ss.summarize(res)
    assert "last_pass_flexflow_over_plain" not in s  # no plain server ran
    cmp_ = s["last_pass_shared_over_per_rank"]
    assert cmp_["rounds"] == 2
    assert cmp_["tier_hit_ratio"] == pytest.approx((0.5 / 0.2 + 0.45 / 0.25) / 2)
    assert cmp_["mean_ttft_ms"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["last_pass_tier_hit_ratio"] == {"per_rank": pytest.approx(0.225), "shared": pytest.approx(0.475)}
    # the first pass (cold tiers) is compared on its own: per-rank 0.0 here gives no ratio
    assert s["first_pass_shared_over_per_rank"]["tier_hit_ratio"] is None
    assert s["first_pass_tier_hit_ratio"] == {"per_rank": 0.0, "shared": 0.0}


def test_outputs_are_compared_per_pass_in_request_order():
    def run(backend, rnd, texts_by_pass):
        passes = [{"pass": i + 1, "median_ttft_ms": 1.0, "mean_ttft_ms": 1.0, "p99_ttft_ms": 1.0,
                   "output_throughput": 1.0, "request_throughput": 1.0, "median_itl_ms": 1.0, "cached_ratio": 0.5,
                   "generated_texts": t} for i, t in enumerate(texts_by_pass)]
        return {"backend": backend, "round": rnd, "ran": True, "passes": passes}
    res = [run("baseline", 0, [["a", "b", "c"], ["a", "b", "c"]]), run("flexflow", 0, [["a", "b", "c"], ["a", "x", "c"]])]
    got = ss.summarize(res)["outputs_vs_plain"]
    assert got == {"round": 0, "passes": [{"pass": 1, "requests": 3, "identical": 3},
                                          {"pass": 2, "requests": 3, "identical": 2}]}
    res[1]["passes"][1]["generated_texts"] = None  # an older bench_serving without details: not compared
    assert ss.compare_outputs(res, "flexflow", "baseline") is None


# ----------------------------------------------------------------------------- --verify
def _workload(**kw):
    import argparse
    base = dict(seed=3, gsp_num_groups=3, gsp_prompts_per_group=2, gsp_system_prompt_len=40, gsp_question_len=6,
                gsp_output_len=4, tokenize_prompt=True)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from flexflow_sglang.tools.cpu_support.tiny_model import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-model")))


def test_verify_prompts_are_sglangs_generated_shared_prefix_set(tiny_model_dir, tmp_path):
    """The prompts come from SGLang's own sampler: groups x prompts, each a group's shared system prompt
    then its question, as token ids for a preset; the same seed gives the same file (bench_serving
    draws its dataset from that seed too), another seed another one."""
    from flexflow_sglang.tools import verify_outputs as vo
    from flexflow_sglang.tools.bench import serving_verify as sv
    a, b, c = (str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert sv.write_prompts(tiny_model_dir, _workload(), a) == 6
    sv.write_prompts(tiny_model_dir, _workload(), b)
    sv.write_prompts(tiny_model_dir, _workload(seed=4), c)
    assert open(a).read() == open(b).read() and open(a).read() != open(c).read()
    prompts = vo.load_prompts(a)
    ids = [vo.prompt_input(p) for p in prompts]
    assert all(isinstance(x, list) and len(x) == 46 for x in ids)
    assert sv.prompt_lens(a) == [46] * 6
    assert len({tuple(x[:40]) for x in ids}) == 3  # one shared system prompt per group
    assert sv.same_prompts_as_bench(a, [46] * 6) is True
    assert sv.same_prompts_as_bench(a, [46] * 5 + [45]) is False
    assert sv.same_prompts_as_bench(a, None) is None


def test_verify_against_an_unreachable_server_is_reported_not_passed(tmp_path):
    from flexflow_sglang.tools.bench import serving_verify as sv
    from flexflow_sglang.tools.server_utils import find_free_port
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
    got = sv.run_verify("baseline", f"http://127.0.0.1:{find_free_port()}", str(prompts), str(tmp_path / "b.json"),
                        str(tmp_path), 2, 60)
    assert got["rc"] == 2 and got["mismatches"] is None
    assert "cannot reach the SGLang server" in open(got["log"]).read()


def test_verify_summary_takes_each_servers_verdict():
    res = [{"backend": "baseline", "ran": True, "passes": [{"input_lens": [3]}],
            "verify": {"phase": "baseline", "rc": 0, "mismatches": 0, "log": "x"}},
           {"backend": "flexflow", "ran": True, "passes": [{"input_lens": [3]}],
            "verify": {"phase": "test", "rc": 1, "mismatches": 2, "log": "y", "r2_differs_from_plain": [2, 9]}},
           {"backend": "flexflow-shared", "ran": False, "error": "e"}]
    import json as _json
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(_json.dumps({"id": "a", "input_ids": [1, 2, 3], "prompt_len": 3}) + "\n")
    got = ss.verify_summary(res, f.name)
    assert got == {"baseline": {"phase": "baseline", "rc": 0, "mismatches": 0, "r2_differs_from_plain": None,
                                "same_prompts_as_bench_serving": True},
                   "flexflow": {"phase": "test", "rc": 1, "mismatches": 2, "r2_differs_from_plain": [2, 9],
                                "same_prompts_as_bench_serving": True}}


def test_verify_needs_the_plain_server_first(capsys):
    with pytest.raises(SystemExit):
        ss.main(["--model", "kv128k", "--backends", "flexflow,baseline", "--verify", "--out", "/nonexistent/x"])
    assert "--verify needs 'baseline' first" in capsys.readouterr().err


def test_verify_output_parsing_reads_the_verdict_lines():
    from flexflow_sglang.tools.bench.serving_verify import parse_verify_output
    text = ("[ok  ] gsp-0001 tokens=9 R1 cached=0\n"
            "Hit vs fresh drift (reported, counted): R2 != baseline R1 in 3 of 32 prompts; the reference ... in 0\n"
            "Total mismatches: 4\n")
    assert parse_verify_output(text) == {"mismatches": 4, "r2_differs_from_plain": [3, 32]}
    assert parse_verify_output("Traceback ...") == {"mismatches": None, "r2_differs_from_plain": None}
