#!/usr/bin/env python3
"""Single-stream wall clock of speculative decoding, one sitting: plain decoding, n-gram
lookup, the shipped DSpark drafter (and any other `--row`) served by `dspark-engine serve`,
and llama.cpp's llama-server on the same GGUF, each driven by bench/loadgen.py at
concurrency 1 (or `--concurrency N`) with the same prompts (default: data/prompts/code.jsonl, HumanEval tasks the
drafters never saw). Prints a markdown table (tokens/s per user, vs plain, vs llama.cpp,
draft acceptance, model-drafter runs per engine step: the share of steps that drafted
when single stream, total tokens/s) and writes it with every
loadgen JSON under --out.

Usage:
  python3 bench/spec_wallclock.py --model MODEL.gguf [--duration 30] [--temperature 0]
      [--row 'NAME=SERVE ARGS' ...] [--bin NAME=PATH ...] [--rounds N] [--no-peer] [--out DIR]
Default rows: plain; ngram (--policy dspark --gamma 7); dspark-markov with the shipped
drafter (--policy dspark --gamma 7). `--rounds N` runs all rows N times, round-robin, each
with a fresh server, and reports the median (and the range) per row: on a noisy VM one
30 s sitting per row moves by 10-20 %. `--bin NAME=PATH` serves row NAME with another
engine binary (A/B of two builds). Run it on a quiet machine.
"""
import argparse, json, os, shlex, subprocess, sys, time, urllib.request
from pathlib import Path

from engines import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache/dspark"))
DRAFTER = ROOT / "drafters/smollm2-135m-dspark-markov"
DEFAULT_ROWS = [
    "plain=--speculation none",
    "ngram=--speculation ngram --policy dspark --gamma 7",
    f"dspark-markov=--speculation dspark-markov --drafter {DRAFTER} --policy dspark --gamma 7",
]


def loadgen(url, args, out_json):
    cmd = [sys.executable, str(ROOT / "bench/loadgen.py"), "--url", url, "--concurrency", str(args.concurrency),
           "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
           "--temperature", str(args.temperature), "--prompts", str(args.prompts),
           "--json-out", str(out_json)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.load(open(out_json))["summaries"][0]
    if s["errors"]:
        raise SystemExit(f"{url}: {s['errors']} failed requests: {s['error_kinds']}")
    return s


def scrape(url):
    """Counters of the engine's /metrics page that say how often the drafter ran."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    want = {"dspark_engine_steps_total": "steps",
            "dspark_spec_decode_draft_skipped_steps_total": "skipped",
            "dspark_spec_decode_num_drafts_total": "drafts"}
    got = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if name in want:
            got[want[name]] = got.get(want[name], 0.0) + float(value)
    return got


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--row", action="append", help="NAME=extra serve args (repeatable)")
    ap.add_argument("--prompts", default=str(ROOT / "data/prompts/code.jsonl"))
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="skip llama-server")
    ap.add_argument("--concurrency", type=int, default=1, help="closed-loop streams (default 1: single stream)")
    ap.add_argument("--rounds", type=int, default=1, help="run all rows this many times, round-robin")
    ap.add_argument("--bin", action="append", default=[], help="NAME=PATH: engine binary for row NAME")
    ap.add_argument("--out", default=str(CACHE / f"bench/spec-wallclock-{time.strftime('%Y%m%d-%H%M%S')}"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    binary = os.environ.get("DSPARK_ENGINE_BIN") or str(
        Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release/dspark-engine")
    bins = dict(b.split("=", 1) for b in args.bin)
    specs = [spec.split("=", 1) for spec in args.row or DEFAULT_ROWS]
    runs = {name: [] for name, _ in specs}
    for rnd in range(max(1, args.rounds)):
        for name, extra in specs:
            port = free_port()
            cmd = [bins.get(name, binary), "serve", "--model", args.model, "--port", str(port),
                   "--threads", str(args.threads), "--served-model-name", "bench"] + shlex.split(extra)
            tag = name if args.rounds <= 1 else f"{name}.r{rnd}"
            log = open(out / f"{tag}.serve.log", "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_ready(f"http://127.0.0.1:{port}/ready", proc)
                s = loadgen(f"http://127.0.0.1:{port}", args, out / f"{tag}.json")
                c = scrape(f"http://127.0.0.1:{port}")
            finally:
                stop(proc)
            s["drafted_steps"] = ((c.get("drafts", 0) / c["steps"]) if c.get("steps") else None)
            runs[name].append(s)
            print(f"# {tag}: {s['per_user_tok_s_p50']:.1f} tok/s per user", flush=True)
    rows = []
    for name, extra in specs:
        rs = runs[name]
        tps = [r["per_user_tok_s_p50"] for r in rs]
        s = dict(rs[0])
        s["per_user_tok_s_p50"] = median(tps)
        s["range"] = (min(tps), max(tps))
        s["throughput_tok_s"] = median([r["throughput_tok_s"] for r in rs])
        s["ok"] = sum(r["ok"] for r in rs)
        accs = [r["acceptance"] for r in rs if r.get("acceptance") is not None]
        s["acceptance"] = median(accs) if accs else None
        ds = [r["drafted_steps"] for r in rs if r.get("drafted_steps") is not None]
        s["drafted_steps"] = median(ds) if ds and "--speculation none" not in extra else None
        rows.append((name, extra if name not in bins else f"{extra}; {bins[name]}", s))
    if not args.no_peer:
        v = os.environ.get("LLAMA_CPP_PY_VERSION", "0.3.36")
        server = CACHE / f"llama.cpp/{v}/bin/llama-server"
        port = free_port()
        cmd = [str(server), "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
               "-np", "1", "-c", "4096", "-t", str(args.threads), "-tb", str(args.threads),
               "--no-webui"]
        log = open(out / "llama-server.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc)
            s = loadgen(f"http://127.0.0.1:{port}", args, out / "llama-server.json")
        finally:
            stop(proc)
        rows.append(("llama.cpp llama-server", " ".join(cmd[3:]), s))
        print(f"# llama-server: {s['per_user_tok_s_p50']:.1f} tok/s per user", flush=True)
    plain = next((s["per_user_tok_s_p50"] for n, _, s in rows if n == "plain"), None)
    peer = rows[-1][2]["per_user_tok_s_p50"] if not args.no_peer else None
    streams = "Single stream" if args.concurrency <= 1 else f"{args.concurrency} streams"
    lines = [f"{streams}, {Path(args.prompts).name}, temperature {args.temperature}, "
             f"max_tokens {args.max_tokens}, {args.duration:g} s per row, {args.threads} threads, "
             f"{max(1, args.rounds)} round(s), {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| setup | tok/s per user (p50; median of rounds) | range | vs plain | vs llama.cpp "
             "| draft acceptance | drafts per step | total tok/s | requests |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, extra, s in rows:
        r = s["per_user_tok_s_p50"]
        lo, hi = s.get("range", (r, r))
        acc, ds = s.get("acceptance"), s.get("drafted_steps")
        lines.append(
            f"| {name} (`{extra}`) | {r:.1f} | {lo:.1f}-{hi:.1f} | "
            f"{f'{r / plain:.2f}x' if plain else '-'} | {f'{r / peer:.2f}x' if peer else '-'} | "
            f"{'-' if acc is None else f'{100 * acc:.1f} %'} | "
            f"{'-' if ds is None else f'{ds:.2f}'} | {s['throughput_tok_s']:.1f} | {s['ok']} |")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    print(f"# results in {out}")


if __name__ == "__main__":
    main()
