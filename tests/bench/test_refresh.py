"""`flexflow bench refresh`: the marker rewrite, the templates, --dry-run, and the markers in the docs.
No benchmark runs here: the bench results are fakes in the shape each benchmark's JSON has."""
import json
import os
import shutil
import subprocess

import pytest

from flexflow_sglang.tools.bench import refresh
from flexflow_sglang.tools.bench.refresh import (BLOCKS, COMMANDS, DOCS, RefreshError, check_docs, find_blocks,
                                                 render_blocks, rewrite_text)
from flexflow_sglang.tools.bench.serve import summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMIT = "abc1234+dirty"


# ------------------------------------------------------------------ fake bench results
def _rec(case, command, result, commit=COMMIT, load=1.25):
    return {"case": case, "command": command, "argv": command.split()[3:], "quick": False, "commit": commit,
            "load_average": load, "started": "2026-12-03T10:00:00+0000", "wall_s": 1.0, "result": result}


def _sel(median, p90, p99):
    return {"n": 50000, "median_us": median, "p90_us": p90, "p99_us": p99, "mean_us": median}


def _host(store, load, store_gbps, load_gbps):
    return {"checksums": False, "bytes_per_move": 134217728, "store_gbps": store_gbps, "load_gbps": load_gbps,
            "copy_gbps": 13.0, "store_ratio": store, "load_ratio": load, "roundtrip_equal": True}


HOST_META = {"num_tokens": 4096, "layers": 8, "heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 16,
             "repeats": 10, "torch_threads": 2, "pool": "sglang MHATokenToKVPool", "target_ratio": 0.8,
             "device": "cpu", "destination_slots": "scattered"}


def _serve_result():
    def pas(first, p50, hit, outputs):
        return {"requests": 9, "wall_s": 3.0, "ttft_p50_s": p50, "ttft_p90_s": p50 * 3, "ttft_p99_s": p50 * 4,
                "ttft_mean_longest_turn_s": p50, "ttft_mean_first_turn_s": first, "throughput_tok_s": 4000.0,
                "prompt_tokens": 11250, "host_hit_tokens": 0, "device_hit_tokens": 0, "host_hit_ratio": hit,
                "outputs": outputs}
    out = {"a": [1, 2]}
    res = [
        {"backend": "baseline", "ran": True, "round": 0, "cold": pas(0.371, 0.107, 0.0, out),
         "warm": pas(0.345, 0.106, 0.0, out), "miss": {"requests": 6, "latency_median_s": 0.426}},
        {"backend": "flexflow", "ran": True, "round": 0, "cold": pas(0.374, 0.110, 0.0, out),
         "warm": pas(0.0841, 0.085, 0.353, out), "miss": {"requests": 6, "latency_median_s": 0.4296}},
    ]
    summary = summarize(res)
    for r in res:
        for p in ("cold", "warm"):
            r[p].pop("outputs")
    return {"command": "flexflow bench serve", "model": "tiny random Llama, preset 'bench'", "model_path": "/m",
            "workload": {"families": 3, "turns": 3, "prefix_words": 1000, "turn_words": 60, "max_new_tokens": 8,
                         "concurrency": 1}, "results": res, "summary": summary}


def fake_records():
    sel = {"selector_backend": "compiled", "results": {
        "dgx8": {"python": _sel(23.4, 41.7, 52.9), "compiled": _sel(0.81, 0.97, 3.36), "speedup_compiled_vs_python": 28.9},
        "cluster2x8": {"python": _sel(57.2, 79.1, 231.0), "compiled": _sel(1.07, 1.38, 5.61),
                       "speedup_compiled_vs_python": 53.5}}}
    host = dict(HOST_META, with_checksums=_host(0.633, 0.487, 8.31, 6.42),
                without_checksums=_host(0.851, 0.617, 11.24, 8.33))
    contiguous = dict(HOST_META, destination_slots="contiguous", without_checksums=_host(0.862, 0.644, 11.04, 8.13))
    kernels = {"num_tokens": 1024, "layers": 16, "heads": 8, "head_dim": 128, "dtype": "float32",
               "kernels_compiled": True, "torch_threads": 2, "page_sizes": {
                   ps: {"bytes_per_move": 134217728, "page_nbytes": 131072 * int(ps), "compiled": True,
                        "store_ratio": s, "load_ratio": l, "twin_store_ratio": 0.031, "twin_load_ratio": 0.029,
                        "roundtrip_equal": True}
                   for ps, s, l in (("1", 0.553, 0.404), ("16", 0.604, 0.571), ("64", 0.593, 0.802))}}
    return {
        "selector": _rec("selector", "flexflow bench selector --json -n 50000", sel),
        "host-tier": _rec("host-tier", "flexflow bench host-tier --repeats 10 --json", host),
        "host-tier-contiguous": _rec("host-tier-contiguous", "flexflow bench host-tier --repeats 10 --dst contiguous "
                                     "--checksums off --json", contiguous),
        "host-tier-kv128k": _rec("host-tier-kv128k", "flexflow bench host-tier --kernels --repeats 3 --json", kernels),
        "serve": _rec("serve", "flexflow bench serve --rounds 2 --backends baseline,flexflow --out runs/refresh/serve",
                      _serve_result(), load=3.5),
    }


# ------------------------------------------------------------------ marker rewrite
DOC = ("# Title\r\n\nintro text stays\n"
       "| row | <!-- refresh:inline -->old inline 1.00x<!-- /refresh --> |\n"
       "text between\n"
       "<!-- refresh:block -->\nold block line 1\nold block line 2\n\n<!-- /refresh -->\n"
       "tail text stays\r\n")


def test_rewrite_replaces_only_between_markers():
    new = rewrite_text(DOC, "doc.md", {"block": "NEW BODY\n\nsecond paragraph"})
    head, tail = DOC.split("<!-- refresh:block -->")[0], DOC.split("<!-- /refresh -->")[-1]
    assert new.startswith(head + "<!-- refresh:block -->")  # everything before, CRLF included, byte-identical
    assert new.endswith("<!-- /refresh -->" + tail)
    assert "old block" not in new and "\nNEW BODY\n\nsecond paragraph\n\n<!-- /refresh -->" in new
    assert "old inline 1.00x" in new  # a block not rendered is untouched
    new2 = rewrite_text(new, "doc.md", {"inline": "fresh 0.50x"})
    assert "| row | <!-- refresh:inline -->fresh 0.50x<!-- /refresh --> |\n" in new2
    assert new2.replace("fresh 0.50x", "old inline 1.00x") == new


def test_rewrite_is_idempotent_and_keeps_markers_parseable():
    once = rewrite_text(DOC, "doc.md", {"block": "body", "inline": "x"})
    assert rewrite_text(once, "doc.md", {"block": "body", "inline": "x"}) == once
    assert set(find_blocks(once, "doc.md")) == {"inline", "block"}


@pytest.mark.parametrize("text, words", [
    ("a <!-- refresh:one -->b\nc", ["doc.md:1", "refresh:one", "never closed"]),
    ("a\nb <!-- /refresh -->", ["doc.md:2", "closes no open"]),
    ("<!-- refresh:one -->x<!-- refresh:two -->y<!-- /refresh -->", ["refresh:two", "inside", "refresh:one"]),
    ("<!-- refresh:one -->x<!-- /refresh -->\n<!-- refresh:one -->y<!-- /refresh -->", ["doc.md:2", "twice"]),
    ("<!-- refresh -->x<!-- /refresh -->", ["doc.md:1", "no valid name"]),
])
def test_unbalanced_markers_are_refused_naming_file_and_marker(text, words):
    with pytest.raises(RefreshError) as e:
        rewrite_text(text, "doc.md", {})
    for w in words:
        assert w in str(e.value)


def test_missing_and_unknown_markers_are_refused():
    with pytest.raises(RefreshError, match=r"docs/x\.md: marker <!-- refresh:serve --> .* not found"):
        rewrite_text(DOC, "docs/x.md", {"serve": "body"})
    with pytest.raises(RefreshError, match=r"docs/x\.md: marker <!-- refresh:selector --> .* not found"):
        rewrite_text(DOC, "docs/x.md", {}, expected=["selector"])
    with pytest.raises(RefreshError, match=r"unknown marker <!-- refresh:inline -->"):
        rewrite_text(DOC, "docs/x.md", {}, known=["block"])


def test_one_line_block_stays_one_line():
    with pytest.raises(RefreshError, match="refresh:inline.*one line"):
        rewrite_text(DOC, "doc.md", {"inline": "two\nlines"})


# ------------------------------------------------------------------ templates
def test_templates_render_the_numbers_and_the_commit():
    out = render_blocks(fake_records(), COMMANDS)
    readme, results = out["README.md"], out["docs/results.md"]
    assert set(readme) == {b.name for b in BLOCKS if b.doc == "README.md"}
    assert set(results) == {b.name for b in BLOCKS if b.doc == "docs/results.md"}
    for doc in (readme, results):
        for name, body in doc.items():
            assert "abc1234+dirty" in body, name
            assert "<!--" not in body, name  # a rendered body can never open or close a marker
    sel = results["selector"]
    assert "`flexflow bench selector --json -n 50000`" in sel and "load average 1.2" in sel
    assert "| 8-GPU mock (`dgx8`) | compiled | 0.81 us | 0.97 us | 3.36 us | median <= 1.5 us, p99 <= 5 us: met |" in sel
    assert "| 2 nodes x 8 GPUs (`cluster2x8`) | compiled | 1.07 us | 1.38 us | 5.61 us | median <= 5 us: met |" in sel
    assert "| 8-GPU mock | Python twin | 23 us | 42 us | 53 us | |" in sel
    assert "**28.9x (dgx8) and 53.5x (cluster)**" in sel and "target >= 20x: met" in sel
    assert "median **0.81 us**, p99 3.36 us, 28.9x faster" in readme["selector-readme"]
    assert readme["selector-readme"].startswith("selector decisions in microseconds | ")
    assert "target median 1.0 us: met" in readme["selector-readme"]
    ht = results["host-tier"]
    assert "| checksums off | scattered | 11.2 GB/s, **0.85x** | 8.3 GB/s, **0.62x** | >= 0.8 on CPU: store met, " \
           "load missed |" in ht
    assert "| checksums off | contiguous (a flushed allocator) | 11.0 GB/s, 0.86x | 8.1 GB/s, 0.64x | |" in ht
    assert "| checksums on (default) | scattered | 8.3 GB/s, 0.63x | 6.4 GB/s, 0.49x | missed |" in ht
    assert "134 MB per move" in ht and "--dst contiguous --checksums off" in ht
    assert readme["host-tier-readme"].startswith("host-tier moves with checksums on (the default) run at 0.49x a plain "
                                                 "copy for loads and 0.63x for stores on CPU (target 0.8: missed")
    kv = results["host-tier-kv128k"]
    assert "128 KB of KV per token, 128 MiB per move" in kv and "| 64 | 0.59x | 0.80x | 0.03x | 0.03x |" in kv
    assert kv.endswith("Target >= 0.9x: **not met** in this run.")
    sv = results["serve"]
    assert "preset `bench`: 4 layers, hidden 512" in sv and "load average 3.5" in sv and "~1,250 prompt tokens" in sv
    assert "| flexflow | 1 | 110 / 330 / 440 | 374 ms | 85 / 255 / 340 | **84 ms** | 0.35 | 430 ms |" in sv
    assert "| baseline | 1 | 107 / 321 / 428 | 371 ms | 106 / 318 / 424 | 345 ms | 0.00 | 426 ms |" in sv
    tg = results["serve-targets"]
    assert "**0.22x** (first turn, median of rounds; plain server 0.93x): met" in tg
    assert "miss-path latency **1.008x** baseline; cold-pass throughput 1.00x: met" in tg
    assert "| outputs identical to the plain server | true (cold and warm passes, one round) |" in tg
    assert "warm first-turn TTFT **0.22x** cold" in readme["serve-readme-warm"] and "byte-identical" in readme["serve-readme-warm"]
    assert readme["serve-readme-miss"].startswith("a miss costs under 1 % | miss-path latency **1.008x**")


def test_templates_turn_verdicts_with_the_numbers():
    recs = fake_records()
    recs["selector"]["result"]["results"]["dgx8"]["compiled"]["p99_us"] = 7.3
    s = recs["serve"]["result"]["summary"]
    s["flexflow_miss_latency_over_baseline"] = 1.052
    s["outputs_identical_to_baseline"] = False
    recs["host-tier"]["result"]["without_checksums"].update(store_ratio=0.91, load_ratio=0.88, load_gbps=0.0123)
    out = render_blocks(recs, COMMANDS)
    assert "p99 <= 5 us: missed" in out["docs/results.md"]["selector"]
    assert "1.052x** baseline; cold-pass throughput 1.00x: missed" in out["docs/results.md"]["serve-targets"]
    assert "| **false** (" in out["docs/results.md"]["serve-targets"]
    assert out["README.md"]["serve-readme-miss"].startswith("a miss costs 5 % |")
    assert "NOT identical" in out["README.md"]["serve-readme-warm"]
    recs["host-tier"]["result"]["with_checksums"].update(store_ratio=0.95, load_ratio=0.93)
    assert "(target 0.8: met;" in render_blocks(recs, COMMANDS)["README.md"]["host-tier-readme"]
    assert "| 0.012 GB/s, **0.88x** | >= 0.8 on CPU: met |" in out["docs/results.md"]["host-tier"]  # small rates keep digits
    # the kv128k kernels block judges against the target its record carries, not a constant
    recs["host-tier-kv128k"]["result"]["target_ratio"] = 0.4
    kv = render_blocks(recs, COMMANDS)["docs/results.md"]["host-tier-kv128k"]
    assert kv.endswith("Target >= 0.4x: **met** in this run."), kv[-80:]


def test_templates_refuse_results_that_cannot_fill_them():
    recs = fake_records()
    del recs["selector"]["result"]["results"]["dgx8"]["compiled"]
    recs["selector"]["result"]["selector_backend"] = "python"
    with pytest.raises(RefreshError, match="compiled core was not active"):
        render_blocks(recs, ["selector"])
    recs = fake_records()
    recs["serve"]["result"]["results"] = [r for r in recs["serve"]["result"]["results"] if r["backend"] != "flexflow"]
    recs["serve"]["result"]["results"].append({"backend": "flexflow", "ran": False, "error": "boom at start"})
    with pytest.raises(RefreshError, match="flexflow server gave no result \\(boom at start\\)"):
        render_blocks(recs, ["serve"])
    with pytest.raises(RefreshError, match="no result for 'host-tier-kv128k'"):
        render_blocks({k: v for k, v in fake_records().items() if k != "host-tier-kv128k"}, ["host-tier"])


# ------------------------------------------------------------------ the docs and the command
def test_markers_exist_in_readme_and_results_for_the_three_commands():
    check_docs(ROOT)  # every block present once, balanced, none unknown
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        found = find_blocks(text, doc)
        for command in COMMANDS:
            names = [b.name for b in BLOCKS if b.doc == doc and b.command == command]
            assert names and all(n in found for n in names), (doc, command)
    # what the README quotes from each command sits inside a marker
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = find_blocks(readme, "README.md")
    inside = lambda name: readme[blocks[name][0]:blocks[name][1]]
    assert "selector decisions in microseconds" in inside("selector-readme")
    assert "host-tier moves with checksums on" in inside("host-tier-readme")
    assert "warm first-turn TTFT" in inside("serve-readme-warm")


def _fake_root(tmp_path):
    for doc in DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, doc), tmp_path / doc)
    return tmp_path


def _save(records, d):
    d.mkdir(parents=True, exist_ok=True)
    for name, rec in records.items():
        (d / f"{name}.json").write_text(json.dumps(rec))
    return d


def _outside(text, path):
    """The doc with every marker's content blanked: what a refresh must never change."""
    for name, (s, e) in sorted(find_blocks(text, path).items(), key=lambda kv: -kv[1][0]):
        text = text[:s] + text[e:]
    return text


def test_dry_run_writes_nothing_and_prints_the_diff(tmp_path, capsys):
    root = _fake_root(tmp_path / "repo")
    before = {doc: (root / doc).read_bytes() for doc in DOCS}
    src = _save(fake_records(), tmp_path / "json")
    assert refresh.main(["--from", str(src), "--dry-run", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert {doc: (root / doc).read_bytes() for doc in DOCS} == before
    assert "+++ b/README.md" in out and "+++ b/docs/results.md" in out
    assert "+`flexflow bench selector --json -n 50000` (Python API" in out and "abc1234+dirty" in out


def test_refresh_rewrites_only_the_markers_of_the_commands_run(tmp_path, monkeypatch, capsys):
    root = _fake_root(tmp_path / "repo")
    before = {doc: (root / doc).read_text(encoding="utf-8") for doc in DOCS}
    recs = fake_records()
    ran = []

    def fake_run_case(case, out_dir, quick, commit):
        ran.append((case.name, quick))
        return dict(recs[case.name], commit=commit)
    monkeypatch.setattr(refresh, "run_case", fake_run_case)
    monkeypatch.setattr(refresh, "current_commit", lambda root: "fff0001")
    out = tmp_path / "out"
    assert refresh.main(["--skip", "serve", "--quick", "--root", str(root), "--out", str(out)]) == 0
    assert ran == [("selector", True), ("host-tier", True), ("host-tier-contiguous", True), ("host-tier-kv128k", True)]
    assert sorted(p.name for p in out.iterdir()) == ["host-tier-contiguous.json", "host-tier-kv128k.json",
                                                    "host-tier.json", "selector.json"]
    assert json.loads((out / "selector.json").read_text())["commit"] == "fff0001"
    for doc in DOCS:
        after = (root / doc).read_text(encoding="utf-8")
        assert _outside(after, doc) == _outside(before[doc], doc)
        old, new = find_blocks(before[doc], doc), find_blocks(after, doc)
        for b in BLOCKS:
            if b.doc != doc:
                continue
            old_body, new_body = before[doc][slice(*old[b.name])], after[slice(*new[b.name])]
            if b.command == "serve":
                assert new_body == old_body, b.name
            else:
                assert new_body != old_body and "fff0001" in new_body, b.name
    check_docs(str(root))  # still well formed for the next refresh


def test_a_broken_doc_fails_before_any_benchmark_runs(tmp_path, monkeypatch):
    root = _fake_root(tmp_path / "repo")
    text = (root / "README.md").read_text(encoding="utf-8")
    (root / "README.md").write_text(text.replace("<!-- refresh:selector-readme -->", ""), encoding="utf-8")
    monkeypatch.setattr(refresh, "run_case", lambda *a: pytest.fail("a benchmark ran"))
    with pytest.raises(RefreshError, match=r"README\.md.*(closes no open|selector-readme)"):
        refresh.main(["--root", str(root), "--out", str(tmp_path / "out")])


def test_only_and_skip_choose_commands():
    assert refresh._commands(None, "serve") == ["selector", "host-tier"]
    assert refresh._commands("serve,selector", None) == ["selector", "serve"]
    with pytest.raises(RefreshError, match="--only nosuch"):
        refresh._commands("nosuch", None)
    with pytest.raises(RefreshError, match="nothing to refresh"):
        refresh._commands("serve", "serve")


def test_run_case_records_command_and_json(tmp_path, monkeypatch):
    def fake_main(argv):
        print(json.dumps({"argv": argv}))
        return 0
    monkeypatch.setattr(refresh, "_bench_main", lambda command: fake_main)
    case = next(c for c in refresh.CASES if c.name == "selector")
    rec = refresh.run_case(case, str(tmp_path), True, "1234567")
    assert rec["command"] == "flexflow bench selector --json -n 2000"
    assert rec["result"] == {"argv": ["--json", "-n", "2000"]} and rec["commit"] == "1234567"
    monkeypatch.setattr(refresh, "_bench_main", lambda command: lambda argv: 3)
    with pytest.raises(RefreshError, match="returned 3"):
        refresh.run_case(case, str(tmp_path), False, "1234567")


def test_current_commit_marks_a_dirty_tree(tmp_path):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sha = git("rev-parse", "--short", "HEAD").stdout.strip()
    assert refresh.current_commit(str(tmp_path)) == sha
    (tmp_path / "f").write_text("2")
    assert refresh.current_commit(str(tmp_path)) == sha + "+dirty"


def test_cli_dispatches_refresh_with_one_line_errors(capsys):
    from flexflow_sglang.tools.cli.main import main
    assert main(["bench", "refresh", "--only", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexflow: error: --only nosuch") and err.count("\n") == 1
