"""Starting and stopping the engines a benchmark measures, in one place: a free loopback
port, `dspark-engine serve` with the benchmark's flags, waiting for `/ready` (or another
path) while watching the process, and a graceful stop. Only loopback: every engine listens
on 127.0.0.1.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300, what: str = "engine") -> None:
    """Polls `url` until it answers 200; exits the benchmark if `proc` dies or time runs out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{what}: {url} not ready after {timeout:.0f} s")


def start_engine(binary: str, model: str, extra: list[str], log: Path, kv_cache_mb: int = 512,
                 max_model_len: int | None = None,
                 timeout: float = 180) -> tuple[subprocess.Popen, int]:
    """`binary serve --model MODEL` on a free port (served name `m`), output to `log`;
    returns the process and its port once `/ready` answers."""
    port = free_port()
    cmd = [binary, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--kv-cache-mb", str(kv_cache_mb)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    proc = subprocess.Popen(cmd + extra, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout, what=f"engine (see {log})")
    return proc, port


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM (the engine drains), then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
