"""`flexflow bench multiturn` without SGLang: the workload, the client loop against a local streaming
HTTP server (real sockets, SGLang's /generate stream shape) and the summary."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flexflow_sglang.tools.bench.multiturn import (FIRST_PLAIN_TOKEN, make_turns, round_stats, run_conversations,
                                                   summarize)


def test_turns_are_deterministic_per_seed_and_differ_per_client():
    t = make_turns(clients=3, rounds=2, system_len=20, request_len=5, vocab=1000, seed=7)
    assert t == make_turns(3, 2, 20, 5, 1000, seed=7)
    assert t != make_turns(3, 2, 20, 5, 1000, seed=8)
    assert [len(x) for x in t[0]] == [20, 5, 5]
    assert t[0][0] != t[1][0]
    assert all(FIRST_PLAIN_TOKEN <= tok < 1000 for c in t for turn in c for tok in turn)
    with pytest.raises(ValueError, match="vocab size 50"):
        make_turns(1, 1, 4, 4, vocab=50, seed=0)


class _FakeSGLang(BaseHTTPRequestHandler):
    """Streams /generate like SGLang (cumulative output_ids, meta_info in every chunk); the reply's
    tokens are a function of the prompt, so the client's history can be checked."""
    log = []
    lock = threading.Lock()
    fail_after = None

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        with self.lock:
            self.log.append(list(ids))
            failing = self.fail_after is not None and len(self.log) > self.fail_after
        if failing:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        out = [(len(ids) + i) % 97 for i in range(n)]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(1, n + 1):
            meta = {"prompt_tokens": len(ids), "completion_tokens": k, "cached_tokens": len(ids) // 2}
            self.wfile.write(b"data: " + json.dumps({"output_ids": out[:k], "meta_info": meta}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_server():
    _FakeSGLang.log, _FakeSGLang.fail_after = [], None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("parallel", [1, 3])
def test_every_round_sends_the_whole_history_with_the_model_replies(fake_server, parallel):
    turns = make_turns(clients=4, rounds=3, system_len=10, request_len=4, vocab=500, seed=1)
    recs = run_conversations(fake_server, turns, rounds=3, output_len=2, max_parallel=parallel, timeout=30,
                             desc="t")
    assert len(recs) == 12 and sorted((x["client"], x["round"]) for x in recs) == \
        [(c, r) for c in range(4) for r in range(3)]
    by = {(x["client"], x["round"]): x for x in recs}
    for c in range(4):
        hist = list(turns[c][0])
        for r in range(3):
            hist += turns[c][r + 1]
            assert by[c, r]["prompt_tokens"] == len(hist)
            assert by[c, r]["output_ids"] == [(len(hist) + i) % 97 for i in range(2)]
            hist += by[c, r]["output_ids"]
    if parallel == 1:
        # FIFO over clients: every client's round r before any client's round r + 1
        clients = [next(c for c in range(4) if ids[:10] == turns[c][0]) for ids in _FakeSGLang.log]
        assert clients == [0, 1, 2, 3] * 3
    s = round_stats(recs, 1)
    assert s["requests"] == 4 and 0.45 < s["cached_ratio"] <= 0.5


def test_round_stats_counts_host_and_storage_hits_as_tier_tokens():
    """A prefix prefetched from storage is reported by SGLang as "storage", not "host": the tiers'
    share of the prompt is both together (it read 0 in later rounds when only "host" counted)."""
    def rec(details):
        return {"round": 1, "ttft_s": 0.1, "t_end_s": 1.0, "e2e_s": 0.5, "prompt_tokens": 100,
                "meta": {"prompt_tokens": 100, "cached_tokens": sum(details.values()), "cached_tokens_details": details}}
    s = round_stats([rec({"device": 10, "host": 20}), rec({"device": 0, "host": 0, "storage": 60}),
                     {**rec({}), "meta": {"prompt_tokens": 100, "cached_tokens": 0}}])
    assert s["tier_ratio"] == 80 / 300 and s["host_ratio"] == 20 / 300 and s["storage_ratio"] == 60 / 300
    assert s["cached_ratio"] == 90 / 300


def test_a_failed_request_stops_the_run_with_its_error(fake_server):
    _FakeSGLang.fail_after = 5
    turns = make_turns(clients=3, rounds=4, system_len=5, request_len=2, vocab=500, seed=1)
    with pytest.raises(RuntimeError, match="HTTP 500"):
        run_conversations(fake_server, turns, rounds=4, output_len=1, max_parallel=2, timeout=30, desc="t")


def test_summary_ratios_and_output_identity():
    def backend(name, ttft, outs):
        recs = [{"client": 0, "round": 1, "output_ids": outs}]
        return {"backend": name, "ran": True, "records": recs,
                "later_rounds": {"mean_ttft_ms": ttft, "median_ttft_ms": ttft, "p99_ttft_ms": ttft,
                                 "request_throughput": 1000 / ttft, "cached_ratio": 0.5}}
    s = summarize([backend("baseline", 200.0, [1, 2]), backend("flexflow", 100.0, [1, 2])])
    assert s["later_rounds_flexflow_over_plain"]["mean_ttft_ms"] == 0.5
    assert s["later_rounds_flexflow_over_plain"]["request_throughput"] == 2.0
    assert s["outputs_identical"] and s["requests_with_identical_output"] == 1
    assert not summarize([backend("baseline", 200.0, [1, 2]), backend("flexflow", 100.0, [1, 3])])["outputs_identical"]
    assert summarize([backend("baseline", 200.0, [1])]) == {}


def test_repeats_aggregate_min_median_max_and_count_the_repeats_that_meet_both_targets():
    from flexflow_sglang.tools.bench.multiturn import aggregate

    def summary(ttft, thr, same=True):
        return {"later_rounds_flexflow_over_plain": {"mean_ttft_ms": ttft, "median_ttft_ms": ttft,
                                                      "p99_ttft_ms": ttft, "request_throughput": thr},
                "outputs_identical": same}
    a = aggregate([summary(0.48, 1.51), summary(0.52, 1.43), summary(0.44, 1.62)])
    assert a["mean_ttft_ms"] == {"min": 0.44, "median": 0.48, "max": 0.52}
    assert a["request_throughput"]["median"] == 1.51
    assert a["both_targets_met"] == 2 and a["paired"] == 3 and a["outputs_identical_every_repeat"]
    # a repeat whose flexflow server did not run is not met, and outputs are then not "identical every repeat"
    b = aggregate([summary(0.40, 2.0), {}])
    assert b["both_targets_met"] == 1 and b["repeats"] == 2 and not b["outputs_identical_every_repeat"]
    assert not aggregate([summary(0.4, 2.0, same=False)])["outputs_identical_every_repeat"]


def test_dirty_pages_are_flushed_before_a_server_and_the_time_is_returned(monkeypatch):
    """A storage tier's server leaves ~1.4 GB of dirty page cache: the next server must not pay for
    writing it back, so the benches sync before every server start and record how long it took."""
    import os

    from flexflow_sglang.tools.bench import flush_dirty_pages
    calls = []
    monkeypatch.setattr(os, "sync", lambda: calls.append(1))
    assert flush_dirty_pages() >= 0 and calls == [1]
