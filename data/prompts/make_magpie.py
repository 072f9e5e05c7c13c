#!/usr/bin/env python3
"""Samples diverse drafter-training prompts from the target itself (Magpie-style, issue #5).

The templated prompts of make_prompts.py cover few phrasings (14 math templates, a few
dozen chat templates), and a drafter trained on them alone learns the templates: on the
disjoint eval prompts its first-position acceptance drops from ~0.5 to ~0.35. Here the
target writes the user turns: the chat template is opened up to a user turn, steered by a
domain system prompt and one example exchange, and the model samples (T = 1, top-p 0.95)
what a user would ask. The target then answers these prompts greedily when the dataset is
generated (`dspark-train train --prompts train-magpie.jsonl --generate-only`), so the
drafter is distilled on the target's own distribution over inputs as well as outputs.

Kept: user turns that ended by themselves (finish_reason "stop"), 20..600 characters,
without template tokens, deduplicated (case and whitespace folded), and sharing less than
half their content words (Jaccard) with any evaluation prompt (code.jsonl, math.jsonl,
chat.jsonl).

Usage: start a server on the target (dspark-engine serve --model SmolLM2... --port 8123),
then python3 data/prompts/make_magpie.py [--base-url http://127.0.0.1:8123/v1] [--per-domain 800]
[--seed-base N --exclude data/prompts/train-magpie.jsonl --out F] (a second, disjoint set).
Writes data/prompts/train-magpie.jsonl (committed; deterministic for a given server build
since every request carries its own seed).
"""
import argparse, concurrent.futures as cf, json, os, re

import openai

here = os.path.dirname(os.path.abspath(__file__))

# Per domain: a system prompt and one example exchange that steer what the user asks.
DOMAINS = {
    "code": (
        "You are a Python programming assistant. Users ask you to write, fix or explain Python code.",
        "Write a Python function that returns the number of vowels in a string.",
        "```python\ndef count_vowels(s: str) -> int:\n    return sum(1 for ch in s.lower() if ch in \"aeiou\")\n```",
    ),
    "math": (
        "You are a math tutor. The user gives you a short grade-school math word problem with numbers, and you solve it step by step.",
        "A shop sells pencils for $2 each and notebooks for $5 each. How much do 3 pencils and 4 notebooks cost?",
        "3 pencils cost 3 x $2 = $6 and 4 notebooks cost 4 x $5 = $20, so the total is $6 + $20 = $26.",
    ),
    "chat": (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        None,
        None,
    ),
}


def prefix(domain):
    system, user, assistant = DOMAINS[domain]
    p = f"<|im_start|>system\n{system}<|im_end|>\n"
    if user:
        p += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"
    return p + "<|im_start|>user\n"


STOP = set("a an and are as at be by can do does for from how i in is it me my of on or so "
           "that the this to what with you your".split())


def words(s):
    return set(re.findall(r"[a-z0-9]+", s.lower())) - STOP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8123/v1")
    ap.add_argument("--per-domain", type=int, default=800)
    ap.add_argument("--oversample", type=float, default=1.6)
    ap.add_argument("--out", default=os.path.join(here, "train-magpie.jsonl"))
    ap.add_argument("--seed-base", type=int, default=0,
                    help="added to every request seed: a new value samples a new prompt set")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a prompt file (jsonl) whose prompts are not repeated (repeatable)")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused")
    avoid = []
    for name in ["code.jsonl", "math.jsonl", "chat.jsonl"]:
        for line in open(os.path.join(here, name)):
            if line.strip():
                avoid.append(words(json.loads(line)["prompt"]))

    def sample(job):
        domain, seed = job
        r = client.completions.create(
            model="default", prompt=prefix(domain), max_tokens=96, temperature=1.0,
            top_p=0.95, seed=seed, stop=["<|im_end|>"])
        return domain, seed, r.choices[0].text.strip(), r.choices[0].finish_reason

    rows, seen = [], set()
    for path in a.exclude:
        for line in open(path):
            if line.strip():
                seen.add(" ".join(json.loads(line)["prompt"].lower().split()))
    for di, domain in enumerate(DOMAINS):
        n = int(a.per_domain * a.oversample)
        jobs = [(domain, a.seed_base + 1000 * di + i) for i in range(n)]
        kept = 0
        with cf.ThreadPoolExecutor(32) as ex:
            for d, seed, text, finish in ex.map(sample, jobs):
                if kept >= a.per_domain:
                    break
                key = " ".join(text.lower().split())
                if finish != "stop" or not 20 <= len(text) <= 600 or "<|" in text or key in seen:
                    continue
                w = words(text)
                if any(len(w & v) >= 0.5 * len(w | v) for v in avoid):
                    continue
                seen.add(key)
                rows.append({"id": f"magpie-{d}-{seed}", "domain": d, "prompt": text})
                kept += 1
        print(f"{domain}: kept {kept} of {n} sampled")
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
