"""Verify that a KV-cache backend never changes greedy outputs and that host-tier hits happen.

Usage::

    # 1. against a reference server (e.g. plain SGLang): record greedy outputs
    python -m flexflow_sglang.tools.verify_outputs --phase baseline --url http://127.0.0.1:30000 \\
        --prompts flexflow_sglang/tools/data/prompts.jsonl --out runs/baseline.json [--max-new-tokens 16]
    # 2. against the server under test (e.g. --radix-cache-backend flexflow)
    python -m flexflow_sglang.tools.verify_outputs --phase test --url http://127.0.0.1:30001 \\
        --prompts flexflow_sglang/tools/data/prompts.jsonl --baseline runs/baseline.json [--concurrency 4]

Baseline phase (reference server): flushes the cache, then records one greedy request (temperature 0,
``ignore_eos``) per prompt in file order (R1; later prompts of a family hit earlier ones' prefixes in
the device tree), then the same prompts again without a flush (R2: device hits), with their cached
lengths.

Test phase, per prompt: R1, R2d (the same prompt again, no flush: a device hit on this server),
``POST /flush_cache`` (which empties the device tree), R2 (the same prompt: served from the host tier).
Every comparison is like with like, because in bf16 SGLang itself does not reproduce a full prefill
from a cache hit (a different extend shape rounds differently, see docs/correctness.md):
- R1 must equal the baseline's R1 when their cached lengths are equal (same request history);
- R2 (host hit) must equal R2d (device hit, same server, same cached length): a wrong host load shows
  here and nowhere else;
- R2 must equal the baseline's R2 (the reference server's device hit) when their cached lengths are
  equal; with a version-1 baseline (no R2), R2 is compared with the baseline's R1 as before;
- R2 against the baseline's R1 (fresh) is reported as ``drift vs fresh`` (not counted, unless
  ``--strict-fresh``), next to how often the reference server's own R2 drifts from its R1.
R2 must report ``meta_info.cached_tokens_details.host > 0`` -- the prefix came back from the host
tier. The host-hit requirement is skipped, and said so, for prompts shorter than
``--min-host-tokens`` (default 8) and entirely with ``--no-host-hit`` (e.g. a plain server).
``--no-device-round`` skips R2d. With ``--concurrency K`` > 1 each round runs all prompts
concurrently (K threads): R1, R2d, one flush, R2.

Output: one line per prompt with every cached length (device / host / storage), then exactly
``Total mismatches: N`` as the last line (N = counted mismatches + missing host hits + failed
requests); exit status 1 if N > 0, 2 on a usage error or an unreachable server.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import requests
from tqdm import tqdm

BASELINE_VERSION = 2
#: baselines without an R2 round (compared as before: R2 against R1)
READABLE_BASELINE_VERSIONS = (1, 2)
DEFAULT_MAX_NEW_TOKENS = 16
DEFAULT_MIN_HOST_TOKENS = 8


class UsageError(Exception):
    """Bad input (file, arguments, unreachable server): reported without a traceback."""


# ----------------------------------------------------------------------------- pure functions
def prompt_hash(text: Union[str, Sequence[int]]) -> str:
    """Digest of a prompt (its text, or its token ids as JSON)."""
    raw = text if isinstance(text, str) else json.dumps([int(t) for t in text], separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:16]


def prompt_input(p: dict) -> Union[str, List[int]]:
    """What a request sends for prompt `p`: its token ids when the file gave them, else its text."""
    ids = p.get("input_ids")
    return ids if ids is not None else p["text"]


def load_prompts(path: str) -> List[dict]:
    """Read a JSONL prompt file: one ``{"id": ..., "text": ...}`` object per line, or
    ``{"id": ..., "input_ids": [...]}`` (token ids sent as they are: models whose tokenizer does not
    round-trip a benchmark's text, e.g. the tiny presets under SGLang's bench_serving --tokenize-prompt)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or "id" not in obj or ("text" not in obj and "input_ids" not in obj):
            raise UsageError(f'{path}:{n}: expected an object with "id" and "text" (or "input_ids")')
        pid = str(obj["id"])
        if pid in seen:
            raise UsageError(f"{path}:{n}: duplicate prompt id {pid!r}")
        seen.add(pid)
        entry = {"id": pid, "text": str(obj.get("text", "")), "group": str(obj.get("group", ""))}
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise UsageError(f"{path}:{n}: input_ids of prompt {pid!r} must be a non-empty list of "
                                 "non-negative integers")
            entry["input_ids"] = ids
        prompts.append(entry)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def normalize_response(resp: dict) -> dict:
    """The fields of a ``/generate`` response that verification uses."""
    meta = resp.get("meta_info") or {}
    details = meta.get("cached_tokens_details") or {}
    return {
        "output_ids": list(resp.get("output_ids") or []),
        "text": resp.get("text", ""),
        "prompt_tokens": int(meta.get("prompt_tokens") or 0),
        "cached_tokens": int(meta.get("cached_tokens") or 0),
        "host_cached": int(details.get("host") or 0),
        "device_cached": int(details.get("device") or 0),
        # tokens loaded from deeper tiers (storage / remote) are reported separately by SGLang
        "storage_cached": int(details.get("storage") or 0),
        "e2e_latency": meta.get("e2e_latency"),
    }


def compare_outputs(expected: dict, got: dict) -> List[str]:
    """Differences between a baseline entry and a result (both with ``output_ids``, ``text``).
    Empty list = identical."""
    problems = []
    e_ids, g_ids = list(expected.get("output_ids") or []), list(got.get("output_ids") or [])
    if e_ids != g_ids:
        k = next((i for i, (a, b) in enumerate(zip(e_ids, g_ids)) if a != b), min(len(e_ids), len(g_ids)))
        a = e_ids[k] if k < len(e_ids) else "<end>"
        b = g_ids[k] if k < len(g_ids) else "<end>"
        problems.append(f"output_ids differ at index {k} (expected {a}, got {b}; "
                        f"lengths {len(e_ids)}/{len(g_ids)})")
    e_txt, g_txt = expected.get("text", ""), got.get("text", "")
    if e_txt.encode("utf-8") != g_txt.encode("utf-8"):
        k = next((i for i, (a, b) in enumerate(zip(e_txt, g_txt)) if a != b), min(len(e_txt), len(g_txt)))
        problems.append(f"text differs at char {k} (expected {e_txt[k:k + 20]!r}, got {g_txt[k:k + 20]!r})")
    return problems


def host_hit_check(got: dict, min_tokens: int = DEFAULT_MIN_HOST_TOKENS) -> tuple:
    """``(problem, skipped_reason)``: problem is a string when R2 missed the host tier."""
    n = int(got.get("prompt_tokens") or 0)
    if n < min_tokens:
        return None, f"host-hit check skipped: prompt has {n} tokens < min {min_tokens}"
    if int(got.get("host_cached") or 0) + int(got.get("storage_cached") or 0) <= 0:
        return (f"no host hit on R2 (cached_tokens {got.get('cached_tokens', 0)}: device "
                f"{got.get('device_cached', 0)}, host {got.get('host_cached', 0)})"), None
    return None, None


@dataclass
class PromptVerdict:
    pid: str
    mismatches: int = 0
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    r1: Optional[dict] = None
    r2: Optional[dict] = None
    r2d: Optional[dict] = None
    #: R2 differs from the reference's fresh R1 (reported; counted only with strict_fresh)
    drift_vs_fresh: bool = False

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    def line(self) -> str:
        head = "ok  " if self.ok else "FAIL"
        parts = [f"[{head}] {self.pid}"]
        r = self.r2 or self.r1
        if r and "prompt_tokens" in r:
            parts.append(f"tokens={r['prompt_tokens']}")
        for name, res in (("R1", self.r1), ("R2d", self.r2d), ("R2", self.r2)):
            if res and "cached_tokens" in res:
                parts.append(f"{name} cached={res['cached_tokens']} (device {res['device_cached']}, "
                             f"host {res['host_cached']}"
                             + (f", storage {res['storage_cached']})" if res.get("storage_cached") else ")"))
        text = " ".join(parts)
        if self.problems:
            text += " :: " + "; ".join(self.problems)
        if self.notes:
            text += " -- " + "; ".join(self.notes)
        return text


def _cached(res: Optional[dict]) -> Optional[int]:
    return None if not isinstance(res, dict) or res.get("cached_tokens") is None else int(res["cached_tokens"])


def _judge_same_length(v: PromptVerdict, ref: dict, got: dict, label: str, skipped: str,
                       require_length: bool = True) -> None:
    """Count `got` != `ref` as a mismatch when both ran at the same cached length (like with like);
    otherwise note `skipped`. Concurrent R1s, for instance, compute a shared prefix side by side."""
    if require_length and _cached(ref) != _cached(got):
        v.notes.append(skipped)
        return
    diffs = compare_outputs(ref, got)
    if diffs:
        v.mismatches += 1
        v.problems.append(f"{label}: " + ", ".join(diffs))


def evaluate_prompt(
    pid: str,
    expected: Optional[dict],
    r1,
    r2,
    *,
    r2d=None,
    text_hash: Optional[str] = None,
    require_host_hit: bool = True,
    min_host_tokens: int = DEFAULT_MIN_HOST_TOKENS,
    strict_fresh: bool = False,
) -> PromptVerdict:
    """Judge one prompt, like with like. ``expected`` is the baseline entry (its R1 at the top level,
    its R2 under ``"r2"`` in version 2); ``r1``/``r2``/``r2d`` are normalized results or an error
    string (failed request); ``r2d`` is None when the device round was skipped.

    Counted: a failed request; R1 != baseline R1; R2 (host hit) != R2d (device hit on the same server
    at the same cached length); R2 != the baseline's R2 at the same cached length (version 1: R2 !=
    baseline R1); a missing host hit. Reported only (unless ``strict_fresh``): R2 != baseline R1."""
    v = PromptVerdict(pid, r1=r1 if isinstance(r1, dict) else None,
                      r2=r2 if isinstance(r2, dict) else None, r2d=r2d if isinstance(r2d, dict) else None)
    if expected is None:
        v.mismatches += 1
        v.problems.append("prompt not in baseline")
        return v
    if text_hash is not None and expected.get("prompt_sha256") not in (None, text_hash):
        v.mismatches += 1
        v.problems.append("prompt text changed since the baseline was recorded")
        return v
    for name, res in (("R1", r1), ("R2d", r2d), ("R2", r2)):
        if res is not None and not isinstance(res, dict):
            v.mismatches += 1
            v.problems.append(f"{name} request failed: {res}")
    if isinstance(r1, dict):
        # a version-1 baseline has no cached length: R1 is always compared then
        _judge_same_length(v, expected, r1, "R1 vs baseline R1",
                           f"baseline R1 cached {_cached(expected)} != R1 cached {_cached(r1)}: R1 not compared",
                           require_length=expected.get("cached_tokens") is not None)
    if isinstance(r2, dict):
        if isinstance(r2d, dict):
            _judge_same_length(v, r2d, r2, "R2 (host hit) vs R2d (device hit, same length)",
                               f"R2d cached {_cached(r2d)} != R2 cached {_cached(r2)}: hit vs hit not compared")
        ref2 = expected.get("r2")
        if isinstance(ref2, dict):
            _judge_same_length(v, ref2, r2, "R2 vs baseline R2 (same cached length)",
                               f"baseline R2 cached {_cached(ref2)} != R2 cached {_cached(r2)}: not compared")
            diffs = compare_outputs(expected, r2)
            if diffs:
                v.drift_vs_fresh = True
                if strict_fresh:
                    v.mismatches += 1
                    v.problems.append("R2 vs baseline R1 (fresh): " + ", ".join(diffs))
                else:
                    v.notes.append("drift vs fresh (R2 != baseline R1"
                                   + ("; the reference server drifts too" if not ref2.get("equals_r1", True) else "")
                                   + ")")
        else:  # version-1 baseline: R1 is the only reference
            diffs = compare_outputs(expected, r2)
            if diffs:
                v.mismatches += 1
                v.problems.append("R2 vs baseline R1: " + ", ".join(diffs))
    if require_host_hit and isinstance(r2, dict):
        problem, skipped = host_hit_check(r2, min_host_tokens)
        if problem:
            v.mismatches += 1
            v.problems.append(problem)
        if skipped:
            v.notes.append(skipped)
    return v


def total_mismatches(verdicts: Sequence[PromptVerdict]) -> int:
    return sum(v.mismatches for v in verdicts)


# ----------------------------------------------------------------------------- server I/O
def check_server(url: str, timeout: float = 10.0) -> dict:
    try:
        r = requests.get(url.rstrip("/") + "/model_info", timeout=timeout)
    except requests.RequestException as e:
        raise UsageError(f"cannot reach the SGLang server at {url}: {type(e).__name__}: "
                         f"{_short(e)}") from None
    if r.status_code != 200:
        raise UsageError(f"{url}/model_info answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return r.json()
    except ValueError:
        raise UsageError(f"{url}/model_info did not return JSON: is this an SGLang server?") from None


def _short(e: Exception) -> str:
    s = str(e)
    return s if len(s) < 300 else s[:300] + "..."


@dataclass(frozen=True)
class PDTarget:
    """PD disaggregation: requests go to this prefill server and to --url (the decode server)."""
    prefill_url: str
    bootstrap_host: str
    bootstrap_port: int


def request_one(url: str, text: Union[str, Sequence[int]], max_new_tokens: int, timeout: float = 600.0,
                pd: Optional[PDTarget] = None):
    """One greedy request (`text`: a string, or token ids); returns a normalized result dict or an
    error string."""
    prompt = {"text": text} if isinstance(text, str) else {"input_ids": [int(t) for t in text]}
    body = {**prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    if pd is not None:
        from flexflow_sglang.pd.router import PDRequestError, pd_generate
        try:
            data = pd_generate(pd.prefill_url, url, pd.bootstrap_host, pd.bootstrap_port, body, timeout=timeout)
        except PDRequestError as e:
            return _short(e)
        try:
            res = normalize_response(data)
        except (ValueError, TypeError, AttributeError):
            return "decode response is not a /generate result"
        res["client_latency"] = time.perf_counter() - t0
        return res
    try:
        r = requests.post(url.rstrip("/") + "/generate", json=body, timeout=timeout)
    except requests.RequestException as e:
        return f"{type(e).__name__}: {_short(e)}"
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text.strip()[:300]}"
    try:
        res = normalize_response(r.json())
    except ValueError:
        return "response is not JSON"
    res["client_latency"] = time.perf_counter() - t0
    return res


def run_batch(url: str, prompts: Sequence[dict], max_new_tokens: int, concurrency: int,
              desc: str, progress: bool = True, pd: Optional[PDTarget] = None) -> Dict[str, object]:
    """Send one request per prompt (``concurrency`` at a time); returns id -> result/error."""
    out: Dict[str, object] = {}
    with tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr, disable=not progress,
              leave=False) as bar:
        if concurrency <= 1:
            for p in prompts:
                out[p["id"]] = request_one(url, prompt_input(p), max_new_tokens, pd=pd)
                bar.update(1)
        else:
            with cf.ThreadPoolExecutor(max_workers=concurrency) as ex:
                futs = {ex.submit(request_one, url, prompt_input(p), max_new_tokens, pd=pd): p["id"] for p in prompts}
                for fut in cf.as_completed(futs):
                    out[futs[fut]] = fut.result()
                    bar.update(1)
    return out


def flush(url: str, wait_s: float = 120.0, pd: Optional[PDTarget] = None) -> Optional[str]:
    """POST /flush_cache (PD: the prefill server's too); returns an error string or None."""
    if pd is not None:
        err = flush(pd.prefill_url, wait_s)
        if err:
            return f"prefill {err}"
    try:
        r = requests.post(url.rstrip("/") + "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 30)
    except requests.RequestException as e:
        return f"flush_cache failed: {type(e).__name__}: {_short(e)}"
    if r.status_code != 200:
        return f"flush_cache -> HTTP {r.status_code}: {r.text.strip()[:200]}"
    return None


# ----------------------------------------------------------------------------- phases
def phase_baseline(args, prompts: List[dict], info: dict) -> int:
    max_new = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if not args.no_flush:
        err = flush(args.url, pd=getattr(args, 'pd', None))
        if err:
            raise UsageError(err)
    results = run_batch(args.url, prompts, max_new, args.concurrency, "baseline R1", args.progress,
                        getattr(args, 'pd', None))
    # R2 without a flush: the reference for a cache hit at the same cached length
    results2 = run_batch(args.url, prompts, max_new, args.concurrency, "baseline R2", args.progress,
                         getattr(args, 'pd', None))
    entries, failures, drift = {}, 0, 0
    for p in prompts:
        res = results[p["id"]]
        if not isinstance(res, dict):
            failures += 1
            print(f"[FAIL] {p['id']} :: request failed: {res}")
            continue
        entry = {"output_ids": res["output_ids"], "text": res["text"], "prompt_tokens": res["prompt_tokens"],
                 "prompt_sha256": prompt_hash(prompt_input(p)), "cached_tokens": res["cached_tokens"],
                 "device_cached": res["device_cached"], "host_cached": res["host_cached"]}
        res2 = results2[p["id"]]
        note = ""
        if isinstance(res2, dict):
            same = not compare_outputs(res, res2)
            drift += not same
            entry["r2"] = {"output_ids": res2["output_ids"], "text": res2["text"], "equals_r1": same,
                           "cached_tokens": res2["cached_tokens"], "device_cached": res2["device_cached"],
                           "host_cached": res2["host_cached"]}
            note = f" R2 cached={res2['cached_tokens']}" + ("" if same else " (R2 != R1: hit vs recompute drift)")
        else:
            failures += 1
            note = f" R2 failed: {res2}"
        entries[p["id"]] = entry
        print(f"[{'ok  ' if isinstance(res2, dict) else 'FAIL'}] {p['id']} tokens={res['prompt_tokens']} "
              f"out={len(res['output_ids'])} cached={res['cached_tokens']}{note} "
              f"latency={res['client_latency'] * 1000:.0f} ms")
    doc = {"version": BASELINE_VERSION, "max_new_tokens": max_new, "url": args.url,
           "model_path": info.get("model_path"), "prompts_file": os.path.abspath(args.prompts),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "prompts": entries}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"Recorded {len(entries)} of {len(prompts)} prompts (max_new_tokens {max_new}) to {args.out}; "
          f"the reference's own device hit differs from its fresh run in {drift}")
    print(f"Total mismatches: {failures}")
    return 1 if failures else 0


def load_baseline(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read baseline {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"baseline {path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") not in READABLE_BASELINE_VERSIONS or "prompts" not in doc:
        raise UsageError(f"{path} is not a verify_outputs baseline (versions {READABLE_BASELINE_VERSIONS})")
    return doc


def phase_test(args, prompts: List[dict], info: dict) -> int:
    base = load_baseline(args.baseline)
    max_new = base["max_new_tokens"]
    if args.max_new_tokens is not None and args.max_new_tokens != max_new:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} differs from the baseline's {max_new}")
    flush_errors: List[str] = []
    pd = getattr(args, "pd", None)
    device_round = not args.no_device_round
    r2d: Dict[str, object] = {}
    if args.concurrency > 1:
        r1 = run_batch(args.url, prompts, max_new, args.concurrency, "R1", args.progress, pd)
        if device_round:
            r2d = run_batch(args.url, prompts, max_new, args.concurrency, "R2d", args.progress, pd)
        err = flush(args.url, pd=pd)
        if err:
            flush_errors.append(err)
        r2 = run_batch(args.url, prompts, max_new, args.concurrency, "R2", args.progress, pd)
    else:
        r1, r2 = {}, {}
        for p in tqdm(prompts, desc="R1/R2d/flush/R2", unit="prompt", file=sys.stderr,
                      disable=not args.progress, leave=False):
            r1[p["id"]] = request_one(args.url, prompt_input(p), max_new, pd=pd)
            if device_round:
                r2d[p["id"]] = request_one(args.url, prompt_input(p), max_new, pd=pd)
            err = flush(args.url, pd=pd)
            if err:
                flush_errors.append(f"{p['id']}: {err}")
            r2[p["id"]] = request_one(args.url, prompt_input(p), max_new, pd=pd)
    verdicts = [
        evaluate_prompt(p["id"], base["prompts"].get(p["id"]), r1[p["id"]], r2[p["id"]], r2d=r2d.get(p["id"]),
                        text_hash=prompt_hash(prompt_input(p)), require_host_hit=not args.no_host_hit,
                        min_host_tokens=args.min_host_tokens, strict_fresh=args.strict_fresh)
        for p in prompts
    ]
    for v in verdicts:
        print(v.line())
    for err in flush_errors:
        print(f"[warn] {err}")
    if args.no_host_hit:
        print("(host-hit requirement disabled: --no-host-hit)")
    total = total_mismatches(verdicts)
    drift = sum(v.drift_vs_fresh for v in verdicts)
    ref_drift = sum(1 for p in prompts if isinstance(base["prompts"].get(p["id"], {}).get("r2"), dict)
                    and not base["prompts"][p["id"]]["r2"].get("equals_r1", True))
    if any(isinstance(e.get("r2"), dict) for e in base["prompts"].values()):
        print(f"Hit vs fresh drift (reported, {'counted' if args.strict_fresh else 'not counted'}): "
              f"R2 != baseline R1 in {drift} of {len(prompts)} prompts; the reference server's own R2 != R1 "
              f"in {ref_drift}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"url": args.url, "baseline": os.path.abspath(args.baseline),
                       "total_mismatches": total, "concurrency": args.concurrency,
                       "drift_vs_fresh": drift, "reference_drift": ref_drift,
                       "prompts": {v.pid: {"ok": v.ok, "mismatches": v.mismatches, "problems": v.problems,
                                           "notes": v.notes, "r1": v.r1, "r2d": v.r2d, "r2": v.r2,
                                           "drift_vs_fresh": v.drift_vs_fresh} for v in verdicts}},
                      f, indent=1, sort_keys=True)
            f.write("\n")
    print(f"Total mismatches: {total}")
    return 1 if total else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flexflow_sglang.tools.verify_outputs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("baseline", "test"), required=True)
    ap.add_argument("--url", required=True, help="SGLang server, e.g. http://127.0.0.1:30000")
    ap.add_argument("--prompts", required=True, help="JSONL file of {id, text} objects")
    ap.add_argument("--out", help="baseline phase: JSON file to write (required); "
                                  "test phase: optional JSON report")
    ap.add_argument("--baseline", help="test phase: baseline JSON written by --phase baseline")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"greedy tokens per request (baseline default {DEFAULT_MAX_NEW_TOKENS}; "
                         "test phase uses the baseline's)")
    ap.add_argument("--concurrency", type=int, default=1, help="concurrent requests per round")
    ap.add_argument("--min-host-tokens", type=int, default=DEFAULT_MIN_HOST_TOKENS,
                    help="skip the host-hit requirement for prompts shorter than this")
    ap.add_argument("--no-host-hit", action="store_true",
                    help="do not require host-tier hits on R2 (e.g. a plain SGLang server)")
    ap.add_argument("--no-flush", action="store_true", help="baseline phase: do not flush first")
    ap.add_argument("--groups", default=None,
                    help="only the prompts whose \"group\" is in this comma-separated list (both phases)")
    ap.add_argument("--no-device-round", action="store_true",
                    help="test phase: skip R2d (the device-hit repeat before the flush)")
    ap.add_argument("--strict-fresh", action="store_true",
                    help="test phase: also count R2 != baseline R1 (hit vs fresh; SGLang itself drifts in bf16)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")
    ap.add_argument("--pd-prefill", metavar="URL", default=None,
                    help="PD disaggregation: the prefill server; --url is then the decode server")
    ap.add_argument("--pd-bootstrap", metavar="HOST:PORT", default=None,
                    help="PD: the prefill server's --disaggregation-bootstrap-port (host defaults to the "
                         "prefill URL's host)")
    return ap


def parse_pd(args) -> Optional[PDTarget]:
    if not args.pd_prefill and not args.pd_bootstrap:
        return None
    if not args.pd_prefill or not args.pd_bootstrap:
        raise UsageError("PD mode needs both --pd-prefill URL and --pd-bootstrap [HOST:]PORT")
    from urllib.parse import urlparse
    host, _, port = args.pd_bootstrap.rpartition(":")
    host = host or (urlparse(args.pd_prefill).hostname or "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--pd-bootstrap {args.pd_bootstrap!r}: expected HOST:PORT or PORT")
    return PDTarget(args.pd_prefill, host, int(port))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.concurrency < 1:
            raise UsageError("--concurrency must be >= 1")
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be >= 1")
        if args.phase == "baseline" and not args.out:
            raise UsageError("--phase baseline needs --out FILE")
        if args.phase == "test" and not args.baseline:
            raise UsageError("--phase test needs --baseline FILE")
        args.pd = parse_pd(args)
        prompts = load_prompts(args.prompts)
        if args.groups:
            keep = {g.strip() for g in args.groups.split(",") if g.strip()}
            prompts = [p for p in prompts if p["group"] in keep]
            if not prompts:
                raise UsageError(f"--groups {args.groups!r}: no prompt of {args.prompts} is in these groups")
        if args.pd is not None:
            check_server(args.pd.prefill_url)
        if args.phase == "test":
            load_baseline(args.baseline)  # fail on a bad file before touching the server
        info = check_server(args.url)
        if args.phase == "baseline":
            return phase_baseline(args, prompts, info)
        return phase_test(args, prompts, info)
    except UsageError as e:
        print(f"verify_outputs: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
