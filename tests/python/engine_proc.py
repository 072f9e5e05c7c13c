"""Starting a real `dspark-engine serve` process for the tests in this folder, and the two
helpers every process-starting test and benchmark shares (`free_port`, `wait_http`; tests/otel
and bench/engines.py import them from here). A module of its own: `conftest` names collide
between test folders run in one pytest session."""

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_bin() -> Path:
    binary = Path(os.environ.get("DSPARK_ENGINE_BIN", ROOT / "target" / "release" / "dspark-engine"))
    assert binary.exists(), f"{binary} missing: run `cargo build --release` (make test does)"
    return binary


def default_model() -> Path:
    model = Path(os.environ.get("DSPARK_MODEL", CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert model.exists(), f"{model} missing: run scripts/fetch-models.sh (make test does)"
    return model


def launch_engine(extra_args=(), log_name="dspark-python-engine.log", model=None, env=None):
    """A `dspark-engine serve` process on a free loopback port, not waited for:
    (proc, url, log path). `model` may be any source (a path, hf://, s3://)."""
    binary = engine_bin()
    model = str(model) if model is not None else str(default_model())
    port = free_port()
    log_path = Path(os.environ.get("DSPARK_TEST_LOG_DIR", "/tmp")) / log_name
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [str(binary), "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "smollm2", "--kv-cache-mb", "128", "--max-model-len", "2048",
         *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_http(url, proc, what, log_path=None, timeout=120):
    """Polls `url` until it answers 200. RuntimeError (naming `what` and the log) when `proc`
    (may be None) exits first or `timeout` seconds pass; then `proc` is killed."""
    see = f"; see {log_path}" if log_path else ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}{see}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    if proc is not None:
        proc.kill()
    raise RuntimeError(f"{what}: {url} not ready after {timeout:.0f} s{see}")


def wait_ready(proc, url, log_path, timeout=120):
    wait_http(url + "/ready", proc, "engine", log_path, timeout)
    return proc, url, log_path


def start_engine(extra_args=(), log_name="dspark-python-engine.log", model=None, env=None):
    """A `dspark-engine serve` process on a free loopback port, ready: (proc, url, log path)."""
    proc, url, log_path = launch_engine(extra_args, log_name, model, env)
    return wait_ready(proc, url, log_path)
