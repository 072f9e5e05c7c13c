#!/usr/bin/env python3
"""The cost of structured outputs: tokens/s with and without a JSON schema, with and without
speculative decoding (the shipped DSpark drafter), and the drafter's acceptance under the
constraint. One sitting, rounds alternating the modes.

Per engine setting (`plain`: no speculation; `dspark`: the shipped drafter and the dspark
policy, or `--spec-policy`) and per concurrency C, each round runs two closed-loop phases of
`--duration` seconds: `free` (no constraint) and `schema` (the request's schema from three
bounded schemas, `response_format: json_schema`), on prompts from tests/peer/prompts.jsonl
(each asked "Answer in JSON." in both phases, greedy, `--max-tokens`). It prints one
markdown table (median over rounds, min-max in brackets): completion tokens/s per phase,
schema/free, the extra milliseconds per token a schema costs at that load, and for
`dspark` the accepted fraction of drafted tokens and the accepted tokens per verify
(`accepted_draft_tokens / draft_tokens`, from `usage`). A JSON with every round goes to
`--out`.

Example (what docs/benchmarks.md records):
  python3 bench/structured.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --concurrency 1,16 --duration 30 --rounds 3 --out /tmp/structured.json
Only loopback: the engines it starts listen on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "python"))
from test_structured import SCHEMAS  # noqa: E402  (the schemas the tests validate)
from engines import start_engine, stop  # noqa: E402


def post(port: int, body: dict) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    if r.status != 200:
        raise RuntimeError(data)
    return data


def phase(port: int, prompts: list[str], conc: int, seconds: float, schema: bool, max_tokens: int) -> dict:
    """Closed loop: `conc` clients start requests for `seconds`; totals of those requests over
    the time until the last one finished."""
    stop = time.time() + seconds
    lock = threading.Lock()
    tot = {"tokens": 0, "requests": 0, "draft": 0, "accepted": 0, "invalid": 0, "cut": 0, "errors": 0}
    nxt = [0]

    def client():
        while time.time() < stop:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            body = {"model": "m", "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": prompts[i % len(prompts)] + "\nAnswer in JSON."}]}
            if schema:
                s = SCHEMAS[i % len(SCHEMAS)]
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "s", "schema": s, "strict": True}}
            try:
                r = post(port, body)
            except Exception as e:  # noqa: BLE001  (counted, and the client goes on)
                with lock:
                    tot["errors"] += 1
                print(f"request failed: {e}", file=sys.stderr)
                continue
            u = r["usage"]
            # A schema answer cut by --max-tokens (finish_reason "length") is counted as cut,
            # not invalid: only a completed answer must parse.
            ok, cut = True, r["choices"][0]["finish_reason"] == "length"
            if schema and not cut:
                try:
                    json.loads(r["choices"][0]["message"]["content"])
                except ValueError:
                    ok = False
            with lock:
                tot["tokens"] += u["completion_tokens"]
                tot["requests"] += 1
                tot["draft"] += u.get("draft_tokens", 0)
                tot["accepted"] += u.get("accepted_draft_tokens", 0)
                tot["invalid"] += 0 if ok else 1
                tot["cut"] += 1 if schema and cut else 0

    t0 = time.time()
    threads = [threading.Thread(target=client) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Every request started in the window counts, over the time until the last one ends.
    tot["seconds"] = time.time() - t0
    tot["tok_s"] = tot["tokens"] / tot["seconds"]
    return tot


def med(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--binary", default=os.environ.get(
        "DSPARK_ENGINE_BIN", str(Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "dspark-engine")))
    ap.add_argument("--drafter", default=str(REPO / "drafters" / "smollm2-135m-dspark-markov"))
    ap.add_argument("--spec-policy", default="dspark")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default="/tmp/structured.json")
    a = ap.parse_args()
    prompts = [json.loads(s)["prompt"][:600] for s in
               (REPO / "tests" / "peer" / "prompts.jsonl").read_text().splitlines() if s.strip()]
    concs = [int(c) for c in a.concurrency.split(",")]
    settings = {"plain": [], "dspark": ["--speculation", "dspark-markov", "--drafter", a.drafter,
                                        "--policy", a.spec_policy]}
    results = {name: {c: {"free": [], "schema": []} for c in concs} for name in settings}
    for rnd in range(a.rounds):
        for name, extra in settings.items():
            proc, port = start_engine(a.binary, a.model, extra, Path(f"/tmp/bench-structured-{name}.log"),
                                      max_model_len=2048)
            try:
                for c in concs:
                    # Alternate which phase goes first, round by round.
                    order = ["free", "schema"] if rnd % 2 == 0 else ["schema", "free"]
                    for mode in order:
                        r = phase(port, prompts, c, a.duration, mode == "schema", a.max_tokens)
                        results[name][c][mode].append(r)
                        print(f"round {rnd} {name} C={c} {mode}: {r['tok_s']:.1f} tok/s "
                              f"({r['requests']} requests, invalid {r['invalid']}, cut {r['cut']})", file=sys.stderr)
            finally:
                stop(proc, grace=60)
    Path(a.out).write_text(json.dumps({k: {str(c): v for c, v in d.items()} for k, d in results.items()}, indent=1))
    print("| engine | streams | free tok/s | schema tok/s | schema / free | extra ms per token (schema) "
          "| accepted / drafted (free) | accepted / drafted (schema) | schema requests (cut at max_tokens, invalid) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in settings:
        for c in concs:
            f, s = results[name][c]["free"], results[name][c]["schema"]
            ratio = [b["tok_s"] / x["tok_s"] for x, b in zip(f, s) if x["tok_s"]]
            extra = [1000 * c * (1 / b["tok_s"] - 1 / x["tok_s"]) for x, b in zip(f, s) if x["tok_s"] and b["tok_s"]]
            acc = lambda rs: [r["accepted"] / r["draft"] if r["draft"] else None for r in rs]  # noqa: E731
            print(f"| {name} | {c} | {med([r['tok_s'] for r in f])} | {med([r['tok_s'] for r in s])} | {med(ratio)} "
                  f"| {med(extra)} | {med(acc(f)) if name != 'plain' else '-'} | {med(acc(s)) if name != 'plain' else '-'} "
                  f"| {sum(r['requests'] for r in s)} ({sum(r['cut'] for r in s)}, {sum(r['invalid'] for r in s)}) "
                  f"| {sum(r['errors'] for r in f + s)} |")


if __name__ == "__main__":
    main()
