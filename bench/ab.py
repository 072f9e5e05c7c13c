#!/usr/bin/env python3
"""Summarise a bench/ab.sh run: per build (A, B) the median over its runs of SPS(B) (decode
steps) and loadgen output throughput per stream count, the min-max over runs, and B/A.

Usage: bench/ab.py RUN_DIR   (RUN_DIR has A-1/, B-2/, B-3/, A-4/ from bench/engine.sh)
"""
import glob
import json
import os
import re
import statistics
import sys


def sps(log):
    out, on = {}, False
    for line in open(log):
        if line.startswith("=="):
            on = "decode steps" in line
            continue
        m = re.match(r"\s*B=\s*(\d+)\s+([\d.]+) steps/s", line)
        if on and m:
            out[int(m.group(1))] = float(m.group(2))
    return out


def tput(path):
    d = json.load(open(path))
    return {s["value"]: s["throughput_tok_s"] for s in d["summaries"] if s["mode"] == "closed"}


def main():
    root = sys.argv[1]
    runs = {"A": [], "B": []}
    for d in sorted(glob.glob(os.path.join(root, "[AB]-*"))):
        if not os.path.isdir(d):
            continue
        side = os.path.basename(d)[0]
        runs[side].append({"sps": sps(d + ".log"), "tput": tput(os.path.join(d, "loadgen.json"))})

    def cell(side, key, x):
        v = [r[key][x] for r in runs[side] if x in r[key]]
        return (statistics.median(v), min(v), max(v)) if v else None

    def fmt(c):
        return "-" if c is None else f"{c[0]:.1f} [{c[1]:.1f}-{c[2]:.1f}]"

    print(f"{len(runs['A'])} runs of A, {len(runs['B'])} of B (median [min-max])\n")
    print("| measure | A | B | B/A |")
    print("|---|---:|---:|---:|")
    levels = sorted({x for side in runs.values() for r in side for x in r["tput"]})
    for key, label, xs in [("sps", "SPS({}) decode, steps/s", [1, 4, 16, 64]),
                           ("tput", "throughput at {} streams, tok/s", levels)]:
        for x in xs:
            a, b = cell("A", key, x), cell("B", key, x)
            ratio = f"{b[0] / a[0]:.3f}" if a and b else "-"
            print(f"| {label.format(x)} | {fmt(a)} | {fmt(b)} | {ratio} |")


if __name__ == "__main__":
    main()
