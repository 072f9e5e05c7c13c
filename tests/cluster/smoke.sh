#!/usr/bin/env bash
# Smoke test of the local test cluster (tests/cluster/cluster.sh). Needs a running cluster
# (`cluster.sh up`). Checks: fake GPU nodes Ready with nvidia.com/gpu, scheduling by node
# type + toleration, garbage collection of a deleted Deployment, CRD CEL validation,
# helm lint/template/install, and that no component talks to a non-loopback address.
# Leaves the cluster as it found it (namespace dspark-smoke is removed).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
eval "$("$HERE/cluster.sh" env)"
NS=dspark-smoke
TD="$HERE/testdata"
FAILS=0

say() { printf '\n[smoke] %s\n' "$*"; }
ok() { printf '[smoke]   ok: %s\n' "$*"; }
fail() { printf '[smoke]   FAIL: %s\n' "$*"; FAILS=$((FAILS + 1)); }
# retry <seconds> <command...>: succeed once the command does.
retry() {
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

main() {
"$HERE/cluster.sh" status >/dev/null || { echo "[smoke] cluster is not up: run tests/cluster/cluster.sh up" >&2; exit 1; }
POD_STAGES=0
grep -q 'name: pod-ready' "$DSPARK_CLUSTER_DIR/kwok.yaml" && POD_STAGES=1

say "versions"
kubectl version 2>&1 | sed 's/^/  /'
helm version | sed 's/^/  /'

say "fake GPU nodes"
kubectl get nodes -o wide
kubectl get nodes \
  -o custom-columns='NAME:.metadata.name,TYPE:.metadata.labels.dspark\.dev/node-type,GPU_CAP:.status.capacity.nvidia\.com/gpu,GPU_ALLOC:.status.allocatable.nvidia\.com/gpu,READY:.status.conditions[?(@.type=="Ready")].status,TAINTS:.spec.taints[*].key'
local n
for n in gpu-a-0 gpu-a-1 gpu-h-0; do
  if [ "$(kubectl get node "$n" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}/{.status.allocatable.nvidia\.com/gpu}')" = "True/8" ]; then
    ok "$n Ready with nvidia.com/gpu=8"
  else
    fail "$n not Ready or without nvidia.com/gpu=8"
  fi
done

say "scheduling by node type (toleration + nodeSelector)"
kubectl create namespace "$NS" >/dev/null
kubectl apply -f "$TD/deployment.yaml"
all_bound() { [ "$(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.spec.nodeName}{"|"}{end}' | tr '|' '\n' | grep -c .)" = 4 ]; }
if retry 60 all_bound; then ok "all 4 pods bound"; else fail "pods not all bound in 60s"; fi
kubectl get pods -n "$NS" -o wide
local p node app
while read -r p node app; do
  case "$app/$node" in
    smoke-a100/gpu-a-*|smoke-h100/gpu-h-0) ok "$p ($app) -> $node" ;;
    *) fail "$p ($app) scheduled to wrong node '$node'" ;;
  esac
done < <(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.metadata.name} {.spec.nodeName} {.metadata.labels.app}{"\n"}{end}')
if [ "$POD_STAGES" = 0 ]; then
  sleep 3
  if [ -z "$(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.status.podIP}{end}')" ]; then
    ok "no pod got a status from kwok (pod stages off: the test kubelet owns pods)"
  else
    fail "kwok touched pod status although pod stages are off"
  fi
else
  retry 30 bash -c "[ \"\$(kubectl get pods -n $NS --field-selector=status.phase=Running -o name | wc -l)\" = 4 ]" \
    && ok "kwok pod stages: 4 pods Running" || fail "pods not Running with kwok pod stages"
  local ip
  for ip in $(kubectl get pods -n "$NS" -o jsonpath='{range .items[*]}{.status.podIP}{" "}{end}'); do
    case "$ip" in 127.*) ok "pod IP $ip is loopback" ;; *) fail "pod IP $ip is not loopback" ;; esac
  done
fi

say "unschedulable: a 9th GPU on the h100 node must stay Pending"
kubectl scale deployment smoke-h100 -n "$NS" --replicas=2 >/dev/null
unsched() { kubectl get pods -n "$NS" -l app=smoke-h100 -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="PodScheduled")].reason}{"\n"}{end}' | grep -qx Unschedulable; }
if retry 30 unsched; then ok "second h100 pod Unschedulable (8 GPUs already requested)"; else fail "no Unschedulable pod"; fi

say "garbage collection: delete Deployment smoke-a100"
local rs
rs="$(kubectl get rs -n "$NS" -l app=smoke-a100 -o name)"
echo "  replicaset: $rs"
kubectl delete deployment smoke-a100 -n "$NS" --wait=false
rs_gone() { [ -z "$(kubectl get rs -n "$NS" -l app=smoke-a100 -o name)" ]; }
if retry 60 rs_gone; then ok "ReplicaSet garbage-collected"; else fail "ReplicaSet still there after 60s"; fi
if [ "$POD_STAGES" = 1 ]; then
  pods_gone() { [ -z "$(kubectl get pods -n "$NS" -l app=smoke-a100 -o name)" ]; }
  if retry 60 pods_gone; then ok "pods deleted"; else fail "pods still there after 60s"; fi
else
  # Bound pods are deleted gracefully: the apiserver sets deletionTimestamp and waits for
  # the node's kubelet to confirm. No kubelet runs here, so they stay Terminating.
  pods_terminating() { ! kubectl get pods -n "$NS" -l app=smoke-a100 -o go-template='{{range .items}}{{if not .metadata.deletionTimestamp}}{{.metadata.name}}{{"\n"}}{{end}}{{end}}' | grep -q .; }
  if retry 60 pods_terminating; then
    ok "all smoke-a100 pods marked for deletion by the garbage collector (Terminating: no kubelet confirms)"
  else
    fail "pods not marked for deletion in 60s"
  fi
  kubectl get pods -n "$NS" -l app=smoke-a100
  kubectl delete pods -n "$NS" -l app=smoke-a100 --grace-period=0 --force >/dev/null 2>&1 || true
fi

say "CRD with CEL validation"
kubectl apply -f "$TD/crd-cel.yaml"
kubectl wait --for=condition=Established crd/widgets.smoke.dspark.dev --timeout=30s
if kubectl apply -f "$TD/widget-good.yaml"; then ok "valid Widget accepted"; else fail "valid Widget rejected"; fi
local out
if out="$(kubectl apply -f "$TD/widget-bad.yaml" 2>&1)"; then
  fail "invalid Widget accepted"
else
  echo "  $out"
  if grep -q 'minReplicas must not exceed maxReplicas' <<<"$out"; then ok "invalid Widget rejected by the CEL rule"; else fail "rejected, but not by the CEL rule"; fi
fi

say "helm"
if helm lint "$TD/chart"; then ok "helm lint"; else fail "helm lint"; fi
helm template smoke "$TD/chart" | grep -E 'kubeVersion' | sed 's/^/  /'
if helm install smoke "$TD/chart" -n "$NS" --wait --timeout 60s >/dev/null && \
   [ "$(kubectl get configmap smoke-smoke -n "$NS" -o jsonpath='{.data.kubeVersion}')" != "" ]; then
  ok "helm install against the cluster (kubeVersion $(kubectl get configmap smoke-smoke -n "$NS" -o jsonpath='{.data.kubeVersion}'))"
else
  fail "helm install"
fi
helm uninstall smoke -n "$NS" >/dev/null || fail "helm uninstall"

say "network: every TCP socket of the cluster processes is on 127.0.0.0/8"
local pids pid bad=0
pids="$(cat "$DSPARK_CLUSTER_DIR"/run/*.pid)"
for pid in $pids; do
  # local and peer address of every TCP socket (listening and connected) of this process
  while read -r state local peer; do
    for a in "$local" "$peer"; do
      a="${a%:*}"; a="${a#[}"; a="${a%]}"; a="${a#::ffff:}"
      case "$a" in 127.*|'*'|0.0.0.0) ;; *) echo "  non-loopback: pid $pid $state $local -> $peer"; bad=1 ;; esac
    done
    # listeners must be bound to loopback, not the wildcard
    if [ "$state" = LISTEN ]; then case "$local" in 127.*) ;; *) echo "  wildcard listener: pid $pid $local"; bad=1 ;; esac; fi
  done < <(ss -Htanp | awk -v p="pid=$pid," 'index($0, p) { print $1, $4, $5 }')
done
ss -Htanp | grep -E "$(echo $pids | sed 's/ /,|pid=/g; s/^/pid=/; s/$/,/')" | awk '{print $1}' | sort | uniq -c | sed 's/^/  sockets by state:/'
if [ "$bad" = 0 ]; then ok "all sockets loopback (listeners on 127.0.0.1)"; else fail "non-loopback sockets"; fi

say "cleanup"
kubectl delete -f "$TD/crd-cel.yaml" --wait=true >/dev/null
# Without a kubelet, bound pods never finish graceful deletion, so the namespace would hang:
# delete the workloads first (so nothing recreates pods), then force-delete the pods.
kubectl delete deployments -n "$NS" --all --wait=false >/dev/null
retry 60 bash -c "[ -z \"\$(kubectl get rs -n $NS -o name)\" ]" || fail "ReplicaSets not garbage-collected"
kubectl delete pods -n "$NS" --all --grace-period=0 --force >/dev/null 2>&1 || true
kubectl delete namespace "$NS" --timeout=60s >/dev/null && ok "namespace $NS deleted (namespace controller)" || fail "namespace $NS not deleted"

echo
if [ "$FAILS" = 0 ]; then echo "[smoke] PASS"; else echo "[smoke] FAILED: $FAILS check(s)"; exit 1; fi
}

main "$@"; exit $?
