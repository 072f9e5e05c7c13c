#!/usr/bin/env python3
"""Adversarial benchmark (issue #51): hostile requests against a serving engine while a
normal load runs. A benchmark, not a test: it asserts nothing, it measures.

Starts `dspark-engine serve` on the default model (SmolLM2-135M-Instruct) on a free
loopback port, keeps --streams concurrent streaming chat requests going (the normal load),
and sends each hostile case below one after the other. Per case it prints a markdown row:
  status   the HTTP status of the hostile request (or `reset` / `timeout`)
  seconds  how long the hostile request took
  load p99 the normal load's p99 end-to-end latency over the requests that overlapped
           the case (and how many did)
  RSS      the engine's resident set after the case (VmRSS, MiB)
  note     what the answer said (finish reason, error code, ...)
The first row is the load alone (no hostile request) for the same window.

Usage:
  python3 bench/adversarial.py [--bin PATH] [--model GGUF] [--streams 4] [--window 5]
Stdlib only. The machine it runs on is noted in the output (nproc, load average): on a
shared machine the latencies carry the other work too.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, timeout=120.0, raw=None, headers=None):
    """(status or 'reset'/'timeout', parsed JSON or text, seconds)."""
    t = time.monotonic()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode("utf-8", "replace")
        try:
            out = json.loads(text)
        except ValueError:
            out = text
        return r.status, out, time.monotonic() - t
    except socket.timeout:
        return "timeout", None, time.monotonic() - t
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return f"reset ({type(e).__name__})", None, time.monotonic() - t
    finally:
        conn.close()


def chat(content, **extra):
    body = {"model": "default", "messages": [{"role": "user", "content": content}]}
    body.update(extra)
    return body


class Load:
    """--streams workers, each streaming one short chat answer after another; records
    (start, end, ok) per request."""

    def __init__(self, port, streams, max_tokens):
        self.port, self.streams, self.max_tokens = port, streams, max_tokens
        self.records: list[tuple[float, float, bool]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(streams)]

    def worker(self, i):
        prompts = ["Write a short poem about the sea.", "Explain what a hash map is.",
                   "List three uses of copper.", "Describe a sunrise in two sentences."]
        k = 0
        while not self.stop.is_set():
            body = chat(prompts[(i + k) % len(prompts)], max_tokens=self.max_tokens, stream=True,
                        temperature=0.7, seed=k)
            k += 1
            t = time.monotonic()
            ok = False
            conn = http.client.HTTPConnection(HOST, self.port, timeout=300)
            try:
                conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                             headers={"content-type": "application/json"})
                r = conn.getresponse()
                text = r.read().decode("utf-8", "replace")
                ok = r.status == 200 and "[DONE]" in text
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            with self.lock:
                self.records.append((t, time.monotonic(), ok))

    def start(self):
        for t in self.threads:
            t.start()

    def p99_between(self, t0, t1):
        """p99 e2e latency of the requests that overlapped [t0, t1], and their count."""
        with self.lock:
            lat = [e - s for s, e, ok in self.records if ok and e >= t0 and s <= t1]
            failed = sum(1 for s, e, ok in self.records if not ok and e >= t0 and s <= t1)
        if not lat:
            return float("nan"), 0, failed
        lat.sort()
        return lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))], len(lat), failed


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def note_of(status, out):
    if isinstance(out, dict):
        if "error" in out:
            e = out["error"]
            return f"{e.get('code') or e.get('type')}: {str(e.get('message'))[:70]}"
        ch = out.get("choices") or []
        if ch:
            reasons = sorted({c.get("finish_reason") for c in ch})
            calls = sum(len((c.get("message") or {}).get("tool_calls") or []) for c in ch)
            extra = f", {calls} call(s)" if calls else ""
            return f"{len(ch)} choice(s), finish {','.join(map(str, reasons))}{extra}"
        return "ok"
    return "" if out is None else str(out)[:60]


def cases(admin_token):
    rec = {"type": "object", "properties": {"l": {"$ref": "#"}, "r": {"$ref": "#"},
           "a": {"type": "array", "items": {"$ref": "#"}, "minItems": 64}},
           "required": ["l", "r", "a"]}
    branching = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"anyOf": [
        {"type": "integer"}, {"type": "string"}, {"type": "array", "items": {"$ref": "#"}}]}
        for i in range(8)}} for _ in range(8)]}
    three = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
             "score": {"type": "number"}}, "required": ["name", "age", "score"]}
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    many_tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(5000)]
    rf = lambda s: {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}
    four_mb = json.dumps(chat("x", stop=[str(i) * (1 << 20) for i in range(4)])).encode()
    twenty_mb = json.dumps(chat("x", stop=["y" * (20 << 20)])).encode()
    yield "recursive $ref schema (300 B, minItems 64)", dict(
        body=chat("x", max_tokens=60, response_format=rf(rec)))
    yield "4 MB body (four 1 MB stop strings)", dict(raw=four_mb)
    yield "20 MB body", dict(raw=twenty_mb)
    yield "tool_choice required (1 tool, 200 tokens)", dict(
        body=chat("What is the weather in Paris?", max_tokens=200, temperature=0.8, seed=1,
                  tools=weather, tool_choice="required"))
    yield "tool_choice auto, parallel_tool_calls false", dict(
        body=chat("What is the weather in Paris? Use the tool.", max_tokens=200, temperature=0.8,
                  seed=1, tools=weather, tool_choice="auto", parallel_tool_calls=False))
    yield "3-field json_schema, max_tokens 160", dict(
        body=chat("Describe a fictional athlete as JSON.", max_tokens=160, temperature=0.8, seed=3,
                  response_format=rf(three)))
    yield "user content null", dict(
        body={"model": "default", "messages": [{"role": "user", "content": None}]})
    yield "branching schema (8 x 8 anyOf, recursive)", dict(
        body=chat("x", max_tokens=60, response_format=rf(branching)))
    yield "n = 100000", dict(body=chat("x", max_tokens=1, n=100000))
    yield "100k logit_bias entries", dict(
        body=chat("x", max_tokens=4, logit_bias={str(i): 1 for i in range(100000)}))
    yield "5,000 tools", dict(body=chat("x", max_tokens=4, tools=many_tools))
    yield "50k messages", dict(body={"model": "default", "max_tokens": 4, "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(50001)]})
    yield "nested-quantifier regex", dict(
        body=chat("x", max_tokens=30, guided_regex="((a+)+)+(b*)*c{1,1000}{1,1000}"))
    if admin_token:
        yield "admin token + 256 bytes", dict(
            admin=True, headers={"authorization": "Bearer " + admin_token + "x" * 256})
    yield "200 streams dropped after their first token", dict(drop=200)


def drop_streams(port, n):
    """Opens n streams, reads until the first content chunk, hangs up; returns how many
    got a first chunk."""
    got = 0
    def one():
        nonlocal got
        s = socket.create_connection((HOST, port), timeout=120)
        body = json.dumps(chat("Tell me a long story.", max_tokens=500, stream=True)).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        buf = b""
        while b"content" not in buf:
            d = s.recv(4096)
            if not d:
                break
            buf += d
        if b"content" in buf:
            got += 1
        s.close()
    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tgt = os.environ.get("CARGO_TARGET_DIR", "target")
    cache = os.environ.get("DSPARK_CACHE", os.path.expanduser("~/.cache/dspark"))
    ap.add_argument("--bin", default=os.environ.get("DSPARK_ENGINE_BIN", f"{tgt}/release/dspark-engine"))
    ap.add_argument("--model", default=f"{cache}/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams of the normal load")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per normal-load answer")
    ap.add_argument("--window", type=float, default=5.0,
                    help="seconds of load measured after each case (and for the load-alone row)")
    ap.add_argument("--case-timeout", type=float, default=120.0)
    a = ap.parse_args()

    port, admin_port = free_port(), free_port()
    token = "adversarial-bench-token"
    env = dict(os.environ, DSPARK_ADMIN_TOKEN=token)
    cmd = [a.bin, "serve", "--model", a.model, "--host", HOST, "--port", str(port),
           "--admin-port", str(admin_port)]
    log = open("/tmp/adversarial-serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            st, _, _ = request(port, "GET", "/ready", timeout=2)
            if st == 200:
                break
            if proc.poll() is not None:
                sys.exit(f"the engine exited: see /tmp/adversarial-serve.log")
            time.sleep(0.2)
        else:
            sys.exit("the engine never became ready")
        print(f"# {' '.join(cmd)}")
        print(f"# machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start "
              "(a shared machine: latencies include other work)")
        print(f"# normal load: {a.streams} streams, {a.max_tokens} tokens each; window {a.window} s")
        print()
        print("| case | status | seconds | load p99 (s) during [n, failed] | RSS after (MiB) | note |")
        print("|---|---|---|---|---|---|")
        load = Load(port, a.streams, a.max_tokens)
        load.start()
        time.sleep(a.window)  # warm-up: the first answers prefill cold
        t0 = time.monotonic()
        time.sleep(a.window)
        p99, n, failed = load.p99_between(t0, time.monotonic())
        print(f"| (load alone) | - | - | {p99:.2f} [{n}, {failed}] | {rss_mib(proc.pid):.0f} | |", flush=True)
        for name, c in cases(token):
            t0 = time.monotonic()
            if "drop" in c:
                got = drop_streams(port, c["drop"])
                secs = time.monotonic() - t0
                # What is still running once they are gone (the load's own streams aside).
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    _, r, _ = request(port, "GET", "/ready", timeout=5)
                    running = r.get("requests_running", -1) if isinstance(r, dict) else -1
                    if 0 <= running <= a.streams:
                        break
                    time.sleep(0.2)
                status, note = f"{got} first tokens", f"{running} running after (load: {a.streams})"
            elif c.get("admin"):
                status, out, secs = request(admin_port, "GET", "/admin/v1/state",
                                            headers=c["headers"], timeout=a.case_timeout)
                note = note_of(status, out)
            else:
                status, out, secs = request(port, "POST", "/v1/chat/completions", body=c.get("body"),
                                            raw=c.get("raw"), timeout=a.case_timeout)
                note = note_of(status, out)
            time.sleep(a.window)
            p99, n, failed = load.p99_between(t0, time.monotonic())
            print(f"| {name} | {status} | {secs:.2f} | {p99:.2f} [{n}, {failed}] | "
                  f"{rss_mib(proc.pid):.0f} | {note.replace('|', '/')} |", flush=True)
        load.stop.set()
        for t in load.threads:
            t.join(timeout=300)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            print("# the engine ignored SIGTERM for 60 s (killed)")


if __name__ == "__main__":
    main()
