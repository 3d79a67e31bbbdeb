"""`flexflow bench refresh`: re-measure the quick figures of README.md and docs/results.md and rewrite
them in place, with the command line and the commit they were measured at.

Runs, one after another (tqdm shows which), each benchmark through its Python entry point with JSON
output:

* `selector`: `flexflow bench selector --json -n 50000` (compiled core vs Python twin, dgx8 and
  cluster2x8 with random loads);
* `host-tier`: `flexflow bench host-tier --repeats 10 --json` (the connector, issue 4), the same with
  `--dst contiguous --checksums off`, and `flexflow bench host-tier --kernels --repeats 3 --json`
  (the copy kernels at the kv128k volume, issue 15);
* `serve`: `flexflow bench serve --rounds 2 --backends baseline,flexflow` (real SGLang servers, cold vs
  warm TTFT and the miss path: the slow one, minutes; `--skip serve` leaves it out).

Each run's raw JSON (with its command, commit and load average) goes to `--out/<case>.json`. Then the
text between the markers

    <!-- refresh:NAME -->...<!-- /refresh -->

in README.md and docs/results.md is regenerated from a template with the new numbers, the command
line and the commit (`git rev-parse --short HEAD`, `+dirty` when the tree has uncommitted changes).
Nothing outside the markers changes; a missing, unknown, duplicated or unbalanced marker is an error
naming the file and the marker, checked before any benchmark runs. `--dry-run` prints the diff and
leaves the docs untouched. `--from DIR` re-renders from the JSON of an earlier refresh, running nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import io
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from flexflow_sglang.errors import FlexFlowError

COMMANDS = ("selector", "host-tier", "serve")
DOCS = ("README.md", "docs/results.md")


class RefreshError(FlexFlowError):
    """A marker is missing or unbalanced, a benchmark failed, or its result cannot fill a template."""


# ------------------------------------------------------------------ markers
_TOKEN = re.compile(r"<!--\s*(/?)\s*refresh\b([^>]*?)\s*-->")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def open_marker(name: str) -> str:
    return f"<!-- refresh:{name} -->"


CLOSE_MARKER = "<!-- /refresh -->"


def find_blocks(text: str, path: str) -> Dict[str, Tuple[int, int]]:
    """name -> (start, end) of the text between `<!-- refresh:NAME -->` and the next `<!-- /refresh -->`.
    Raises RefreshError naming `path`, the marker and its line on a nested, unclosed, stray, unnamed or
    duplicated marker."""
    blocks: Dict[str, Tuple[int, int]] = {}
    lines: Dict[str, int] = {}
    cur: Optional[Tuple[str, int, int]] = None  # name, content start, line
    for m in _TOKEN.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        closing, rest = m.group(1) == "/", m.group(2).strip()
        if closing:
            if rest:
                raise RefreshError(f"{path}:{line}: closing marker {m.group(0)!r} takes no name: write {CLOSE_MARKER}")
            if cur is None:
                raise RefreshError(f"{path}:{line}: {CLOSE_MARKER} closes no open <!-- refresh:NAME --> marker")
            blocks[cur[0]] = (cur[1], m.start())
            cur = None
            continue
        name = rest[1:].strip() if rest.startswith(":") else ""
        if not rest.startswith(":") or not _NAME.fullmatch(name):
            raise RefreshError(f"{path}:{line}: marker {m.group(0)!r} has no valid name: write <!-- refresh:NAME -->")
        if cur is not None:
            raise RefreshError(f"{path}:{line}: marker {open_marker(name)} opens inside {open_marker(cur[0])} "
                               f"(line {cur[2]}), which is not closed by {CLOSE_MARKER}")
        if name in lines:
            raise RefreshError(f"{path}:{line}: marker {open_marker(name)} appears twice (first at line {lines[name]})")
        lines[name] = line
        cur = (name, m.end(), line)
    if cur is not None:
        raise RefreshError(f"{path}:{cur[2]}: marker {open_marker(cur[0])} is never closed by {CLOSE_MARKER}")
    return blocks


def _fit(old: str, body: str, path: str, name: str) -> str:
    """`body` in place of `old`, keeping old's leading and trailing whitespace (a block on its own lines
    stays on its own lines, an inline one inline); a one-line block must stay one line (table rows)."""
    if not old.strip():
        return old + body.strip()
    lead = old[:len(old) - len(old.lstrip())]
    trail = old[len(old.rstrip()):]
    body = body.strip()
    if "\n" not in old and "\n" in body:
        raise RefreshError(f"{path}: marker {open_marker(name)} holds one line (e.g. a table row) but its "
                           "template rendered several")
    return lead + body + trail


def rewrite_text(text: str, path: str, rendered: Dict[str, str], expected: Iterable[str] = (),
                 known: Optional[Iterable[str]] = None) -> str:
    """`text` with the content of each marker named in `rendered` replaced by its rendered body; every
    byte outside those markers is kept. `expected`: markers that must be present; `known`: when given,
    a marker not named in it is an error (a typo would otherwise never be refreshed)."""
    blocks = find_blocks(text, path)
    if known is not None:
        known = set(known)
        for name in blocks:
            if name not in known:
                raise RefreshError(f"{path}: unknown marker {open_marker(name)}; known: {', '.join(sorted(known))}")
    for name in list(expected) + list(rendered):
        if name not in blocks:
            raise RefreshError(f"{path}: marker {open_marker(name)} ... {CLOSE_MARKER} not found")
    out = text
    for name, (s, e) in sorted(blocks.items(), key=lambda kv: -kv[1][0]):
        if name in rendered:
            out = out[:s] + _fit(out[s:e], rendered[name], path, name) + out[e:]
    return out


# ------------------------------------------------------------------ formatting
def _us(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def _x(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}x"


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _ms(s: float) -> str:
    return f"{s * 1000:.0f}"


def _measured(rec: dict, note: str = "", load: bool = True) -> str:
    out = f"measured at {rec['commit']}"
    if load and rec.get("load_average") is not None:
        out += f", load average {rec['load_average']:.1f}"
    return out + (f"; {note}" if note else "")


def _cmd(rec: dict) -> str:
    return f"`{rec['command']}`"


def _need(records: dict, case: str) -> dict:
    if case not in records:
        raise RefreshError(f"no result for {case!r}: run its benchmark (or give --from a directory that has {case}.json)")
    return records[case]


# ------------------------------------------------------------------ templates: selector
def _selector(records: dict) -> Tuple[dict, dict]:
    rec = _need(records, "selector")
    res = rec["result"]
    for topo in ("dgx8", "cluster2x8"):
        r = res.get("results", {}).get(topo)
        if r is None:
            raise RefreshError(f"selector: no {topo} result in the run")
        if "compiled" not in r:
            raise RefreshError(f"selector: the compiled core was not active (selector core: "
                               f"{res.get('selector_backend')}); build it before refreshing the compiled figures")
    return rec, res["results"]


def render_selector(records: dict, note: str = "") -> str:
    rec, r = _selector(records)
    d, c = r["dgx8"], r["cluster2x8"]
    dc, cc = d["compiled"], c["compiled"]
    rows = [
        f"| 8-GPU mock (`dgx8`) | compiled | {_us(dc['median_us'])} us | {_us(dc['p90_us'])} us | {_us(dc['p99_us'])} us "
        f"| median <= 1.5 us, p99 <= 5 us: {_met(dc['median_us'] <= 1.5 and dc['p99_us'] <= 5)} |",
        f"| 2 nodes x 8 GPUs (`cluster2x8`) | compiled | {_us(cc['median_us'])} us | {_us(cc['p90_us'])} us "
        f"| {_us(cc['p99_us'])} us | median <= 5 us: {_met(cc['median_us'] <= 5)} |",
        f"| 8-GPU mock | Python twin | {_us(d['python']['median_us'])} us | {_us(d['python']['p90_us'])} us "
        f"| {_us(d['python']['p99_us'])} us | |",
        f"| 2 x 8 cluster | Python twin | {_us(c['python']['median_us'])} us | {_us(c['python']['p90_us'])} us "
        f"| {_us(c['python']['p99_us'])} us | |",
    ]
    sd, sc = d["speedup_compiled_vs_python"], c["speedup_compiled_vs_python"]
    return "\n".join([
        f"{_cmd(rec)} (Python API `PathSelector.select`, 64 loaded requests, GC off; {_measured(rec, note)}):",
        "",
        "| topology | core | median | p90 | p99 | target |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Compiled core vs Python twin, same inputs, same run: **{sd:g}x (dgx8) and {sc:g}x (cluster)** faster at the",
        f"median (target >= 20x: {_met(min(sd, sc) >= 20)}).",
    ])


def render_selector_readme(records: dict, note: str = "") -> str:
    rec, r = _selector(records)
    dc = r["dgx8"]["compiled"]
    return (f"selector decisions in microseconds | `select()` on dgx8 with random loads: median "
            f"**{_us(dc['median_us'])} us**, p99 {_us(dc['p99_us'])} us, "
            f"{r['dgx8']['speedup_compiled_vs_python']:g}x faster than the Python twin (target median 1.0 us: "
            f"{_met(dc['median_us'] <= 1.0)}; {_cmd(rec)}, {_measured(rec, note, load=False)}, docs/selector.md)")


# ------------------------------------------------------------------ templates: host tier
def _gbx(m: dict, what: str, bold: bool = False) -> str:
    ratio = _x(m[f"{what}_ratio"])
    gbps = m[f"{what}_gbps"]
    return (f"{gbps:.1f}" if gbps >= 1 else f"{gbps:.2g}") + " GB/s, " + (f"**{ratio}**" if bold else ratio)


def _verdict(store_ok: bool, load_ok: bool) -> str:
    if store_ok and load_ok:
        return "met"
    if not store_ok and not load_ok:
        return "missed"
    return f"store {_met(store_ok)}, load {_met(load_ok)}"


def render_host_tier(records: dict, note: str = "") -> str:
    rec = _need(records, "host-tier")
    con = _need(records, "host-tier-contiguous")
    res, cres = rec["result"], con["result"]
    try:
        off, on, coff = res["without_checksums"], res["with_checksums"], cres["without_checksums"]
    except KeyError as e:
        raise RefreshError(f"host-tier: the run has no {e.args[0]} result") from None
    t = res["target_ratio"]
    ok = lambda m, w: m[f"{w}_ratio"] >= t
    where = "CPU" if res["device"] == "cpu" else res["device"]
    return "\n".join([
        f"{_cmd(rec)} and {_cmd(con)} ({res['num_tokens']} tokens, {res['layers']} layers, "
        f"{res['heads']} KV heads x {res['head_dim']}, {res['dtype']}, page {res['page_size']}, "
        f"{off['bytes_per_move'] / 1e6:.0f} MB per move, torch threads {res['torch_threads']}; stores read random "
        f"scattered device pages; ratio to `copy_` of the same bytes in the same run; {_measured(rec, note)}):",
        "",
        "| mode | load slots | store | load | target |",
        "|---|---|---|---|---|",
        f"| checksums off | scattered | {_gbx(off, 'store', True)} | {_gbx(off, 'load', True)} "
        f"| >= {t} on {where}: {_verdict(ok(off, 'store'), ok(off, 'load'))} |",
        f"| checksums off | contiguous (a flushed allocator) | {_gbx(coff, 'store')} | {_gbx(coff, 'load')} | |",
        f"| checksums on (default) | scattered | {_gbx(on, 'store')} | {_gbx(on, 'load')} "
        f"| {_verdict(ok(on, 'store'), ok(on, 'load'))} |",
    ])


def render_host_tier_readme(records: dict, note: str = "") -> str:
    # The README quotes the default (checksums on): that is what a host hit pays in serving.
    rec = _need(records, "host-tier")
    res = rec["result"]
    on = res.get("with_checksums")
    if on is None:
        raise RefreshError("host-tier: the run has no with_checksums result")
    t = res["target_ratio"]
    where = "CPU" if res["device"] == "cpu" else res["device"]
    verdict = _verdict(on["store_ratio"] >= t, on["load_ratio"] >= t)
    return (f"host-tier moves with checksums on (the default) run at {_x(on['load_ratio'])} a plain copy for loads "
            f"and {_x(on['store_ratio'])} for stores on {where} (target {t}: {verdict}; "
            f"{_cmd(rec)}, {_measured(rec, note, load=False)})")


def render_host_tier_kv128k(records: dict, note: str = "") -> str:
    rec = _need(records, "host-tier-kv128k")
    res = rec["result"]
    pages = res.get("page_sizes") or {}
    if not pages:
        raise RefreshError("host-tier-kv128k: the run has no page sizes")
    kv_token = 2 * res["layers"] * res["heads"] * res["head_dim"] * {"float32": 4, "float16": 2, "bfloat16": 2}.get(
        res["dtype"], 4)
    move = next(iter(pages.values()))["bytes_per_move"]
    rows = [f"| {ps} | {_x(m['store_ratio'])} | {_x(m['load_ratio'])} | {_x(m['twin_store_ratio'])} "
            f"| {_x(m['twin_load_ratio'])} |" for ps, m in pages.items()]
    # the target travels in the record (older records have none: the bench's own constant)
    t = res.get("target_ratio")
    if t is None:
        from .host_tier_bench import TARGET_RATIO as t
    ok = res.get("kernels_compiled") and all(m["store_ratio"] >= t and m["load_ratio"] >= t for m in pages.values())
    built = "" if res.get("kernels_compiled") else " (kernels NOT BUILT: the compiled columns ran the twin)"
    return "\n".join([
        f"{_cmd(rec)} ({_measured(rec, note)}; {res['num_tokens']} tokens x {res['layers']} layers x "
        f"{res['heads']} KV heads x {res['head_dim']}, {res['dtype']} = {kv_token // 1024} KB of KV per token, "
        f"{move / 2**20:.0f} MiB per move; store = gather of random scattered device pages into host rows with their "
        f"hashes, load = scatter into other random pages with verification; ratio = plain `copy_` time of the "
        f"same bytes / kernel time; torch threads {res['torch_threads']}){built}:",
        "",
        "| page | store (compiled) | load (compiled) | store (torch twin) | load (torch twin) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Target >= {t}x: **{'met' if ok else 'not met'}** in this run.",
    ])


# ------------------------------------------------------------------ templates: serve
def _serve(records: dict) -> Tuple[dict, List[dict], dict]:
    rec = _need(records, "serve")
    res = rec["result"]
    ran = [r for r in res.get("results", []) if r.get("ran")]
    for name in ("baseline", "flexflow"):
        if not any(r["backend"] == name for r in ran):
            why = next((r.get("error") for r in res.get("results", []) if r.get("backend") == name), "not run")
            raise RefreshError(f"serve: the {name} server gave no result ({why}); the figures need both")
    s = res.get("summary") or {}
    if "flexflow_miss_latency_over_baseline" not in s:
        raise RefreshError("serve: no baseline/flexflow pair in the run's summary")
    return rec, ran, s


def _model_words(model: str) -> str:
    m = re.search(r"preset '(\w+)'", model or "")
    if m:
        try:
            from flexflow_sglang.tools.cpu_support.tiny_model import PRESETS
            p = PRESETS[m.group(1)]
            return (f"tiny random Llama, preset `{m.group(1)}`: {p['layers']} layers, hidden {p['hidden']}, "
                    f"MLP {p['intermediate']}")
        except (ImportError, KeyError):
            pass
    return model or "model not recorded"


def render_serve(records: dict, note: str = "") -> str:
    rec, ran, s = _serve(records)
    res = rec["result"]
    w = res.get("workload", {})
    first = ran[0]["cold"]
    per_req = first["prompt_tokens"] / max(first["requests"], 1)
    rounds = s.get("rounds", 1)
    miss_n = ran[0]["miss"]["requests"]
    trip = lambda p: f"{_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p90_s'])} / {_ms(p['ttft_p99_s'])}"
    rows = []
    for r in ran:
        warm_first = f"{_ms(r['warm']['ttft_mean_first_turn_s'])} ms"
        if r["backend"] == "flexflow":
            warm_first = f"**{warm_first}**"
        rows.append(f"| {r['backend']} | {r.get('round', 0) + 1} | {trip(r['cold'])} "
                    f"| {_ms(r['cold']['ttft_mean_first_turn_s'])} ms | {trip(r['warm'])} | {warm_first} "
                    f"| {r['warm']['host_hit_ratio']:.2f} | {_ms(r['miss']['latency_median_s'])} ms |")
    failed = [r for r in res.get("results", []) if not r.get("ran")]
    tail = [""] + [f"`{r['backend']}` did not start: {r.get('error', '')}" for r in failed] if failed else []
    return "\n".join([
        f"{_cmd(rec)} ({_model_words(res.get('model'))}; {w.get('families')} conversations x {w.get('turns')} turns, "
        f"~{per_req:,.0f} prompt tokens per request; cold pass, `/flush_cache`, warm pass; plus a miss-path pass "
        f"of {miss_n} unique prompts; {'backends in ABAB order' if rounds > 1 else 'one round'}; "
        f"{_measured(rec, note)}):",
        "",
        "| backend | round | cold: TTFT p50 / p90 / p99 (ms) | cold first turn | warm: TTFT p50 / p90 / p99 (ms) "
        f"| warm first turn | warm host-hit ratio | miss path (median, {miss_n} unique prompts) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        *tail,
    ])


def render_serve_targets(records: dict, note: str = "") -> str:
    rec, ran, s = _serve(records)
    ff, base = s["flexflow"]["warm_over_cold_ttft_first_turn"], s["baseline"]["warm_over_cold_ttft_first_turn"]
    miss, thr = s["flexflow_miss_latency_over_baseline"], s["flexflow_cold_pass_throughput_over_baseline"]
    same = s.get("outputs_identical_to_baseline")
    n = s.get("rounds", 1)
    rounds = "one round" if n == 1 else "both rounds" if n == 2 else f"all {n} rounds"
    return "\n".join([
        f"Targets, same run ({rec['commit']}):",
        "",
        "| target | result |",
        "|---|---|",
        f"| warm TTFT <= 0.3x cold for long prompts | **{_x(ff)}** (first turn, median of rounds; plain server "
        f"{_x(base)}): {_met(ff <= 0.3)} |",
        f"| flexflow miss-path overhead <= 3 % | miss-path latency **{_x(miss, 3)}** baseline; cold-pass throughput "
        f"{_x(thr)}: {_met(miss <= 1.03)} |",
        f"| outputs identical to the plain server | {'true' if same else '**false**'} (cold and warm passes, {rounds}) |",
    ])


def render_serve_readme_warm(records: dict, note: str = "") -> str:
    rec, ran, s = _serve(records)
    ff = s["flexflow"]["warm_over_cold_ttft_first_turn"]
    same = "byte-identical" if s.get("outputs_identical_to_baseline") else "NOT identical to the plain server's"
    return (f"a repeated long prompt skips prefill from the host tier | warm first-turn TTFT **{_x(ff)}** cold on "
            f"the real server, outputs {same} ({_cmd(rec)}, {_measured(rec, note, load=False)})")


def render_serve_readme_miss(records: dict, note: str = "") -> str:
    rec, ran, s = _serve(records)
    r = s["flexflow_miss_latency_over_baseline"]
    claim = ("a miss costs under 1 %" if r < 1.01 else "a miss costs under 3 %" if r < 1.03
             else f"a miss costs {(r - 1) * 100:.0f} %")
    rounds = "ABAB rounds" if s.get("rounds", 1) > 1 else "one round"
    return (f"{claim} | miss-path latency **{_x(r, 3)}** the plain server (same prompts, {rounds}; {_cmd(rec)}, "
            f"{_measured(rec, note, load=False)})")


# ------------------------------------------------------------------ blocks and cases
@dataclasses.dataclass(frozen=True)
class Block:
    name: str
    doc: str
    command: str
    render: Callable[[dict, str], str]


BLOCKS: Tuple[Block, ...] = (
    Block("selector", "docs/results.md", "selector", render_selector),
    Block("selector-readme", "README.md", "selector", render_selector_readme),
    Block("host-tier", "docs/results.md", "host-tier", render_host_tier),
    Block("host-tier-readme", "README.md", "host-tier", render_host_tier_readme),
    Block("host-tier-kv128k", "docs/results.md", "host-tier", render_host_tier_kv128k),
    Block("serve", "docs/results.md", "serve", render_serve),
    Block("serve-targets", "docs/results.md", "serve", render_serve_targets),
    Block("serve-readme-warm", "README.md", "serve", render_serve_readme_warm),
    Block("serve-readme-miss", "README.md", "serve", render_serve_readme_miss),
)
BLOCK_NAMES = tuple(b.name for b in BLOCKS)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    command: str                 # selector | host-tier | serve
    argv: Tuple[str, ...]        # full settings (the ones the docs quote)
    quick_argv: Tuple[str, ...]  # smallest settings: a smoke test, not a figure


CASES: Tuple[Case, ...] = (
    Case("selector", "selector", ("--json", "-n", "50000"), ("--json", "-n", "2000")),
    Case("host-tier", "host-tier", ("--repeats", "10", "--json"),
         ("--tokens", "256", "--repeats", "1", "--json")),
    Case("host-tier-contiguous", "host-tier", ("--repeats", "10", "--dst", "contiguous", "--checksums", "off", "--json"),
         ("--tokens", "256", "--repeats", "1", "--dst", "contiguous", "--checksums", "off", "--json")),
    Case("host-tier-kv128k", "host-tier", ("--kernels", "--repeats", "3", "--json"),
         ("--kernels", "--tokens", "64", "--repeats", "1", "--json")),
    Case("serve", "serve", ("--rounds", "2", "--backends", "baseline,flexflow"),
         ("--rounds", "1", "--backends", "baseline,flexflow", "--families", "1", "--turns", "2",
          "--prefix-words", "200", "--miss-requests", "2")),
)


def _bench_main(command: str):
    if command == "selector":
        from flexflow_sglang.tools.bench.selector_bench import main
    elif command == "host-tier":
        from flexflow_sglang.tools.bench.host_tier_bench import main  # type: ignore
    elif command == "serve":
        from flexflow_sglang.tools.bench.serve import main  # type: ignore
    else:  # pragma: no cover - CASES names only these
        raise RefreshError(f"unknown benchmark {command!r}")
    return main


def run_case(case: Case, out_dir: str, quick: bool, commit: str) -> dict:
    """Run one case through its benchmark's Python entry point; returns its record (command line,
    commit, load average, wall time, raw result)."""
    argv = list(case.quick_argv if quick else case.argv)
    if case.command == "serve":
        argv += ["--out", os.path.join(out_dir, "serve")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    main = _bench_main(case.command)
    t0 = time.time()
    buf = io.StringIO()
    try:
        # selector and host-tier print their JSON on stdout; serve prints progress there (sent to stderr)
        with contextlib.redirect_stdout(sys.stderr if case.command == "serve" else buf):
            rc = main(list(argv))
    except SystemExit as e:  # argparse of the benchmark
        raise RefreshError(f"{case.name}: `flexflow bench {case.command} {' '.join(argv)}` exited with {e.code}") from None
    if rc:
        raise RefreshError(f"{case.name}: `flexflow bench {case.command} {' '.join(argv)}` returned {rc}")
    if case.command == "serve":
        path = os.path.join(out_dir, "serve", "bench_serve.json")
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            raise RefreshError(f"serve: cannot read {path}: {e}") from None
    else:
        try:
            result = json.loads(buf.getvalue())
        except ValueError:
            raise RefreshError(f"{case.name}: the benchmark printed no JSON: {buf.getvalue()[-300:]!r}") from None
    return {"case": case.name, "command": " ".join(["flexflow", "bench", case.command, *argv]), "argv": argv,
            "quick": quick, "commit": commit, "load_average": load,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
            "wall_s": round(time.time() - t0, 1), "result": result}


def current_commit(root: str) -> str:
    """Short HEAD, `+dirty` when tracked or untracked (not ignored) files differ from it."""
    def git(*a):
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, check=True).stdout.strip()
    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain"))
    except (OSError, subprocess.CalledProcessError) as e:
        raise RefreshError(f"{root}: cannot read the commit with git ({e}); the figures must name one") from None
    return sha + ("+dirty" if dirty else "")


def render_blocks(records: dict, commands: Iterable[str], note: str = "") -> Dict[str, Dict[str, str]]:
    """doc -> {marker name: rendered body} for every block of the given commands."""
    commands = set(commands)
    out: Dict[str, Dict[str, str]] = {d: {} for d in DOCS}
    for b in BLOCKS:
        if b.command in commands:
            out[b.doc][b.name] = b.render(records, note)
    return out


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except OSError as e:
        raise RefreshError(f"cannot read {path}: {e.strerror}") from None


def check_docs(root: str) -> None:
    """Every marker of BLOCKS present once in its doc, balanced, none unknown; raises RefreshError."""
    for doc in DOCS:
        rewrite_text(_read(os.path.join(root, doc)), doc, {},
                     expected=[b.name for b in BLOCKS if b.doc == doc],
                     known=[b.name for b in BLOCKS if b.doc == doc])


def apply(root: str, rendered: Dict[str, Dict[str, str]], dry_run: bool, stream=None) -> List[str]:
    """Rewrite the docs (re-read right before writing: other edits made meanwhile are kept). With
    `dry_run` print the unified diff to `stream` and write nothing. Returns the docs that changed."""
    stream = stream or sys.stdout
    changed = []
    for doc in DOCS:
        if not rendered.get(doc):
            continue
        path = os.path.join(root, doc)
        old = _read(path)
        new = rewrite_text(old, doc, rendered[doc], expected=[b.name for b in BLOCKS if b.doc == doc],
                           known=[b.name for b in BLOCKS if b.doc == doc])
        if new == old:
            continue
        changed.append(doc)
        if dry_run:
            stream.writelines(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                   fromfile=f"a/{doc}", tofile=f"b/{doc}"))
            continue
        tmp = path + ".refresh.tmp"
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(new)
        os.replace(tmp, path)
    return changed


def _repo_root() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in range(5):
        here = os.path.dirname(here)
        if os.path.exists(os.path.join(here, "README.md")) and os.path.isdir(os.path.join(here, "docs")):
            return here
    return os.getcwd()


def _commands(only: Optional[str], skip: Optional[str]) -> List[str]:
    def parse(s, flag):
        names = [x.strip() for x in s.split(",") if x.strip()]
        bad = [n for n in names if n not in COMMANDS]
        if bad:
            raise RefreshError(f"{flag} {','.join(bad)}: unknown; choose from {', '.join(COMMANDS)}")
        return names
    chosen = parse(only, "--only") if only else list(COMMANDS)
    skipped = set(parse(skip, "--skip")) if skip else set()
    chosen = [c for c in COMMANDS if c in chosen and c not in skipped]
    if not chosen:
        raise RefreshError("nothing to refresh: --only/--skip leave no benchmark")
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="flexflow bench refresh",
        description="Re-measure the quick figures (selector, host tier, serve) and rewrite them in README.md and "
                    "docs/results.md between their <!-- refresh:NAME --> markers, with command and commit.")
    ap.add_argument("--only", metavar="LIST", help=f"comma list of benchmarks to run, from {', '.join(COMMANDS)}")
    ap.add_argument("--skip", metavar="LIST", help="comma list of benchmarks to leave out (e.g. serve: the slow one)")
    ap.add_argument("--dry-run", action="store_true", help="print the diff of the docs instead of writing them")
    ap.add_argument("--out", default="runs/refresh", help="raw JSON of each run goes here (default runs/refresh)")
    ap.add_argument("--quick", action="store_true",
                    help="smallest settings of each benchmark (a smoke test: the command line in the docs says so)")
    ap.add_argument("--from", dest="from_dir", metavar="DIR",
                    help="run nothing: re-render from the <case>.json records of an earlier refresh in DIR")
    ap.add_argument("--note", default="", help="added to every rewritten figure, e.g. 'machine shared with 4 jobs'")
    ap.add_argument("--root", default=None, help="checkout holding README.md and docs/ (default: this package's)")
    a = ap.parse_args(list(argv) if argv is not None else None)
    root = os.path.abspath(a.root or _repo_root())
    commands = _commands(a.only, a.skip)
    check_docs(root)  # a broken marker fails now, not after minutes of benchmarks
    cases = [c for c in CASES if c.command in commands]
    records: Dict[str, dict] = {}
    if a.from_dir:
        for c in cases:
            path = os.path.join(a.from_dir, f"{c.name}.json")
            try:
                with open(path) as f:
                    records[c.name] = json.load(f)
            except (OSError, ValueError) as e:
                raise RefreshError(f"--from: cannot read {path}: {e}") from None
    else:
        from tqdm import tqdm
        commit = current_commit(root)
        os.makedirs(a.out, exist_ok=True)
        bar = tqdm(cases, desc="bench refresh", unit="bench", file=sys.stderr)
        for c in bar:
            bar.set_postfix_str(c.name)
            rec = run_case(c, a.out, a.quick, commit)
            records[c.name] = rec
            with open(os.path.join(a.out, f"{c.name}.json"), "w") as f:
                json.dump(rec, f, indent=2)
        bar.close()
    rendered = render_blocks(records, commands, a.note)
    changed = apply(root, rendered, a.dry_run)
    names = [n for d in DOCS for n in rendered.get(d, {})]
    verb = "would rewrite" if a.dry_run else "rewrote"
    print(f"bench refresh: {verb} {', '.join(changed) or 'nothing (figures unchanged)'}; markers: {', '.join(names)}"
          + ("" if a.from_dir else f"; raw JSON in {a.out}"), file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m flexflow_sglang.tools.bench.refresh
    sys.exit(main())
