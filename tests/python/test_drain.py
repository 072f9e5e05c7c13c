"""SIGTERM drains: the engine stops admitting (503 on /ready and on new requests), lets
in-flight requests finish, and exits 0; past --drain-timeout-secs it exits anyway."""

import json
import signal
import threading
import time
import urllib.error
import urllib.request

from engine_proc import start_engine


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_running(url, timeout=30):
    """Returns once the engine reports a running request."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with urllib.request.urlopen(url + "/ready", timeout=5) as r:
            if json.loads(r.read())["requests_running"] >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("no request started running")


def completion(n):
    return {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": n,
            "temperature": 0, "ignore_eos": True}


LONG = 512


def test_sigterm_lets_inflight_requests_finish_then_exits_zero():
    proc, url, log = start_engine(["--drain-timeout-secs", "60"], "dspark-drain-engine.log")
    try:
        result = {}
        # Long enough (~2-4 s here) that it is still running while the checks below run:
        # a short one could finish, and the engine exit, before /ready is asked.
        t = threading.Thread(target=lambda: result.update(
            r=post(url + "/v1/completions", completion(LONG))))
        t.start()
        # Wait until the request is running, then ask the engine to stop.
        wait_running(url)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert status(url + "/ready") == 503
        code, body = post(url + "/v1/completions", completion(4))
        assert code == 503, body
        assert b"shutting down" in body
        t.join(timeout=120)
        code, body = result["r"]
        assert code == 200, body
        done = json.loads(body)
        assert done["usage"]["completion_tokens"] == LONG
        assert done["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_drain_deadline_bounds_shutdown():
    proc, url, log = start_engine(["--drain-timeout-secs", "1"], "dspark-drain-engine2.log")
    try:
        def cut_off():  # the process exits under it: the connection drops
            try:
                post(url + "/v1/completions", completion(1500), timeout=60)
            except OSError:
                pass

        t = threading.Thread(target=cut_off, daemon=True)
        t.start()
        wait_running(url)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.time() - t0
        assert took < 10, f"exit took {took:.1f}s with a 1 s drain deadline"
        assert "drain timeout passed" in open(log).read()
    finally:
        if proc.poll() is None:
            proc.kill()
