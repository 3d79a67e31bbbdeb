"""Generate ``chat_prompts.jsonl`` (deterministic): real-language prompts for the real model (SmolLM2).

Usage::

    python -m flexflow_sglang.tools.data.make_chat_prompts [OUT]   # default: chat_prompts.jsonl next to this file

Texts are rendered with SmolLM2's chat template (ChatML: ``<|im_start|>role\\n...<|im_end|>``), so the
server sees what ``/v1/chat/completions`` would send. Two workloads prefix caching is for:

* ``sys*-*``  -- shared-prefix families: one long system prompt (~60 to ~900 tokens) with different
  user questions (the first member asks the shortest question);
* ``chat*-t*`` -- multi-turn conversations: turn k is turn k-1's whole text plus a (fixed) assistant
  reply and the next user message, so every turn extends the previous conversation.

The output depends only on the fixed seed and the sentences below (no tokenizer, no hub).
"""

from __future__ import annotations

import json
import os
import random
import sys

SEED = 20261202
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_prompts.jsonl")

SENTENCES = """\
A radix tree stores every prompt prefix once, so two requests that share a system prompt share its KV cache.
When the device cache is full, the least recently used leaves are evicted first.
Moving a page of KV from host memory back to the GPU is far cheaper than recomputing it.
Prefill cost grows with the prompt length, while decode cost grows with the number of running requests.
A host tier keeps evicted pages in pinned memory so that a later request can load them back.
The path selector compares the direct link with relays through idle GPUs and with split transfers.
Tensor parallel all-reduce traffic must keep its bandwidth even while KV pages move on the same links.
A storage tier survives restarts, and a remote tier lets another node reuse what this node computed.
Every page key is a hash of the whole prefix before it, so a key names the KV of one page in context.
Checksums catch a corrupt page before it reaches the attention kernel.
A failed transfer must become a cache miss, never a wrong token.
The scheduler thread decodes for every running request, so it must never wait on a disk or a socket.
Greedy decoding picks the most likely token at every step, which makes outputs easy to compare.
The weather in the mountains changes quickly, and hikers should carry a warm jacket.
Bread dough rises faster in a warm kitchen than in a cold one.
A good cup of tea needs water that has just come to the boil.
The library opens at nine in the morning and closes at six in the evening.
Trains to the coast leave every half hour during the summer.
Rivers carry sand and stones down from the hills to the sea.
A small garden can grow tomatoes, beans and herbs with a few hours of sun a day.
The museum has a new exhibition about the history of navigation.
Bicycles are the fastest way to cross the old town at rush hour.
The recipe asks for two eggs, a cup of flour and a pinch of salt.
Owls hunt at night and rest during the day in hollow trees.
The committee will publish its report at the end of the month.
Light from the sun takes about eight minutes to reach the earth.
A lighthouse warns ships away from the rocks near the harbour.
The school choir practises every Thursday after lessons.
Clear instructions save time for everyone who reads them later.
The bridge was closed for repairs after the winter storms.
""".strip().splitlines()

SYSTEM_LEAD = [
    "You are a helpful assistant for the operators of a large language model service.",
    "You are a friendly travel guide who answers questions about a small coastal town.",
    "You are a patient tutor who explains ideas step by step.",
    "You are a careful editor who keeps answers short and precise.",
]
QUESTIONS = [
    "What is a radix tree?", "Why does prefix caching help?", "What should I pack for a hike?",
    "How do I bake bread?", "When does the library open?", "What does a lighthouse do?",
    "Summarise the notes above in one sentence.", "Which sentence above is about trains?",
    "Explain eviction in simple words.", "What is the capital of France?", "Name three herbs for a garden.",
    "How long does sunlight take to reach us?",
]
REPLIES = [
    "Sure. In short: it keeps shared prefixes once and lets requests reuse them.",
    "Here is a brief answer, based on the notes you gave me.",
    "Good question. The notes above cover most of it; the rest is common sense.",
    "In one sentence: do the cheap thing first and measure before you optimise.",
]


def chatml(messages) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + "<|im_start|>assistant\n"


def _notes(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(n))


def make(rng: random.Random) -> list:
    prompts = []
    # shared-prefix families: system prompts of ~3, 12, 40 and 75 sentences (~60-1000 tokens)
    for fam, n_sent in enumerate((3, 12, 40, 75)):
        system = SYSTEM_LEAD[fam % len(SYSTEM_LEAD)] + " Notes: " + _notes(rng, n_sent)
        qs = rng.sample(QUESTIONS, 4)
        qs.sort(key=len)
        for k, q in enumerate(qs):
            prompts.append({"id": f"sys{fam}-{k}", "group": f"sys{fam}",
                            "text": chatml([{"role": "system", "content": system}, {"role": "user", "content": q}])})
    # multi-turn conversations: 3 of 4 turns each
    for conv in range(3):
        messages = [{"role": "system", "content": SYSTEM_LEAD[conv % len(SYSTEM_LEAD)]}]
        for turn in range(4):
            user = rng.choice(QUESTIONS) + " " + _notes(rng, rng.randint(1, 6))
            messages.append({"role": "user", "content": user})
            prompts.append({"id": f"chat{conv}-t{turn}", "group": f"chat{conv}", "text": chatml(messages)})
            messages.append({"role": "assistant", "content": rng.choice(REPLIES) + " " + _notes(rng, rng.randint(1, 3))})
    return prompts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0] if argv else DEFAULT_OUT
    prompts = make(random.Random(SEED))
    with open(out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(p, sort_keys=True) + "\n")
    print(f"wrote {len(prompts)} prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
