#!/usr/bin/env python3
"""Generates the Grafana dashboards in this folder (edit here, then run it):

    python3 config/grafana/generate.py           # rewrite *.json
    python3 config/grafana/generate.py --check   # exit 1 when a *.json differs (tests do this)

Dashboards (Grafana 10+/11 JSON model, Prometheus datasource chosen with the `datasource`
variable, so they import anywhere):

- dspark-slo.json          SLOs (TTFT / ITL / e2e p50 & p95), queueing, throughput
- dspark-speculation.json  acceptance by position, verify budget vs load, scheduler
                           calibration (expected vs committed tokens), cost table revision/source
- dspark-operator.json     engine replicas per pool, scaling decisions, profiling, cost-table
                           pushes, reconciles

Every expression is executed against a real engine and operator by
tests/otel/test_prometheus.py (with $model / $pool = .* and $__rate_interval = a fixed window).
Metric names: engine/src/metrics.rs (prometheus-client adds `_total` to counters, the engine
adds `model_name`), operator/src/telemetry.rs; scrape jobs `dspark-engine` / `dspark-operator`
and the `pool` label come from config/prometheus/prometheus.yaml.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
ENGINE = 'model_name=~"$model", pool=~"$pool"'


def target(expr, legend, ref):
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


class Board:
    def __init__(self, uid, title, description, variables=("model", "pool")):
        self.uid, self.title, self.description = uid, title, description
        self.panels, self.x, self.y, self.row_h, self.next_id = [], 0, 0, 0, 1
        self.variables = variables

    def row(self, title):
        self._newline()
        self.panels.append({"id": self._id(), "type": "row", "title": title, "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def _id(self):
        self.next_id += 1
        return self.next_id - 1

    def _newline(self):
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0

    def panel(self, title, targets, unit="short", w=12, h=8, kind="timeseries", description="",
              decimals=None, overrides=(), stack=False, min0=True, thresholds=None, mappings=None):
        if self.x + w > 24:
            self._newline()
        defaults = {"unit": unit, "custom": {}}
        if kind == "timeseries":
            defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                  "showPoints": "never", "spanNulls": True,
                                  "stacking": {"mode": "normal" if stack else "none"}}
        if min0:
            defaults["min"] = 0
        if decimals is not None:
            defaults["decimals"] = decimals
        if thresholds:
            defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
        if mappings:
            defaults["mappings"] = mappings
        p = {
            "id": self._id(), "type": kind, "title": title, "description": description,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [target(e, l, chr(ord("A") + i)) for i, (e, l) in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
        }
        if kind == "stat":
            p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "value", "graphMode": "area", "textMode": "auto"}
        if kind == "state-timeline":
            p["options"] = {"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def json(self):
        var = []
        var.append({"name": "datasource", "label": "Prometheus", "type": "datasource",
                    "query": "prometheus", "current": {}, "hide": 0, "refresh": 1,
                    "regex": "", "options": []})
        # Multi-value label filters, "All" selected.
        for name, query in (("model", "label_values(dspark_num_requests_running, model_name)"),
                            ("pool", 'label_values(up{job="dspark-engine"}, pool)')):
            if name in self.variables:
                var.append({"name": name, "label": name, "type": "query", "datasource": DS,
                            "query": {"query": query, "refId": name},
                            "definition": query,
                            "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
                            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                            "sort": 1, "hide": 0, "options": []})
        return {
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": ["dspark"], "editable": True, "graphTooltip": 1, "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": [{"asDropdown": True, "icon": "external link", "tags": ["dspark"],
                       "title": "DSpark", "type": "dashboards"}],
            "templating": {"list": var},
            "panels": self.panels,
        }


def quantiles(metric, by="model_name, pool", qs=(0.5, 0.95), legend="{{model_name}} {{pool}}"):
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{ENGINE}}}[{RI}])))",
             f"p{int(q * 100)} {legend}") for q in qs]


def slo_board():
    b = Board("dspark-slo", "DSpark / SLOs and throughput",
              "Latency SLOs (p50/p95 of the engine's histograms) and throughput, per model and pool. "
              "Targets: spec.slo of the DSparkDeployment (alerts: config/prometheus/alerts.yaml).")
    b.row("Latency")
    b.panel("Time to first token (p50 / p95)", quantiles("dspark_time_to_first_token_seconds"),
            unit="s", description="dspark_time_to_first_token_seconds. The p95 is what the "
            "operator's SLO autoscaler and the DSparkTTFTSLOBurn alert compare with spec.slo.ttftP95Ms.")
    b.panel("Inter-token latency (p50 / p95)", quantiles("dspark_inter_token_latency_seconds"),
            unit="s", description="dspark_inter_token_latency_seconds (time between streamed tokens "
            "of a request; speculation lowers it when drafts are accepted).")
    b.panel("End-to-end request latency (p50 / p95)", quantiles("dspark_e2e_request_latency_seconds"),
            unit="s")
    b.panel("Queue time (p95) and requests waiting",
            quantiles("dspark_request_queue_time_seconds", qs=(0.95,)) + [
                (f"sum by (model_name, pool) (dspark_num_requests_waiting{{{ENGINE}}})",
                 "waiting {{model_name}} {{pool}}")],
            unit="s", overrides=[{"matcher": {"id": "byRegexp", "options": "waiting.*"},
                                  "properties": [{"id": "unit", "value": "short"},
                                                 {"id": "custom.axisPlacement", "value": "right"}]}])
    b.row("Throughput")
    b.panel("Generated tokens / s", [
        (f"sum by (model_name, pool) (rate(dspark_generation_tokens_total{{{ENGINE}}}[{RI}]))",
         "generated {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_prompt_tokens_total{{{ENGINE}}}[{RI}]))",
         "prompt {{model_name}} {{pool}}")], unit="short",
        description="dspark_generation_tokens_total and dspark_prompt_tokens_total, rate.")
    b.panel("Requests / s by finish reason", [
        (f"sum by (model_name, finished_reason) (rate(dspark_request_success_total{{{ENGINE}}}[{RI}]))",
         "{{finished_reason}} {{model_name}}"),
        (f"sum by (model_name) (rate(dspark_requests_rejected_total{{{ENGINE}}}[{RI}]))",
         "rejected (429) {{model_name}}")], unit="reqps")
    b.panel("Requests running / waiting", [
        (f"sum by (model_name, pool) (dspark_num_requests_running{{{ENGINE}}})", "running {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (dspark_num_requests_waiting{{{ENGINE}}})", "waiting {{model_name}} {{pool}}")],
        w=8)
    b.panel("KV cache usage", [
        (f"max by (instance, model_name) (dspark_kv_cache_usage_ratio{{{ENGINE}}})", "{{instance}}")],
        unit="percentunit", w=8)
    b.panel("Engine steps / s and preemptions", [
        (f"sum by (model_name, pool) (rate(dspark_engine_steps_total{{{ENGINE}}}[{RI}]))", "steps {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_num_preemptions_total{{{ENGINE}}}[{RI}]))", "preemptions {{model_name}} {{pool}}")],
        w=8)
    b.row("Prefix cache")
    b.panel("Prompt tokens served from the prefix cache", [
        (f"sum by (model_name, pool) (rate(dspark_prefix_cache_hits_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_prefix_cache_queries_total{{{ENGINE}}}[{RI}]))",
         "hit rate {{model_name}} {{pool}}")], unit="percentunit", w=8,
        description="dspark_prefix_cache_hits_total / dspark_prefix_cache_queries_total (prompt tokens), rate.")
    b.panel("Cached prefix blocks", [
        (f"max by (instance, model_name) (dspark_prefix_cache_blocks{{{ENGINE}}})", "{{instance}}")], w=8,
        description="KV blocks registered in the prefix cache (in use or kept for reuse).")
    b.panel("Prefix cache evictions / s", [
        (f"sum by (model_name, pool) (rate(dspark_prefix_cache_evictions_total{{{ENGINE}}}[{RI}]))",
         "evictions {{model_name}} {{pool}}")], w=8,
        description="Cached blocks evicted to make room: a cache too small for the traffic's shared prefixes.")
    return b


def spec_board():
    b = Board("dspark-speculation", "DSpark / Speculation and scheduler",
              "Speculative decoding: acceptance by draft position, how many draft tokens the "
              "scheduler verifies against load, and whether its expectations come true.")
    b.row("Acceptance")
    b.panel("Acceptance rate by draft position", [
        (f"sum by (model_name, position) (rate(dspark_spec_decode_num_accepted_tokens_per_pos_total{{{ENGINE}}}[{RI}]))"
         f" / ignoring(position) group_left sum by (model_name) (rate(dspark_spec_decode_num_drafts_total{{{ENGINE}}}[{RI}]))",
         "position {{position}}")], unit="percentunit", decimals=2,
        description="Accepted tokens at draft position i per draft "
        "(dspark_spec_decode_num_accepted_tokens_per_pos_total / "
        "dspark_spec_decode_num_drafts_total). A position appears once a token there was accepted.")
    b.panel("Live acceptance estimate by position (scheduler)", [
        (f"avg by (model_name, position) (dspark_spec_decode_live_acceptance_rate{{{ENGINE}}})",
         "position {{position}}")], unit="percentunit", decimals=2,
        description="dspark_spec_decode_live_acceptance_rate{position}: the running estimate the "
        "dspark policy uses to choose verify lengths.")
    b.panel("Online calibration by position (model drafters)", [
        (f"avg by (model_name, mode, position) (dspark_spec_decode_calibration_offset{{{ENGINE}}})",
         "offset {{mode}} position {{position}}"),
        (f"avg by (model_name, mode, position) (dspark_spec_decode_calibration_scale{{{ENGINE}}})",
         "scale {{mode}} position {{position}}")], decimals=2,
        description="serve --online-calibration: c' = sigmoid(scale * logit(c) + offset) on the "
        "drafter's STS-calibrated confidence c, learned from verify outcomes "
        "(dspark_spec_decode_calibration_offset / _scale{mode,position}). Offset below 0: the head "
        "over-states acceptance on this traffic; scale below 1: it is too sharp; offset 0 and "
        "scale 1: the offline calibration holds.")
    b.panel("Acceptance length (accepted tokens per draft)", [
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_num_accepted_tokens_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_spec_decode_num_drafts_total{{{ENGINE}}}[{RI}]))",
         "accepted / draft {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_num_accepted_tokens_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_spec_decode_num_draft_tokens_total{{{ENGINE}}}[{RI}]))",
         "draft-token acceptance {{model_name}} {{pool}}")], decimals=2)
    b.panel("Drafts and draft tokens / s", [
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_num_drafts_total{{{ENGINE}}}[{RI}]))", "drafts {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_num_draft_tokens_total{{{ENGINE}}}[{RI}]))", "draft tokens {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_num_accepted_tokens_total{{{ENGINE}}}[{RI}]))", "accepted {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_draft_skipped_steps_total{{{ENGINE}}}[{RI}]))",
         "steps with the drafter skipped {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_lookup_drafts_total{{{ENGINE}}}[{RI}]))",
         "prompt-lookup drafts {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_lookup_accepted_tokens_total{{{ENGINE}}}[{RI}]))",
         "prompt-lookup accepted {{model_name}} {{pool}}")],
        description="Drafter skipped: steps where the dspark policy decoded plainly because the "
        "model drafter's live acceptance could not pay for its own time (probing every 16th step). "
        "Prompt lookup: verified blocks found in the sequence's own context instead of the "
        "drafter's (serve --prompt-lookup), and their accepted tokens (also in the totals).")
    b.panel("Drafting steps and drafter calls / s", [
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_draft_steps_total{{{ENGINE}}}[{RI}]))",
         "drafting steps {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_drafter_calls_total{{{ENGINE}}}[{RI}]))",
         "drafter calls {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_skipped_probes_total{{{ENGINE}}}[{RI}]))",
         "probes priced out {{model_name}} {{pool}}")],
        description="dspark_spec_decode_draft_steps_total: steps whose drafting plan ran the model "
        "drafter (probes included); dspark_spec_decode_drafter_calls_total: context feeds and "
        "drafts the drafter counted. A step that drafts nothing makes no call. "
        "dspark_spec_decode_skipped_probes_total: due probes not run because even a drafter "
        "that is never wrong would not pay at that load.")
    b.row("Online policy experiment (serve --policy-experiment)")
    b.panel("Committed tokens / s per arm (while in force)", [
        (f"sum by (model_name, policy) (rate(dspark_experiment_tokens_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, policy) (rate(dspark_experiment_seconds_total{{{ENGINE}}}[{RI}]))",
         "{{policy}}")], w=8,
        description="dspark_experiment_tokens_total / dspark_experiment_seconds_total per arm: the "
        "throughput each verify policy delivered in its own windows. Compare arms at matched load "
        "(panel to the right); `dspark-engine experiment-report --url ...` gives the ratio with a "
        "confidence interval from load-matched neighbouring windows.")
    b.panel("Per-user tokens / s per arm", [
        (f"sum by (model_name, policy) (rate(dspark_experiment_tokens_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, policy) (rate(dspark_experiment_running_seconds_total{{{ENGINE}}}[{RI}]))",
         "{{policy}}")], w=8,
        description="Tokens per running request-second (dspark_experiment_running_seconds_total "
        "integrates the running requests over time).")
    b.panel("Load per arm (mean running requests)", [
        (f"sum by (model_name, policy) (rate(dspark_experiment_running_seconds_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, policy) (rate(dspark_experiment_seconds_total{{{ENGINE}}}[{RI}]))",
         "{{policy}}")], w=8, decimals=2)
    b.panel("TTFT p50 / p95 per arm", [
        (f"histogram_quantile(0.5, sum by (policy, le) (rate(dspark_experiment_time_to_first_token_seconds_bucket{{{ENGINE}}}[{RI}])))",
         "p50 {{policy}}"),
        (f"histogram_quantile(0.95, sum by (policy, le) (rate(dspark_experiment_time_to_first_token_seconds_bucket{{{ENGINE}}}[{RI}])))",
         "p95 {{policy}}")], unit="s")
    b.panel("ITL p50 / p95 per arm", [
        (f"histogram_quantile(0.5, sum by (policy, le) (rate(dspark_experiment_inter_token_latency_seconds_bucket{{{ENGINE}}}[{RI}])))",
         "p50 {{policy}}"),
        (f"histogram_quantile(0.95, sum by (policy, le) (rate(dspark_experiment_inter_token_latency_seconds_bucket{{{ENGINE}}}[{RI}])))",
         "p95 {{policy}}")], unit="s")
    b.panel("Arm in force", [
        (f"max by (policy) (dspark_experiment_active{{{ENGINE}}}) == 1", "{{policy}}")],
        kind="state-timeline", w=8)
    b.panel("Experiment windows finished per arm", [
        (f"sum by (model_name, policy) (increase(dspark_experiment_windows_total{{{ENGINE}}}[{RI}]))",
         "{{policy}}")], w=8, decimals=0,
        description="dspark_experiment_windows_total: windows each arm completed (every window is "
        "one row of GET /experiment, which experiment-report pairs by load).")
    b.row("Verify budget vs load")
    b.panel("Verify length per request (mean, p95) vs requests running", [
        (f"sum by (model_name, pool) (rate(dspark_spec_decode_verify_length_sum{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_spec_decode_verify_length_count{{{ENGINE}}}[{RI}]))",
         "mean verify length {{model_name}} {{pool}}"),
        (f"histogram_quantile(0.95, sum by (model_name, pool, le) (rate(dspark_spec_decode_verify_length_bucket{{{ENGINE}}}[{RI}])))",
         "p95 verify length {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (dspark_num_requests_running{{{ENGINE}}})", "running {{model_name}} {{pool}}")],
        overrides=[{"matcher": {"id": "byRegexp", "options": "running.*"},
                    "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                   {"id": "custom.drawStyle", "value": "bars"}]}],
        description="dspark_spec_decode_verify_length: draft tokens verified per request per step. "
        "Under the dspark policy it shrinks as the batch (load) grows.")
    b.panel("Batch tokens per step (p50 / p95, mean)", quantiles("dspark_batch_tokens") + [
        (f"sum by (model_name, pool) (rate(dspark_batch_tokens_sum{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_batch_tokens_count{{{ENGINE}}}[{RI}]))",
         "mean {{model_name}} {{pool}}")],
        description="dspark_batch_tokens: B, the tokens of one forward (decode + verify + prefill chunk).")
    b.row("Scheduler calibration")
    b.panel("Expected vs committed tokens / s", [
        (f"sum by (model_name, pool) (rate(dspark_scheduler_expected_tokens_total{{{ENGINE}}}[{RI}]))", "expected {{model_name}} {{pool}}"),
        (f"sum by (model_name, pool) (rate(dspark_scheduler_committed_tokens_total{{{ENGINE}}}[{RI}]))", "committed {{model_name}} {{pool}}")],
        w=8, description="dspark_scheduler_expected_tokens_total (what the scheduler predicted from "
        "its acceptance estimates) vs dspark_scheduler_committed_tokens_total (what verification kept).")
    b.panel("Calibration ratio (committed / expected)", [
        (f"sum by (model_name, pool) (rate(dspark_scheduler_committed_tokens_total{{{ENGINE}}}[{RI}]))"
         f" / sum by (model_name, pool) (rate(dspark_scheduler_expected_tokens_total{{{ENGINE}}}[{RI}]))",
         "{{model_name}} {{pool}}")], w=8, decimals=3, min0=False,
        description="1.0 = perfectly calibrated; the DSparkSchedulerMiscalibrated alert fires below 0.7.")
    b.panel("Scheduler theta", [
        (f"max by (instance, model_name) (dspark_scheduler_theta{{{ENGINE}}})", "{{instance}}")], w=8,
        description="dspark_scheduler_theta: the scheduler's current threshold.")
    b.panel("Forward time vs the cost table", [
        (f"max by (instance, kind) (dspark_scheduler_step_cost_ratio{{{ENGINE}}})", "{{instance}} {{kind}}"),
        (f"max by (instance) (dspark_scheduler_verify_cost_factor{{{ENGINE}}})", "{{instance}} verify factor")],
        w=8, decimals=2, min0=False,
        description="dspark_scheduler_step_cost_ratio{kind=plain|verify}: measured / cost-table forward time "
        "of decode-only steps (moving averages); dspark_scheduler_verify_cost_factor: verify / plain, 1-2, "
        "the factor the drafting plans price a verifying forward by.")
    b.row("Cost table")
    b.panel("Cost table revision", [
        (f"max by (instance, model_name) (dspark_cost_table_revision{{{ENGINE}}})", "{{instance}}")],
        w=8, decimals=0, description="dspark_cost_table_revision: bumps on every installed table "
        "(file reload, admin push from the operator).")
    b.panel("Cost table source", [
        (f"max by (instance, source) (dspark_cost_table_source{{{ENGINE}}}) == 1", "{{instance}} {{source}}")],
        kind="state-timeline", w=8,
        description="dspark_cost_table_source{source=file|admin|default} = 1 for the table in force. "
        "`default` = the built-in conservative table (not profiled).")
    b.panel("Cost tables refused", [
        (f"sum by (instance, model_name) (increase(dspark_cost_table_refusals_total{{{ENGINE}}}[{RI}]))", "{{instance}}")],
        w=8, decimals=0, description="dspark_cost_table_refusals_total: pushed or reloaded tables "
        "that were malformed, not monotone, or for another model/device/engine version.")
    return b


def operator_board():
    b = Board("dspark-operator", "DSpark / Operator and scaling",
              "Engine replicas per pool as Prometheus sees them, and what dspark-operator did: "
              "scaling decisions, profiling, cost tables, reconciles.", variables=("pool",))
    b.row("Replicas")
    b.panel("Engine replicas per pool (scraped and up)", [
        ('sum by (pool) (up{job="dspark-engine", pool=~"$pool"})', "up {{pool}}"),
        ('count by (pool) (up{job="dspark-engine", pool=~"$pool"})', "targets {{pool}}")],
        decimals=0, description="Engine pods discovered per pool (label serving.dspark.dev/pool) "
        "and how many answer scrapes.")
    b.panel("Desired vs ready replicas per pool (operator)", [
        ('max by (deployment, pool) (dspark_operator_pool_desired_replicas{pool=~"$pool"})', "desired {{deployment}} {{pool}}"),
        ('max by (deployment, pool) (dspark_operator_pool_ready_replicas{pool=~"$pool"})', "ready {{deployment}} {{pool}}")],
        decimals=0, description="dspark_operator_pool_desired_replicas / _ready_replicas{deployment, pool}: "
        "what the operator decided at its last reconcile and how many engine pods were Ready.")
    b.panel("Scaling decisions", [
        (f"sum(increase(dspark_operator_scaling_decisions_total[{RI}]))", "applied"),
        (f"sum(increase(dspark_operator_advisory_decisions_total[{RI}]))", "advisory (not applied)")],
        decimals=0, description="dspark_operator_scaling_decisions_total / _advisory_decisions_total: "
        "replica changes per interval. Compare with the replica panel.")
    b.panel("Pool p95 latency as the operator measures it", [
        ('max by (deployment, pool) (dspark_operator_pool_ttft_p95_seconds{pool=~"$pool"})', "TTFT p95 {{deployment}} {{pool}}"),
        ('max by (deployment, pool) (dspark_operator_pool_itl_p95_seconds{pool=~"$pool"})', "ITL p95 {{deployment}} {{pool}}")],
        unit="s", description="The p95s the SLO autoscaler compares with spec.slo (over "
        "spec.slo.windowSeconds); absent while a pool has no fresh data.")
    b.panel("Pool acceptance length and request rate (operator)", [
        ('max by (deployment, pool) (dspark_operator_pool_acceptance_length{pool=~"$pool"})', "acceptance length {{deployment}} {{pool}}"),
        ('max by (deployment, pool) (dspark_operator_pool_request_rate{pool=~"$pool"})', "requests/s {{deployment}} {{pool}}")],
        overrides=[{"matcher": {"id": "byRegexp", "options": "requests/s.*"},
                    "properties": [{"id": "unit", "value": "reqps"},
                                   {"id": "custom.axisPlacement", "value": "right"}]}])
    b.row("Profiling and cost tables")
    b.panel("Profiling jobs and failures", [
        (f"sum(increase(dspark_operator_profiling_jobs_total[{RI}]))", "jobs started"),
        (f"sum(increase(dspark_operator_profiling_failures_total[{RI}]))", "failures")], w=8, decimals=0)
    b.panel("Cost tables stored / pushed", [
        (f"sum(increase(dspark_operator_cost_tables_stored_total[{RI}]))", "stored"),
        (f"sum(increase(dspark_operator_cost_table_pushes_total[{RI}]))", "pushed to engines"),
        (f"sum(increase(dspark_operator_cost_table_push_failures_total[{RI}]))", "push failures")], w=8, decimals=0)
    b.panel("Engine cost table revision per pool", [
        ('max by (pool) (dspark_cost_table_revision{pool=~"$pool"})', "{{pool}}")], w=8, decimals=0)
    b.row("Reconciler")
    b.panel("Reconciles / s and errors", [
        (f"sum(rate(dspark_operator_reconciles_total[{RI}]))", "reconciles"),
        (f"sum(rate(dspark_operator_reconcile_errors_total[{RI}]))", "errors")], w=8, unit="ops")
    b.panel("Reconcile duration", [
        (f"histogram_quantile(0.5, sum by (le) (rate(dspark_operator_reconcile_duration_seconds_bucket[{RI}])))", "p50"),
        (f"histogram_quantile(0.99, sum by (le) (rate(dspark_operator_reconcile_duration_seconds_bucket[{RI}])))", "p99"),
        (f"sum(rate(dspark_operator_reconcile_duration_seconds_sum[{RI}]))"
         f" / sum(rate(dspark_operator_reconcile_duration_seconds_count[{RI}]))", "mean")], w=8, unit="s")
    b.panel("API server requests / s by verb", [
        (f"sum by (verb) (rate(dspark_operator_kube_requests_total[{RI}]))", "{{verb}}")], w=8, unit="reqps")
    b.panel("Leader", [("max by (instance) (dspark_operator_leader)", "{{instance}}")], w=8,
            kind="stat", decimals=0,
            mappings=[{"type": "value", "options": {"0": {"text": "standby"}, "1": {"text": "leader"}}}])
    return b


BOARDS = {"dspark-slo.json": slo_board, "dspark-speculation.json": spec_board,
          "dspark-operator.json": operator_board}


def render(fn):
    return json.dumps(fn().json(), indent=2) + "\n"


def main(argv):
    check = "--check" in argv
    stale = []
    for name, fn in BOARDS.items():
        text, path = render(fn), HERE / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python3 config/grafana/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
