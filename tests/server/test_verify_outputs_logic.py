"""Unit tests (no server): verify_outputs' comparison logic, inputs, CLI errors; the prompt set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexflow_sglang.tools import verify_outputs as vo

from server_helpers import PROMPTS_FILE, REPO_ROOT, repo_env

BASE = {"output_ids": [5, 6, 7, 8], "text": " cache tree", "prompt_tokens": 20, "prompt_sha256": "abc"}


def res(ids=(5, 6, 7, 8), text=" cache tree", prompt_tokens=20, device=0, host=0):
    return {"output_ids": list(ids), "text": text, "prompt_tokens": prompt_tokens,
            "cached_tokens": device + host, "device_cached": device, "host_cached": host}


def test_compare_identical():
    assert vo.compare_outputs(BASE, res()) == []


def test_compare_ids_and_text_differences():
    p = vo.compare_outputs(BASE, res(ids=(5, 6, 9, 8), text=" cache trees"))
    assert len(p) == 2
    assert "output_ids differ at index 2 (expected 7, got 9" in p[0]
    assert "text differs at char 11" in p[1]
    short = vo.compare_outputs(BASE, res(ids=(5, 6, 7)))
    assert "index 3 (expected 8, got <end>; lengths 4/3)" in short[0]


def test_compare_text_only_difference_is_caught():
    assert len(vo.compare_outputs(BASE, res(text=" cache tre\u00e9"))) == 1


def test_normalize_response_handles_missing_details():
    r = vo.normalize_response({"text": "x", "output_ids": [1], "meta_info": {
        "prompt_tokens": 9, "cached_tokens": 0, "cached_tokens_details": None}})
    assert (r["host_cached"], r["device_cached"], r["prompt_tokens"]) == (0, 0, 9)
    r = vo.normalize_response({"text": "x", "output_ids": [1], "meta_info": {
        "prompt_tokens": 9, "cached_tokens": 8, "cached_tokens_details": {"device": 3, "host": 5}}})
    assert (r["host_cached"], r["device_cached"], r["cached_tokens"]) == (5, 3, 8)


def test_host_hit_check():
    assert vo.host_hit_check(res(host=19)) == (None, None)
    problem, skipped = vo.host_hit_check(res(device=19))
    assert "no host hit" in problem and skipped is None
    problem, skipped = vo.host_hit_check(res(prompt_tokens=4), min_tokens=8)
    assert problem is None and "4 tokens < min 8" in skipped


def test_evaluate_prompt_counts():
    ok = vo.evaluate_prompt("p", BASE, res(), res(host=19), text_hash="abc")
    assert ok.ok and ok.mismatches == 0 and ok.line().startswith("[ok  ] p")
    both_bad = vo.evaluate_prompt("p", BASE, res(ids=(1,)), res(ids=(1,)), text_hash="abc")
    assert both_bad.mismatches == 3  # R1, R2, missing host hit
    no_host_req = vo.evaluate_prompt("p", BASE, res(), res(), require_host_hit=False)
    assert no_host_req.ok
    failed = vo.evaluate_prompt("p", BASE, "HTTP 400: busy", res(host=3))
    assert failed.mismatches == 1 and "R1 request failed: HTTP 400" in failed.problems[0]
    missing = vo.evaluate_prompt("p", None, res(), res(host=3))
    assert missing.mismatches == 1 and "not in baseline" in missing.problems[0]
    changed = vo.evaluate_prompt("p", BASE, res(), res(host=3), text_hash="other")
    assert changed.mismatches == 1 and "changed" in changed.problems[0]
    short = vo.evaluate_prompt("p", dict(BASE, prompt_tokens=4), res(prompt_tokens=4),
                               res(prompt_tokens=4), min_host_tokens=8)
    assert short.ok and "skipped" in short.line()
    assert vo.total_mismatches([ok, both_bad, failed, short]) == 4


BASE2 = dict(BASE, r2={"output_ids": [5, 6, 7, 8], "text": " cache tree", "cached_tokens": 19, "equals_r1": True})


def test_evaluate_prompt_like_with_like():
    """Version-2 baselines: R2 (host hit) is judged against hit runs at the same cached length; a
    difference from the fresh run is drift, reported and counted only when asked for."""
    host, dev = res(host=19), res(device=19)
    ok = vo.evaluate_prompt("p", BASE2, res(), host, r2d=dev, text_hash="abc")
    assert ok.ok and not ok.drift_vs_fresh and "R2d cached=19 (device 19" in ok.line()
    # a wrong host load: R2 differs from the same server's device hit at the same length
    bad = vo.evaluate_prompt("p", BASE2, res(), res(ids=(5, 6, 7, 9), host=19), r2d=dev)
    assert bad.mismatches == 2  # vs R2d and vs the baseline's R2
    assert "R2 (host hit) vs R2d (device hit, same length): output_ids differ at index 3" in bad.problems[0]
    # SGLang's own hit-vs-recompute drift: both hits agree, the fresh run differs
    drift_base = dict(BASE2, output_ids=[5, 6, 1, 1], r2=dict(BASE2["r2"], equals_r1=False))
    drift = vo.evaluate_prompt("p", drift_base, res(ids=(5, 6, 1, 1)), host, r2d=dev)
    assert drift.ok and drift.drift_vs_fresh and "the reference server drifts too" in drift.line()
    strict = vo.evaluate_prompt("p", drift_base, res(ids=(5, 6, 1, 1)), host, r2d=dev, strict_fresh=True)
    assert strict.mismatches == 1 and "R2 vs baseline R1 (fresh)" in strict.problems[0]
    # different cached lengths are not compared, and the verdict says so
    other_len = vo.evaluate_prompt("p", BASE2, res(), res(ids=(9,), host=19), r2d=res(ids=(9,), device=12))
    assert other_len.mismatches == 1  # only vs the baseline's R2 (same length 19)
    assert "R2d cached 12 != R2 cached 19: hit vs hit not compared" in other_len.line()
    failed = vo.evaluate_prompt("p", BASE2, res(), host, r2d="HTTP 500: boom")
    assert failed.mismatches == 1 and "R2d request failed" in failed.problems[0]


def test_load_prompts_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "text": "a"}\n\n{"id": "1", "text": "b"}\n')
    with pytest.raises(vo.UsageError, match="duplicate prompt id '1'"):
        vo.load_prompts(str(f))
    f.write_text('{"id": "a"}\n')
    with pytest.raises(vo.UsageError, match='"id" and "text"'):
        vo.load_prompts(str(f))
    with pytest.raises(vo.UsageError, match="cannot read prompts file"):
        vo.load_prompts(str(tmp_path / "missing.jsonl"))


def test_prompts_may_be_token_ids(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "input_ids": [5, 0, 7]}\n{"id": "b", "text": "hello"}\n')
    a, b = vo.load_prompts(str(f))
    assert vo.prompt_input(a) == [5, 0, 7] and vo.prompt_input(b) == "hello"
    # the ids are what the hash covers: another id list is another prompt
    assert vo.prompt_hash([5, 0, 7]) != vo.prompt_hash([5, 0, 8])
    assert vo.prompt_hash("hello") == vo.prompt_hash(vo.prompt_input(b))
    for bad in ('[]', '[1, -2]', '"1 2"', '[1, 2.5]', '[true]'):
        f.write_text('{"id": "x", "input_ids": %s}\n' % bad)
        with pytest.raises(vo.UsageError, match=r"p.jsonl:1: input_ids of prompt 'x' must be"):
            vo.load_prompts(str(f))


def test_request_sends_token_ids_as_input_ids():
    """request_one against a real HTTP listener: token ids go out as `input_ids`, text as `text`."""
    import http.server
    import threading

    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            reply = json.dumps({"output_ids": [1], "text": "x", "meta_info": {"prompt_tokens": 3}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        got = vo.request_one(url, [4, 5, 6], 2)
        assert got["output_ids"] == [1] and got["prompt_tokens"] == 3
        vo.request_one(url, "four five", 2)
    finally:
        srv.shutdown()
    assert bodies[0]["input_ids"] == [4, 5, 6] and "text" not in bodies[0]
    assert bodies[1]["text"] == "four five" and "input_ids" not in bodies[1]
    assert bodies[0]["sampling_params"]["temperature"] == 0


def test_bundled_prompt_set_is_generated_and_well_formed(tmp_path):
    prompts = vo.load_prompts(str(PROMPTS_FILE))
    assert 12 <= len(prompts) <= 16
    ids = [p["id"] for p in prompts]
    assert {"short-0", "long-1", "famA-0", "famB-2"} <= set(ids)
    fam_a = [p["text"] for p in prompts if p["id"].startswith("famA-")]
    common = len(__import__("os").path.commonprefix(fam_a).split())
    assert len(fam_a) == 3 and common >= 1000  # long shared prefix
    assert max(len(p["text"].split()) for p in prompts) < 3000  # ~1.08 tokens per word
    out = tmp_path / "regen.jsonl"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "flexflow_sglang/tools/data/make_prompts.py"), str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == PROMPTS_FILE.read_bytes()  # committed file == deterministic output


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flexflow_sglang.tools.verify_outputs", *args],
                          env=repo_env(), capture_output=True, text=True, timeout=120)


def test_cli_unreachable_server_is_a_clear_error(tmp_path):
    from flexflow_sglang.tools.server_utils import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}"
    p = _cli("--phase", "baseline", "--url", url, "--prompts", str(PROMPTS_FILE), "--out", str(tmp_path / "b.json"))
    assert p.returncode == 2
    assert "cannot reach the SGLang server at " + url in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_cli_usage_errors(tmp_path):
    p = _cli("--phase", "test", "--url", "http://127.0.0.1:1", "--prompts", str(PROMPTS_FILE))
    assert p.returncode == 2 and "needs --baseline" in p.stderr
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"something": 1}))
    p = _cli("--phase", "test", "--url", "http://127.0.0.1:1", "--prompts", str(PROMPTS_FILE), "--baseline", str(bad))
    assert p.returncode == 2 and "is not a verify_outputs baseline" in p.stderr
    assert "Traceback" not in p.stderr
