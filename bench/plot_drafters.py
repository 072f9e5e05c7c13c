#!/usr/bin/env python3
"""PNG plots of `dspark-engine eval --json FILE` (issue #5): per-position conditional
acceptance per domain, tau per domain, and the reliability diagram of the model drafters'
confidences. Usage: python3 bench/plot_drafters.py FILE.json OUT_DIR"""
import json, os, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

doc = json.load(open(sys.argv[1]))
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
stats = doc["stats"]
domains = sorted({s["domain"] for s in stats}, key=lambda d: ["code", "math", "chat"].index(d) if d in ["code", "math", "chat"] else 9)
drafters = [d for d in dict.fromkeys(s["drafter"] for s in stats) if d != "plain"]
get = {(s["drafter"], s["domain"]): s for s in stats}
palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
color = {d: palette[i % len(palette)] for i, d in enumerate(drafters)}

fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.4), sharey=True, squeeze=False)
for ax, dom in zip(axes[0], domains):
    for d in drafters:
        s = get.get((d, dom))
        if not s:
            continue
        ks = [k + 1 for k, n in enumerate(s["reached"]) if n > 0]
        ax.plot(ks, [s["acceptance"][k - 1] for k in ks], marker="o", label=d, color=color[d])
    ax.set_title(f"{dom}")
    ax.set_xlabel("block position k")
    ax.grid(alpha=0.3)
axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
axes[0][-1].legend(fontsize=8)
fig.suptitle(f"{doc['model']}: conditional acceptance, gamma={doc['gamma']}, greedy")
fig.tight_layout()
fig.savefig(os.path.join(out, "acceptance_per_position.png"), dpi=110)

fig, ax = plt.subplots(figsize=(5.5, 3.4))
w = 0.8 / max(1, len(drafters))
for i, d in enumerate(drafters):
    xs = [j + i * w for j in range(len(domains))]
    ax.bar(xs, [get[(d, dom)]["tau"] if (d, dom) in get else 0 for dom in domains], w, label=d, color=color[d])
ax.set_xticks([j + w * (len(drafters) - 1) / 2 for j in range(len(domains))], domains)
ax.set_ylabel("tau (tokens per target forward)")
ax.legend(fontsize=8)
ax.grid(axis="y", alpha=0.3)
fig.tight_layout()
fig.savefig(os.path.join(out, "tau.png"), dpi=110)

fig, ax = plt.subplots(figsize=(4.2, 4.2))
ax.plot([0, 1], [0, 1], "k--", lw=1)
for d in drafters:
    bins = []
    for dom in domains:
        bins += get.get((d, dom), {}).get("reliability", [])
    if not bins:
        continue
    # merge bins of all domains by count-weighted means
    agg = {}
    for c, a, n in bins:
        b = min(int(c * 10), 9)
        sc, sa, sn = agg.get(b, (0.0, 0.0, 0))
        agg[b] = (sc + c * n, sa + a * n, sn + n)
    pts = sorted((sc / sn, sa / sn) for sc, sa, sn in agg.values())
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d, color=color[d])
ax.set_xlabel("confidence c_k (after STS)")
ax.set_ylabel("observed acceptance")
ax.set_title("reliability (conditional, all domains)")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(os.path.join(out, "reliability.png"), dpi=110)
print("wrote", out)
