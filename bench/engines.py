"""Starting and stopping the engines a benchmark measures, in one place: a free loopback
port, `dspark-engine serve` with the benchmark's flags, waiting for `/ready` (or another
path) while watching the process, and a graceful stop. Only loopback: every engine listens
on 127.0.0.1.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from engine_proc import free_port, wait_http  # noqa: E402,F401  (benchmarks import free_port from here)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300, what: str = "engine") -> None:
    """Polls `url` until it answers 200; exits the benchmark if `proc` dies or time runs out."""
    try:
        wait_http(url, proc, what, timeout=timeout)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


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
