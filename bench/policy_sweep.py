#!/usr/bin/env python3
"""Verify-policy sweep: the same engine, drafter and prompts under each `--policy`, over a
range of concurrency levels, to compare throughput against per-user speed (the Pareto view
of the DSpark paper) and check the scheduler's claim: `dspark` at or above the best other
policy at every load, and ahead of fixed gamma=16 at the highest load.

For each policy it starts `dspark-engine serve` on a loopback port with one shared SPS(B)
cost table (measured with `dspark-engine profile` first unless --cost-table is given), runs
bench/loadgen.py (closed loop) at each concurrency level, stops the engine, and finally
prints one markdown table and writes a PNG (per-user tok/s vs total tok/s, one curve per
policy) and a JSON with every summary.

Rounds: `--rounds N` repeats the whole sweep, alternating the policy order from level to
level and from round to round, so drifting background load hits every policy alike; the
tables report the median over rounds and the range (min-max). Each level runs a warm-up
request per stream first (loadgen) and should complete at least 4 requests per stream;
levels that did not are flagged. With `--drafter`, the cost table is profiled with the
drafter (its time per draft call, `draft_points`), in the same sitting, unless
`--cost-table` is given. `--natural` lets answers end at EOS as users' do (default: every
request runs to --max-tokens with ignore_eos, a fixed length).

Example (what docs/benchmarks.md records):
  python3 bench/policy_sweep.py --model ~/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --speculation dspark-markov --drafter drafters/smollm2-135m-dspark-markov \
      --policies none,fixed:3,dspark --gamma-max 7 --concurrency 1,4,16,64,128 \
      --duration 40 --rounds 2 --out /tmp/sweep
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engines import stop, wait_ready

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POLICIES = "none,fixed:4,fixed:8,fixed:16,threshold:0.4,dspark"


def policy_args(spec: str, gamma_max: int, speculation: str) -> tuple[str, list[str]]:
    """`none` | `fixed:G` | `threshold:T` | `dspark` -> (label, serve args)."""
    kind, _, val = spec.partition(":")
    if kind == "none":
        return "none", ["--speculation", "none"]
    base = ["--speculation", speculation]
    if kind == "fixed":
        g = int(val or 4)
        return f"fixed γ={g}", base + ["--policy", "fixed", "--gamma", str(g)]
    if kind == "threshold":
        t = float(val or 0.4)
        return f"threshold {t}", base + ["--policy", "threshold", "--gamma", str(gamma_max),
                                        "--threshold", str(t)]
    if kind == "dspark":
        return "dspark", base + ["--policy", "dspark", "--gamma", str(gamma_max)]
    raise SystemExit(f"policy_sweep: unknown policy {spec!r} (none, fixed:G, threshold:T, dspark)")


def level_length(args, streams: int) -> list[str]:
    """loadgen's length of one level: a request count, max(streams x --requests-per-stream,
    --min-requests), when either is set, else `--duration`. A count gives every policy the
    very same prompts (the seeded cycle, taken in order), so their ratio is not the noise
    of different prompt mixes (natural lengths differ by prompt)."""
    n = max(streams * args.requests_per_stream, args.min_requests)
    if n:
        return ["--requests", str(n)]
    return ["--duration", str(args.duration)]


def merge_prompts(paths: str, out: Path) -> Path:
    """One prompt file from a comma-separated list (a held-out set in several files)."""
    files = [Path(x.strip()) for x in paths.split(",") if x.strip()]
    if len(files) == 1:
        return files[0]
    merged = out / "prompts.jsonl"
    lines = []
    for f in files:
        lines += [ln for ln in f.read_text().splitlines() if ln.strip()]
    merged.write_text("\n".join(lines) + "\n")
    return merged


def start_busy(cores: int) -> list[subprocess.Popen]:
    """`cores` processes that each keep one core busy (the shared-CPU condition)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def run_level(args, table: str, spec: str, level: str, out: Path, rnd: int,
              prompts: Path) -> list[dict]:
    """Starts an engine with policy `spec`, runs one closed-loop level, stops it."""
    label, pargs = policy_args(spec, args.gamma_max, args.speculation)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [args.bin, "serve", "--model", args.model, "--host", "127.0.0.1", "--port",
           str(args.port), "--served-model-name", "bench", "--cost-table", table,
           "--max-running", str(max(64, int(level))), *pargs]
    if args.drafter and spec != "none":
        cmd += ["--drafter", args.drafter]
    tag = f"{spec.replace(':', '-')}-c{level}-r{rnd}"
    log = open(out / f"serve-{tag}.log", "w")
    print(f"# {label} @ {level} streams: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"{url}/ready", proc, what="policy_sweep: engine")
        jpath = out / f"loadgen-{tag}.json"
        lg = [sys.executable, str(REPO / "bench" / "loadgen.py"), "--url", url,
              "--model", "bench", "--concurrency", level, *level_length(args, int(level)),
              "--max-tokens", str(args.max_tokens),
              "--temperature", str(args.temperature), "--warmup", level,
              "--seed", str(args.seed + rnd), "--prompts", str(prompts), "--json-out", str(jpath)]
        if not args.natural:
            lg.append("--ignore-eos")
        subprocess.run(lg, check=True)
        data = json.loads(jpath.read_text())
        return [{"policy": label, "spec": spec, "round": rnd, **s} for s in data["summaries"]]
    finally:
        stop(proc, grace=60)
        log.close()
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    cache = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    ap.add_argument("--bin", default=os.environ.get("DSPARK_ENGINE_BIN") or str(
        Path(os.environ.get("CARGO_TARGET_DIR", cache / "cargo-target")) / "release" / "dspark-engine"),
        help="dspark-engine binary (default: the Makefile's build output)")
    ap.add_argument("--speculation", default="ngram")
    ap.add_argument("--drafter")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--gamma-max", type=int, default=16,
                    help="block size for threshold and dspark (the longest they may verify)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--duration", type=float, default=20)
    ap.add_argument("--requests-per-stream", type=int, default=0,
                    help="run each level until every stream completed this many measured "
                         "requests (after the warm-up) instead of for --duration seconds")
    ap.add_argument("--min-requests", type=int, default=0,
                    help="at least this many measured requests per level (e.g. the prompt "
                         "set's size, so every level sees every prompt)")
    ap.add_argument("--busy-cores", type=int, default=0,
                    help="keep this many cores busy with a background process while the "
                         "levels run (not while profiling): the shared-CPU condition")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default=str(REPO / "tests" / "peer" / "prompts.jsonl"),
                    help="prompt file(s), comma-separated (e.g. the held-out "
                         "data/prompts/chat.jsonl,data/prompts/code.jsonl,data/prompts/math.jsonl)")
    ap.add_argument("--cost-table", help="use this table instead of profiling first")
    ap.add_argument("--profile-max-batch", type=int, default=128)
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--natural", action="store_true",
                    help="answers end at EOS (default: ignore_eos, every request --max-tokens)")
    ap.add_argument("--seed", type=int, default=0, help="loadgen seed of round 0 (+1 per round)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = args.cost_table
    if not table:
        table = str(out / "cost-table.json")
        print(f"# profiling SPS(B) up to B={args.profile_max_batch} -> {table}", flush=True)
        prof = [args.bin, "profile", "--model", args.model, "--max-batch",
                str(args.profile_max_batch), "--output", table]
        if args.drafter:
            prof += ["--drafter", args.drafter, "--speculation", args.speculation]
        subprocess.run(prof, check=True)
    ct = json.loads(Path(table).read_text())
    print("# cost table: " + ", ".join(f"SPS({b})={s:.1f}" for b, s in ct["points"]))

    results = []
    specs = [p.strip() for p in args.policies.split(",")]
    levels = [c.strip() for c in args.concurrency.split(",")]
    # Level-major: every policy runs each load level back to back, the order alternating
    # from level to level and from round to round.
    prompts = merge_prompts(args.prompts, out)
    busy = start_busy(args.busy_cores)
    if busy:
        print(f"# {len(busy)} busy background process(es) while the levels run", flush=True)
    try:
        k = 0
        for rnd in range(args.rounds):
            for level in levels:
                for spec in (specs if k % 2 == 0 else specs[::-1]):
                    results.extend(run_level(args, table, spec, level, out, rnd, prompts))
                k += 1
    finally:
        for b in busy:
            b.kill()
            b.wait()
    results.sort(key=lambda r: (specs.index(r["spec"]), float(r["value"]), r["round"]))
    (out / "sweep.json").write_text(json.dumps({"cost_table": ct, "args": vars(args),
                                                "results": results}, indent=1))

    def med(xs):
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])

    def cell(rs, key):
        return [r[key] or 0 for r in rs]

    levels_f = sorted({r["value"] for r in results}, key=float)
    by = {(r["spec"], r["value"]): [] for r in results}
    for r in results:
        by[(r["spec"], r["value"])].append(r)
    print()
    mode = "natural lengths" if args.natural else f"{args.max_tokens} tokens, ignore_eos"
    if args.busy_cores:
        mode += f", {args.busy_cores} core(s) taken by a background process"
    print(f"Medians over {args.rounds} round(s) [min-max], {mode}, temperature {args.temperature}:")
    print()
    print("| policy | streams | tok/s | per-user tok/s | TTFT p50 ms | ITL p50 ms | accept % | requests |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    short = []
    for spec in specs:
        for lv in levels_f:
            rs = by.get((spec, lv))
            if not rs:
                continue
            tp = cell(rs, "throughput_tok_s")
            acc = [r["acceptance"] for r in rs if r.get("acceptance") is not None]
            acc_s = "-" if not acc else f"{100 * med(acc):.1f}"
            reqs = min(r["ok"] for r in rs)
            if reqs < 4 * int(lv):
                short.append(f"{rs[0]['policy']} @ {lv}")
            print(f"| {rs[0]['policy']} | {lv} | {med(tp):.1f} [{min(tp):.0f}-{max(tp):.0f}] "
                  f"| {med(cell(rs, 'per_user_tok_s_p50')):.1f} "
                  f"| {med([r['ttft_ms']['p50'] or 0 for r in rs]):.0f} "
                  f"| {med([r['itl_ms']['p50'] or 0 for r in rs]):.1f} | {acc_s} | {reqs} |")
    if short:
        print(f"\n# fewer than 4 completed requests per stream (raise --duration): {', '.join(short)}")
    # Ratios per round (same round, same level), then their median and range.
    if "none" in specs:
        print()
        others = [s for s in specs if s != "none"]
        names = [policy_args(s2, args.gamma_max, args.speculation)[0] for s2 in others]
        print("| streams | none tok/s | " + " | ".join(f"{n} / none" for n in names)
              + " | dspark / best other |")
        print("|---:|---:|" + "---:|" * len(others) + "---:|")
        for lv in levels_f:
            base = by.get(("none", lv))
            if not base:
                continue
            row = [f"{med(cell(base, 'throughput_tok_s')):.1f}"]
            for s2 in others:
                rs = by.get((s2, lv), [])
                ratios = [r["throughput_tok_s"] / b["throughput_tok_s"]
                          for r in rs for b in base if b["round"] == r["round"] and b["throughput_tok_s"]]
                row.append(f"{med(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios else "-")
            best = "-"
            if "dspark" in specs:
                rat = []
                for rnd in range(args.rounds):
                    at = {s2: next((r for r in by.get((s2, lv), []) if r["round"] == rnd), None) for s2 in specs}
                    d = at.get("dspark")
                    oth = [r for s2, r in at.items() if s2 != "dspark" and r]
                    if d and oth:
                        rat.append(d["throughput_tok_s"] / max(r["throughput_tok_s"] for r in oth))
                if rat:
                    best = f"{med(rat):.2f} [{min(rat):.2f}-{max(rat):.2f}]"
            row.append(best)
            print(f"| {lv} | " + " | ".join(row) + " |")
    results_by_policy = {}
    for r in results:
        results_by_policy.setdefault(r["policy"], []).append(r)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 5))
        for label, rs_all in results_by_policy.items():
            rs = []
            for lv in levels_f:
                at = [r for r in rs_all if r["value"] == lv]
                if at:
                    rs.append({"value": lv,
                               "per_user_tok_s_p50": med([r["per_user_tok_s_p50"] or 0 for r in at]),
                               "throughput_tok_s": med([r["throughput_tok_s"] for r in at])})
            xs = [r["per_user_tok_s_p50"] or 0 for r in rs]
            ys = [r["throughput_tok_s"] for r in rs]
            ax.plot(xs, ys, "o-", label=label, linewidth=2.5 if label == "dspark" else 1.2)
            for r, x, y in zip(rs, xs, ys):
                ax.annotate(str(r["value"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xlabel("per-user tok/s (median decode rate)")
        ax.set_ylabel("total output tok/s")
        ax.set_title(f"verify policies, {args.speculation} drafter (labels: concurrent streams)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=120)
        # The cost table the scheduler used: SPS(B) and the token throughput B * SPS(B).
        fig, ax = plt.subplots(figsize=(7, 4.5))
        bs = [b for b, _ in ct["points"]]
        sps = [v for _, v in ct["points"]]
        ax.plot(bs, sps, "o-", label="SPS(B): target forwards / s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in one target forward (B)")
        ax.set_ylabel("steps / s")
        ax2 = ax.twinx()
        ax2.plot(bs, [b * v for b, v in zip(bs, sps)], "s--", color="tab:orange",
                 label="B * SPS(B): tokens / s")
        ax2.set_ylabel("tokens / s")
        ax.set_title(f"SPS(B) of {ct['model_id']} on {ct['device']}")
        ax.grid(True, alpha=0.3)
        fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.88))
        fig.tight_layout()
        fig.savefig(out / "sps.png", dpi=120)
        print(f"\n# wrote {out / 'sweep.png'}, {out / 'sps.png'} and {out / 'sweep.json'}")
    except ImportError:
        print("# matplotlib missing: no PNG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
