#!/usr/bin/env python3
"""Automatic prefix caching on a multi-turn chat workload: the same engine with and without
`--no-prefix-cache`, alternated round by round in one sitting.

Workload: C concurrent conversations (closed loop). Every conversation starts with the same
long system prompt (a shared prefix, as applications send) and a user question from
tests/peer/prompts.jsonl, then runs TURNS turns: each turn re-sends the whole history with
the model's previous answers and a follow-up question, as chat clients do. Per request it
measures TTFT (first streamed content), e2e, the prompt tokens and the cached prompt
tokens the server reports (`usage.prompt_tokens_details.cached_tokens`).

It prints one markdown table (median over rounds, min-max in brackets): TTFT p50/p90, e2e
p50, requests/s, the fraction of prompt tokens served from the cache; writes a PNG (TTFT
per turn, both settings) and a JSON with every record.

Example (what docs/benchmarks.md records):
  python3 bench/prefix_cache.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --concurrency 4 --conversations 24 --turns 4 --rounds 3 --out /tmp/prefix
Only loopback: the engines it starts listen on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from engines import start_engine, stop

REPO = Path(__file__).resolve().parent.parent
SYSTEM = (
    "You are a helpful, precise assistant for a software company. Answer in plain English, "
    "in at most three sentences. Prefer concrete facts to general advice. When a question is "
    "ambiguous, pick the most common reading and say which one you picked. Never invent "
    "references, version numbers or APIs; if you do not know, say so. Keep code short and "
    "idiomatic, with no comments unless they explain why. Use metric units. Do not greet the "
    "user and do not repeat the question. If the user asks for a list, give at most five "
    "items, one per line, without numbering. If the user writes in another language, answer "
    "in that language. Be kind but direct. These rules apply to every answer in this chat."
)
FOLLOW_UPS = ["Can you say that more briefly?", "Why is that so?", "Give one example.",
              "What is a common mistake here?", "Summarise your answers in one line."]


def chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: {ttft, e2e, text, prompt_tokens, cached_tokens}."""
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft, text, usage = None, [], {}
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            content = ch.get("delta", {}).get("content")
            if content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(content)
    e2e = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else e2e, "e2e": e2e, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run_workload(port: int, questions: list[str], args) -> tuple[list[dict], float]:
    """C workers, each runs whole conversations from a shared queue; returns records."""
    queue = list(enumerate(questions))
    lock = threading.Lock()
    records: list[dict] = []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                cid, q = queue.pop(0)
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for turn in range(args.turns):
                rec = chat(port, msgs, args.max_tokens)
                rec.update(conversation=cid, turn=turn)
                with lock:
                    records.append(rec)
                msgs.append({"role": "assistant", "content": rec["text"]})
                msgs.append({"role": "user", "content": FOLLOW_UPS[(cid + turn) % len(FOLLOW_UPS)]})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(records, wall):
    prompt = sum(r["prompt_tokens"] for r in records)
    return {"requests": len(records), "ttft_p50": pct([r["ttft"] for r in records], 0.5),
            "ttft_p90": pct([r["ttft"] for r in records], 0.9),
            "e2e_p50": pct([r["e2e"] for r in records], 0.5), "req_per_s": len(records) / wall,
            "cached_frac": sum(r["cached_tokens"] for r in records) / max(prompt, 1),
            "prompt_tokens_mean": prompt / max(len(records), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default=os.environ.get(
        "DSPARK_ENGINE_BIN", str(Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "dspark-engine")))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", default="", help="more serve flags for both engines")
    ap.add_argument("--out", default="/tmp/prefix-cache")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(l)["prompt"] for l in (REPO / "tests/peer/prompts.jsonl").read_text().splitlines() if l.strip()]
    random.Random(args.seed).shuffle(prompts)
    questions = (prompts * (args.conversations // max(len(prompts), 1) + 1))[:args.conversations]
    settings = {"prefix cache": [], "--no-prefix-cache": ["--no-prefix-cache"]}
    results: dict[str, list[dict]] = {k: [] for k in settings}
    all_records: dict[str, list[list[dict]]] = {k: [] for k in settings}
    for rnd in range(args.rounds):
        order = list(settings) if rnd % 2 == 0 else list(reversed(settings))
        for name in order:
            proc, port = start_engine(args.engine, args.model, settings[name] + args.extra.split(),
                                      out / f"engine-{rnd}-{name.strip('-').replace(' ', '-')}.log")
            try:
                chat(port, [{"role": "user", "content": "warm up"}], 4)
                recs, wall = run_workload(port, questions, args)
            finally:
                stop(proc, grace=60)
            s = summary(recs, wall)
            results[name].append(s)
            all_records[name].append(recs)
            print(f"round {rnd} {name}: {json.dumps({k: round(v, 4) for k, v in s.items()})}", flush=True)
    # Same greedy answers with and without the cache (the first round of each).
    a = {(r["conversation"], r["turn"]): r["text"] for r in all_records["prefix cache"][0]}
    b = {(r["conversation"], r["turn"]): r["text"] for r in all_records["--no-prefix-cache"][0]}
    same = sum(a[k] == b.get(k) for k in a)
    print(f"\nidentical answers: {same}/{len(a)}")
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.concurrency} at once, "
          f"{args.max_tokens} max tokens, {args.rounds} rounds (median [min-max])\n")
    cols = [("ttft_p50", "TTFT p50 (s)", 3), ("ttft_p90", "TTFT p90 (s)", 3), ("e2e_p50", "e2e p50 (s)", 3),
            ("req_per_s", "requests/s", 2), ("cached_frac", "prompt tokens cached", 2),
            ("prompt_tokens_mean", "prompt tokens / request", 0)]
    print("| setting | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, rs in results.items():
        cells = []
        for key, _, nd in cols:
            xs = [r[key] for r in rs]
            cells.append(f"{statistics.median(xs):.{nd}f} [{min(xs):.{nd}f}-{max(xs):.{nd}f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    (out / "prefix_cache.json").write_text(json.dumps({"args": vars(args), "summaries": results,
                                                       "records": all_records}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, runs in all_records.items():
            turns = range(args.turns)
            med = [statistics.median([r["ttft"] for recs in runs for r in recs if r["turn"] == t]) for t in turns]
            ax.plot(list(turns), med, marker="o", label=name)
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT median (s)")
        ax.set_title("Multi-turn chat: TTFT per turn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "prefix_cache.png", dpi=120)
        print(f"\nplot: {out / 'prefix_cache.png'}")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
