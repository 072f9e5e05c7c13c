"""Real Prometheus scraping a real engine and operator: every PromQL expression of the Grafana
dashboards (config/grafana/*.json) and the alert rules (config/prometheus/alerts.yaml) must
return data, and the key panels are rendered from that data into a PNG (docs/img/dashboard.png
when DSPARK_DASHBOARD_PNG says so, see PNG below).

The stack (tests/otel/conftest.py): dspark-engine (SmolLM2, the shipped DSpark Markov
drafter with online recalibration, dspark policy, admin API) and dspark-operator without a cluster (a kubeconfig naming a closed
loopback port: its /metrics is served, its counters stay 0), both scraped every second by
tests/otel/prometheus.sh with the alert rules loaded. During the run a client keeps sending
requests (some streaming) and pushes a cost table (revision 1, source admin) and a bad one
(a refusal), so every engine series moves.

Template variables are replaced the way Grafana would with "All" selected: $model and $pool
by `.*`, $__rate_interval by promql.RATE (20 s). Alert expressions are run whole (they must evaluate)
and by their signal: the left side of the final comparison and the argument of absent(),
which must return data (a healthy system's alert expression itself is empty).
"""

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, http, non_loopback_sockets
from promql import (POOL_GAUGE, dashboard_exprs, is_operator_expr, needs_cluster, signals,
                    substitute)

GRAFANA = ROOT / "config" / "grafana"  # (promql.py reads the dashboards)
ALERTS = ROOT / "config" / "prometheus" / "alerts.yaml"
PROM_K8S = ROOT / "config" / "prometheus" / "prometheus.yaml"
# Where the picture goes. The checked-in docs/img/dashboard.png is refreshed with
#   DSPARK_DASHBOARD_PNG=docs/img/dashboard.png python3 -m pytest -q tests/otel/test_prometheus.py
# (by default a test run writes to the log dir, so `make test` leaves the work tree clean).
PNG = Path(os.environ.get("DSPARK_DASHBOARD_PNG",
                          Path(os.environ.get("DSPARK_TEST_LOG_DIR", "/tmp")) / "dspark-dashboard.png"))
PNG_RATE = "6s"       # and for the rendered time series
MIN_SCRAPES = 20      # engine samples in Prometheus before the expressions are checked
PUSH_AT, MORE_AT, CHECK_AT = 10, 22, 36  # timeline of the load, seconds (see `stack`)
POOL = "test-pool"    # static `pool` label of the engine target (pod label in a cluster)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "red green blue red green blue red green blue red green",
]


def test_signal_extraction():
    assert signals("absent(up{job=\"x\"})") == ['up{job="x"}']
    assert signals('up{job="a"} == 0') == ['up{job="a"}']
    assert signals("a > 0 and b{x=~\"a|b\"} == 0") == ["a", 'b{x=~"a|b"}']
    assert signals("sum(rate(x[5m])) / clamp_min(y, 1e-9) > 0.5") == ["sum(rate(x[5m])) / clamp_min(y, 1e-9)"]
    assert signals("histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m]))) >= 0.5") == \
        ["histogram_quantile(0.95, sum by (le) (rate(h_bucket[5m])))"]


# --- static checks ------------------------------------------------------------------------

def test_grafana_dashboards_generated():
    r = subprocess.run(["python3", str(GRAFANA / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_promtool_check_rules():
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (Debian's prometheus package, scripts/setup.sh)")
    r = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(re.findall(r"^\s*- alert:", ALERTS.read_text(), re.M))
    assert f"SUCCESS: {n} rules found" in r.stdout, r.stdout


def test_promtool_alert_unit_tests():
    """tests/otel/promtool/alerts_test.yaml: alerts fire on synthetic series (thresholds,
    `for`, labels, rendered annotations) and stay quiet below them."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (Debian's prometheus package, scripts/setup.sh)")
    r = subprocess.run(["promtool", "test", "rules", str(Path(__file__).parent / "promtool" / "alerts_test.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_promtool_check_k8s_config():
    """config/prometheus/prometheus.yaml: Debian's Prometheus has no Kubernetes service
    discovery, so the kubernetes_sd_configs blocks are swapped for empty static ones; the rest
    (relabelling regexes, rule file) is validated by promtool as is."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (Debian's prometheus package, scripts/setup.sh)")
    text = PROM_K8S.read_text()
    n = text.count("kubernetes_sd_configs:\n      - role: pod\n")
    assert n == text.count("kubernetes_sd_configs") and n >= 2
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "prometheus.yaml").write_text(
            text.replace("kubernetes_sd_configs:\n      - role: pod\n", "static_configs:\n      - targets: []\n"))
        shutil.copy(ALERTS, Path(d) / "alerts.yaml")
        r = subprocess.run(["promtool", "check", "config", str(Path(d) / "prometheus.yaml")],
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the live stack ----------------------------------------------------------------------

class Load:
    """Clients sending completions in a loop (every other one streaming) until stopped;
    `add` starts another client (more load: more requests running, larger batches)."""

    def __init__(self, engine):
        self.engine, self.stop, self.count, self.errors, self.threads = engine, threading.Event(), 0, [], []

    def _run(self, k):
        i = k
        while not self.stop.is_set():
            try:
                self.engine.complete(PROMPTS[i % len(PROMPTS)], max_tokens=24 + 8 * (i % 3),
                                     stream=bool(i % 2))
                self.count += 1
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
                time.sleep(0.5)
            i += 1

    def add(self):
        t = threading.Thread(target=self._run, args=(len(self.threads),), daemon=True)
        self.threads.append(t)
        t.start()

    def __enter__(self):
        self.add()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


@pytest.fixture(scope="module")
def stack(engine, operator, prometheus):
    """Timeline (seconds after Prometheus starts): 0-PUSH_AT one client, built-in default cost
    table; at PUSH_AT a profiled-looking table is pushed (revision 1, source admin) and a bad
    one refused; at MORE_AT two more clients join. The checks run while the load goes on."""
    t0 = time.time()
    prometheus.up(f"dspark-engine=127.0.0.1:{engine.port},pool={POOL}", f"dspark-operator={operator}")
    with Load(engine) as load:
        _sleep_until(t0 + PUSH_AT)
        # Verification nearly free at small B, so drafts get verified at this load.
        status, body = engine.admin("GET", "/admin/v1/cost-table")
        assert status == 200, body
        table = json.loads(body)
        table.update(dtype="q4_1", measured_at="2026-01-01T00:00:00Z",
                     points=[[1, 100.0], [8, 99.0], [16, 90.0], [64, 60.0], [512, 10.0]])
        status, body = engine.admin("PUT", "/admin/v1/cost-table", table)
        assert status == 200, body
        bad = dict(table, points=[[1, 10.0], [2, 20.0]])
        status, body = engine.admin("PUT", "/admin/v1/cost-table", bad)
        assert status == 400, body
        _sleep_until(t0 + MORE_AT)
        load.add()
        load.add()
        _sleep_until(t0 + CHECK_AT)
        deadline = time.time() + 60
        while True:
            n = prometheus.api("query", query='count_over_time(up{job="dspark-engine"}[5m])')["result"]
            acc = prometheus.api("query", query="dspark_spec_decode_num_accepted_tokens_per_pos_total")["result"]
            if n and float(n[0]["value"][1]) >= MIN_SCRAPES and acc and load.count >= 6:
                break
            assert time.time() < deadline, f"not enough data: scrapes {n}, accepted {acc}, " \
                f"requests {load.count}, errors {load.errors[:3]}"
            time.sleep(1)
        yield {"prom": prometheus, "engine": engine, "operator": operator, "load": load, "t0": t0}
    assert not load.errors, load.errors[:5]


def _sleep_until(t):
    time.sleep(max(0.0, t - time.time()))


def _query(prom, expr):
    return prom.api("query", query=substitute(expr))["result"]


def _finite(result):
    return [r for r in result if not math.isnan(float(r["value"][1])) and not math.isinf(float(r["value"][1]))]


def test_targets_up_and_rules_loaded(stack):
    prom = stack["prom"]
    targets = prom.api("targets")["activeTargets"]
    jobs = {t["labels"]["job"]: t["health"] for t in targets}
    assert jobs == {"dspark-engine": "up", "dspark-operator": "up"}, targets
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    n = len(re.findall(r"^\s*- alert:", ALERTS.read_text(), re.M))
    assert len(rules) == n, [r["name"] for r in rules]
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    firing = sorted(r["name"] for r in rules if r["state"] == "firing")
    # The run pushed one bad cost table on purpose: exactly that alert fires, for this engine.
    assert firing == ["DSparkCostTableRefused"], firing
    # Prometheus listens on and talks to loopback addresses only.
    assert not non_loopback_sockets(prom.pid()), non_loopback_sockets(prom.pid())
    alert = next(r for r in rules if r["name"] == "DSparkCostTableRefused")["alerts"][0]
    assert alert["labels"]["instance"] == f"127.0.0.1:{stack['engine'].port}", alert
    assert float(alert["value"]) >= 1, alert


def _check(stack, items):
    prom, failures, report = stack["prom"], [], []
    for where, expr, need_finite in items:
        res = _query(prom, expr)
        fin = _finite(res)
        report.append(f"{len(res):3d} series ({len(fin)} finite)  {where}: {' '.join(expr.split())[:110]}")
        if not res:
            failures.append(f"EMPTY {where}: {expr}")
        elif need_finite and not fin:
            failures.append(f"ONLY NaN/Inf {where}: {expr} -> {res[:3]}")
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def test_engine_dashboard_expressions(stack):
    items = [(f"{f} / {title} / {legend}", e, True)
             for f, title, legend, e in dashboard_exprs() if not is_operator_expr(e)]
    assert len(items) >= 30, items
    _check(stack, items)


def test_operator_dashboard_expressions(stack):
    """The operator runs without a cluster: its counters exist (all 0), so rates are 0 and
    ratios of them (mean reconcile duration) are NaN; those must still return series. The
    per-pool gauges: test_operator_pool_expressions."""
    items = [(f"{f} / {title} / {legend}", e, False)
             for f, title, legend, e in dashboard_exprs() if is_operator_expr(e) and not needs_cluster(e)]
    assert len(items) >= 8, items
    _check(stack, items)


def _rules(stack):
    return [r for g in stack["prom"].api("rules")["groups"] for r in g["rules"]]


def test_alert_expressions_evaluate(stack):
    prom = stack["prom"]
    for r in _rules(stack):
        prom.api("query", query=r["query"])  # asserts status success


def test_engine_alert_signals(stack):
    items = [(f"{r['name']} signal", s, False) for r in _rules(stack) for s in signals(r["query"])
             if not is_operator_expr(r["query"])]
    assert len(items) >= 8, items
    _check(stack, items)


def test_operator_alert_signals(stack):
    items = [(f"{r['name']} signal", s, False) for r in _rules(stack) for s in signals(r["query"])
             if is_operator_expr(r["query"]) and not needs_cluster(r["query"])]
    assert len(items) >= 5, items
    _check(stack, items)


def test_operator_pool_expressions(stack):
    """NOT a data check: dspark_operator_pool_* (desired/ready replicas, measured p95s,
    acceptance length, request rate per deployment and pool) have series only after the
    operator reconciled a DSparkDeployment, which needs a cluster. Here each expression using
    them must evaluate, and every such metric name must be declared (# TYPE) by the running
    operator's /metrics; skipped, saying so, when the operator build predates these gauges."""
    exprs = [(f"{f} / {title} / {legend}", e) for f, title, legend, e in dashboard_exprs() if needs_cluster(e)]
    exprs += [(f"{r['name']} (alert)", r["query"]) for r in _rules(stack) if needs_cluster(r["query"])]
    assert len(exprs) >= 7, exprs
    status, body = http("GET", f"http://{stack['operator']}/metrics")
    assert status == 200
    declared = set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.M))
    used = {m for _, e in exprs for m in POOL_GAUGE.findall(e)}
    missing = sorted(used - declared)
    for where, e in exprs:
        res = _query(stack["prom"], e)
        print(f"{len(res):3d} series (cluster needed for data)  {where}: {' '.join(e.split())[:100]}")
    if missing:
        pytest.skip(f"NOT CHECKED: this dspark-operator build does not declare {missing} (used by "
                    f"{len(exprs)} dashboard/alert expressions); rebuild it")
    print(f"declared by the operator: {sorted(used)}; values need a DSparkDeployment (make e2e)")


# Metric families deliberately on no dashboard or alert (name: why).
NOT_ON_DASHBOARDS = {
    name: "the vLLM spelling a stock GIE endpoint picker scrapes; dashboards read the dspark_ original"
    for name in ("vllm:cache_config_info", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:lora_requests_info",
                 "vllm:num_requests_running", "vllm:num_requests_waiting")
}


def _families(addr):
    status, body = http("GET", f"http://{addr}/metrics")
    assert status == 200
    return sorted(set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.M)))


@pytest.mark.parametrize("who", ["engine", "operator"])
def test_every_metric_family_is_used(stack, who):
    """Every metric family the engine / the operator declares appears in a dashboard or an
    alert (or in NOT_ON_DASHBOARDS with a reason): new metrics get a panel."""
    addr = f"127.0.0.1:{stack['engine'].port}" if who == "engine" else stack["operator"]
    used = "\n".join(e for *_, e in dashboard_exprs()) + "\n" + ALERTS.read_text()
    fams = _families(addr)
    assert len(fams) >= (20 if who == "engine" else 10), fams
    unused = [f for f in fams if f not in NOT_ON_DASHBOARDS
              and not re.search(rf"\b{re.escape(f)}(_total|_bucket|_sum|_count)?\b", used)]
    assert not unused, f"{who} metrics on no dashboard/alert: {unused}"


# --- the picture --------------------------------------------------------------------------

KEY_PANELS = [
    ("dspark-slo.json", "Time to first token (p50 / p95)"),
    ("dspark-slo.json", "Inter-token latency (p50 / p95)"),
    ("dspark-slo.json", "Generated tokens / s"),
    ("dspark-speculation.json", "Acceptance rate by draft position"),
    ("dspark-speculation.json", "Verify length per request (mean, p95) vs requests running"),
    ("dspark-speculation.json", "Expected vs committed tokens / s"),
    ("dspark-speculation.json", "Cost table revision"),
    ("dspark-speculation.json", "Batch tokens per step (p50 / p95, mean)"),
    ("dspark-operator.json", "Engine replicas per pool (scraped and up)"),
]


def _legend(fmt, metric):
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt).strip() or str(metric)


def test_render_dashboard_png(stack):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prom = stack["prom"]
    end = time.time()
    start = stack["t0"]
    panels = {}
    for f, title, legend, expr in dashboard_exprs():
        panels.setdefault((f, title), []).append((legend, expr))
    cols = 3
    rows = math.ceil(len(KEY_PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows))
    empty = []
    for ax, key in zip(axes.flat, KEY_PANELS):
        assert key in panels, f"panel {key} not in the dashboards"
        n = 0
        for legend, expr in panels[key]:
            res = prom.api("query_range", query=substitute(expr, PNG_RATE), start=f"{start:.3f}",
                           end=f"{end:.3f}", step="1")["result"]
            for s in res:
                xs = [float(t) - start for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                ax.plot(xs, ys, label=_legend(legend, s["metric"])[:48], linewidth=1.2)
                n += 1
        if not n:
            empty.append(key)
        for at, what in ((PUSH_AT, "cost table pushed"), (MORE_AT, "1 -> 3 clients")):
            ax.axvline(at, color="grey", linestyle=":", linewidth=1)
            ax.annotate(what, (at, 1.0), xycoords=("data", "axes fraction"), fontsize=6,
                        color="grey", rotation=90, va="top", ha="right")
        ax.set_title(f"{key[1]}\n({key[0]})", fontsize=9)
        ax.set_xlabel("seconds since Prometheus start", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if n:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(KEY_PANELS):]:
        ax.axis("off")
    fig.suptitle("DSpark dashboards, key panels: real engine (SmolLM2-135M, ngram, dspark policy) "
                 "and operator scraped by Prometheus every 1 s (tests/otel/test_prometheus.py)", fontsize=10)
    fig.tight_layout()
    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PNG, dpi=80)
    plt.close(fig)
    assert not empty, f"panels without data: {empty}"
    assert PNG.stat().st_size > 20_000
