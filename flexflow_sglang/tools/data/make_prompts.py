"""Generate ``prompts.jsonl`` (deterministic): the prompt set for output/cache verification.

Usage::

    python -m flexflow_sglang.tools.data.make_prompts [OUT]    # default: prompts.jsonl next to this file
    python flexflow_sglang/tools/data/make_prompts.py [OUT]

Each line is ``{"id": ..., "text": ..., "group": ...}``. The text is made of the words the tiny
model's tokenizer was trained on (``flexflow_sglang.tools.cpu_support.tiny_model.WORDS``), so one word
costs about one token there. 14 prompts:

* ``short-*``   -- 3 prompts of 3, 12 and 30 words (the first is below the host-hit minimum of
  verify_outputs, so it exercises the "too short" skip);
* ``medium-*``  -- 3 prompts of ~200, ~450 and ~800 words;
* ``long-*``    -- 2 prompts of ~1500 and ~2750 words (~1620 and ~2980 tokens; prompt + new
  tokens must stay below the tiny model's context of 8192 and the default KV pool of 4096);
* ``famA-*``    -- 3 prompts sharing a ~1200-word prefix, each with a different ~60-word suffix;
* ``famB-*``    -- 3 prompts sharing a ~400-word prefix, suffixes of 10, 80 and 250 words.

The output depends only on the fixed seed below (no tokenizer, no hub).
"""

from __future__ import annotations

import json
import os
import random
import sys

SEED = 20240601
WORDS = (
    "the cache radix tree prefix token server model request page block evict hit miss node key "
    "value batch decode prefill alpha beta gamma delta one two three four five"
).split()
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")


def _sentences(rng: random.Random, n_words: int) -> str:
    """About ``n_words`` words as sentences of 5-20 words, each ending in '.'."""
    out, left = [], n_words
    while left > 0:
        k = min(left, rng.randint(5, 20))
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)) + ".")
        left -= k
    return " ".join(out)


def make_prompts(seed: int = SEED) -> list:
    rng = random.Random(seed)
    prompts = [
        {"id": "short-0", "group": "short", "text": "the radix cache"},
        {"id": "short-1", "group": "short", "text": _sentences(rng, 12)},
        {"id": "short-2", "group": "short", "text": _sentences(rng, 30)},
    ]
    for i, n in enumerate((200, 450, 800)):
        prompts.append({"id": f"medium-{i}", "group": "medium", "text": _sentences(rng, n)})
    for i, n in enumerate((1500, 2750)):
        prompts.append({"id": f"long-{i}", "group": "long", "text": _sentences(rng, n)})
    prefix_a = _sentences(rng, 1200)
    for i in range(3):
        prompts.append({"id": f"famA-{i}", "group": "famA",
                        "text": prefix_a + " " + _sentences(rng, 60)})
    prefix_b = _sentences(rng, 400)
    for i, n in enumerate((10, 80, 250)):
        prompts.append({"id": f"famB-{i}", "group": "famB",
                        "text": prefix_b + " " + _sentences(rng, n)})
    return prompts


def write_prompts(path: str = DEFAULT_OUT, seed: int = SEED) -> int:
    prompts = make_prompts(seed)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, sort_keys=True) + "\n")
    return len(prompts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT_OUT
    n = write_prompts(path)
    print(f"make_prompts: wrote {n} prompts to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
