#!/usr/bin/env python3
"""Automatic prefix caching on a multi-turn chat workload: the same engine with and without
`--no-prefix-cache` and, with `--peer`, llama.cpp's llama-server with its prompt cache (one
slot per concurrent user, per-slot prompt reuse and its host-memory prompt cache, both on by
default), alternated round by round in one sitting.

Workload: C concurrent users (closed loop) run conversations from a shared queue. Every
conversation starts with the same long system prompt (a shared prefix, as applications send:
the assistant's rules and a reference section, grown to `--system-tokens` tokens) and a user
question from tests/peer/prompts.jsonl, then runs TURNS turns: each turn re-sends the whole
history with the model's previous answers and a follow-up question, as chat clients do. Per
request it measures TTFT (first streamed content), e2e, the prompt, completion and cached
prompt tokens the server reports (`usage.prompt_tokens_details.cached_tokens`).

It prints two markdown tables (median over rounds, min-max in brackets): per setting, TTFT
p50/p90, e2e p50, requests/s, output tok/s and the fraction of prompt tokens served from the
cache; per setting and turn, TTFT p50/p95. It writes a PNG (TTFT per turn) and a JSON with
every record.

Examples (what docs/benchmarks.md records):
  python3 bench/prefix_cache.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --concurrency 4 --conversations 24 --turns 4 --rounds 3 --system-tokens 0 --out /tmp/prefix
  python3 bench/prefix_cache.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --concurrency 16 --conversations 32 --turns 4 --rounds 2 --system-tokens 1000 --peer \
      --out /tmp/prefix16
Only loopback: the engines it starts listen on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import http.client
import subprocess
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from engines import free_port, start_engine, stop, wait_ready

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
# The reference section that grows the system prompt to --system-tokens: a made-up service
# catalogue, the kind of context (tools, documents) applications put in front of every chat.
TEAMS = ["Payments", "Search", "Identity", "Storage", "Messaging", "Billing", "Analytics", "Mobile"]
LANGS = ["Rust", "Go", "Java", "Python", "TypeScript", "Kotlin"]
REGIONS = ["eu-west", "us-east", "ap-south", "eu-north", "us-west"]


def system_prompt(lines: int) -> str:
    """SYSTEM followed by `lines` catalogue entries (deterministic)."""
    if lines <= 0:
        return SYSTEM
    rows = [f"- svc-{i:03d}: a {LANGS[i % len(LANGS)]} service of the {TEAMS[i % len(TEAMS)]} team, "
            f"port {8000 + 7 * i}, runs in {REGIONS[i % len(REGIONS)]} and {REGIONS[(i + 2) % len(REGIONS)]}, "
            f"{2 + i % 5} replicas, on call: week {1 + i % 4}."
            for i in range(lines)]
    return SYSTEM + "\n\nReference, the company's services (use it when the user asks about them):\n" + "\n".join(rows)


def count_tokens(port: int, text: str) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/tokenize", json.dumps({"prompt": text}), {"content-type": "application/json"})
    return json.loads(c.getresponse().read())["count"]


def grow_system(port: int, target: int) -> str:
    """The shortest catalogue whose system prompt has at least `target` tokens."""
    lines = 0
    while target > 0 and count_tokens(port, system_prompt(lines)) < target:
        lines += 4
    return system_prompt(lines)


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
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run_workload(port: int, questions: list[str], system: str, args) -> tuple[list[dict], float]:
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
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
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
            "tok_per_s": sum(r["completion_tokens"] for r in records) / wall,
            "prompt_tokens_mean": prompt / max(len(records), 1)}


def start_llama_server(args, log: Path) -> tuple[subprocess.Popen, int]:
    """llama-server on the same GGUF: one slot per concurrent user, its defaults otherwise
    (`cache_prompt` per request and the host-memory prompt cache are on by default)."""
    port = free_port()
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
           "-np", str(args.concurrency), "-c", str(args.concurrency * args.ctx_per_slot),
           "-t", str(args.threads), "-tb", str(args.threads), "--no-webui"] + args.peer_extra.split()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, 300, what=f"llama-server (see {log})")
    return proc, port


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
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="grow the shared system prompt to at least this many tokens (0: the short rules alone)")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    ap.add_argument("--extra", default="", help="more serve flags for both engines")
    ap.add_argument("--peer", action="store_true", help="also measure llama-server with its prompt cache")
    ap.add_argument("--llama-server", default=str(Path.home() / ".cache/dspark/llama.cpp" /
                                                  os.environ.get("LLAMA_CPP_PY_VERSION", "0.3.36") / "bin/llama-server"))
    ap.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    ap.add_argument("--peer-extra", default="", help="more llama-server flags")
    ap.add_argument("--out", default="/tmp/prefix-cache")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(l)["prompt"] for l in (REPO / "tests/peer/prompts.jsonl").read_text().splitlines() if l.strip()]
    random.Random(args.seed).shuffle(prompts)
    questions = (prompts * (args.conversations // max(len(prompts), 1) + 1))[:args.conversations]
    settings = {"prefix cache": [], "--no-prefix-cache": ["--no-prefix-cache"]}
    if args.peer:
        settings["llama-server (prompt cache)"] = None
    results: dict[str, list[dict]] = {k: [] for k in settings}
    all_records: dict[str, list[list[dict]]] = {k: [] for k in settings}
    system = None
    for rnd in range(args.rounds):
        order = list(settings) if rnd % 2 == 0 else list(reversed(settings))
        for name in order:
            log = out / f"{rnd}-{name.strip('-').split(' (')[0].replace(' ', '-')}.log"
            if settings[name] is None:
                proc, port = start_llama_server(args, log)
            else:
                proc, port = start_engine(args.engine, args.model, settings[name] + args.extra.split(), log,
                                          kv_cache_mb=args.kv_cache_mb)
            try:
                if system is None:
                    if settings[name] is None:
                        raise SystemExit("measure one of this engine's settings first")
                    system = grow_system(port, args.system_tokens)
                    print(f"system prompt: {count_tokens(port, system)} tokens", flush=True)
                chat(port, [{"role": "user", "content": "warm up"}], 4)
                recs, wall = run_workload(port, questions, system, args)
            finally:
                stop(proc, grace=60)
            s = summary(recs, wall)
            results[name].append(s)
            all_records[name].append(recs)
            print(f"round {rnd} {name}: {json.dumps({k: round(v, 4) for k, v in s.items()})}", flush=True)
    # Same greedy answers with and without the cache (the first round of each).
    a = {(r["conversation"], r["turn"]): r["text"] for r in all_records["prefix cache"][0]}
    for other in list(settings)[1:]:
        b = {(r["conversation"], r["turn"]): r["text"] for r in all_records[other][0]}
        same = sum(a[k] == b.get(k) for k in a)
        print(f"\nidentical answers, prefix cache vs {other}: {same}/{len(a)}")
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.concurrency} users at once, "
          f"turn-1 prompts of {count_tokens_cached(all_records)} tokens (median), "
          f"{args.max_tokens} max tokens, {args.rounds} rounds (median [min-max])\n")
    cols = [("ttft_p50", "TTFT p50 (s)", 3), ("ttft_p90", "TTFT p90 (s)", 3), ("e2e_p50", "e2e p50 (s)", 3),
            ("req_per_s", "requests/s", 2), ("tok_per_s", "output tok/s", 1),
            ("cached_frac", "prompt tokens cached", 2), ("prompt_tokens_mean", "prompt tokens / request", 0)]
    print("| setting | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, rs in results.items():
        cells = []
        for key, _, nd in cols:
            xs = [r[key] for r in rs]
            cells.append(f"{statistics.median(xs):.{nd}f} [{min(xs):.{nd}f}-{max(xs):.{nd}f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nTTFT per turn, seconds (p50 / p95 of each round's requests; median [min-max] over rounds)\n")
    print("| setting | " + " | ".join(f"turn {t + 1} p50 | turn {t + 1} p95" for t in range(args.turns)) + " |")
    print("|---|" + "---:|---:|" * args.turns)
    for name, runs in all_records.items():
        cells = []
        for t in range(args.turns):
            for q in (0.5, 0.95):
                xs = [pct([r["ttft"] for r in recs if r["turn"] == t], q) for recs in runs]
                cells.append(f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    (out / "prefix_cache.json").write_text(json.dumps({"args": vars(args), "system": system, "summaries": results,
                                                       "records": all_records}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, runs in all_records.items():
            turns = list(range(args.turns))
            med = [statistics.median([r["ttft"] for recs in runs for r in recs if r["turn"] == t]) for t in turns]
            ax.plot([t + 1 for t in turns], med, marker="o", label=name)
        ax.set_xticks([t + 1 for t in range(args.turns)])
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT median (s)")
        ax.set_yscale("log")
        ax.set_title(f"Multi-turn chat, {args.concurrency} users: TTFT per turn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "prefix_cache.png", dpi=120)
        print(f"\nplot: {out / 'prefix_cache.png'}")
    except ImportError:
        print("matplotlib missing: no plot")
    return 0


def count_tokens_cached(all_records) -> int:
    """Median prompt tokens of turn-1 requests as this engine reports them."""
    xs = [r["prompt_tokens"] for recs in all_records["prefix cache"] for r in recs if r["turn"] == 0]
    return int(statistics.median(xs)) if xs else 0


if __name__ == "__main__":
    sys.exit(main())
