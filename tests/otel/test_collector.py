"""The OpenTelemetry Collector built from Go modules (tests/otel/collector) starts in test mode
on loopback ports, receives OTLP over HTTP and gRPC, and its debug exporter (detailed) writes
what it received to the log file that tests read."""

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import HERE, free_port, http, non_loopback_sockets


@pytest.fixture(scope="module")
def collector():
    if shutil.which("go") is None and not os.environ.get("DSPARK_OTELCOL_BIN"):
        pytest.fail("go is not installed: the collector is built from Go modules (scripts/setup.sh)")
    state = Path(tempfile.mkdtemp(prefix="dspark-otel-col-"))
    env = dict(os.environ, DSPARK_OTEL_DIR=str(state), DSPARK_OTEL_GRPC_PORT=str(free_port()),
               DSPARK_OTEL_HTTP_PORT=str(free_port()), DSPARK_OTEL_METRICS_PORT=str(free_port()))
    script = str(HERE / "otelcol.sh")
    # A cold build takes minutes (setup.sh does it once); a cached one returns at once.
    subprocess.run([script, "up", "--test"], env=env, check=True, timeout=1800)
    exports = subprocess.run([script, "env"], env=env, check=True, capture_output=True, text=True).stdout
    vals = {}
    for line in exports.splitlines():
        k, v = line.removeprefix("export ").split("=", 1)
        vals[k] = v.strip("'")
    try:
        yield vals
    finally:
        subprocess.run([script, "down"], env=env, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def _wait_for(path, needle, timeout=10):
    deadline = time.time() + timeout
    text = ""
    while time.time() < deadline:
        text = Path(path).read_text() if Path(path).exists() else ""
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in {path} after {timeout}s:\n{text[-2000:]}")


def test_env_names_loopback_endpoints(collector):
    for k in ("DSPARK_OTEL_GRPC_ENDPOINT", "DSPARK_OTEL_HTTP_ENDPOINT"):
        assert collector[k].startswith("127.0.0.1:"), collector
    # dspark binaries speak OTLP/HTTP (protobuf)
    assert collector["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://" + collector["DSPARK_OTEL_HTTP_ENDPOINT"]
    assert collector["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
    assert Path(collector["DSPARK_OTELCOL_BIN"]).is_file()


def test_otlp_http_span_and_metric_reach_debug_log(collector):
    base = "http://" + collector["DSPARK_OTEL_HTTP_ENDPOINT"]
    res = {"attributes": [{"key": "service.name", "value": {"stringValue": "dspark-engine"}}]}
    span = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
            "name": "text_completion smollm2", "kind": 2,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000500000000",
            "attributes": [{"key": "gen_ai.request.model", "value": {"stringValue": "smollm2"}}]}
    status, body = http("POST", base + "/v1/traces",
                        {"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": [span]}]}]})
    assert status == 200, body
    metric = {"name": "gen_ai.server.time_to_first_token", "unit": "s",
              "histogram": {"aggregationTemporality": 2, "dataPoints": [{
                  "startTimeUnixNano": "1700000000000000000", "timeUnixNano": "1700000001000000000",
                  "count": "2", "sum": 0.3, "bucketCounts": ["1", "1", "0"],
                  "explicitBounds": [0.1, 0.5]}]}}
    status, body = http("POST", base + "/v1/metrics",
                        {"resourceMetrics": [{"resource": res, "scopeMetrics": [{"metrics": [metric]}]}]})
    assert status == 200, body
    text = _wait_for(collector["DSPARK_OTEL_DEBUG_LOG"], "gen_ai.server.time_to_first_token")
    text = _wait_for(collector["DSPARK_OTEL_DEBUG_LOG"], "Name           : text_completion smollm2")
    assert "service.name: Str(dspark-engine)" in text
    assert "gen_ai.request.model: Str(smollm2)" in text
    assert "Trace ID       : 5b8efff798038103d269b633813fc60c" in text
    assert "DataType: Histogram" in text


def test_otlp_grpc_port_accepts_http2(collector):
    # No gRPC client library is needed to see that the gRPC receiver speaks HTTP/2: an h2c
    # prior-knowledge request to the Export method gets a gRPC status back.
    if shutil.which("curl") is None:
        pytest.fail("curl missing")
    out = subprocess.run(
        ["curl", "-s", "--http2-prior-knowledge", "-o", "/dev/null", "-D", "-", "-X", "POST",
         "-H", "content-type: application/grpc", "--data-binary", "@/dev/null",
         "http://" + collector["DSPARK_OTEL_GRPC_ENDPOINT"]
         + "/opentelemetry.proto.collector.trace.v1.TraceService/Export"],
        capture_output=True, text=True, timeout=10).stdout.lower()
    assert "http/2 200" in out and "grpc-status" in out, out


def test_collector_sockets_loopback_only(collector):
    pid = int((Path(collector["DSPARK_OTEL_DIR"]) / "otelcol.pid").read_text())
    assert not non_loopback_sockets(pid), non_loopback_sockets(pid)
    # ... and it listens on the three ports it was given (OTLP gRPC, OTLP HTTP, own metrics).
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True).stdout
    listening = [line for line in out.splitlines() if f"pid={pid}," in line]
    assert len(listening) == 3, listening
