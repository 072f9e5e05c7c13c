"""Starting a real `dspark-engine serve` process for the tests in this folder. (A module of
its own: `conftest` names collide between test folders run in one pytest session.)"""

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def _free_port() -> int:
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
    port = _free_port()
    log_path = Path(os.environ.get("DSPARK_TEST_LOG_DIR", "/tmp")) / log_name
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [str(binary), "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "smollm2", "--kv-cache-mb", "128", "--max-model-len", "2048",
         *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_ready(proc, url, log_path, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, url, log_path
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"engine did not become ready in {timeout} s")


def start_engine(extra_args=(), log_name="dspark-python-engine.log", model=None, env=None):
    """A `dspark-engine serve` process on a free loopback port, ready: (proc, url, log path)."""
    proc, url, log_path = launch_engine(extra_args, log_name, model, env)
    return wait_ready(proc, url, log_path)
