#!/usr/bin/env python3
"""Table and plot of a bench/qwen_spec.sh run: output tok/s per configuration, prompt set and
concurrency (median [min-max] over rounds), the ratio to engine-none of the same round, and,
for the engine, the draft acceptance from /metrics.

Usage: python3 bench/qwen_spec_report.py OUT_DIR   (writes OUT_DIR/qwen-spec.png)
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    tps = defaultdict(dict)  # (cfg, set, level) -> {round: tok/s}
    for f in sorted(out.glob("r*-*.json")):
        m = re.match(r"r(\d+)-(.+)-([a-z]+)\.json$", f.name)
        if not m:
            continue
        rnd, cfg, pset = int(m[1]), m[2], m[3]
        for s in json.loads(f.read_text())["summaries"]:
            tps[(cfg, pset, s["level"])][rnd] = (s["throughput_tok_s"], s["requests"],
                                                s["errors"])
    cfgs = list(dict.fromkeys(k[0] for k in tps))
    print("| config | prompts | streams | requests/round | tok/s median [min-max] | vs engine-none |")
    print("|---|---|---|---:|---:|---:|")
    rows = []
    for (cfg, pset, level), by_round in sorted(tps.items(), key=lambda kv: (kv[0][1], kv[0][2], cfgs.index(kv[0][0]))):
        vals = [v[0] for v in by_round.values()]
        base = tps.get(("engine-none", pset, level), {})
        ratios = [by_round[r][0] / base[r][0] for r in by_round if r in base and base[r][0] > 0]
        med = statistics.median(vals)
        ratio = (f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                 if ratios else "-")
        errs = sum(v[2] for v in by_round.values())
        reqs = "/".join(str(v[1]) for v in by_round.values())
        print(f"| {cfg} | {pset} | {level[1:]} | {reqs}{f' ({errs} errors)' if errs else ''} | "
              f"{med:.2f} [{min(vals):.2f}-{max(vals):.2f}] | {ratio} |")
        rows.append((cfg, pset, level, med))
    for f in sorted(out.glob("r*-engine-*.metrics")):
        text = f.read_text()
        get = lambda name: sum(float(l.split()[-1]) for l in text.splitlines()
                               if l.startswith(name) and not l.startswith("#"))
        drafted = get("dspark_spec_decode_num_draft_tokens_total")
        accepted = get("dspark_spec_decode_num_accepted_tokens_total")
        blocks = get("dspark_spec_decode_num_drafts_total")
        lookup = get("dspark_spec_decode_lookup_drafts_total")
        lookup_acc = get("dspark_spec_decode_lookup_accepted_tokens_total")
        if drafted:
            print(f"\n{f.stem}: drafted {drafted:.0f}, accepted {accepted:.0f} "
                  f"({100 * accepted / drafted:.1f} %)"
                  + (f"; prompt lookup: {lookup:.0f} of {blocks:.0f} blocks, "
                     f"{lookup_acc:.0f} accepted tokens" if lookup else ""))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sets = sorted({r[1] for r in rows})
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, pset in zip(axes[0], sets):
        levels = sorted({r[2] for r in rows if r[1] == pset}, key=lambda l: int(l[1:]))
        width = 0.8 / max(1, len(cfgs))
        for i, cfg in enumerate(cfgs):
            ys = [next((r[3] for r in rows if r[:3] == (cfg, pset, l)), 0) for l in levels]
            ax.bar([j + i * width for j in range(len(levels))], ys, width, label=cfg)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))])
        ax.set_xticklabels([f"{l[1:]} stream(s)" for l in levels])
        ax.set_ylabel("output tok/s (median over rounds)")
        ax.set_title(f"Qwen2.5-Coder-1.5B Q4_K_M, {pset} prompts")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "qwen-spec.png", dpi=110)
    print(f"\n# wrote {out / 'qwen-spec.png'}")


if __name__ == "__main__":
    main()
