#!/usr/bin/env python3
"""The PromQL of the checked-in dashboards and alerts, and a checker for any Prometheus.

Used by tests/otel/test_prometheus.py; also a command, for a Prometheus that scrapes a real
deployment (e.g. a cluster after `make e2e`-style load, where the operator's per-pool gauges
have data):

    python3 tests/otel/promql.py --prom http://127.0.0.1:9090 [--rate 1m] [--skip-operator]

runs every dashboard expression (template variables: $model/$pool = .*, $__rate_interval =
--rate) and every loaded alert rule's signals, prints the series count of each, and exits 1
when any returns nothing.
"""

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "config" / "grafana"
RATE = "20s"  # default $__rate_interval (tests scrape every 1 s)


def substitute(expr, rate=RATE):
    return (expr.replace("$__rate_interval", rate).replace("${model}", ".*").replace("$model", ".*")
            .replace("${pool}", ".*").replace("$pool", ".*"))


def dashboard_exprs():
    """[(dashboard file, panel title, legend, expr)] of every target of every panel."""
    out = []
    for f in sorted(GRAFANA.glob("*.json")):
        doc = json.loads(f.read_text())
        panels = list(doc["panels"])
        for p in list(panels):
            panels.extend(p.get("panels", []))
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f.name, p["title"], t.get("legendFormat", ""), t["expr"]))
        for v in doc.get("templating", {}).get("list", []):
            q = v.get("query")
            if isinstance(q, dict):
                q = q.get("query")
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q or "")
            if m:  # the variable's series selector must match something
                out.append((f.name, f"variable ${v['name']}", "", m.group(1)))
    return out


def is_operator_expr(expr):
    return "dspark_operator_" in expr or 'job="dspark-operator"' in expr


POOL_GAUGE = re.compile(r"\bdspark_operator_pool_\w+")


def needs_cluster(expr):
    """The operator's per-pool gauges have series only once it reconciled a DSparkDeployment
    (a cluster: `make e2e`); here they are checked by name and syntax only."""
    return bool(POOL_GAUGE.search(expr))


# --- PromQL signal extraction (top-level scanning, enough for these rule files) -----------

def _top_level(expr):
    """Yields (index, char) of characters outside (), [], {} and string literals."""
    depth, quote, i = 0, None, 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            yield i, c
        i += 1


def _split_set_ops(expr):
    parts, start = [], 0
    positions = {i for i, _ in _top_level(expr)}
    for m in re.finditer(r"\b(and|or|unless)\b", expr):
        if m.start() in positions:
            parts.append(expr[start:m.start()])
            start = m.end()
    parts.append(expr[start:])
    return [p.strip() for p in parts if p.strip()]


def _strip_comparison(expr):
    last = None
    top = dict(_top_level(expr))
    for i in sorted(top):
        two = expr[i:i + 2]
        if two in (">=", "<=", "==", "!=") and i + 1 in top:
            last = (i, 2)
        elif top[i] in "<>" and (last is None or last[0] != i - 1):
            last = (i, 1)
    if last is None:
        return expr.strip()
    return expr[:last[0]].strip()


def signals(expr):
    """The expressions that must return data when the system is healthy."""
    out = []
    for part in _split_set_ops(expr):
        lhs = _strip_comparison(part)
        m = re.fullmatch(r"absent\((.*)\)", lhs, re.S)
        out.append(m.group(1).strip() if m else lhs)
    return out


def query(prom_url, expr):
    url = f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as r:
        doc = json.load(r)
    if doc.get("status") != "success":
        raise RuntimeError(f"{expr}: {doc}")
    return doc["data"]["result"]


def loaded_rules(prom_url):
    with urllib.request.urlopen(f"{prom_url}/api/v1/rules", timeout=30) as r:
        doc = json.load(r)
    return [r for g in doc["data"]["groups"] for r in g["rules"]]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prom", default="http://127.0.0.1:9090")
    ap.add_argument("--rate", default="1m", help="value of $__rate_interval")
    ap.add_argument("--skip-operator", action="store_true",
                    help="do not require data from operator expressions")
    args = ap.parse_args(argv)
    items = [(f"{f} / {t} / {l}", e) for f, t, l, e in dashboard_exprs()]
    items += [(f"{r['name']} signal", s) for r in loaded_rules(args.prom) if r.get("type", "alerting") == "alerting"
              for s in signals(r["query"])]
    empty = []
    for where, e in items:
        if args.skip_operator and is_operator_expr(e):
            print(f"  -  skipped (operator)  {where}")
            continue
        res = query(args.prom, substitute(e, args.rate))
        print(f"{len(res):3d} series  {where}: {' '.join(e.split())[:100]}")
        if not res:
            empty.append(where)
    print(f"{len(items) - len(empty)} passed, {len(empty)} failed")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
