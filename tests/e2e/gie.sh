# The Gateway API Inference Extension phase of tests/e2e/e2e.sh (sourced by it; uses its
# mark / info / die / wait_until / engines helpers and $NS, $DSD, $WORK, $ROOT).
#
# The real endpoint picker (GIE's reference EPP, built from its Go module by
# tests/cluster/gie/build.sh) runs against the InferencePool that the operator made for
# the DSparkDeployment (spec.inferencePool) and scrapes the engines' model-server metrics
# (vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc) at
# their loopback pod IPs. tests/cluster/gie/extproc-client stands in for the gateway (no
# Envoy runs here): it sends each request's headers and body over ext_proc and prints the
# endpoint the picker chose.
#   1. engines idle: every pick is a live engine, and two of them both get picked;
#   2. one engine's queue full (requests sent straight to it, more than its --max-running):
#      every pick goes to another live engine (the autoscaler stays on, so there may be
#      more than two);
#   3. that engine's pool removed from the DSparkDeployment: its pods go and they are never
#      picked again; the InferencePool still selects what remains.

GIE_PID=""
GIE_LOAD_PIDS=()

gie_stop() {
  local p
  for p in "${GIE_LOAD_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${GIE_LOAD_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  GIE_LOAD_PIDS=()
  if [ -n "$GIE_PID" ]; then kill "$GIE_PID" 2>/dev/null || true; wait "$GIE_PID" 2>/dev/null || true; fi
  GIE_PID=""
}

# free_port: an unused TCP port on loopback.
gie_free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# gie_picks N: N picks through the picker, distinct prompts (no prefix affinity), one
# endpoint per line.
gie_picks() {
  local n="$1" i out=""
  for i in $(seq 1 "$n"); do
    out+="$("$GIE_BIN/extproc-client" --addr "127.0.0.1:$GIE_GRPC" --n 1 \
      --body "{\"model\":\"$MODEL_ID\",\"prompt\":\"gie probe $i $RANDOM\",\"max_tokens\":1}")"$'\n'
  done
  printf '%s' "$out"
}

# gie_picks_avoid PICKS IP...: every pick (one endpoint per line) is a ready engine of the
# DSparkDeployment now, and none is one of the IPs named.
gie_picks_avoid() {
  local picks="$1"
  shift
  engines | python3 -c '
import json, sys
picks = sys.argv[1].split()
avoid = {ip + ":8000" for ip in sys.argv[2:]}
live = {p["ip"] + ":8000" for p in map(json.loads, sys.stdin) if p["ready"] and not p["deleting"]}
ok = len(picks) == 10 and all(p in live and p not in avoid for p in picks)
sys.exit(0 if ok else "picks %s; live %s; avoided %s" % (picks, sorted(live), sorted(avoid)))' "$picks" "$@"
}

# gie_metric IP NAME: the engine's value of a model-server metric (0 when absent).
gie_metric() {
  curl -sf "http://$1:8000/metrics" |
    awk -v m="$2" '$1 == m || index($1, m "{") == 1 { v = $2 } END { print (v == "" ? "missing" : v) }'
}

gie_phase() {
  GIE_BIN="$("$ROOT/tests/cluster/gie/build.sh")" || die "building the GIE endpoint picker failed"
  kubectl apply --server-side -f "$GIE_BIN/inferencepools.yaml" >/dev/null
  kubectl wait --for condition=established --timeout=60s crd/inferencepools.inference.networking.k8s.io >/dev/null
  MODEL_ID="$(kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.spec.model.id}')"

  # The operator creates the InferencePool once the field is set.
  kubectl patch dsd -n "$NS" "$DSD" --type merge \
    -p '{"spec":{"inferencePool":{"endpointPicker":{"name":"e2e-epp","port":9002}}}}' >/dev/null
  pool_made() { kubectl get inferencepool.inference.networking.k8s.io -n "$NS" "$DSD" -o name; }
  wait_until 60 "the operator to create InferencePool $DSD" pool_made
  kubectl get inferencepool.inference.networking.k8s.io -n "$NS" "$DSD" -o json >"$WORK/inferencepool.json"
  python3 - "$WORK/inferencepool.json" "$DSD" <<'EOF' || die "InferencePool spec"
import json, sys
p = json.load(open(sys.argv[1]))
s = p["spec"]
assert s["selector"]["matchLabels"] == {"serving.dspark.dev/deployment": sys.argv[2], "app.kubernetes.io/component": "engine"}, s
assert s["targetPorts"] == [{"number": 8000}], s
assert s["endpointPickerRef"]["name"] == "e2e-epp" and s["endpointPickerRef"]["port"]["number"] == 9002, s
assert p["metadata"]["ownerReferences"][0]["kind"] == "DSparkDeployment", p["metadata"]
EOF
  pool_in_status() {
    kubectl get dsd -n "$NS" "$DSD" -o jsonpath='{.status.inferencePool}' | grep -qx "$DSD"
  }
  wait_until 30 "status.inferencePool" pool_in_status
  kubectl patch dsd -n "$NS" "$DSD" --type merge \
    -p '{"spec":{"inferencePool":{"endpointPicker":{"name":"e2e-epp","port":9003}}}}' >/dev/null
  pool_port() {
    [ "$(kubectl get inferencepool.inference.networking.k8s.io -n "$NS" "$DSD" -o jsonpath='{.spec.endpointPickerRef.port.number}')" = 9003 ]
  }
  wait_until 30 "the operator to update the InferencePool's endpointPickerRef" pool_port
  mark "InferencePool $DSD created by the operator (selector: the engine pods of both pools, target port 8000) and updated with the spec; status.inferencePool reports it"

  GIE_GRPC="$(gie_free_port)"
  local health metrics
  health="$(gie_free_port)"
  metrics="$(gie_free_port)"
  cat >"$WORK/epp-config.yaml" <<'EOF'
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
EOF
  # The picker chart's default plugins (queue, KV-cache use, prefix affinity).
  "$GIE_BIN/epp" --pool-name "$DSD" --pool-namespace "$NS" --grpc-port "$GIE_GRPC" \
    --grpc-health-port "$health" --metrics-port "$metrics" --secure-serving=false \
    --config-file "$WORK/epp-config.yaml" --refresh-metrics-interval 100ms \
    >"$WORK/epp.log" 2>&1 &
  GIE_PID=$!
  local ips
  mapfile -t ips < <(engines | python3 -c '
import json, sys
for l in sys.stdin:
    p = json.loads(l)
    if p["ready"] and not p["deleting"]:
        print(p["ip"] + " " + p["pool"])')
  [ "${#ips[@]}" -ge 2 ] || die "GIE phase needs two ready engines, found: ${ips[*]}"
  local a_ip a_pool b_ip
  read -r a_ip a_pool <<<"${ips[0]}"
  read -r b_ip _ <<<"${ips[1]}"
  picker_sees_both() {
    local p; p="$(gie_picks 8)"
    grep -q "^$a_ip:8000$" <<<"$p" && grep -q "^$b_ip:8000$" <<<"$p"
  }
  wait_until 60 "the picker to pick both engines ($a_ip, $b_ip)" picker_sees_both
  local picks
  picks="$(gie_picks 12)"
  python3 - "$picks" "${ips[@]}" <<'EOF' || die "idle picks: $picks"
import sys
live = {l.split()[0] + ":8000" for l in sys.argv[2:]}
picks = sys.argv[1].split()
assert picks and all(p in live for p in picks), (picks, live)
EOF
  mark "endpoint picker (GIE $(awk '$1 == "sigs.k8s.io/gateway-api-inference-extension" {print $2}' "$ROOT/tests/cluster/gie/go.mod") reference EPP) running on the InferencePool: idle picks spread over $(sort -u <<<"$picks" | tr '\n' ' ')"

  # Fill A's queue: more long requests straight to it than its --max-running (64, the
  # engine's default).
  local i
  for i in $(seq 1 80); do
    curl -sN --max-time 300 "http://$a_ip:8000/v1/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"default\",\"prompt\":\"Write a long story, part $i:\",\"max_tokens\":400,\"temperature\":0,\"stream\":true}" \
      >/dev/null 2>&1 &
    GIE_LOAD_PIDS+=($!)
  done
  a_queued() { local w; w="$(gie_metric "$a_ip" vllm:num_requests_waiting)"; [ "$w" != missing ] && awk -v w="$w" 'BEGIN { exit !(w >= 4) }'; }
  wait_until 60 "engine $a_ip to report waiting requests (vllm:num_requests_waiting)" a_queued
  info "engine $a_ip: waiting $(gie_metric "$a_ip" vllm:num_requests_waiting), running $(gie_metric "$a_ip" vllm:num_requests_running), KV use $(gie_metric "$a_ip" vllm:kv_cache_usage_perc); engine $b_ip: waiting $(gie_metric "$b_ip" vllm:num_requests_waiting)"
  sleep 1 # two metric refreshes of the picker (100 ms each) with margin
  picks="$(gie_picks 10)"
  # The autoscaler stays on, so the DSparkDeployment may hold more than two engines: the
  # property is that no pick goes to the full engine and every pick is a live one.
  gie_picks_avoid "$picks" "$a_ip" ||
    die "with $a_ip's queue full, picks were: $(tr '\n' ' ' <<<"$picks")"
  mark "engine $a_ip's queue full: 10 of 10 picks went to the other engines ($(sort -u <<<"$picks" | tr '\n' ' '))"
  for i in "${GIE_LOAD_PIDS[@]}"; do kill "$i" 2>/dev/null || true; done
  for i in "${GIE_LOAD_PIDS[@]}"; do wait "$i" 2>/dev/null || true; done
  GIE_LOAD_PIDS=()
  a_drained() { [ "$(gie_metric "$a_ip" vllm:num_requests_running)" = 0 ] && [ "$(gie_metric "$a_ip" vllm:num_requests_waiting)" = 0 ]; }
  wait_until 60 "engine $a_ip to drain after its clients left" a_drained

  # Remove A's pool: its engines go and are never picked again.
  local idx
  idx="$(kubectl get dsd -n "$NS" "$DSD" -o json | python3 -c '
import json, sys
pools = json.load(sys.stdin)["spec"]["pools"]
print([p["name"] for p in pools].index(sys.argv[1]))' "$a_pool")"
  # Its engines' addresses, read before the removal (A's among them).
  local a_pool_ips
  a_pool_ips="$(engines | python3 -c '
import json, sys
ips = {p["ip"] for p in map(json.loads, sys.stdin) if p["pool"] == sys.argv[1] and p["ip"]}
print(" ".join(sorted(ips | {sys.argv[2]})))' "$a_pool" "$a_ip")"
  kubectl patch dsd -n "$NS" "$DSD" --type json -p "[{\"op\":\"remove\",\"path\":\"/spec/pools/$idx\"}]" >/dev/null
  a_pool_gone() { ! engines | python3 -c '
import json, sys
sys.exit(0 if any(json.loads(l)["pool"] == sys.argv[1] for l in sys.stdin) else 1)' "$a_pool"; }
  wait_until 120 "pool $a_pool's engines ($a_pool_ips) to be removed" a_pool_gone
  picks="$(gie_picks 10)"
  # shellcheck disable=SC2086 # one argument per removed engine
  gie_picks_avoid "$picks" $a_pool_ips ||
    die "after removing pool $a_pool ($a_pool_ips), picks were: $(tr '\n' ' ' <<<"$picks")"
  mark "pool $a_pool removed: its engines ($a_pool_ips) left the InferencePool; 10 of 10 picks went to the remaining engines ($(sort -u <<<"$picks" | tr '\n' ' '))"

  kubectl patch dsd -n "$NS" "$DSD" --type json -p '[{"op":"remove","path":"/spec/inferencePool"}]' >/dev/null
  pool_gone() { ! kubectl get inferencepool.inference.networking.k8s.io -n "$NS" "$DSD" >/dev/null 2>&1; }
  wait_until 60 "the operator to prune InferencePool $DSD" pool_gone
  gie_stop
  mark "spec.inferencePool removed: the operator pruned the InferencePool"
}
