#!/usr/bin/env python3
"""Merge one bench/compare.sh run (dspark-engine and llama.cpp on the same GGUF) into one
markdown table and two PNGs.

Usage: bench/compare.py RUN_DIR   (RUN_DIR has dspark/ from bench/engine.sh and llamacpp/
from bench/peer-llamacpp.sh)

SPS(B) rows (median of bench/engine.sh's PROFILE_RUNS profile runs): dspark `profile` (B sequences x 1 new token at context 256: a decode step;
and B sequences x 4 tokens: verify-shaped) against llama-batched-bench (B sequences x 1
token after a 32-token prompt: S_TG / B) and llama-bench pp B (one sequence of B tokens at
empty context: t/s / B).
"""
import json
import os
import re
import statistics
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def sps_points(path, log=None, section=None):
    """Raw measured SPS(B) from the profile's log lines under every `section` header (the
    cost table JSON is made non-increasing by a running minimum, which hides noisy points),
    the median over the runs; the JSON when there is no log."""
    if log and os.path.exists(log):
        runs, on = {}, False
        for line in open(log):
            if line.startswith("=="):
                on = section in line
                continue
            m = re.match(r"\s*B=\s*(\d+)\s+([\d.]+) steps/s", line)
            if on and m:
                runs.setdefault(int(m.group(1)), []).append(float(m.group(2)))
        if runs:
            return {b: statistics.median(v) for b, v in runs.items()}
    t = load(path)
    return {int(b): float(s) for b, s in t["points"]}


def throughput(path):
    d = load(path)
    return {s["value"]: s for s in d["summaries"] if s["mode"] == "closed"}


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def main():
    root = sys.argv[1]
    ds, lc = os.path.join(root, "dspark"), os.path.join(root, "llamacpp")
    dlog = os.path.join(root, "dspark.log")
    dec = sps_points(os.path.join(ds, "sps-decode-1.json"), dlog, "decode steps")
    ver = sps_points(os.path.join(ds, "sps-verify-1.json"), dlog, "verify-shaped")
    peer = load(os.path.join(lc, "bench-summary.json"))
    pp = {int(b): v / int(b) for b, v in peer["pp_ts"].items()}
    bb = {int(b): v / int(b) for b, v in peer["batched_tg_ts"].items()}
    tp_d = throughput(os.path.join(ds, "loadgen.json"))
    tp_l = throughput(os.path.join(lc, "loadgen.json"))
    out = []
    p = out.append
    load_txt = open(os.path.join(root, "load.txt")).read().strip().replace("\n", "; ")
    p(f"Run `{root}` ({load_txt})\n")
    tg = peer["tg"].get("tg128")
    p("### Single-stream decode\n")
    p("| | tok/s |\n|---|---:|")
    p(f"| dspark-engine, profile SPS(1) (1 token at context 256) | {fmt(dec.get(1))} |")
    c1 = tp_d.get(1)
    p(f"| dspark-engine, HTTP stream (loadgen c=1, per-user p50) | "
      f"{fmt(c1['per_user_tok_s_p50'] if c1 else None)} |")
    p(f"| llama.cpp llama-bench tg128 | {fmt(tg)} |")
    l1 = tp_l.get(1)
    p(f"| llama.cpp llama-server (loadgen c=1, per-user p50) | "
      f"{fmt(l1['per_user_tok_s_p50'] if l1 else None)} |")
    if tg and dec.get(1):
        p(f"\nratio dspark SPS(1) / llama-bench tg128 = {dec[1] / tg:.2f}\n")
    p("### SPS(B): forward steps per second with B new tokens\n")
    p("| B | dspark decode (B seqs x 1) | dspark verify (B/4 seqs x 4)* | llama-batched-bench S_TG/B "
      "| llama-bench pp B / B |")
    p("|---:|---:|---:|---:|---:|")
    bs = sorted(set(dec) | set(bb) | set(pp))
    for b in bs:
        p(f"| {b} | {fmt(dec.get(b))} | {fmt(ver.get(b))} | {fmt(bb.get(b))} | {fmt(pp.get(b))} |")
    p("\n*verify rows: B counts new tokens; the profile runs ceil(B/4) sequences of 4 tokens.\n")
    for name, t in (("dspark decode", dec), ("dspark verify", ver), ("llama-batched-bench", bb),
                    ("llama-bench pp", pp)):
        if t.get(1) and t.get(4):
            p(f"- SPS(4)/SPS(1), {name}: {t[4] / t[1]:.2f}")
    p("\n### Total throughput, closed loop, 128 output tokens per request\n")
    p("| streams | dspark tok/s | llama-server tok/s | ratio | dspark TTFT p50 ms | llama TTFT p50 ms "
      "| dspark ITL p50 ms | llama ITL p50 ms |")
    p("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in sorted(set(tp_d) | set(tp_l)):
        a, b = tp_d.get(c), tp_l.get(c)
        ta = a["throughput_tok_s"] if a else None
        tb = b["throughput_tok_s"] if b else None
        r = ta / tb if ta and tb else None
        p(f"| {c} | {fmt(ta)} | {fmt(tb)} | {fmt(r, 2)} | "
          f"{fmt(a['ttft_ms']['p50'] if a else None, 0)} | {fmt(b['ttft_ms']['p50'] if b else None, 0)} | "
          f"{fmt(a['itl_ms']['p50'] if a else None)} | {fmt(b['itl_ms']['p50'] if b else None)} |")
    print("\n".join(out))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: no PNG)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for t, label, style in ((dec, "dspark-engine decode", "o-"), (ver, "dspark-engine verify x4", "s--"),
                            (bb, "llama.cpp batched-bench", "^-"), (pp, "llama.cpp pp B", "v:")):
        ks = sorted(t)
        axes[0].plot(ks, [t[k] for k in ks], style, label=label)
        axes[1].plot(ks, [k * t[k] for k in ks], style, label=label)
    for ax, yl in ((axes[0], "SPS(B)  steps/s"), (axes[1], "B x SPS(B)  tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("B (new tokens per forward)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("SPS(B): dspark-engine vs llama.cpp, same GGUF, same run")
    fig.tight_layout()
    fig.savefig(os.path.join(root, "compare-sps.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for tp, label in ((tp_d, "dspark-engine"), (tp_l, "llama-server")):
        ks = sorted(tp)
        ax.plot(ks, [tp[k]["throughput_tok_s"] for k in ks], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("total tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(root, "compare-throughput.png"), dpi=110)
    print(f"\nPNGs: {root}/compare-sps.png, {root}/compare-throughput.png")


if __name__ == "__main__":
    main()
