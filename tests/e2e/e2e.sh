#!/usr/bin/env bash
# End-to-end test of DSpark on the local control plane (`make e2e`):
#   cluster up (+ smoke test) -> test kubelet -> `helm install` of the previous chart version
#   (tests/e2e/charts/) with the operator built from this tree running as a pod (its
#   ServiceAccount, RBAC, probes, leader election) -> a two-pool DSparkDeployment (config/samples/dsparkdeployment-e2e.yaml)
#   whose model is a `huggingFace` source on a loopback Hub (tests/python/fakehub.py serving
#   MODEL), fetched by each pod's init container -> profiling Jobs per node type complete, DSparkCostTables hold tables -> engine pods on
#   the right fake nodes, served by real engine processes on loopback pod IPs, answering
#   -> engines report the stored table (admin API digest) -> load pushes TTFT over the SLO ->
#   a pool scales up -> load stops -> it scales down after the window -> `helm upgrade` to
#   charts/dspark-operator under load (no request fails, no engine pod replaced, the new
#   operator applies its CRDs: spec.suspend works) -> other sources for real through the
#   test kubelet: an S3 source (moto on loopback) and an image source (an OCI image of the
#   weights in a loopback registry, an image volume) serve, a gated repo with a wrong token
#   Secret shows ModelAvailable=False (Unauthorized) and an Event -> deleting the DSparkDeployment removes
#   everything -> helm uninstall leaves only the CRDs.
# Prints a timeline at the end. Needs the release builds (`make build`) and the model
# (scripts/fetch-models.sh).
#
# Environment: DSPARK_E2E_KEEP=1 leaves the cluster and everything in it running;
# MODEL (default: $DSPARK_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf);
# E2E_CONCURRENCY (default 12) load workers; E2E_SKIP_SCALING=1 stops after the table checks;
# E2E_MODEL_SOURCE=hostPath serves MODEL from a hostPath instead of the loopback Hub;
# E2E_IMAGE_RUNTIME (runc, the default, or crun): the OCI runtime with which the test kubelet
# runs every container FROM its image (operator and engine images built by scripts/images.sh,
# pushed to the registry on loopback and referenced by digest).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CL="$ROOT/tests/cluster/cluster.sh"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$CACHE/cargo-target}"
export DSPARK_ENGINE_BIN="${DSPARK_ENGINE_BIN:-$CARGO_TARGET_DIR/release/dspark-engine}"
export DSPARK_OPERATOR_BIN="${DSPARK_OPERATOR_BIN:-$CARGO_TARGET_DIR/release/dspark-operator}"
MODEL="${MODEL:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
NS=dspark-e2e
OPNS=dspark-system
RELEASE=dspark
DSD=e2e
SAMPLE="$ROOT/config/samples/dsparkdeployment-e2e.yaml"
PREVIOUS_CHART="$HERE/charts/dspark-operator-0.1.0.tgz"
CONCURRENCY="${E2E_CONCURRENCY:-12}"
IMAGE_RUNTIME="${E2E_IMAGE_RUNTIME:-runc}"
WORK="$(mktemp -d /tmp/dspark-e2e.XXXXXX)"
T0=$(date +%s.%N)
TIMELINE="$WORK/timeline"
LOAD_PID=""
HUB_PID=""
S3_PID=""
REGISTRY_UP=0
PREEXISTING=0
: >"$TIMELINE"

since() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%6.1f", b - a }'; }
mark() {
  local line; line="+$(since)s  $*"
  echo "$line" >>"$TIMELINE"
  printf '\n[e2e %s\n' "$line"
}
info() { printf '[e2e]   %s\n' "$*"; }
# in_container PID: the process runs in a mount namespace other than ours (a container).
in_container() { [ "$(readlink "/proc/$1/ns/mnt" 2>/dev/null || echo none)" != "$(readlink /proc/self/ns/mnt)" ] && [ -e "/proc/$1" ]; }
die() { printf '\n[e2e] FAIL: %s\n' "$*" >&2; echo "+$(since)s  FAIL: $*" >>"$TIMELINE"; exit 1; }
# wait_until <seconds> <what> <command...>: poll every second until the command succeeds.
wait_until() {
  local secs="$1" what="$2"; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || die "timed out after ${secs}s waiting for $what"
    sleep 1
  done
}

diagnostics() {
  echo "===== diagnostics ====="
  kubectl get nodes -L dspark.dev/node-type 2>&1 || true
  kubectl get all,dsd,dsct,cm,secret,pdb -n "$NS" -o wide 2>&1 || true
  kubectl get pods -n "$OPNS" -o wide 2>&1 || true
  kubectl get events -n "$NS" --sort-by=.lastTimestamp 2>&1 | tail -n 30 || true
  echo "--- test kubelet log (tail) ---"
  tail -n 30 "$DSPARK_CLUSTER_DIR/logs/dspark-test-kubelet.log" 2>/dev/null || true
  local f
  for f in "$DSPARK_CLUSTER_DIR"/kubelet/pods/*/*.log; do
    [ -f "$f" ] || continue
    echo "--- $f (tail) ---"
    tail -n 15 "$f"
  done
}

# stop_load: SIGTERM to the load generator; it finishes the requests in flight and exits.
stop_load() {
  if [ -n "$LOAD_PID" ]; then kill "$LOAD_PID" 2>/dev/null || true; wait "$LOAD_PID" 2>/dev/null || true; fi
  LOAD_PID=""
}

finish() {
  local rc=$?
  stop_load
  gie_stop
  if [ -n "$HUB_PID" ]; then kill "$HUB_PID" 2>/dev/null || true; wait "$HUB_PID" 2>/dev/null || true; fi
  if [ -n "$S3_PID" ]; then kill "$S3_PID" 2>/dev/null || true; wait "$S3_PID" 2>/dev/null || true; fi
  if [ "$REGISTRY_UP" = 1 ]; then "$ROOT/tests/registry/registry.sh" down >/dev/null 2>&1 || true; fi
  [ "$rc" = 0 ] || diagnostics
  echo
  echo "===== e2e timeline ($( [ "$rc" = 0 ] && echo PASSED || echo "FAILED, rc $rc")) ====="
  cat "$TIMELINE"
  if [ "${DSPARK_E2E_KEEP:-0}" = 1 ]; then
    echo "(DSPARK_E2E_KEEP=1: cluster left running; eval \"\$($CL env)\"; $CL down to stop)"
  elif [ "$PREEXISTING" = 1 ]; then
    # Someone else's cluster (another test may be using it): leave it as found.
    kubectl delete namespace "$NS" "$OPNS" --wait=true --timeout=60s >/dev/null 2>&1 || true
    "$CL" kubelet-down >/dev/null 2>&1 || true
    echo "(the cluster was already up before the e2e: left running, test kubelet stopped)"
  else
    "$CL" down >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap finish EXIT
# shellcheck source=tests/e2e/gie.sh
. "$HERE/gie.sh"

[ -x "$DSPARK_ENGINE_BIN" ] || die "no engine binary at $DSPARK_ENGINE_BIN (make build)"
[ -x "$DSPARK_OPERATOR_BIN" ] || die "no operator binary at $DSPARK_OPERATOR_BIN (make build)"
[ -f "$MODEL" ] || die "no model at $MODEL (scripts/fetch-models.sh)"

PREEXISTING=0
"$CL" status >/dev/null 2>&1 && PREEXISTING=1
mark "start: cluster up$( [ "$PREEXISTING" = 1 ] && echo " (already running: it is left up afterwards)")"
"$CL" up
eval "$("$CL" env)"
# The smoke test expects nobody to run pods (a kubelet left by DSPARK_E2E_KEEP=1 would).
"$CL" kubelet-down >/dev/null 2>&1 || true
"$ROOT/tests/cluster/smoke.sh" >"$WORK/smoke.log" 2>&1 || { cat "$WORK/smoke.log"; die "cluster smoke test failed"; }
mark "cluster up, smoke test passed; starting the test kubelet"
# The images of this tree, pushed to the CNCF registry on loopback; pods name them by digest.
"$ROOT/tests/registry/registry.sh" up >"$WORK/registry.log" 2>&1 || { cat "$WORK/registry.log"; die "the registry did not start"; }
REGISTRY_UP=1
REG="$("$ROOT/tests/registry/registry.sh" addr)"
DSPARK_IMAGES_OUT="$WORK/images" "$ROOT/scripts/images.sh" push "$REG" operator engine >"$WORK/images.log" 2>&1 ||
  { tail -n 30 "$WORK/images.log"; die "building or pushing the images failed"; }
# shellcheck disable=SC1091
. "$WORK/images/digests.env"
[[ "$OPERATOR_IMAGE" == "$REG"/dspark/operator@sha256:* && "$ENGINE_IMAGE" == "$REG"/dspark/engine@sha256:* ]] ||
  die "images not referenced by digest: $OPERATOR_IMAGE $ENGINE_IMAGE"
mark "images built and pushed to the loopback registry: $OPERATOR_IMAGE, $ENGINE_IMAGE"
export DSPARK_KUBELET_IMAGE_RUNTIME="$IMAGE_RUNTIME"
"$CL" kubelet-up
mark "test kubelet up (containers run by: $IMAGE_RUNTIME) on $(kubectl get nodes -l dspark.dev/test-kubelet=true -o name | wc -l) fake GPU nodes"

# --- the operator, from the previous chart version ------------------------------------------
# Installed from the previous release of the chart (tests/e2e/charts/, `helm package` of it);
# it is upgraded to this tree's chart under load further down.
kubectl create namespace "$OPNS" >/dev/null
CRD=dsparkdeployments.serving.dspark.dev
CRD_BEFORE=0
kubectl get crd "$CRD" >/dev/null 2>&1 && CRD_BEFORE=1
# The previous chart has no image.digest: REPO:TAG@DIGEST (a runtime ignores the tag).
VERSION="$(awk -F'"' '/^version *=/ { print $2; exit }' "$ROOT/Cargo.toml")"
IMAGE_VALUES=(--set image.repository="${OPERATOR_IMAGE%@*}" --set-string image.tag="$VERSION@${OPERATOR_IMAGE#*@}")
HELM_VALUES=("${IMAGE_VALUES[@]}"
  --set-string 'nodeSelector.dspark\.dev/test-kubelet=true'
  --set 'tolerations[0].key=nvidia.com/gpu' --set 'tolerations[0].operator=Exists'
  --set leaderElection.leaseSeconds=6)
helm install "$RELEASE" "$PREVIOUS_CHART" -n "$OPNS" --wait --timeout 120s \
  "${HELM_VALUES[@]}" >"$WORK/helm-install.log"
leader() { kubectl get lease -n "$OPNS" "$RELEASE-dspark-operator-leader" -o jsonpath='{.spec.holderIdentity}'; }
OPPOD="$(kubectl get pods -n "$OPNS" -l app.kubernetes.io/component=operator -o jsonpath='{.items[0].metadata.name}')"
first_leader() { [ "$(leader)" = "$OPPOD" ]; }
wait_until 60 "the leader Lease" first_leader
mark "helm install of the previous chart $(basename "$PREVIOUS_CHART") done: operator pod $OPPOD Ready on $(kubectl get pod -n "$OPNS" "$OPPOD" -o jsonpath='{.spec.nodeName} at {.status.podIP}'), holds the Lease"
crd_has_suspend() {
  kubectl get crd "$CRD" -o jsonpath='{.spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.suspend.type}' | grep -qx boolean
}
if [ "$CRD_BEFORE" = 0 ]; then
  ! crd_has_suspend || die "the previous chart's CRD already has spec.suspend"
  info "CRD $CRD as the previous chart installed it: no spec.suspend, schema revision '$(kubectl get crd "$CRD" -o jsonpath='{.metadata.annotations.serving\.dspark\.dev/schema-revision}')'"
fi

# --- the DSparkDeployment ------------------------------------------------------------------
kubectl create namespace "$NS" >/dev/null
sed "s|/var/lib/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf|$MODEL|" "$SAMPLE" >"$WORK/dsd.yaml"
sed -i "s|image: dspark/engine:dev|image: $ENGINE_IMAGE|" "$WORK/dsd.yaml"
grep -q "image: $ENGINE_IMAGE" "$WORK/dsd.yaml" || die "the sample's engine image was not replaced"
SOURCE="hostPath $MODEL"
if [ "${E2E_MODEL_SOURCE:-huggingFace}" = huggingFace ]; then
  # The model from a Hub on loopback: the pods' fetch-model init containers download it into
  # their model cache (HF_ENDPOINT through engine.env), the engines serve it from there.
  python3 "$ROOT/tests/python/fakehub.py" "$MODEL" >"$WORK/hub.url" 2>"$WORK/hub.log" &
  HUB_PID=$!
  wait_until 30 "the loopback Hub" test -s "$WORK/hub.url"
  HUB="$(head -n1 "$WORK/hub.url")"
  python3 - "$WORK/dsd.yaml" "$HUB" <<'EOF' || die "cannot rewrite the sample"
import sys, yaml
path, hub = sys.argv[1], sys.argv[2]
d = yaml.safe_load(open(path))
d["spec"]["model"] = {"id": d["spec"]["model"]["id"],
                      "huggingFace": {"repo": "dspark-test/SmolLM2-135M-Instruct-GGUF"}}
d["spec"]["engine"].setdefault("env", []).append({"name": "HF_ENDPOINT", "value": hub})
yaml.safe_dump(d, open(path, "w"))
EOF
  SOURCE="huggingFace dspark-test/SmolLM2-135M-Instruct-GGUF from the loopback Hub $HUB"
fi
kubectl apply -n "$NS" -f "$WORK/dsd.yaml" >/dev/null
mark "applied DSparkDeployment $DSD (pools h100 -> h100-80gb, a100 -> a100-80gb; model: $SOURCE)"

jobs_done() {
  local n
  n="$(kubectl get jobs -n "$NS" -l app.kubernetes.io/component=profiler -o jsonpath='{range .items[*]}{.status.succeeded}{"\n"}{end}' | grep -c '^1$' || true)"
  [ "$n" -ge 2 ]
}
# A Hub source is profiled once the first fetch has resolved its commit (the table's key
# carries it): an engine pod's init container fetches first.
wait_until 240 "two profiling Jobs" sh -c "[ \$(kubectl get jobs -n $NS -l app.kubernetes.io/component=profiler -o name | wc -l) -ge 2 ]"
mark "profiling Jobs created: $(kubectl get jobs -n "$NS" -l app.kubernetes.io/component=profiler -o jsonpath='{.items[*].metadata.name}')"
wait_until 300 "the profiling Jobs to complete" jobs_done
# Each profiling pod ran on a node of its table's node type.
kubectl get pods -n "$NS" -l app.kubernetes.io/component=profiler -o json >"$WORK/profpods.json"
kubectl get nodes -o json >"$WORK/nodes.json"
kubectl get dsct -n "$NS" -o json >"$WORK/dsct.json"
python3 - "$WORK" <<'EOF' || die "profiling pods on the wrong nodes"
import json, sys
w = sys.argv[1]
nodes = {n["metadata"]["name"]: n["metadata"]["labels"].get("dspark.dev/node-type") for n in json.load(open(f"{w}/nodes.json"))["items"]}
tables = {t["metadata"]["name"]: t["spec"]["nodeType"] for t in json.load(open(f"{w}/dsct.json"))["items"]}
for p in json.load(open(f"{w}/profpods.json"))["items"]:
    ct = p["metadata"]["labels"]["serving.dspark.dev/cost-table"]
    node = p["spec"]["nodeName"]
    term = p["status"]["containerStatuses"][0]["state"].get("terminated", {})
    print(f"[e2e]   profiling pod {p['metadata']['name']}: node {node} ({nodes[node]}), exit {term.get('exitCode')}, termination message {len(term.get('message', ''))} bytes, table for {tables.get(ct)}")
    assert nodes[node] == tables[ct], (node, nodes[node], tables[ct])
EOF
mark "profiling Jobs completed, each on its node type"
tables_ready() {
  local n
  n="$(kubectl get dsct -n "$NS" -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}' | grep -c '^Ready$' || true)"
  [ "$n" -ge 2 ]
}
wait_until 60 "both DSparkCostTables Ready" tables_ready
kubectl get dsct -n "$NS" -o json >"$WORK/dsct.json"
python3 - "$WORK/dsct.json" <<'EOF2' || die "DSparkCostTables without tables"
import json, sys
for t in json.load(open(sys.argv[1]))["items"]:
    s = t["status"]
    name, nt = t["metadata"]["name"], t["spec"]["nodeType"]
    print(f"[e2e]   dsct {name}: nodeType {nt} phase {s['phase']} revision {s['revision']} "
          f"digest {s['digest'][:16]} points {len(s['table']['points'])} measured {s.get('measuredAt')}")
    assert s["table"]["points"] and s["table"]["node_type"] == nt
EOF2
mark "DSparkCostTables hold tables (phase Ready)"
if [ -n "${HUB:-}" ]; then
  # The commit the Hub serves is what the first fetch resolved, what the tables are keyed by,
  # and what the pool ConfigMaps pin for every later fetch.
  curl -sf "$HUB/api/models/dspark-test/SmolLM2-135M-Instruct-GGUF/revision/main" >"$WORK/hub-info.json" ||
    die "the loopback Hub does not answer its model info"
  kubectl get dsd -n "$NS" "$DSD" -o json >"$WORK/dsd-status.json"
  kubectl get dsct -n "$NS" -o json >"$WORK/dsct.json"
  kubectl get cm -n "$NS" -o json >"$WORK/cms.json"
  python3 - "$WORK" <<'EOF3' || die "the resolved revision is not what keys and pins the model"
import json, sys
w = sys.argv[1]
sha = json.load(open(f"{w}/hub-info.json"))["sha"]
source = "hf://dspark-test/SmolLM2-135M-Instruct-GGUF"
# The previous chart's CRD has no status.resolvedSources: this operator keeps the resolution
# in memory there (and stores it once the upgrade below applied its CRD).
res = {r["role"]: r for r in json.load(open(f"{w}/dsd-status.json"))["status"].get("resolvedSources", [])}
print(f"[e2e]   Hub commit {sha}; status.resolvedSources.model (not in the previous CRD): {res.get('model')}")
for t in json.load(open(f"{w}/dsct.json"))["items"]:
    assert t["spec"]["modelId"].endswith("@" + sha), t["spec"]
    # Measured by a profiling pod that fetched that commit.
    assert t["status"]["table"]["model_id"].endswith("@" + sha[:12]), t["status"]["table"]["model_id"]
pins = [c["data"]["revision-pins"] for c in json.load(open(f"{w}/cms.json"))["items"] if "revision-pins" in c.get("data", {})]
assert len(pins) == 2 and all(p == f"{source} {sha}\n" for p in pins), pins
print(f"[e2e]   both tables keyed by @{sha[:12]} and measured on it; both pool ConfigMaps pin it")
EOF3
  SHA="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["sha"])' "$WORK/hub-info.json")"
  mark "the first fetch resolved the Hub's commit: it keys both cost tables and is pinned in both pools' ConfigMaps"
fi

# --- engines -------------------------------------------------------------------------------
# engines_json: every engine pod with pool, node, node type, IP, readiness, as JSON lines.
engines() {
  kubectl get pods -n "$NS" -l "serving.dspark.dev/deployment=$DSD,app.kubernetes.io/component=engine" -o json |
    python3 -c '
import json, subprocess, sys
nodes = {n["metadata"]["name"]: n["metadata"]["labels"].get("dspark.dev/node-type") for n in json.loads(subprocess.check_output(["kubectl", "get", "nodes", "-o", "json"]))["items"]}
for p in json.load(sys.stdin)["items"]:
    st = p.get("status", {})
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
    node = p["spec"].get("nodeName", "")
    print(json.dumps({"name": p["metadata"]["name"], "pool": p["metadata"]["labels"]["serving.dspark.dev/pool"],
        "node": node, "nodeType": nodes.get(node), "wants": p["spec"]["nodeSelector"]["dspark.dev/node-type"],
        "ip": st.get("podIP", ""), "ready": ready, "deleting": "deletionTimestamp" in p["metadata"],
        "args": p["spec"]["containers"][0].get("args", [])}))
'
}
ready_count() { engines | python3 -c 'import json,sys; print(sum(1 for l in sys.stdin if json.loads(l)["ready"] and not json.loads(l)["deleting"]))'; }
# The pools have their tables: the operator passes --cost-table once a table is stored, so
# wait for ready pods with that flag (the rollout after the tables were stored).
engines_with_table() {
  engines | python3 -c '
import json, sys
pods = [json.loads(l) for l in sys.stdin]
live = [p for p in pods if not p["deleting"]]
ok = [p for p in live if p["ready"] and "--cost-table" in p["args"]]
pools = {p["pool"] for p in ok}
sys.exit(0 if pools >= {"h100", "a100"} and len(ok) == len(live) else 1)'
}
wait_until 300 "ready engine pods of both pools running with their tables" engines_with_table
engines >"$WORK/engines.jsonl"
python3 - "$WORK/engines.jsonl" <<'EOF' || die "engine pods misplaced"
import ipaddress, json, sys
for l in open(sys.argv[1]):
    p = json.loads(l)
    if p["deleting"]:
        continue
    print(f"[e2e]   engine {p['name']}: pool {p['pool']} node {p['node']} ({p['nodeType']}) ip {p['ip']} ready {p['ready']}")
    assert p["nodeType"] == p["wants"], p
    assert ipaddress.ip_address(p["ip"]).is_loopback, p
EOF
mark "engine pods Ready on the right node types ($(ready_count) pods), with --cost-table"
if [ -n "$HUB_PID" ]; then
  kubectl get pods -n "$NS" -l "serving.dspark.dev/deployment=$DSD,app.kubernetes.io/component=engine" -o json >"$WORK/enginepods.json"
  python3 - "$WORK/enginepods.json" <<'EOF' || die "engine pods did not fetch the model in their init container"
import json, sys
for p in json.load(open(sys.argv[1]))["items"]:
    if "deletionTimestamp" in p["metadata"]:
        continue
    init = {c["name"]: c for c in p["status"].get("initContainerStatuses", [])}
    t = init["fetch-model"]["state"].get("terminated", {})
    print(f"[e2e]   engine {p['metadata']['name']}: fetch-model exit {t.get('exitCode')}, engine args {' '.join(p['spec']['containers'][0]['args'][:5])}")
    assert t.get("exitCode") == 0, init
EOF
  model_available() {
    kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.conditions[?(@.type=="ModelAvailable")].status}' | grep -qx True
  }
  wait_until 30 "ModelAvailable=True" model_available
  mark "every engine pod fetched the model in its init container; ModelAvailable=True: $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.conditions[?(@.type=="ModelAvailable")].message}')"
fi

TOKEN="$(kubectl get secret -n "$NS" "$DSD-admin-token" -o jsonpath='{.data.token}' | base64 -d)"
check_engines() {
  local quiet="${1:-}" line name pool ip want ct got
  while read -r line; do
    name="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["name"])' "$line")"
    pool="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["pool"])' "$line")"
    ip="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ip"])' "$line")"
    ct="$(kubectl get dsd -n "$NS" "$DSD" -o jsonpath="{.status.pools[?(@.name==\"$pool\")].costTable}")"
    want="$(kubectl get dsct -n "$NS" "$ct" -o jsonpath='{.status.digest}')"
    got="$(curl -fsS --max-time 5 -H "Authorization: Bearer $TOKEN" "http://$ip:8001/admin/v1/state")" || return 1
    python3 - "$got" "$want" "$name" "$quiet" <<'EOF' || return 1
import json, sys
s, want, name, quiet = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
if not quiet:
    print(f"[e2e]   {name}: cost_table_source {s['cost_table_source']} revision {s['cost_table_revision']} digest {s['cost_table_digest'][:16]} (dsct {want[:16]}) policy {s['policy']} speculation {s['speculation']}")
sys.exit(0 if s["cost_table_digest"] == want else 1)
EOF
  done < <(engines | python3 -c 'import json,sys; [print(l.strip()) for l in sys.stdin if json.loads(l)["ready"] and not json.loads(l)["deleting"]]')
}
wait_until 60 "every engine to report its pool's table digest" check_engines quiet
check_engines
mark "every engine reports its pool's cost table (admin API digest == DSparkCostTable digest)"

# A real answer from each engine.
while read -r ip; do
  out="$(curl -fsS --max-time 60 "http://$ip:8000/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"default","messages":[{"role":"user","content":"Say hello."}],"max_tokens":8}')" || die "engine $ip did not answer"
  info "engine $ip answered: $(python3 -c 'import json,sys; print(repr(json.loads(sys.argv[1])["choices"][0]["message"]["content"]))' "$out")"
done < <(engines | python3 -c 'import json,sys; [print(json.loads(l)["ip"]) for l in sys.stdin if json.loads(l)["ready"] and not json.loads(l)["deleting"]]')
mark "each engine answered a chat completion"

# Every socket of the engine, operator and kubelet processes is on 127.0.0.0/8.
ss -Htanp | awk '/"dspark-(engine|operator|test-kub)/ { print $4, $5 }' >"$WORK/sockets"
if awk '{ split($1, a, ":"); split($2, b, ":"); if (a[1] !~ /^127\./ || (b[1] != "*" && b[1] !~ /^127\./ && b[1] != "0.0.0.0")) { print; bad = 1 } } END { exit bad }' "$WORK/sockets"; then
  info "$(wc -l <"$WORK/sockets") sockets of engine/operator/kubelet processes, all on 127.0.0.0/8"
else
  die "a socket off loopback: $(cat "$WORK/sockets")"
fi
mark "network check: all sockets of the DSpark processes on loopback"

# The pods run FROM the images: their status names the pulled digests, and each engine is
# a container of the engine image, as uid 65532 on a read-only root.
kubectl get pods -n "$NS" -l "serving.dspark.dev/deployment=$DSD,app.kubernetes.io/component=engine" -o json >"$WORK/engine-pods.json"
kubectl get pods -n "$OPNS" -l app.kubernetes.io/component=operator -o json >"$WORK/operator-pods.json"
python3 - "$WORK" "$ENGINE_IMAGE" "$OPERATOR_IMAGE" <<'PY' || die "pods do not run the pushed images"
import json, sys
w, engine, operator = sys.argv[1:]
for f, want in (("engine-pods", engine), ("operator-pods", operator)):
    for p in json.load(open(f"{w}/{f}.json"))["items"]:
        for c in p["status"].get("initContainerStatuses", []) + p["status"]["containerStatuses"]:
            assert c["imageID"] == want, (p["metadata"]["name"], c["name"], c["imageID"], want)
            assert c.get("containerID", "runc://").startswith("runc://"), c
print(f"[e2e]   engine and operator containers report imageID {engine.split('@')[1][:19]}... / {operator.split('@')[1][:19]}...")
PY
ENGINE_PID=""
for p in $(pgrep -x dspark-engine || true); do
  in_container "$p" && { ENGINE_PID=$p; break; }
done
[ -n "$ENGINE_PID" ] || die "no engine process runs in a container"
[ "$(awk '/^Uid:/ { print $2 }' "/proc/$ENGINE_PID/status")" = 65532 ] || die "the engine container does not run as uid 65532"
grep -E '^[^ ]+ / ' "/proc/$ENGINE_PID/mounts" | grep -q '[ ,]ro[ ,]' || die "the engine container's root is not read-only"
mark "every engine and operator container runs from its image by digest (runc); an engine runs as uid 65532 on a read-only root"

# Pull failures and a missing entrypoint surface as a kubelet shows them.
cat >"$WORK/bad-pods.yaml" <<YAML
apiVersion: v1
kind: Pod
metadata: {name: e2e-no-such-image}
spec:
  nodeSelector: {dspark.dev/test-kubelet: "true"}
  tolerations: [{key: nvidia.com/gpu, operator: Exists}]
  containers:
    - name: engine
      image: $REG/dspark/engine@sha256:$(printf '0%.0s' $(seq 64))
---
apiVersion: v1
kind: Pod
metadata: {name: e2e-bad-entrypoint}
spec:
  restartPolicy: Never
  nodeSelector: {dspark.dev/test-kubelet: "true"}
  tolerations: [{key: nvidia.com/gpu, operator: Exists}]
  securityContext: {runAsUser: 65532, runAsNonRoot: true}
  containers:
    - name: engine
      image: $ENGINE_IMAGE
      command: ["/usr/local/bin/no-such-entrypoint"]
YAML
kubectl apply -n "$NS" -f "$WORK/bad-pods.yaml" >/dev/null
waiting_reason() { kubectl get pod -n "$NS" e2e-no-such-image -o jsonpath='{.status.containerStatuses[0].state.waiting.reason}'; }
pull_failed() { [ "$(waiting_reason)" = ErrImagePull ]; }
pull_backoff() { [ "$(waiting_reason)" = ImagePullBackOff ]; }
wait_until 60 "e2e-no-such-image: ErrImagePull" pull_failed
PULL_MSG="$(kubectl get pod -n "$NS" e2e-no-such-image -o jsonpath='{.status.containerStatuses[0].state.waiting.message}')"
wait_until 60 "e2e-no-such-image: ImagePullBackOff" pull_backoff
start_error() {
  [ "$(kubectl get pod -n "$NS" e2e-bad-entrypoint -o jsonpath='{.status.containerStatuses[0].state.terminated.reason}')" = StartError ]
}
wait_until 90 "e2e-bad-entrypoint: StartError" start_error
START_MSG="$(kubectl get pod -n "$NS" e2e-bad-entrypoint -o jsonpath='{.status.containerStatuses[0].state.terminated.message}')"
[[ "$START_MSG" == *no-such-entrypoint* ]] || die "e2e-bad-entrypoint: the termination message does not name the entrypoint: $START_MSG"
[ "$(kubectl get pod -n "$NS" e2e-bad-entrypoint -o jsonpath='{.status.phase}')" = Failed ] || die "e2e-bad-entrypoint is not Failed"
kubectl delete pod -n "$NS" e2e-no-such-image e2e-bad-entrypoint --wait=true --timeout=60s >/dev/null
mark "an image that is not in the registry: ErrImagePull then ImagePullBackOff ($(echo "$PULL_MSG" | tail -c 160)); a missing entrypoint: StartError, exit 128 ($(echo "$START_MSG" | tail -c 160))"

if [ "${E2E_SKIP_SCALING:-0}" != 1 ]; then
  # --- scale up under load, down after it ------------------------------------------------
  replicas() { kubectl get deploy -n "$NS" -l "serving.dspark.dev/deployment=$DSD" -o jsonpath='{range .items[*]}{.metadata.labels.serving\.dspark\.dev/pool}={.spec.replicas} {end}'; }
  total_replicas() { kubectl get deploy -n "$NS" -l "serving.dspark.dev/deployment=$DSD" -o jsonpath='{range .items[*]}{.spec.replicas}{"\n"}{end}' | awk '{ s += $1 } END { print s + 0 }'; }
  base="$(total_replicas)"
  info "replicas before load: $(replicas)"
  (
    while :; do
      engines | python3 -c 'import json,sys; [print("http://%s:8000" % json.loads(l)["ip"]) for l in sys.stdin if json.loads(l)["ready"] and not json.loads(l)["deleting"]]' >"$WORK/targets.tmp" 2>/dev/null &&
        mv "$WORK/targets.tmp" "$WORK/targets"
      sleep 2
    done
  ) &
  REFRESH_PID=$!
  sleep 3
  python3 "$HERE/load.py" --targets "$WORK/targets" --concurrency "$CONCURRENCY" --max-tokens 48 --report 5 &
  LOAD_PID=$!
  mark "load started: $CONCURRENCY concurrent chat requests over the ready engines (SLO: TTFT p95 $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.spec.slo.ttftP95Ms}') ms)"
  scaled_up() { [ "$(total_replicas)" -gt "$base" ]; }
  wait_until 240 "a scale-up under load" scaled_up
  mark "scaled up: $(replicas); decision: $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.lastScalingDecision.pool}: {.status.lastScalingDecision.fromReplicas} -> {.status.lastScalingDecision.toReplicas} ({.status.lastScalingDecision.reason})')"
  info "pool status: $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{range .status.pools[*]}{.name}: ttft_p95 {.ttftP95Ms} ms itl_p95 {.itlP95Ms} ms ready {.readyReplicas}/{.desiredReplicas}; {end}')"
  more_ready() { [ "$(ready_count)" -gt "$base" ]; }
  wait_until 180 "the new engine pod Ready" more_ready
  mark "new engine pod Ready ($(ready_count) ready engines, serving load)"
  sleep 10
  stop_load
  kill "$REFRESH_PID" 2>/dev/null || true
  mark "load stopped"
  at_min() { [ "$(total_replicas)" -le "$base" ]; }
  wait_until 300 "the scale-down after the window" at_min
  mark "scaled down: $(replicas); decision: $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.lastScalingDecision.pool}: {.status.lastScalingDecision.fromReplicas} -> {.status.lastScalingDecision.toReplicas} ({.status.lastScalingDecision.reason})')"
fi

# --- helm upgrade to this tree's chart, under load -----------------------------------------
# Helm never upgrades crds/: the upgraded operator applies its CRDs (--apply-crds) when it
# takes the Lease over. The engines keep serving throughout: every request of a closed-loop
# load across the upgrade succeeds and no engine pod is replaced.
engine_names() { engines | python3 -c 'import json,sys; print(" ".join(sorted(json.loads(l)["name"] for l in sys.stdin if not json.loads(l)["deleting"])))'; }
PODS_BEFORE="$(engine_names)"
engines | python3 -c 'import json,sys; [print("http://%s:8000" % json.loads(l)["ip"]) for l in sys.stdin if json.loads(l)["ready"] and not json.loads(l)["deleting"]]' >"$WORK/targets"
if [ "$CRD_BEFORE" = 0 ]; then
  # The old schema prunes a field it does not know: the apiserver drops spec.suspend.
  kubectl patch dsd -n "$NS" "$DSD" --type merge -p '{"spec":{"suspend":false}}' >/dev/null
  [ -z "$(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.spec.suspend}')" ] || die "the old CRD kept spec.suspend"
  info "before the upgrade: spec.suspend is pruned by the old CRD"
fi
python3 "$HERE/load.py" --targets "$WORK/targets" --concurrency 3 --max-tokens 16 --report 2 \
  --stats "$WORK/upgrade-load.json" >"$WORK/upgrade-load.log" 2>&1 &
LOAD_PID=$!
load_ok() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["ok"] >= int(sys.argv[2]) else 1)' "$WORK/upgrade-load.json" "$1"; }
wait_until 60 "the load to get answers" load_ok 3
mark "load on $(wc -l <"$WORK/targets") engines; helm upgrade to this tree's chart ($(awk '/^version:/ {print $2}' "$ROOT/charts/dspark-operator/Chart.yaml"))"
UPGRADE_VALUES=(--set-string image.tag= --set-string image.digest="${OPERATOR_IMAGE#*@}")
helm upgrade "$RELEASE" "$ROOT/charts/dspark-operator" -n "$OPNS" --wait --timeout 120s \
  "${HELM_VALUES[@]}" "${UPGRADE_VALUES[@]}" >"$WORK/helm-upgrade.log" || { cat "$WORK/helm-upgrade.log"; die "helm upgrade failed"; }
new_leader() { local h; h="$(leader)"; [ -n "$h" ] && [ "$h" != "$OPPOD" ]; }
wait_until 90 "the upgraded operator to take the Lease over" new_leader
wait_until 60 "the upgraded operator to apply its CRDs" crd_has_suspend
mark "upgraded (REVISION $(awk '/^REVISION:/ {print $2}' "$WORK/helm-upgrade.log")): $(leader) leads; CRD schema revision $(kubectl get crd "$CRD" -o jsonpath='{.metadata.annotations.serving\.dspark\.dev/schema-revision}') applied by the operator (spec.suspend now served)"
if [ -n "${SHA:-}" ]; then
  # The new CRD stores the resolution the operator kept in memory.
  resolved_stored() {
    [ "$(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.resolvedSources[?(@.role=="model")].revision}')" = "$SHA" ]
  }
  wait_until 60 "status.resolvedSources to hold the Hub commit" resolved_stored
  info "status.resolvedSources: $(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.resolvedSources}')"
fi
# The new field works end to end with the upgraded operator: suspend, then resume.
dsd_condition() { kubectl get dsd -n "$NS" "$DSD" -o jsonpath="{.status.conditions[?(@.type==\"$1\")].status}"; }
kubectl patch dsd -n "$NS" "$DSD" --type merge -p '{"spec":{"suspend":true}}' >/dev/null
suspended() { [ "$(dsd_condition Suspended)" = True ]; }
wait_until 30 "Suspended=True" suspended
kubectl patch dsd -n "$NS" "$DSD" --type merge -p '{"spec":{"suspend":false}}' >/dev/null
resumed() { [ -z "$(dsd_condition Suspended)" ]; }
wait_until 30 "the Suspended condition to go" resumed
info "spec.suspend: Suspended=True, then gone on resume (Ready=$(dsd_condition Ready))"
sleep 4
stop_load
read -r UP_OK UP_ERR UP_LAST < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["ok"], d["err"], d["last_error"] or "-")' "$WORK/upgrade-load.json")
[ "$UP_ERR" = 0 ] || { cat "$WORK/upgrade-load.log"; die "$UP_ERR of $((UP_OK + UP_ERR)) requests failed across the upgrade (last: $UP_LAST)"; }
[ "$UP_OK" -ge 5 ] || die "only $UP_OK requests completed across the upgrade"
PODS_AFTER=" $(engine_names) "
for p in $PODS_BEFORE; do
  [[ "$PODS_AFTER" == *" $p "* ]] || die "the upgrade replaced engine pod $p: $PODS_BEFORE ->$PODS_AFTER"
done
mark "served throughout the upgrade: $UP_OK requests, 0 failed; every engine pod kept ($PODS_BEFORE)"

# --- other sources, for real through the test kubelet ----------------------------------------
# An S3 source (moto's S3-compatible server on loopback; credentials from a Secret) is fetched
# by the init container and answers; an image source (an OCI image holding the GGUF, pushed to
# the CNCF registry on loopback, referenced by digest) is mounted as an image volume and
# answers; a gated Hub repo with a wrong token Secret fails in the real fetch-model init
# container, and the operator shows the engine's message as ModelAvailable=False
# (Unauthorized) with a Warning Event. Each is a one-pool DSparkDeployment beside $DSD.
if [ -n "$HUB_PID" ]; then
  python3 "$HERE/s3server.py" "$MODEL" >"$WORK/s3.url" 2>"$WORK/s3.log" &
  S3_PID=$!
  wait_until 60 "the loopback S3 server" test -s "$WORK/s3.url"
  S3_URL="$(head -n1 "$WORK/s3.url")"
  if [ "$REGISTRY_UP" = 0 ]; then
    "$ROOT/tests/registry/registry.sh" up >"$WORK/registry.log" 2>&1 || { cat "$WORK/registry.log"; die "the registry did not start"; }
    REGISTRY_UP=1
    REG="$("$ROOT/tests/registry/registry.sh" addr)"
  fi
  umoci init --layout "$WORK/weights"
  umoci new --image "$WORK/weights:w"
  umoci unpack --rootless --image "$WORK/weights:w" "$WORK/weights-bundle" >/dev/null
  cp "$MODEL" "$WORK/weights-bundle/rootfs/"
  umoci repack --image "$WORK/weights:w" "$WORK/weights-bundle" >/dev/null
  skopeo copy -q --dest-tls-verify=false --digestfile "$WORK/weights.digest" \
    "oci:$WORK/weights:w" "docker://$REG/dspark-test/smollm2-weights:e2e"
  WEIGHTS="$REG/dspark-test/smollm2-weights@$(cat "$WORK/weights.digest")"
  kubectl create secret generic -n "$NS" s3-creds --from-literal=AWS_ACCESS_KEY_ID=e2e-key \
    --from-literal=AWS_SECRET_ACCESS_KEY=e2e-secret >/dev/null
  kubectl create secret generic -n "$NS" hf-wrong --from-literal=token=hf_not_the_token >/dev/null
  python3 - "$WORK/dsd.yaml" "$WORK" "$S3_URL" "$(basename "$MODEL")" "$WEIGHTS" <<'PY' || die "cannot write the source deployments"
import copy, sys, yaml
path, work, s3, name, weights = sys.argv[1:]
base = yaml.safe_load(open(path))
base["spec"]["pools"] = [p for p in base["spec"]["pools"] if p["name"] == "a100"]
base["spec"]["pools"][0]["maxReplicas"] = 1
for dsd, model in [("e2e-s3", {"s3": {"uri": f"s3://models/smollm2/{name}", "endpoint": s3,
                                      "secretRef": {"name": "s3-creds"}}}),
                   ("e2e-image", {"image": {"reference": weights, "path": name}}),
                   ("e2e-gated", {"huggingFace": {"repo": "dspark-test/gated-SmolLM2-135M-Instruct-GGUF",
                                                  "tokenSecretRef": {"name": "hf-wrong"}}})]:
    d = copy.deepcopy(base)
    d["metadata"] = {"name": dsd}
    # No spec.model.id: each artifact keys its own cost table (the engine's model id carries
    # the file name and the revision, so a table profiled on another source would not fit).
    d["spec"]["model"] = model
    yaml.safe_dump(d, open(f"{work}/{dsd}.yaml", "w"))
PY
  kubectl apply -n "$NS" -f "$WORK/e2e-s3.yaml" -f "$WORK/e2e-image.yaml" -f "$WORK/e2e-gated.yaml" >/dev/null
  mark "applied e2e-s3 (s3://models/smollm2/$(basename "$MODEL") on $S3_URL, Secret s3-creds), e2e-image ($WEIGHTS) and e2e-gated (a gated Hub repo, Secret hf-wrong)"
  cond_of() { kubectl get dsd -n "$NS" "$1" -o jsonpath="{.status.conditions[?(@.type==\"$2\")].$3}"; }
  # serving DSD: a Ready engine pod of DSD answers a chat completion and ModelAvailable=True.
  serving() {
    local ip
    ip="$(kubectl get pods -n "$NS" -l "serving.dspark.dev/deployment=$1,app.kubernetes.io/component=engine" \
      -o jsonpath='{range .items[*]}{.status.podIP}{" "}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
      awk '$2 == "True" {print $1; exit}')"
    [ -n "$ip" ] && [ "$(cond_of "$1" ModelAvailable status)" = True ] || return 1
    curl -fsS --max-time 60 "http://$ip:8000/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"default","messages":[{"role":"user","content":"Say hello."}],"max_tokens":4}' >"$WORK/$1-answer.json"
  }
  wait_until 240 "e2e-s3 to fetch from S3 and answer" serving e2e-s3
  mark "e2e-s3: fetched from S3 in its init container and answered; ModelAvailable=True: $(cond_of e2e-s3 ModelAvailable message)"
  wait_until 120 "e2e-image to mount its image volume and answer" serving e2e-image
  mark "e2e-image: the weights image pulled by digest into an image volume, served and answered"
  gated_refused() { [ "$(cond_of e2e-gated ModelAvailable reason)" = Unauthorized ]; }
  wait_until 120 "e2e-gated: ModelAvailable=False, Unauthorized" gated_refused
  [ "$(cond_of e2e-gated ModelAvailable status)" = False ] || die "e2e-gated: ModelAvailable is not False"
  GATED_MSG="$(cond_of e2e-gated ModelAvailable message)"
  [[ "$GATED_MSG" == *"refused the token"*"HF_TOKEN"* ]] ||
    die "e2e-gated: the condition does not carry the engine's message: $GATED_MSG"
  gated_event() {
    kubectl get events -n "$NS" --field-selector involvedObject.name=e2e-gated,reason=Unauthorized,type=Warning -o name | grep -q .
  }
  wait_until 30 "e2e-gated: an Unauthorized Warning Event" gated_event
  mark "e2e-gated: the real fetch failed; ModelAvailable=False (Unauthorized): $GATED_MSG; Warning Event recorded"
  kubectl delete dsd -n "$NS" e2e-s3 e2e-image e2e-gated --wait=true --timeout=60s >/dev/null
  kubectl delete secret -n "$NS" s3-creds hf-wrong >/dev/null
  kill "$S3_PID" 2>/dev/null || true
  wait "$S3_PID" 2>/dev/null || true
  S3_PID=""
fi

# --- the Gateway API Inference Extension: InferencePool + the real endpoint picker --------
gie_phase

# --- deletion ------------------------------------------------------------------------------
kubectl delete dsd -n "$NS" "$DSD" --wait=true --timeout=60s >/dev/null
all_gone() {
  local left
  left="$(kubectl get deploy,rs,pods,svc,pdb,jobs,dsct,cm,secret -n "$NS" -l app.kubernetes.io/managed-by=dspark-operator -o name 2>/dev/null)"
  left+="$(kubectl get pods,jobs,dsct -n "$NS" -o name 2>/dev/null)"
  [ -z "$left" ]
}
wait_until 120 "everything the DSparkDeployment owned to be removed" all_gone
# Containers have their own mount namespace (and no other engine container runs by now).
ns_processes() {
  local p
  for p in $(pgrep -f dspark-engine || true); do
    in_container "$p" && echo "$p"
  done
  return 0
}
no_ns_processes() { [ -z "$(ns_processes)" ]; }
wait_until 30 "the engine processes to exit" no_ns_processes
mark "deleted the DSparkDeployment: pods, Deployments, Services, PDBs, Jobs, ConfigMaps, Secret, DSparkCostTables gone; no engine process left"

helm uninstall "$RELEASE" -n "$OPNS" --wait --timeout 90s >/dev/null
wait_until 60 "the operator pod to go" sh -c "[ -z \"\$(kubectl get pods -n $OPNS -o name)\" ]"
left="$(kubectl get clusterrole,clusterrolebinding -l "app.kubernetes.io/instance=$RELEASE" -o name)"
[ -z "$left" ] || die "left after helm uninstall: $left"
kubectl get crd dsparkdeployments.serving.dspark.dev dsparkcosttables.serving.dspark.dev >/dev/null ||
  die "the CRDs went with the release"
# The kubelet records each container's process group until it has exited.
no_pod_processes() { [ -z "$(ls -A "$DSPARK_CLUSTER_DIR/kubelet/pgids" 2>/dev/null)" ]; }
wait_until 30 "every pod process to exit" no_pod_processes
mark "helm uninstall: operator and RBAC gone, CRDs kept; e2e passed"
