#!/usr/bin/env python3
"""Where a serving step spends its time: `dspark-engine serve` under a closed-loop load at one
concurrency level, sampled by `perf record` while the load runs, reported as the hottest
functions (self time, both threads of the kernel pool and the engine loop together) plus the
server's own counters over the same window (steps, drafting steps, draft tokens).

One profile per (policy, streams) pair; e.g. the four the issue asks for:
  python3 bench/perf_profile.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --speculation dspark-markov --drafter drafters/smollm2-135m-dspark-markov \\
      --cost-table /tmp/sweep/cost-table.json --policies none,dspark --concurrency 1,64 \\
      --seconds 15 --out /tmp/perf

Needs `perf` (Debian `linux-perf`) and permission to sample (root, or
kernel.perf_event_paranoid <= 1). Functions are grouped by name (the Rust hash suffix cut);
"[k]" are kernel symbols. The tables go to stdout and OUT/perf-POLICY-cC.txt.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engines import start_engine, stop
from policy_sweep import policy_args

REPO = Path(__file__).resolve().parent.parent
COUNTERS = ("dspark_engine_steps_total", "dspark_spec_decode_draft_steps_total",
            "dspark_spec_decode_num_draft_tokens_total",
            "dspark_spec_decode_num_accepted_tokens_total", "dspark_generation_tokens_total")


def counters(port: int) -> dict[str, float]:
    """The server's counters named in COUNTERS (summed over labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in COUNTERS:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def top_symbols(perf_data: Path, n: int) -> list[tuple[float, str]]:
    """(percent of samples, function) of the `n` hottest functions, by self time."""
    rep = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--stdio",
                          "--sort", "sym", "--percent-limit", "0.3"],
                         capture_output=True, text=True, check=True).stdout
    agg: dict[str, float] = collections.defaultdict(float)
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[(.)\]\s+(.*)$", line)
        if not m:
            continue
        sym = re.sub(r"::h[0-9a-f]{16}$", "", m.group(3).strip())
        agg[("[k] " if m.group(2) == "k" else "") + sym] += float(m.group(1))
    return sorted(((v, k) for k, v in agg.items()), reverse=True)[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", default=None, help="dspark-engine binary (default: policy_sweep's)")
    ap.add_argument("--speculation", default="dspark-markov")
    ap.add_argument("--drafter")
    ap.add_argument("--cost-table", help="the SPS(B) table the server plans with (needed by the "
                    "dspark policy; the engine's own profile at start-up when absent)")
    ap.add_argument("--policies", default="none,dspark")
    ap.add_argument("--gamma-max", type=int, default=7)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--seconds", type=float, default=15, help="sampled seconds per profile")
    ap.add_argument("--warmup", type=float, default=8, help="seconds of load before sampling")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", default=str(REPO / "tests" / "peer" / "prompts.jsonl"))
    ap.add_argument("--frequency", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.bin is None:
        import os
        cache = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
        args.bin = os.environ.get("DSPARK_ENGINE_BIN") or str(
            Path(os.environ.get("CARGO_TARGET_DIR", cache / "cargo-target")) / "release" / "dspark-engine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for spec in [p.strip() for p in args.policies.split(",")]:
        label, pargs = policy_args(spec, args.gamma_max, args.speculation)
        for level in [int(c) for c in args.concurrency.split(",")]:
            tag = f"{spec.replace(':', '-')}-c{level}"
            table = ["--cost-table", args.cost_table] if args.cost_table else []
            extra = [*table, "--max-running", str(max(64, level)), *pargs]
            if args.drafter and spec != "none":
                extra += ["--drafter", args.drafter]
            proc, port = start_engine(args.bin, args.model, extra, out / f"serve-{tag}.log")
            load = None
            try:
                dur = args.warmup + args.seconds + 5
                load = subprocess.Popen(
                    [sys.executable, str(REPO / "bench" / "loadgen.py"), "--url",
                     f"http://127.0.0.1:{port}", "--concurrency", str(level), "--duration",
                     str(dur), "--warmup", "0", "--max-tokens", str(args.max_tokens),
                     "--prompts", args.prompts],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(args.warmup)
                before = counters(port)
                data = out / f"perf-{tag}.data"
                subprocess.run(["perf", "record", "-q", "-F", str(args.frequency), "-o", str(data),
                                "-p", str(proc.pid), "--", "sleep", str(args.seconds)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                after = counters(port)
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
                stop(proc)
            d = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
            steps = max(d["dspark_engine_steps_total"], 1)
            lines = [f"## {label}, {level} streams: {args.seconds:.0f} s sampled",
                     "",
                     f"steps {d['dspark_engine_steps_total']:.0f} "
                     f"({1000 * args.seconds / steps:.2f} ms per step), "
                     f"tokens out {d['dspark_generation_tokens_total']:.0f} "
                     f"({d['dspark_generation_tokens_total'] / args.seconds:.1f} tok/s), "
                     f"drafting steps {d['dspark_spec_decode_draft_steps_total']:.0f}, "
                     f"draft tokens {d['dspark_spec_decode_num_draft_tokens_total']:.0f}, "
                     f"accepted {d['dspark_spec_decode_num_accepted_tokens_total']:.0f}",
                     "",
                     "| self % | function |", "|---:|---|"]
            lines += [f"| {p:.1f} | `{s[:110]}` |" for p, s in top_symbols(data, args.top)]
            text = "\n".join(lines) + "\n"
            (out / f"perf-{tag}.txt").write_text(text)
            print(text, flush=True)
            data.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
