#!/usr/bin/env python3
"""Output digest of an engine build (issue #53): are two builds' answers bit-identical?

Starts `dspark-engine serve` (the binary given, on a free loopback port, with the serve
arguments after `--`), sends the 40 `tests/peer` prompts greedily (temperature 0, fixed
max_tokens) once one at a time and once from --streams concurrent clients, and prints per
stream count: the sha256 of the answers (each token's text, in prompt order, so batching
cannot reorder them), and the speculation counters from /metrics (steps, drafted and accepted
tokens) over that pass. Two builds with the same digest and the same counters served the
same tokens through the same drafts. A benchmark tool, not a test: it prints, asserts nothing.

Usage:
  python3 bench/digest.py --bin A/dspark-engine [--streams 1,16] [--max-tokens 96] \\
      -- --speculation dspark-markov --drafter drafters/smollm2-135m-dspark-markov \\
         --policy fixed --gamma 4
Stdlib only. The model defaults to the embedded SmolLM2 GGUF (scripts/fetch-models.sh).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTERS = {
    "steps": "dspark_engine_steps_total",
    "drafted": "dspark_spec_decode_num_draft_tokens_total",
    "accepted": "dspark_spec_decode_num_accepted_tokens_total",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}", json.dumps(body).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def counters(port: int) -> dict:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {k: 0.0 for k in COUNTERS}
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            # Summed over every label set (e.g. the step kind).
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def answer(port: int, prompt: str, max_tokens: int) -> list:
    r = post(port, "/v1/completions", {
        "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 0})
    c = r["choices"][0]
    # The answer token by token (the logprobs' token strings), not only its text.
    return [c["finish_reason"], (c.get("logprobs") or {}).get("tokens"), c["text"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    prompts = [json.loads(l)["prompt"] for l in open(os.path.join(ROOT, "tests/peer/prompts.jsonl"))]
    port = free_port()
    cmd = [a.bin, "serve", "--model", a.model, "--host", HOST, "--port", str(port),
           *a.serve_args]
    print("# " + " ".join(cmd))
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"digest-{port}.log"), "w")
    eng = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://{HOST}:{port}/ready", timeout=2)
                break
            except OSError:
                if eng.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the engine did not become ready (log: {log.name})")
                time.sleep(0.5)
        print(f"# {len(prompts)} tests/peer prompts, greedy, max_tokens {a.max_tokens}\n")
        print("| streams | sha256 of the answers | steps | drafted | accepted | seconds |")
        print("|---:|---|---:|---:|---:|---:|")
        for streams in [int(s) for s in a.streams.split(",")]:
            before, t = counters(port), time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                answers = list(pool.map(lambda p: answer(port, p, a.max_tokens), prompts))
            secs, after = time.monotonic() - t, counters(port)
            digest = hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16]
            d = {k: int(after[k] - before[k]) for k in COUNTERS}
            print(f"| {streams} | {digest} | {d['steps']} | {d['drafted']} | {d['accepted']} | {secs:.1f} |")
    finally:
        eng.terminate()
        eng.wait(timeout=60)


if __name__ == "__main__":
    main()
