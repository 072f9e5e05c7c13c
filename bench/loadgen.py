#!/usr/bin/env python3
"""Load generator for OpenAI-compatible chat servers (our engine and llama-server alike).

Streams `POST {url}/v1/chat/completions` (stream=true, stream_options.include_usage=true)
and measures per request:
  ttft   time from sending the request to the first non-empty content delta
  itl    gaps between consecutive content chunks; when the server reports
         usage.completion_tokens and it exceeds the number of chunks (several tokens per
         chunk), each gap is divided by the mean tokens per chunk, so ITL is per token
  e2e    time from sending to the end of the stream
  tokens usage.completion_tokens when the server reports it, else the number of content
         chunks (marked `tokens_estimated`)

Modes (each level runs until --duration seconds have passed or --requests requests have
been started, whichever is given; in-flight requests are then allowed to finish, bounded by
--request-timeout):
  --concurrency 1,4,16,32   closed loop: C workers, each sends its next request as soon as
                            the previous one ends
  --rate 2,4                open loop: Poisson arrivals at R req/s (seeded); at most
                            --max-inflight requests in flight, later arrivals are dropped
                            and counted

Per level it prints a markdown row: requests, errors, output throughput (tok/s over the
level's wall time), per-user tok/s (median over requests of decode speed (tokens-1)/(t_last-t_first),
scaled likewise when chunks carry several tokens),
TTFT and ITL p50/p95/p99, e2e p50. `--json-out` writes config, summaries and per-request
records; `--png` plots throughput against per-user tok/s (matplotlib).

Only loopback servers are accepted (127.0.0.0/8, ::1, localhost); anything else is refused.

Prompts: JSONL with a "prompt" field (sent as one user message) and optional "domain" and
"id"; default tests/peer/prompts.jsonl. Requests cycle through a seeded shuffle of them.

Example:
  python3 bench/loadgen.py --url http://127.0.0.1:8080 --model smollm2 \
      --concurrency 1,4,16,32 --duration 30 --max-tokens 128 --json-out /tmp/r.json
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

try:
    import aiohttp
except ImportError:  # pragma: no cover
    sys.exit("loadgen: aiohttp is required: pip install -r bench/requirements.txt")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "tests" / "peer" / "prompts.jsonl"
MAX_DURATION_S = 3600.0
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 1024


# ---------------------------------------------------------------------------------------
# loopback-only guard
# ---------------------------------------------------------------------------------------
def check_loopback(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise SystemExit(f"loadgen: refusing URL {url!r}: scheme must be http or https")
    host = parts.hostname
    if not host:
        raise SystemExit(f"loadgen: refusing URL {url!r}: no host")
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        if host != "localhost":
            raise SystemExit(
                f"loadgen: refusing URL {url!r}: only loopback servers are allowed "
                "(127.0.0.0/8, ::1, localhost)")
        addrs = [ipaddress.ip_address(ai[4][0].split("%")[0])
                 for ai in socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)]
    bad = [str(a) for a in addrs if not a.is_loopback]
    if bad or not addrs:
        raise SystemExit(f"loadgen: refusing URL {url!r}: {host} is not loopback ({bad})")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base


# ---------------------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------------------
@dataclass
class Result:
    level: str
    prompt_id: str
    domain: str
    start: float = 0.0          # seconds since level start
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    tokens_estimated: bool = True
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    itl: list[float] = field(default_factory=list)
    # dspark-engine's usage extension (speculative decoding); 0 for other servers
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def decode_rate(self) -> float | None:
        """Per-user decode speed: tokens after the first chunk / time from first to last
        content chunk (= (tokens-1)/span with one token per chunk)."""
        if self.error or self.tokens < 2 or self.chunks < 2 or not self._span or self._span <= 0:
            return None
        return self.tokens * (1.0 - 1.0 / self.chunks) / self._span

    _span: float | None = None


async def one_request(session, base, args, prompt, level, t_level) -> Result:
    r = Result(level=level, prompt_id=prompt.get("id", ""), domain=prompt.get("domain", ""))
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt["prompt"]}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
    }
    if not args.no_usage:
        body["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.extra_body:
        body.update(json.loads(args.extra_body))
    t0 = time.perf_counter()
    r.start = t0 - t_level
    chunk_times: list[float] = []
    usage_tokens = None
    try:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with session.post(f"{base}/v1/chat/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                txt = (await resp.text())[:200]
                r.error = f"HTTP {resp.status}: {txt}"
                return r
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    try:
                        ev = json.loads(data)
                    except json.JSONDecodeError:
                        continue
                    if "error" in ev:
                        r.error = f"stream error: {str(ev['error'])[:200]}"
                    u = ev.get("usage")
                    if u and u.get("completion_tokens") is not None:
                        usage_tokens = int(u["completion_tokens"])
                        r.draft_tokens = int(u.get("draft_tokens") or 0)
                        r.accepted_draft_tokens = int(u.get("accepted_draft_tokens") or 0)
                    for ch in ev.get("choices") or []:
                        delta = ch.get("delta") or {}
                        if delta.get("content"):
                            chunk_times.append(time.perf_counter())
                        if ch.get("finish_reason"):
                            r.finish_reason = ch["finish_reason"]
    except asyncio.TimeoutError:
        r.error = f"timeout after {args.request_timeout}s"
    except aiohttp.ClientError as e:
        r.error = f"{type(e).__name__}: {e}"[:200]
    t_end = time.perf_counter()
    r.e2e = t_end - t0
    r.chunks = len(chunk_times)
    if chunk_times:
        r.ttft = chunk_times[0] - t0
        r._span = chunk_times[-1] - chunk_times[0]
    if usage_tokens is not None:
        r.tokens, r.tokens_estimated = usage_tokens, False
    else:
        r.tokens = len(chunk_times)
    if len(chunk_times) >= 2:
        gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        scale = 1.0
        if not r.tokens_estimated and r.tokens > len(chunk_times):
            scale = (len(chunk_times) - 1) / (r.tokens - 1)  # 1 / mean tokens per gap
        r.itl = [g * scale for g in gaps]
    if not r.error and not chunk_times:
        r.error = "no content"
    return r


# ---------------------------------------------------------------------------------------
# levels
# ---------------------------------------------------------------------------------------
class PromptCycle:
    def __init__(self, prompts, seed):
        self.p = list(prompts)
        random.Random(seed).shuffle(self.p)
        self.i = 0

    def next(self):
        x = self.p[self.i % len(self.p)]
        self.i += 1
        return x


async def run_closed(session, base, args, conc, prompts) -> tuple[list[Result], float, int]:
    level = f"c{conc}"
    results: list[Result] = []
    started = 0
    t_level = time.perf_counter()
    deadline = t_level + args.duration if args.duration else math.inf

    async def worker():
        nonlocal started
        while True:
            if time.perf_counter() >= deadline:
                return
            if args.requests and started >= args.requests:
                return
            started += 1
            results.append(await one_request(session, base, args, prompts.next(), level, t_level))

    await asyncio.gather(*(worker() for _ in range(conc)))
    return results, time.perf_counter() - t_level, 0


async def run_open(session, base, args, rate, prompts, seed) -> tuple[list[Result], float, int]:
    level = f"r{rate:g}"
    rng = random.Random(seed)
    results: list[Result] = []
    tasks = []
    dropped = 0
    inflight = 0
    t_level = time.perf_counter()
    deadline = t_level + args.duration if args.duration else math.inf

    async def go(p):
        nonlocal inflight
        inflight += 1
        try:
            results.append(await one_request(session, base, args, p, level, t_level))
        finally:
            inflight -= 1

    n = 0
    t_next = t_level
    while True:
        t_next += rng.expovariate(rate)
        if t_next >= deadline or (args.requests and n >= args.requests):
            break
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        n += 1
        if inflight >= args.max_inflight:
            dropped += 1
            continue
        tasks.append(asyncio.create_task(go(prompts.next())))
    if tasks:
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t_level, dropped


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(level, mode, value, results, wall, dropped) -> dict:
    ok = [r for r in results if not r.error]
    toks = sum(r.tokens for r in ok)
    rates = [x for x in (r.decode_rate() for r in ok) if x is not None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    errs: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        if r.error:
            key = r.error.split(":")[0][:60]
            errs[key] = errs.get(key, 0) + 1
            examples.setdefault(key, r.error[:200])
    return {
        "level": level, "mode": mode, "value": value,
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_kinds": errs, "error_examples": examples, "dropped": dropped,
        "wall_s": wall, "output_tokens": toks,
        "tokens_estimated": any(r.tokens_estimated for r in ok),
        "throughput_tok_s": toks / wall if wall > 0 else 0.0,
        "req_s": len(ok) / wall if wall > 0 else 0.0,
        "per_user_tok_s_p50": statistics.median(rates) if rates else None,
        "per_user_tok_s_mean": statistics.fmean(rates) if rates else None,
        "ttft_ms": {f"p{q}": (pct(ttft, q) or 0) * 1e3 if ttft else None for q in (50, 95, 99)},
        "itl_ms": {f"p{q}": (pct(itl, q) or 0) * 1e3 if itl else None for q in (50, 95, 99)},
        "e2e_ms_p50": pct(e2e, 50) * 1e3 if e2e else None,
        "mean_output_tokens": toks / len(ok) if ok else 0.0,
        "draft_tokens": sum(r.draft_tokens for r in ok),
        "accepted_draft_tokens": sum(r.accepted_draft_tokens for r in ok),
        # draft tokens accepted / verified (None when the server did not speculate)
        "acceptance": (sum(r.accepted_draft_tokens for r in ok) / sum(r.draft_tokens for r in ok))
        if sum(r.draft_tokens for r in ok) else None,
    }


HEADER = ("| level | req | err | out tok | tok/s | per-user tok/s | TTFT p50/p95/p99 ms "
          "| ITL p50/p95/p99 ms | e2e p50 ms | accept % |\n"
          "|---|---:|---:|---:|---:|---:|---|---|---:|---:|")


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def row(s) -> str:
    t, i = s["ttft_ms"], s["itl_ms"]
    err = str(s["errors"]) + (f" (+{s['dropped']} dropped)" if s["dropped"] else "")
    return (f"| {s['level']} | {s['requests']} | {err} | {s['output_tokens']}"
            f"{'~' if s['tokens_estimated'] else ''} | {fmt(s['throughput_tok_s'])} "
            f"| {fmt(s['per_user_tok_s_p50'])} | {fmt(t['p50'])} / {fmt(t['p95'])} / {fmt(t['p99'])} "
            f"| {fmt(i['p50'], 2)} / {fmt(i['p95'], 2)} / {fmt(i['p99'], 2)} | {fmt(s['e2e_ms_p50'], 0)} "
            f"| {fmt(None if s.get('acceptance') is None else 100 * s['acceptance'])} |")


def plot(summaries, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = [s["per_user_tok_s_p50"] or 0 for s in summaries]
    ys = [s["throughput_tok_s"] for s in summaries]
    ax.plot(xs, ys, "o-")
    for s, x, y in zip(summaries, xs, ys):
        ax.annotate(s["level"], (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("per-user tok/s (median decode rate)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_prompts(path, domain):
    out = []
    with open(path) as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            if "prompt" not in d:
                raise SystemExit(f"loadgen: {path}:{n+1}: no 'prompt' field")
            d.setdefault("id", f"{Path(path).stem}-{n}")
            if domain and d.get("domain") not in domain.split(","):
                continue
            out.append(d)
    if not out:
        raise SystemExit(f"loadgen: no prompts in {path} (domain filter {domain!r})")
    return out


async def amain(args) -> int:
    base = check_loopback(args.url)
    prompts = load_prompts(args.prompts, args.domain)
    levels: list[tuple[str, float]] = []
    if args.concurrency:
        levels += [("closed", int(c)) for c in args.concurrency.split(",") if c.strip()]
    if args.rate:
        levels += [("open", float(r)) for r in args.rate.split(",") if r.strip()]
    if not levels:
        levels = [("closed", 1)]
    for mode, v in levels:
        if v <= 0 or (mode == "closed" and v > MAX_CONCURRENCY):
            raise SystemExit(f"loadgen: bad {mode} level {v}")
    max_conc = max([int(v) for m, v in levels if m == "closed"] + [args.max_inflight])
    # One connection per request: reusing idle keep-alive connections races with the
    # server closing them between levels (ServerDisconnectedError at 0 ms); a loopback
    # connect costs well under a millisecond.
    conn = aiohttp.TCPConnector(limit=max_conc + 4, force_close=True)
    summaries, records = [], []
    print(f"# loadgen: {base}  model={args.model}  max_tokens={args.max_tokens}  "
          f"prompts={len(prompts)} ({args.prompts})  "
          + (f"duration={args.duration}s/level" if args.duration else f"requests={args.requests}/level"),
          flush=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        if args.model == "auto":
            async with session.get(f"{base}/v1/models",
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                data = (await resp.json()).get("data") or []
            if not data:
                raise SystemExit("loadgen: --model auto: server lists no models")
            args.model = data[0]["id"]
            print(f"# model: {args.model} (from /v1/models)", flush=True)
        if args.warmup:
            wp = PromptCycle(prompts, args.seed + 1)
            ws = await asyncio.gather(*(one_request(session, base, args, wp.next(), "warmup",
                                                    time.perf_counter())
                                        for _ in range(args.warmup)))
            bad = [w.error for w in ws if w.error]
            if bad:
                print(f"# warmup errors: {bad[:3]}", flush=True)
                if len(bad) == len(ws):
                    print("loadgen: all warm-up requests failed; is the server up?", file=sys.stderr)
                    return 2
        print(HEADER, flush=True)
        for k, (mode, v) in enumerate(levels):
            pc = PromptCycle(prompts, args.seed)
            if mode == "closed":
                res, wall, dropped = await run_closed(session, base, args, int(v), pc)
                level = f"c{int(v)}"
            else:
                res, wall, dropped = await run_open(session, base, args, v, pc, args.seed + 100 + k)
                level = f"r{v:g}"
            s = summarize(level, mode, v, res, wall, dropped)
            summaries.append(s)
            print(row(s), flush=True)
            for r in res:
                d = asdict(r)
                d.pop("_span", None)
                if not args.json_itl:
                    d.pop("itl")
                records.append(d)
            for kind, n in s["error_kinds"].items():
                print(f"#   {level}: {n} x {kind}  (e.g. {s['error_examples'][kind]!r})",
                      flush=True)
    if args.json_out:
        out = {"config": {k: v for k, v in vars(args).items()}, "base_url": base,
               "summaries": summaries, "requests": records}
        tmp = args.json_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, args.json_out)
        print(f"# wrote {args.json_out}")
    if args.png:
        plot(summaries, args.png, args.title or f"{args.model} @ {base}")
        print(f"# wrote {args.png}")
    total = sum(s["requests"] for s in summaries)
    errors = sum(s["errors"] for s in summaries)
    return 1 if total and errors == total else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--url", required=True, help="server base URL, loopback only")
    ap.add_argument("--model", default="auto",
                    help="model name to send; 'auto' (default) takes the first of /v1/models")
    ap.add_argument("--concurrency", help="closed-loop levels, e.g. 1,4,16,32")
    ap.add_argument("--rate", help="open-loop Poisson levels in req/s, e.g. 2,4")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--duration", type=float, help="seconds per level")
    g.add_argument("--requests", type=int, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--domain", help="only prompts of these domains (comma list)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--max-inflight", type=int, default=256, help="open-loop in-flight cap")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos=true (llama-server extension) for fixed-length outputs")
    ap.add_argument("--no-usage", action="store_true", help="do not send stream_options")
    ap.add_argument("--extra-body", help="JSON object merged into every request body")
    ap.add_argument("--json-out")
    ap.add_argument("--json-itl", action="store_true", help="keep per-request ITL lists in JSON")
    ap.add_argument("--png")
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    if args.duration is not None and not (0 < args.duration <= MAX_DURATION_S):
        ap.error(f"--duration must be in (0, {MAX_DURATION_S}]")
    if args.requests is not None and not (0 < args.requests <= MAX_REQUESTS):
        ap.error(f"--requests must be in (0, {MAX_REQUESTS}]")
    if not (0 < args.request_timeout <= 3600):
        ap.error("--request-timeout must be in (0, 3600]")
    if args.max_tokens <= 0:
        ap.error("--max-tokens must be > 0")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
