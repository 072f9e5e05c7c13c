"""Fixtures for tests/otel: a real engine, the operator (no cluster), Prometheus and the
OpenTelemetry Collector, all on loopback ports picked at random."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", CACHE / "cargo-target"))
LOG_DIR = Path(os.environ.get("DSPARK_TEST_LOG_DIR", "/tmp"))

sys.path.insert(0, str(ROOT / "tests" / "python"))
from engine_proc import free_port, wait_http  # noqa: E402,F401  (test_engine_otlp imports both from here)


def http(method, url, body=None, headers=None, timeout=30):
    """(status, body bytes) of a request; HTTP errors are returned, not raised."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stop(proc, timeout=40):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _bin(env_var, name):
    p = Path(os.environ.get(env_var, TARGET / "release" / name))
    assert p.exists(), f"{p} missing: run `cargo build --release` (make test does)"
    return p


def non_loopback_sockets(pid):
    """TCP/UDP sockets of process `pid` whose local or peer address is not on 127.0.0.0/8
    (or ::1 / ::ffff:127.x), from `ss -tuanp`."""
    out = subprocess.run(["ss", "-Htuanp"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        cols = line.split()
        local = cols[4].rsplit(":", 1)[0].strip("[]")
        peer = cols[5].rsplit(":", 1)[0].strip("[]")
        loop = lambda h: h.startswith("127.") or h == "::1" or h.startswith("::ffff:127.")  # noqa: E731
        # Listeners have the peer `0.0.0.0:*` / `[::]:*`; anything else must be loopback.
        if not loop(local) or not (loop(peer) or peer in ("*", "0.0.0.0", "::")):
            bad.append(line)
    return bad


class Engine:
    def __init__(self, url, admin_url, token, proc):
        self.url, self.admin_url, self.token, self.proc = url, admin_url, token, proc
        self.port = int(url.rsplit(":", 1)[1])

    def admin(self, method, path, body=None):
        return http(method, self.admin_url + path, body,
                    headers={"Authorization": f"Bearer {self.token}"})

    def complete(self, prompt, max_tokens=24, stream=False):
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": stream, "ignore_eos": True}
        status, data = http("POST", self.url + "/v1/completions", body, timeout=120)
        assert status == 200, data[:500]
        return data


@pytest.fixture(scope="module")
def engine():
    """dspark-engine serving SmolLM2 with the shipped DSpark drafter (online recalibration)
    and the dspark policy in an online experiment against plain decoding, admin API on."""
    binary = _bin("DSPARK_ENGINE_BIN", "dspark-engine")
    model = Path(os.environ.get("DSPARK_MODEL", CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert model.exists(), f"{model} missing: run scripts/fetch-models.sh (make test does)"
    port, admin_port = free_port(), free_port()
    token = "otel-test-token"
    log_path = LOG_DIR / "dspark-otel-engine.log"
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["DSPARK_ADMIN_TOKEN"] = token
    proc = subprocess.Popen(
        [str(binary), "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--admin-port", str(admin_port), "--policy", "dspark",
         # The shipped trained drafter with online recalibration (every drafter series moves).
         "--speculation", "dspark-markov",
         "--drafter", str(ROOT / "drafters" / "smollm2-135m-dspark-markov"),
         "--online-calibration", "0.05",
         # The online experiment (dspark vs none in 4 s windows): its panels get data.
         "--policy-experiment", "dspark,none", "--experiment-window", "4",
         # The built-in default table until the test pushes one (the alert timeline).
         "--startup-profile", "false",
         "--kv-cache-mb", "128", "--max-model-len", "2048", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, "engine", log_path)
        yield Engine(url, f"http://127.0.0.1:{admin_port}", token, proc)
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="module")
def operator():
    """dspark-operator serving /metrics and /healthz without a cluster.

    It only needs a kubeconfig to start: this one names a closed loopback port, so its
    controllers keep retrying (and its counters stay at 0) while /metrics is served. Yields
    HOST:PORT of that endpoint."""
    binary = Path(os.environ.get("DSPARK_OPERATOR_BIN", TARGET / "release" / "dspark-operator"))
    if not binary.exists():
        pytest.fail(f"{binary} missing: run `cargo build --release` (make test does)")
    tmp = Path(tempfile.mkdtemp(prefix="dspark-otel-op-"))
    closed = free_port()  # bound and released: nothing listens there
    (tmp / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: none\n  cluster: {{server: \"http://127.0.0.1:{closed}\"}}\n"
        "users:\n- name: none\n  user: {token: none}\n"
        "contexts:\n- name: none\n  context: {cluster: none, user: none, namespace: default}\n"
        "current-context: none\n")
    port = free_port()
    log_path = LOG_DIR / "dspark-otel-operator.log"
    log = open(log_path, "w")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_EXPORTER_OTLP", "KUBERNETES_SERVICE_"))}
    env["KUBECONFIG"] = str(tmp / "kubeconfig")
    proc = subprocess.Popen([str(binary), "--http", f"127.0.0.1:{port}", "--no-leader-election"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, "operator", log_path, timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc, timeout=15)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


class Prometheus:
    """tests/otel/prometheus.sh on a free port with its own state dir."""

    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="dspark-otel-prom-"))
        self.env = dict(os.environ, DSPARK_PROM_PORT=str(self.port), DSPARK_PROM_DIR=str(self.dir))
        self.url = f"http://127.0.0.1:{self.port}"

    def up(self, *targets):
        subprocess.run([str(HERE / "prometheus.sh"), "up", *targets], env=self.env, check=True,
                       timeout=60)

    def down(self):
        subprocess.run([str(HERE / "prometheus.sh"), "down"], env=self.env, check=False, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)

    def pid(self):
        return int((self.dir / "prometheus.pid").read_text())

    def api(self, path, **params):
        q = urllib.parse.urlencode(params)
        status, body = http("GET", f"{self.url}/api/v1/{path}?{q}")
        doc = json.loads(body)
        assert status == 200 and doc.get("status") == "success", f"{path} {params}: {status} {doc}"
        return doc["data"]


@pytest.fixture(scope="module")
def prometheus():
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: scripts/setup.sh installs Debian's package")
    p = Prometheus()
    try:
        yield p
    finally:
        p.down()

