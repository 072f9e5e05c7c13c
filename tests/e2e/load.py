#!/usr/bin/env python3
"""Closed-loop chat load over a changing set of engine pods (loopback pod IPs only).

Reads the target base URLs from --targets (one per line, re-read every request, so pods
added by a scale-up get traffic), runs --concurrency workers until SIGTERM/SIGINT or
--duration, prints one status line every --report seconds.
"""
import argparse
import ipaddress
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works, step by step.",
    "List ten facts about the moon.",
    "Describe the water cycle to a child.",
    "What are the pros and cons of remote work? Answer in detail.",
]


def loopback(url: str) -> bool:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", required=True)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--report", type=float, default=5.0)
    ap.add_argument("--stats", help="write the running totals {ok, err, last_error} here as JSON")
    args = ap.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    lock = threading.Lock()
    stats = {"ok": 0, "err": 0, "lat": [], "last_err": ""}
    rr = [0]

    def targets():
        try:
            with open(args.targets) as f:
                urls = [u.strip() for u in f if u.strip()]
        except OSError:
            return []
        return [u for u in urls if loopback(u)]

    def worker(i: int):
        n = i
        while not stop.is_set():
            ts = targets()
            if not ts:
                time.sleep(0.5)
                continue
            with lock:
                rr[0] += 1
                url = ts[rr[0] % len(ts)]
            body = json.dumps({
                "model": "default",
                "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
            }).encode()
            n += 1
            req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                with lock:
                    stats["ok"] += 1
                    stats["lat"].append(time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    stats["err"] += 1
                    stats["last_err"] = f"{url}: {e}"
                time.sleep(0.2)

    def write_stats():
        if not args.stats:
            return
        with lock:
            doc = {"ok": stats["ok"], "err": stats["err"], "last_error": stats["last_err"]}
        with open(args.stats + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(args.stats + ".tmp", args.stats)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    t_start = time.monotonic()
    while not stop.is_set():
        stop.wait(args.report)
        with lock:
            lat = sorted(stats["lat"])
            stats["lat"] = []
            ok, err, last = stats["ok"], stats["err"], stats["last_err"]
        p50 = lat[len(lat) // 2] if lat else 0.0
        print(f"[load] +{time.monotonic() - t_start:5.0f}s targets={len(targets())} ok={ok} "
              f"err={err} p50_latency={p50:.2f}s" + (f" last_error={last}" if err else ""),
              flush=True)
        write_stats()
        if args.duration and time.monotonic() - t_start >= args.duration:
            stop.set()
    # Requests in flight finish (or fail) before the final count.
    for t in threads:
        t.join(timeout=130)
    write_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
