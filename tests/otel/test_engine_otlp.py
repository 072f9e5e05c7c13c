"""dspark-engine's OTLP export against the real OpenTelemetry Collector (tests/otel/collector):
a request carrying W3C trace context yields a `text_completion {model}` span in the caller's
trace, with queue / prefill / decode children and one event per speculation cycle; the GenAI
server metrics arrive with values; JSON logs carry the trace id. With no OTEL_* endpoint the
engine exports nothing (checked by the plain engine fixture elsewhere)."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CACHE, LOG_DIR, _bin, free_port, http, stop, wait_http
from test_collector import collector  # noqa: F401  (fixture)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def otel_engine(collector):  # noqa: F811
    binary = _bin("DSPARK_ENGINE_BIN", "dspark-engine")
    model = Path(os.environ.get("DSPARK_MODEL", CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    port = free_port()
    log_path = LOG_DIR / "dspark-otel-export-engine.log"
    log = open(log_path, "w")
    env = dict(os.environ,
               OTEL_EXPORTER_OTLP_ENDPOINT="http://" + collector["DSPARK_OTEL_HTTP_ENDPOINT"],
               OTEL_SERVICE_NAME="dspark-engine-test", OTEL_METRIC_EXPORT_INTERVAL="500",
               OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci",
               DSPARK_LOG_FORMAT="json", RUST_LOG="info")
    env.pop("OTEL_EXPORTER_OTLP_PROTOCOL", None)
    proc = subprocess.Popen(
        [str(binary), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "smollm2", "--speculation", "ngram", "--policy", "fixed",
         "--gamma", "4", "--kv-cache-mb", "64", "--max-model-len", "1024", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, "engine", log_path)
        yield url, collector["DSPARK_OTEL_DEBUG_LOG"], log_path
    finally:
        stop(proc)
        log.close()


def spans(text):
    """The debug exporter's detailed span blocks as dicts (name, ids, attributes, events)."""
    out = []
    for block in re.split(r"\nSpan #\d+\n", text)[1:]:
        block = block.split("\nResourceSpans #")[0].split("\nScopeSpans #")[0]
        s = {"attrs": {}, "events": []}
        for key, field in (("trace", "Trace ID"), ("parent", "Parent ID"), ("id", "ID"),
                           ("name", "Name")):
            m = re.search(rf"^\s*{field}\s*: ?(.*)$", block, re.M)
            s[key] = m.group(1).strip() if m else ""
        for m in re.finditer(r"^\s*-> ([\w.]+): (\w+)\((.*)\)$", block, re.M):
            s["attrs"].setdefault(m.group(1), m.group(3))
        s["events"] = re.findall(r"SpanEvent #\d+\s*\n\s*-> Name: (.*)", block)
        out.append(s)
    return out


def wait_for(path, pred, timeout=20):
    deadline = time.time() + timeout
    text = ""
    while time.time() < deadline:
        text = Path(path).read_text() if Path(path).exists() else ""
        if pred(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"condition not met in {path} after {timeout}s; tail:\n{text[-3000:]}")


def test_request_span_tree_in_callers_trace(otel_engine):
    url, debug_log, _ = otel_engine
    body = {"model": "smollm2", "prompt": "one two three, one two three, one two three,",
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, data = http("POST", url + "/v1/completions", body, headers={
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "content-type": "application/json"})
    assert status == 200, data
    usage = json.loads(data)["usage"]

    def done(text):
        names = {s["name"] for s in spans(text) if s["trace"] == TRACE_ID}
        return {"text_completion smollm2", "queue", "prefill", "decode"} <= names

    text = wait_for(debug_log, done)
    mine = [s for s in spans(text) if s["trace"] == TRACE_ID]
    req = next(s for s in mine if s["name"] == "text_completion smollm2")
    assert req["parent"] == PARENT_ID, req  # the caller's span is the parent
    assert req["attrs"]["gen_ai.operation.name"] == "text_completion"
    assert req["attrs"]["gen_ai.request.model"] == "smollm2"
    assert req["attrs"]["gen_ai.usage.output_tokens"] == "24"
    assert int(req["attrs"]["gen_ai.usage.input_tokens"]) == usage["prompt_tokens"]
    assert int(req["attrs"]["dspark.accepted_draft_tokens"]) == usage["accepted_draft_tokens"]
    kids = {s["name"]: s for s in mine if s["parent"] == req["id"]}
    assert {"queue", "prefill", "decode"} <= set(kids), [s["name"] for s in mine]
    cycles = kids["decode"]["events"]
    assert cycles and all(e == "speculation cycle" for e in cycles), kids["decode"]
    assert "service.name: Str(dspark-engine-test)" in text
    assert "deployment.environment: Str(ci)" in text


def test_streaming_chat_without_trace_context_starts_a_new_trace(otel_engine):
    url, debug_log, _ = otel_engine
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
    status, data = http("POST", url + "/v1/chat/completions", body)
    assert status == 200 and b"[DONE]" in data
    text = wait_for(debug_log, lambda t: any(s["name"] == "chat smollm2" for s in spans(t)))
    chat = next(s for s in spans(text) if s["name"] == "chat smollm2")
    assert chat["trace"] != TRACE_ID and chat["parent"] == ""
    assert chat["attrs"]["gen_ai.usage.output_tokens"] == "8"


def test_genai_metrics_exported_with_values(otel_engine):
    url, debug_log, _ = otel_engine
    names = ["gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
             "gen_ai.server.request.duration", "gen_ai.client.token.usage"]
    text = wait_for(debug_log, lambda t: all(f"Name: {n}" in t for n in names))
    for n in names:
        block = text[text.rindex(f"Name: {n}"):][:3000]
        m = re.search(r"Count: (\d+)", block)
        assert m and int(m.group(1)) >= 1, block
    usage = text[text.rindex("Name: gen_ai.client.token.usage"):][:6000]
    assert "gen_ai.token.type: Str(output)" in usage and "gen_ai.token.type: Str(input)" in usage


def test_json_logs(otel_engine):
    _, _, log_path = otel_engine
    lines = [l for l in Path(log_path).read_text().splitlines() if l.startswith("{")]
    assert lines, "no JSON log lines"
    recs = [json.loads(l) for l in lines]
    for rec in recs:
        assert "level" in rec and "fields" in rec
    # The traced request's log line carries the caller's trace id.
    done = [r for r in recs if r["fields"].get("message") == "request finished"]
    assert any(r["fields"].get("trace_id") == TRACE_ID for r in done), done
