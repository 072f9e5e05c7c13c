#!/usr/bin/env python3
"""Markdown tables from `dspark-train eval --json` files: tau, per-position acceptance and
ECE per (drafter, domain), and each drafter's tau relative to a baseline drafter (default
`parallel`), per domain and averaged over domains (the issue's "Markov tau >= 1.2x parallel").

Usage: python3 bench/drafter_table.py EVAL.json [EVAL2.json ...] [--baseline parallel]
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--baseline", default="parallel")
    a = ap.parse_args()
    rows = []
    for f in a.files:
        doc = json.load(open(f))
        rows += [s for s in doc["stats"] if s["drafter"] != "plain"]
    if not rows:
        raise SystemExit("no drafter rows")
    gamma = max(len(s["acceptance"]) for s in rows)
    head = "| drafter | domain | tau | " + " | ".join(f"acc@{k + 1}" for k in range(gamma))
    print(head + " | ECE(prod c) | draft ms/cycle |")
    print("|" + "---|" * (gamma + 5))
    for s in rows:
        acc = [
            f"{x:.2f}" if r > 0 else "-"
            for x, r in zip(s["acceptance"], s["reached"])
        ]
        ece = s.get("ece_survival")
        ece = f"{100 * ece:.1f} %" if ece is not None else "-"
        ms = s.get("draft_ms_per_cycle") or 0
        ms = f"{ms:.2f}" if ms else "-"
        print(f"| {s['drafter']} | {s['domain']} | {s['tau']:.2f} | " + " | ".join(acc) + f" | {ece} | {ms} |")
    tau = {(s["drafter"], s["domain"]): s["tau"] for s in rows}
    domains = sorted({d for _, d in tau}, key=[s["domain"] for s in rows].index)
    base = {d: tau.get((a.baseline, d)) for d in domains}
    if any(v is None for v in base.values()):
        return
    print(f"\ntau / {a.baseline} tau\n")
    print("| drafter | " + " | ".join(domains) + " | mean |")
    print("|" + "---|" * (len(domains) + 2))
    for name in dict.fromkeys(s["drafter"] for s in rows):
        r = [tau[(name, d)] / base[d] for d in domains if (name, d) in tau]
        if len(r) != len(domains):
            continue
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in r) + f" | {sum(r) / len(r):.3f} |")


if __name__ == "__main__":
    main()
