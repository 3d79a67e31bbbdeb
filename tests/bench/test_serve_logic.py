"""Pure logic of `flexflow bench serve` (the servers themselves are exercised in tests/server)."""
from flexflow_sglang.tools.bench.serve import make_workload, summarize


def test_workload_is_multi_turn_with_shared_prefix():
    reqs = make_workload(families=2, prefix_words=50, turns=3, turn_words=5, seed=1)
    assert len(reqs) == 6
    fam0 = [r for r in reqs if r["family"] == 0]
    assert fam0[1]["text"].startswith(fam0[0]["text"]) and fam0[2]["text"].startswith(fam0[1]["text"])
    assert reqs == make_workload(2, 50, 3, 5, seed=1)  # deterministic
    assert not reqs[3]["text"].startswith(reqs[0]["text"][:40])  # families differ


def _res(name, rnd, cold_first, warm_first, miss, outputs):
    pas = lambda t: {"ttft_p50_s": t, "ttft_mean_longest_turn_s": t, "ttft_mean_first_turn_s": t,
                     "host_hit_ratio": 0.5, "throughput_tok_s": 1 / t, "outputs": outputs}
    return {"backend": name, "ran": True, "round": rnd, "cold": pas(cold_first), "warm": pas(warm_first),
            "miss": {"latency_median_s": miss}}


def test_summary_ratios_and_identity():
    res = [_res("baseline", 0, 1.0, 1.0, 1.0, {"a": [1]}), _res("flexflow", 0, 1.0, 0.2, 1.02, {"a": [1]}),
           _res("baseline", 1, 2.0, 2.0, 2.0, {"a": [1]}), _res("flexflow", 1, 2.0, 0.6, 2.1, {"a": [1]}),
           {"backend": "hicache", "ran": False, "error": "x"}]
    s = summarize(res)
    assert abs(s["flexflow"]["warm_over_cold_ttft_first_turn"] - 0.25) < 1e-9  # median of 0.2 and 0.3
    assert abs(s["flexflow_miss_latency_over_baseline"] - 1.035) < 1e-9
    assert s["outputs_identical_to_baseline"] and s["rounds"] == 2
    res[3]["warm"]["outputs"] = {"a": [2]}
    assert not summarize(res)["outputs_identical_to_baseline"]
