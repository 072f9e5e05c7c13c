#!/usr/bin/env python3
"""The operator at fleet scale (issue #22): N DSparkDeployments over M fake GPU nodes.

Against the local control plane (`tests/cluster/cluster.sh up`: real etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and kwok playing the nodes), this program
  1. adds M kwok nodes spread over node types (GPU capacity, taint, node-type label);
  2. starts the release `dspark-operator` for one namespace;
  3. applies N DSparkDeployments (each with pools on two node types, models rotating, so
     that cost tables are shared the way a fleet shares them);
  4. plays the kubelet for the profiling pods only (each finishes with a cost table as its
     termination message, as `dspark-engine profile` writes it); engine pods are scheduled
     onto the kwok nodes but no container runs, so no push or scrape ever succeeds;
  5. waits for steady state (every deployment observed at its generation, every table
     Ready and named in its pools' status) and then watches the operator at rest over
     `--rounds` windows of `--rest` seconds.
It prints one table: time to steady state, reconcile duration p50/p99 (from the operator's
histogram, while converging and at rest), API requests per reconcile by verb, write
requests per minute at rest, objects whose resourceVersion moved at rest, and the
operator's resident memory. Numbers go to docs/benchmarks.md with the exact command.

Usage (after `make cluster-up` and a release build of the operator):
  eval "$(tests/cluster/cluster.sh env)"
  python3 bench/operator_scale.py --nodes 1000 --deployments 100 --rest 60 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))
from engine_proc import free_port, wait_http  # noqa: E402

NODE_TYPES = ["a100-80gb", "h100-80gb", "l40s-48gb", "h200-141gb"]
NODE_LABEL = "dspark.dev/scale-bench"
WRITE_VERBS = ("create", "patch", "update", "delete")
KINDS = [
    "dsparkdeployments",
    "dsparkcosttables",
    "deployments",
    "services",
    "poddisruptionbudgets",
    "configmaps",
    "secrets",
    "jobs",
]


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    p = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=300
    )
    if check and p.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)} failed: {p.stderr.strip()}")
    return p.stdout


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json"))


def node_yaml(i: int, node_type: str) -> str:
    name = f"scale-{node_type}-{i}"
    # Loopback addresses only (127.20.x.y); kwok never dials them.
    ip = f"127.20.{i // 250}.{i % 250 + 1}"
    return f"""---
apiVersion: v1
kind: Node
metadata:
  name: {name}
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: {name}
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    {NODE_LABEL}: "true"
    dspark.dev/fake-gpu-node: "true"
    dspark.dev/node-type: {node_type}
    nvidia.com/gpu.present: "true"
spec:
  taints:
  - key: nvidia.com/gpu
    value: present
    effect: NoSchedule
status:
  addresses:
  - type: InternalIP
    address: {ip}
  capacity: {{cpu: "64", memory: 1Ti, pods: "110", nvidia.com/gpu: "8"}}
  allocatable: {{cpu: "64", memory: 1Ti, pods: "110", nvidia.com/gpu: "8"}}
"""


def deployment_yaml(i: int, models: int) -> str:
    a, b = NODE_TYPES[i % len(NODE_TYPES)], NODE_TYPES[(i + 1) % len(NODE_TYPES)]
    pools = "".join(
        f"""
    - name: p{k}
      nodeType: {nt}
      tolerations:
        - {{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}
      minReplicas: 1
      maxReplicas: 4"""
        for k, nt in enumerate((a, b))
    )
    return f"""---
apiVersion: serving.dspark.dev/v1alpha1
kind: DSparkDeployment
metadata:
  name: svc-{i:03d}
spec:
  model:
    id: model-{i % models}
    pvc: {{claimName: models, path: model-{i % models}}}
  engine:
    image: dspark/engine:0.1.0
  pools:{pools}
  slo: {{ttftP95Ms: 500, itlP95Ms: 50, windowSeconds: 60}}
  speculation: none
"""


def table_json(spec: dict) -> str:
    return json.dumps(
        {
            "schema": 1,
            "model_id": spec["modelId"],
            "engine_version": spec["engineVersion"],
            "device": "fake",
            "node_type": spec["nodeType"],
            "dtype": "q4_1",
            "measured_at": "2026-12-02T00:00:00Z",
            "points": [[1, 100.0], [4, 60.0], [16, 25.0]],
        },
        separators=(",", ":"),
    )


class ProfilingKubelet(threading.Thread):
    """Finishes every profiling pod of the namespace with its table, as the engine would."""

    def __init__(self, ns: str):
        super().__init__(daemon=True)
        self.ns, self.done, self.stop = ns, set(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(2.0):
            try:
                self.tick()
            except SystemExit as e:  # a transient kubectl failure: try again
                print(f"profiling kubelet: {e}", file=sys.stderr)

    def tick(self) -> None:
        pods = get_json("pods", "-n", self.ns, "-l", "job-name")["items"]
        todo = [p for p in pods if p["metadata"]["name"] not in self.done]
        if not todo:
            return
        jobs = {j["metadata"]["name"]: j for j in get_json("jobs", "-n", self.ns)["items"]}
        tables = {
            t["metadata"]["name"]: t
            for t in get_json("dsparkcosttables", "-n", self.ns)["items"]
        }
        for pod in todo:
            job = jobs.get(pod["metadata"]["labels"]["job-name"])
            if not job:
                continue
            table = tables.get(job["metadata"]["labels"].get("serving.dspark.dev/cost-table", ""))
            if not table:
                continue
            status = {
                "status": {
                    "phase": "Succeeded",
                    "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "image": c["image"],
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {
                                "terminated": {
                                    "exitCode": 0,
                                    "reason": "Completed",
                                    "message": table_json(table["spec"]),
                                    "startedAt": "2026-12-02T00:00:00Z",
                                    "finishedAt": "2026-12-02T00:01:00Z",
                                }
                            },
                        }
                        for c in pod["spec"]["containers"]
                    ],
                }
            }
            kubectl(
                "patch", "pod", pod["metadata"]["name"], "-n", self.ns,
                "--subresource=status", "--type=merge", "-p", json.dumps(status),
            )
            self.done.add(pod["metadata"]["name"])


def scrape(url: str) -> dict[str, float]:
    """Series -> value of the operator's exposition."""
    out = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                series, _, value = line.rpartition(" ")
                out[series] = float(value)
    return out


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}


def quantile(q: float, m: dict[str, float]) -> float:
    """histogram_quantile over the reconcile-duration buckets of `m` (a delta or a total)."""
    buckets = []
    for k, v in m.items():
        mm = re.fullmatch(r'dspark_operator_reconcile_duration_seconds_bucket\{le="([^"]+)"\}', k)
        if mm:
            buckets.append((float(mm.group(1)), v))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return float("nan")
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9)
        prev_le, prev_n = le, n
    return prev_le


def verbs(m: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in m.items():
        mm = re.fullmatch(r'dspark_operator_kube_requests_total\{verb="(\w+)"\}', k)
        if mm:
            out[mm.group(1)] = v
    return out


def versions(ns: str) -> dict[str, str]:
    out = {}
    for kind in KINDS:
        for o in get_json(kind, "-n", ns)["items"]:
            out[f"{kind}/{o['metadata']['name']}"] = o["metadata"]["resourceVersion"]
    return out


def rss_mib(pid: int) -> tuple[float, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    kib = lambda k: float(fields[k].split()[0]) / 1024  # noqa: E731
    return kib("VmRSS"), kib("VmHWM")


def steady(ns: str, n: int) -> tuple[bool, str]:
    dsds = get_json("dsparkdeployments", "-n", ns)["items"]
    tables = get_json("dsparkcosttables", "-n", ns)["items"]
    observed = sum(
        1
        for d in dsds
        if (d.get("status") or {}).get("observedGeneration") == d["metadata"]["generation"]
        and all(p.get("costTableRevision") for p in d["status"].get("pools", []))
        and len(d["status"].get("pools", [])) == len(d["spec"]["pools"])
    )
    ready = sum(1 for t in tables if (t.get("status") or {}).get("phase") == "Ready")
    return observed == n and tables and ready == len(tables), (
        f"{observed}/{n} deployments settled, {ready}/{len(tables)} tables Ready"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--models", type=int, default=10, help="distinct model ids (tables = models x node types used)")
    ap.add_argument("--rest", type=float, default=60.0, help="seconds per window at rest")
    ap.add_argument("--rounds", type=int, default=3, help="windows at rest")
    ap.add_argument("--namespace", default="scale-bench")
    cache = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    ap.add_argument("--operator-bin", default=str(cache / "cargo-target" / "release" / "dspark-operator"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to reach steady state")
    ap.add_argument("--keep", action="store_true", help="leave the nodes and namespace behind")
    ap.add_argument("--operator-arg", action="append", default=[],
                    help="an extra argument of the operator (repeat), e.g. --operator-arg=--max-concurrent-reconciles=0")
    args = ap.parse_args()
    ns, n = args.namespace, args.deployments

    kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true")
    kubectl("create", "namespace", ns)
    t = time.time()
    docs = [node_yaml(i, NODE_TYPES[i % len(NODE_TYPES)]) for i in range(args.nodes)]
    for k in range(0, len(docs), 200):
        kubectl("apply", "--server-side", "-f", "-", stdin="".join(docs[k : k + 200]))
    while True:
        nodes = get_json("nodes", "-l", NODE_LABEL)["items"]
        ready = sum(
            1
            for x in nodes
            if any(c["type"] == "Ready" and c["status"] == "True" for c in (x.get("status") or {}).get("conditions", []))
        )
        if ready >= args.nodes:
            break
        if time.time() - t > 600:
            raise SystemExit(f"only {ready}/{args.nodes} nodes Ready after 600 s")
        time.sleep(3)
    print(f"{args.nodes} kwok nodes Ready in {time.time() - t:.0f} s", flush=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(f"/tmp/operator-scale-{port}.log", "w")
    env = dict(os.environ, RUST_LOG="warn,dspark_operator=warn")
    op = subprocess.Popen(
        [args.operator_bin, "--http", f"127.0.0.1:{port}", "--namespace", ns, "--no-leader-election",
         *args.operator_arg],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    kubelet = ProfilingKubelet(ns)
    try:
        wait_http(f"{url}/healthz", op, "dspark-operator", log.name, 60)
        m0 = scrape(f"{url}/metrics")
        kubelet.start()
        t0 = time.time()
        kubectl("apply", "-n", ns, "--server-side", "-f", "-",
                stdin="".join(deployment_yaml(i, args.models) for i in range(n)))
        last = ""
        while True:
            ok, what = steady(ns, n)
            if what != last:
                print(f"  {time.time() - t0:6.1f} s  {what}", flush=True)
                last = what
            if ok:
                break
            if time.time() - t0 > args.timeout:
                raise SystemExit(f"no steady state after {args.timeout:.0f} s: {what}")
            time.sleep(1)
        t_steady = time.time() - t0
        m1 = scrape(f"{url}/metrics")
        rss_converged = rss_mib(op.pid)
        ramp = delta(m0, m1)
        # Let the transitions' requeues and Events drain before measuring rest.
        time.sleep(30)
        windows = []
        for _ in range(args.rounds):
            a, va = scrape(f"{url}/metrics"), versions(ns)
            time.sleep(args.rest)
            b, vb = scrape(f"{url}/metrics"), versions(ns)
            moved = sorted(k for k in vb if va.get(k) != vb[k])
            windows.append((delta(a, b), moved, rss_mib(op.pid)))
        tables = len(get_json("dsparkcosttables", "-n", ns)["items"])
        pods = len(get_json("pods", "-n", ns, "-l", "app.kubernetes.io/component=engine")["items"])
    finally:
        kubelet.stop.set()
        op.terminate()
        try:
            op.wait(30)
        except subprocess.TimeoutExpired:
            op.kill()
        if not args.keep:
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
            kubectl("delete", "nodes", "-l", NODE_LABEL, "--wait=false", check=False)

    def per_reconcile(d: dict[str, float]) -> str:
        r = d.get("dspark_operator_reconciles_total", 0)
        v = verbs(d)
        total = sum(v.values())
        parts = ", ".join(f"{k} {v[k] / r:.1f}" for k in sorted(v) if v[k])
        return f"{total / r:.1f} ({parts})" if r else "-"

    print()
    print(f"{args.nodes} kwok nodes ({len(NODE_TYPES)} types), {n} DSparkDeployments x 2 pools, "
          f"{tables} cost tables, {pods} engine pods (scheduled, not started)")
    print()
    print("| phase | seconds | reconciles | p50 ms | p99 ms | API requests / reconcile | "
          "write requests / min | objects changed | RSS MiB (peak) |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    print(f"| to steady state | {t_steady:.1f} | {ramp.get('dspark_operator_reconciles_total', 0):.0f} | "
          f"{quantile(0.5, ramp) * 1e3:.1f} | {quantile(0.99, ramp) * 1e3:.1f} | {per_reconcile(ramp)} | "
          f"- | - | {rss_converged[0]:.0f} ({rss_converged[1]:.0f}) |")
    for k, (d, moved, rss) in enumerate(windows):
        writes = sum(v for verb, v in verbs(d).items() if verb in WRITE_VERBS)
        print(f"| at rest {k + 1} | {args.rest:.0f} | {d.get('dspark_operator_reconciles_total', 0):.0f} | "
              f"{quantile(0.5, d) * 1e3:.1f} | {quantile(0.99, d) * 1e3:.1f} | {per_reconcile(d)} | "
              f"{writes * 60 / args.rest:.1f} | {len(moved)} | {rss[0]:.0f} ({rss[1]:.0f}) |")
    for k, (_, moved, _) in enumerate(windows):
        if moved:
            print(f"window {k + 1}: changed at rest: {', '.join(moved[:10])}{' ...' if len(moved) > 10 else ''}")


if __name__ == "__main__":
    main()
