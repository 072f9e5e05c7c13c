#!/usr/bin/env bash
# Local Kubernetes test cluster for DSpark, built from the official Go modules.
#
#   tests/cluster/cluster.sh build       build (once, cached) etcd, kube-*, kubectl, helm, kwok
#   tests/cluster/cluster.sh up          start etcd, apiserver, controller-manager, scheduler, kwok
#                                        and create the fake GPU nodes (idempotent)
#   tests/cluster/cluster.sh down        stop everything `up` started; remove state
#                                        (keep it with DSPARK_KEEP_STATE=1)
#   tests/cluster/cluster.sh kubelet-up  start the test kubelet (tests/kubelet): it runs the pods of
#                                        the fake nodes FROM their images (runc) on loopback pod IPs;
#                                        labels the nodes dspark.dev/test-kubelet=true
#   tests/cluster/cluster.sh kubelet-down  stop it (and every process it started), unlabel
#   tests/cluster/cluster.sh status      health of each component
#   tests/cluster/cluster.sh logs [N|-f] last N (default 40) lines of every component log;
#                                        -f follows them
#   tests/cluster/cluster.sh smoke       run tests/cluster/smoke.sh against the running cluster
#   tests/cluster/cluster.sh kubeconfig  print the kubeconfig path
#   tests/cluster/cluster.sh env         shell exports: eval "$(tests/cluster/cluster.sh env)"
#   tests/cluster/cluster.sh bindir      print the cached bin dir
#   tests/cluster/cluster.sh gen-k8s-mod vX.Y.Z   regenerate k8s/go.mod for another release
#
# Environment:
#   DSPARK_CACHE          build cache root (default ~/.cache/dspark); binaries go to
#                         $DSPARK_CACHE/k8s/<key>/bin, <key> = hash of the wrapper modules
#   DSPARK_CLUSTER_DIR    state, certs, logs, pid files (default /tmp/dspark-cluster)
#   DSPARK_KEEP_STATE=1   `down` keeps the state dir
#   DSPARK_KWOK_POD_STAGES=1  let kwok also play pods (ready/complete/delete), pod IPs from
#                         the node's podCIDR 127.1.N.0/24. Off by default: the project's test
#                         kubelet owns pods. Read by `up` only.
#   DSPARK_TEST_KUBELET=1 `up` also runs `kubelet-up`.
#   DSPARK_KUBELET_NODES  nodes the test kubelet plays (default: every fake GPU node)
#   DSPARK_KUBELET_IMAGE_RUNTIME  runc (default) or crun: the OCI runtime that runs each
#                         container FROM its image (pulled from a loopback registry)
#   DSPARK_TEST_KUBELET_BIN  a prebuilt test kubelet (default: build it in $CARGO_TARGET_DIR)
#
# Everything listens on 127.0.0.1 only; nothing is sent off the loopback network.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Bump when the build recipe (flags, ldflags, binary list) changes, to force a rebuild.
RECIPE_REV=1

CACHE_ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}"
CLUSTER_DIR="${DSPARK_CLUSTER_DIR:-/tmp/dspark-cluster}"

# Ports (all on 127.0.0.1; chosen away from the Kubernetes defaults).
ETCD_CLIENT_PORT=23790
ETCD_PEER_PORT=23800
APISERVER_PORT=16443
KCM_PORT=16257
SCHEDULER_PORT=16259
KWOK_PORT=16247
# Service ClusterIPs: only the apiserver allocates from this range; it is loopback so that
# even a stray connection to a ClusterIP stays on this host.
SERVICE_CIDR=127.2.0.0/16
# Pod IPs handed out by kwok pod stages (opt-in) come from each node's spec.podCIDR
# (127.1.N.0/24, see nodes.yaml); this loopback range is kwok's fallback for nodes without one
# (kwok's own default, 10.0.0.0/24, is not loopback).
KWOK_POD_CIDR=127.3.0.1/16

COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm kwok)

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# --- versions (single source of truth: the wrapper go.mod files) -------------------------

modver() { # modver <dir> <module>: the version <dir>/go.mod requires for <module>
  awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) { v = ($1 == "require") ? $3 : $2; print v; exit }' "$HERE/$1/go.mod"
}

K8S_VERSION="$(modver k8s k8s.io/kubernetes)"
ETCD_VERSION="$(modver etcd go.etcd.io/etcd/server/v3)"
HELM_VERSION="$(modver helm helm.sh/helm/v3)"
KWOK_VERSION="$(modver kwok sigs.k8s.io/kwok)"

cache_key() {
  {
    echo "recipe=$RECIPE_REV"
    go env GOVERSION GOOS GOARCH
    for d in etcd k8s helm kwok; do
      for f in "$HERE/$d"/go.mod "$HERE/$d"/go.sum "$HERE/$d"/*.go; do
        [ -f "$f" ] && { echo "== $d/$(basename "$f")"; cat "$f"; }
      done
    done
  } | sha256sum | cut -c1-16
}

bindir() {
  command -v go >/dev/null || die "go is not on PATH"
  echo "$CACHE_ROOT/k8s/$(cache_key)/bin"
}

# --- build --------------------------------------------------------------------------------

# go_build <module dir> <output name> <package> [ldflags]
go_build() {
  local dir="$1" name="$2" pkg="$3" ldflags="${4:-}" bin="$BIN_DIR" t0
  if [ -x "$bin/$name" ]; then
    log "  $name: cached"
    return 0
  fi
  log "  $name: building $pkg (log: $BUILD_LOG_DIR/$name.log) ..."
  t0=$(now)
  if ! (cd "$HERE/$dir" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly \
          -ldflags "-s -w $ldflags" -o "$bin/.$name.tmp" "$pkg") >"$BUILD_LOG_DIR/$name.log" 2>&1; then
    tail -n 30 "$BUILD_LOG_DIR/$name.log" >&2
    die "building $name failed (full log: $BUILD_LOG_DIR/$name.log)"
  fi
  mv -f "$bin/.$name.tmp" "$bin/$name"
  local secs; secs=$(elapsed "$t0")
  echo "$name ${secs}s $(date -u +%FT%TZ)" >>"$(dirname "$bin")/build-times.txt"
  log "  $name: built in ${secs}s"
}

have_all_binaries() {
  local b
  for b in "${BINARIES[@]}"; do [ -x "$BIN_DIR/$b" ] || return 1; done
}

cmd_build() {
  BIN_DIR="$(bindir)"
  if have_all_binaries; then
    log "binaries up to date in $BIN_DIR"
    return 0
  fi
  mkdir -p "$BIN_DIR"
  BUILD_LOG_DIR="$(dirname "$BIN_DIR")/build-logs"
  mkdir -p "$BUILD_LOG_DIR"
  # One build at a time per cache key (two checkouts may call build concurrently).
  exec 9>"$(dirname "$BIN_DIR")/build.lock"
  flock 9
  if have_all_binaries; then
    log "binaries up to date in $BIN_DIR (built by a concurrent run)"
    return 0
  fi
  local t0; t0=$(now)
  log "building into $BIN_DIR"
  log "  kubernetes $K8S_VERSION, etcd $ETCD_VERSION, helm $HELM_VERSION, kwok $KWOK_VERSION"
  log "  (cold builds take a long time on 2 cores; go build runs under nice -n 10)"

  go_build etcd etcd dspark.dev/tests/cluster/etcd

  local kmaj kmin kv="k8s.io/component-base/version"
  kmaj="${K8S_VERSION#v}"; kmaj="${kmaj%%.*}"
  kmin="${K8S_VERSION#v*.}"; kmin="${kmin%%.*}"
  local kflags="-X $kv.gitVersion=$K8S_VERSION -X $kv.gitMajor=$kmaj -X $kv.gitMinor=$kmin"
  kflags+=" -X $kv.gitTreeState=clean -X $kv.buildDate=1970-01-01T00:00:00Z"
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    go_build k8s "$c" "k8s.io/kubernetes/cmd/$c" "$kflags"
  done

  # helm: its version, and the Kubernetes version it assumes for `helm template`/lint,
  # derived from the client-go it is built with (as helm's Makefile does).
  local cg hmin hv="helm.sh/helm/v3/internal/version"
  cg="$(cd "$HERE/helm" && go list -mod=readonly -m -f '{{.Version}}' k8s.io/client-go)"
  hmin="${cg#v0.}"; hmin="${hmin%%.*}"
  local hflags="-X $hv.version=$HELM_VERSION -X $hv.metadata= -X $hv.gitTreeState=clean"
  hflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$hmin"
  hflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$hmin"
  go_build helm helm helm.sh/helm/v3/cmd/helm "$hflags"

  go_build kwok kwok sigs.k8s.io/kwok/cmd/kwok \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$K8S_VERSION"

  log "build done in $(elapsed "$t0")s"
}

cmd_gen_k8s_mod() {
  local v="${1:-}"
  [[ "$v" =~ ^v1\.[0-9]+\.[0-9]+$ ]] || die "usage: cluster.sh gen-k8s-mod v1.X.Y"
  local sv="v0.${v#v1.}" gomod
  gomod="$(cd /tmp && go mod download -json "k8s.io/kubernetes@$v" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  local mods goline
  # Every staging module that k8s.io/kubernetes maps with a local replace needs its tag.
  mods="$(sed -n '/^replace (/,/^)/p' "$gomod" | awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' | sort)"
  [ -n "$mods" ] || die "no staging replaces found in $gomod"
  goline="$(awk '$1 == "go" { print $2; exit }' "$gomod")"
  {
    echo "// Generated by tests/cluster/cluster.sh gen-k8s-mod $v; do not edit by hand."
    echo "module dspark.dev/tests/cluster/k8s"
    echo
    echo "go $goline"
    echo
    echo "require k8s.io/kubernetes $v"
    echo
    echo "replace ("
    local m
    for m in $mods; do printf '\t%s => %s %s\n' "$m" "$m" "$sv"; done
    echo ")"
  } >"$HERE/k8s/go.mod"
  rm -f "$HERE/k8s/go.sum"
  (cd "$HERE/k8s" && go mod tidy)
  log "regenerated $HERE/k8s/go.mod for $v ($(echo "$mods" | wc -l) staging modules)"
}

# --- process helpers ----------------------------------------------------------------------

pidfile() { echo "$CLUSTER_DIR/run/$1.pid"; }

# alive <component>: its pid file names a live process running our binary.
alive() {
  local pf pid exe
  pf="$(pidfile "$1")"
  [ -f "$pf" ] || return 1
  pid="$(cat "$pf")"
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  [ "$(basename "${exe% (deleted)}")" = "$1" ]
}

# start <component> <args...>: run it in its own session (process group), log to logs/.
start() {
  local name="$1"; shift
  log "  starting $name"
  setsid "$BIN_DIR/$name" "$@" >>"$CLUSTER_DIR/logs/$name.log" 2>&1 </dev/null &
  local pid=$! i
  echo "$pid" >"$(pidfile "$name")"
  # Until the forked shell has exec'd the binary, /proc/$pid/exe is still bash or setsid;
  # wait for that here so later liveness checks are not fooled (seen on a loaded machine).
  for i in $(seq 1 100); do
    alive "$name" && return 0
    running "$pid" || break
    sleep 0.1
  done
  tail -n 30 "$CLUSTER_DIR/logs/$name.log" >&2 || true
  die "$name did not start (log: $CLUSTER_DIR/logs/$name.log)"
}

# running <pid>: the process exists and is not a zombie waiting to be reaped.
running() {
  local st
  st="$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

stop() {
  local name="$1" pid i
  alive "$name" || { rm -f "$(pidfile "$name")"; return 0; }
  pid="$(cat "$(pidfile "$name")")"
  log "  stopping $name (pid $pid)"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 150); do
    running "$pid" || break
    sleep 0.1
  done
  if running "$pid"; then
    log "  $name did not exit in 15s; killing"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do running "$pid" || break; sleep 0.1; done
  fi
  rm -f "$(pidfile "$name")"
}

port_busy() { ss -Htln "sport = :$1" | grep -q .; }

# wait_for <what> <seconds> <component> <command...>
wait_for() {
  local what="$1" secs="$2" comp="$3"; shift 3
  local deadline=$(( $(date +%s) + secs )) t0; t0=$(now)
  until "$@" >/dev/null 2>&1; do
    if ! alive "$comp"; then
      tail -n 30 "$CLUSTER_DIR/logs/$comp.log" >&2 || true
      die "$comp exited while waiting for $what (log: $CLUSTER_DIR/logs/$comp.log)"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -n 30 "$CLUSTER_DIR/logs/$comp.log" >&2 || true
      die "timed out after ${secs}s waiting for $what (log: $CLUSTER_DIR/logs/$comp.log)"
    fi
    sleep 0.2
  done
  log "  $what: ok after $(elapsed "$t0")s"
}

# https GET against a component with the admin client cert.
kget() {
  curl -fsS --max-time 3 --cacert "$CLUSTER_DIR/pki/ca.crt" \
    --cert "$CLUSTER_DIR/pki/admin.crt" --key "$CLUSTER_DIR/pki/admin.key" "$@"
}
# Health endpoint of a component serving a self-signed cert (controller-manager, scheduler).
hget() { curl -fsSk --max-time 3 "$@"; }

kubectl_() { "$BIN_DIR/kubectl" --kubeconfig "$CLUSTER_DIR/kubeconfig" "$@"; }

# --- certificates -------------------------------------------------------------------------

gen_pki() {
  local p="$CLUSTER_DIR/pki"
  mkdir -p "$p"
  [ -f "$p/admin.crt" ] && [ -f "$p/front-proxy-client.crt" ] && [ -f "$p/sa.pub" ] && return 0
  log "  generating certificates in $p"
  (
    cd "$p"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
      -subj "/CN=dspark-test-ca" >/dev/null 2>&1
    cat >apiserver.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:127.2.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
      -subj "/CN=kube-apiserver" >/dev/null 2>&1
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
      -out apiserver.crt -days 3650 -extfile apiserver.ext >/dev/null 2>&1
    cat >client.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EOF
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
      -subj "/O=system:masters/CN=dspark-admin" >/dev/null 2>&1
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
      -out admin.crt -days 3650 -extfile client.ext >/dev/null 2>&1
    # Front-proxy (request-header) CA + client, as kubeadm sets up: without it the
    # controller-manager and scheduler log "missing content for CA bundle" every minute,
    # and aggregated API servers could not authenticate the apiserver.
    openssl req -x509 -newkey rsa:2048 -nodes -keyout front-proxy-ca.key -out front-proxy-ca.crt \
      -days 3650 -subj "/CN=dspark-front-proxy-ca" >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -keyout front-proxy-client.key -out front-proxy-client.csr \
      -subj "/CN=front-proxy-client" >/dev/null 2>&1
    openssl x509 -req -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key \
      -CAcreateserial -out front-proxy-client.crt -days 3650 -extfile client.ext >/dev/null 2>&1
    openssl genrsa -out sa.key 2048 >/dev/null 2>&1
    openssl rsa -in sa.key -pubout -out sa.pub >/dev/null 2>&1
    rm -f ./*.csr ./*.ext ./*.srl
    chmod 644 ./*.crt sa.pub
  )
}

write_kubeconfig() {
  local p="$CLUSTER_DIR/pki" kc="$CLUSTER_DIR/kubeconfig"
  cat >"$kc" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: dspark
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 <"$p/ca.crt")
users:
- name: dspark-admin
  user:
    client-certificate-data: $(base64 -w0 <"$p/admin.crt")
    client-key-data: $(base64 -w0 <"$p/admin.key")
contexts:
- name: dspark
  context:
    cluster: dspark
    user: dspark-admin
current-context: dspark
EOF
  chmod 600 "$kc"
}

# --- kwok configuration -------------------------------------------------------------------

write_kwok_config() {
  local f="$CLUSTER_DIR/kwok.yaml"
  {
    cat <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  # Loopback only, even though no pod stage runs by default (kwok's default is 10.0.0.0/24).
  cidr: $KWOK_POD_CIDR
  nodeIP: 127.0.0.1
  manageAllNodes: false
  manageNodesWithAnnotationSelector: kwok.x-k8s.io/node=fake
  serverAddress: 127.0.0.1:$KWOK_PORT
  nodeLeaseDurationSeconds: 40
  # Given explicitly: with --config, kwok v0.8 leaves these at 0 and then refuses to start
  # ("node leases parallelism must be greater than 0").
  nodeLeaseParallelism: 4
  nodePlayStageParallelism: 4
  podPlayStageParallelism: 4
  podsOnNodeSyncParallelism: 1
EOF
    echo "---"
    cat "$HERE/kwok/stages-node.yaml"
    if [ "${DSPARK_KWOK_POD_STAGES:-0}" = 1 ]; then
      echo "---"
      cat "$HERE/kwok/stages-pod.yaml"
    fi
  } >"$f"
}

# --- up / down ----------------------------------------------------------------------------

all_alive() {
  local c
  for c in "${COMPONENTS[@]}"; do alive "$c" || return 1; done
}

any_alive() {
  local c
  for c in "${COMPONENTS[@]}"; do alive "$c" && return 0; done
  return 1
}

apiserver_ready() { kget "https://127.0.0.1:$APISERVER_PORT/readyz" | grep -qx ok; }

cmd_up() {
  local t0; t0=$(now)
  if all_alive && apiserver_ready; then
    log "already up (state: $CLUSTER_DIR, kubeconfig: $CLUSTER_DIR/kubeconfig)"
    [ "${DSPARK_TEST_KUBELET:-0}" = 1 ] && cmd_kubelet_up
    local running_pod_stages=0
    grep -q 'name: pod-ready' "$CLUSTER_DIR/kwok.yaml" 2>/dev/null && running_pod_stages=1
    if [ "$running_pod_stages" != "${DSPARK_KWOK_POD_STAGES:-0}" ]; then
      log "WARNING: running kwok has pod stages $([ "$running_pod_stages" = 1 ] && echo ON || echo OFF)," \
        "but DSPARK_KWOK_POD_STAGES=${DSPARK_KWOK_POD_STAGES:-0}; run \`$0 down\` first to change it"
    fi
    return 0
  fi
  if any_alive; then
    log "cluster partially up; restarting it"
    DSPARK_KEEP_STATE=1 cmd_down
  fi
  cmd_build
  BIN_DIR="$(bindir)"

  local port
  for port in $ETCD_CLIENT_PORT $ETCD_PEER_PORT $APISERVER_PORT $KCM_PORT $SCHEDULER_PORT $KWOK_PORT; do
    port_busy "$port" && die "127.0.0.1:$port is already in use by another process: $(ss -Htlnp "sport = :$port" | head -n1)"
  done

  log "starting cluster in $CLUSTER_DIR"
  mkdir -p "$CLUSTER_DIR"/{run,logs}
  # If anything below fails, stop what was started but keep the logs.
  trap 'log "up failed; stopping the components (logs kept in $CLUSTER_DIR/logs; \`$0 down\` removes them)"; DSPARK_KEEP_STATE=1 cmd_down' EXIT
  gen_pki
  write_kubeconfig
  write_kwok_config
  local p="$CLUSTER_DIR/pki" kc="$CLUSTER_DIR/kubeconfig"

  start etcd \
    --name=dspark \
    --data-dir="$CLUSTER_DIR/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="dspark=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync=true \
    --log-level=warn
  wait_for "etcd /health" 60 etcd curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health"

  start kube-apiserver \
    --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
    --bind-address=127.0.0.1 \
    --advertise-address=127.0.0.1 \
    --secure-port="$APISERVER_PORT" \
    --tls-cert-file="$p/apiserver.crt" \
    --tls-private-key-file="$p/apiserver.key" \
    --client-ca-file="$p/ca.crt" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$p/sa.pub" \
    --service-account-signing-key-file="$p/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --endpoint-reconciler-type=none \
    --authorization-mode=RBAC \
    --allow-privileged=true \
    --kubelet-preferred-address-types=InternalIP,Hostname \
    --requestheader-client-ca-file="$p/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$p/front-proxy-client.crt" \
    --proxy-client-key-file="$p/front-proxy-client.key" \
    --profiling=false
  wait_for "kube-apiserver /readyz" 120 kube-apiserver apiserver_ready

  local auth=(--kubeconfig="$kc" --authentication-kubeconfig="$kc" --authorization-kubeconfig="$kc")
  start kube-controller-manager "${auth[@]}" \
    --bind-address=127.0.0.1 \
    --secure-port="$KCM_PORT" \
    --leader-elect=false \
    --controllers='*' \
    --root-ca-file="$p/ca.crt" \
    --service-account-private-key-file="$p/sa.key" \
    --use-service-account-credentials=true \
    --cluster-name=dspark \
    --cluster-signing-cert-file="$p/ca.crt" \
    --cluster-signing-key-file="$p/ca.key" \
    --profiling=false
  start kube-scheduler "${auth[@]}" \
    --bind-address=127.0.0.1 \
    --secure-port="$SCHEDULER_PORT" \
    --leader-elect=false \
    --profiling=false
  start kwok \
    --kubeconfig="$kc" \
    --config="$CLUSTER_DIR/kwok.yaml"

  wait_for "kube-controller-manager /healthz" 60 kube-controller-manager hget "https://127.0.0.1:$KCM_PORT/healthz"
  wait_for "kube-scheduler /healthz" 60 kube-scheduler hget "https://127.0.0.1:$SCHEDULER_PORT/healthz"
  wait_for "kwok /healthz" 60 kwok curl -fsS --max-time 2 "http://127.0.0.1:$KWOK_PORT/healthz"

  log "  creating fake GPU nodes"
  kubectl_ apply -f "$HERE/nodes.yaml" >/dev/null
  wait_for "fake nodes Ready" 60 kwok kubectl_ wait --for=condition=Ready node \
    -l dspark.dev/fake-gpu-node=true --timeout=2s
  # The default namespace's ServiceAccount is what test pods run as.
  wait_for "default ServiceAccount" 60 kube-controller-manager kubectl_ get serviceaccount default -n default

  trap - EXIT
  [ "${DSPARK_TEST_KUBELET:-0}" = 1 ] && cmd_kubelet_up
  log "cluster up in $(elapsed "$t0")s"
  log "  export KUBECONFIG=$kc   (or: eval \"\$($0 env)\")"
}

cmd_down() {
  local t0 i; t0=$(now)
  if alive "$KUBELET" || [ -d "$CLUSTER_DIR/kubelet/pgids" ]; then
    stop "$KUBELET"
    kill_pod_processes
  fi
  if ! any_alive; then
    log "no cluster processes running"
  else
    for (( i=${#COMPONENTS[@]}-1; i>=0; i-- )); do stop "${COMPONENTS[$i]}"; done
  fi
  if [ "${DSPARK_KEEP_STATE:-0}" != 1 ] && [ -d "$CLUSTER_DIR" ]; then
    rm -rf "$CLUSTER_DIR"
    log "removed $CLUSTER_DIR"
  fi
  log "down in $(elapsed "$t0")s"
}

# --- test kubelet (tests/kubelet) ---------------------------------------------------------

KUBELET=dspark-test-kubelet
KUBELET_LABEL=dspark.dev/test-kubelet
cargo_target() { echo "${CARGO_TARGET_DIR:-$CACHE_ROOT/cargo-target}"; }

# Kill the process groups of containers a kubelet left behind (it was SIGKILLed), and the
# containers its OCI runtime still runs (--image-runtime runc|crun, state in kubelet/runtime).
kill_pod_processes() {
  local d="$CLUSTER_DIR/kubelet/pgids" f pg rt="$CLUSTER_DIR/kubelet/runtime" r id
  for r in runc crun; do
    [ -d "$rt" ] && command -v "$r" >/dev/null || continue
    for id in $("$r" --root "$rt" list -q 2>/dev/null); do
      "$r" --root "$rt" kill "$id" KILL >/dev/null 2>&1 || true
      "$r" --root "$rt" delete -f "$id" >/dev/null 2>&1 || true
    done
  done
  [ -d "$d" ] || return 0
  for f in "$d"/*; do
    [ -e "$f" ] || continue
    pg="$(basename "$f")"
    [[ "$pg" =~ ^[0-9]+$ ]] && kill -KILL -- "-$pg" 2>/dev/null || true
    rm -f "$f"
  done
}

cmd_kubelet_up() {
  BIN_DIR="$(bindir)"
  apiserver_ready || die "the cluster is not up (run \`$0 up\`)"
  if grep -q 'name: pod-ready' "$CLUSTER_DIR/kwok.yaml" 2>/dev/null; then
    die "kwok runs pod stages (DSPARK_KWOK_POD_STAGES=1): it and the test kubelet would both write pod status"
  fi
  if alive "$KUBELET"; then
    log "test kubelet already running (log: $CLUSTER_DIR/logs/$KUBELET.log)"
    return 0
  fi
  local tgt bin; tgt="$(cargo_target)"; bin="${DSPARK_TEST_KUBELET_BIN:-$tgt/release/$KUBELET}"
  if [ -n "${DSPARK_TEST_KUBELET_BIN:-}" ]; then
    [ -x "$bin" ] || die "DSPARK_TEST_KUBELET_BIN=$bin is not an executable"
  elif [ ! -x "$bin" ] || [ -n "$(find "$HERE/../kubelet/src" "$HERE/../kubelet/Cargo.toml" -newer "$bin" \( -name '*.rs' -o -name Cargo.toml \) | head -n1)" ]; then
    log "  building $KUBELET"
    (cd "$HERE/../.." && CARGO_TARGET_DIR="$tgt" nice -n 10 cargo build --release -q -p "$KUBELET") ||
      die "building $KUBELET failed"
  fi
  local nodes="${DSPARK_KUBELET_NODES:-}"
  if [ -n "$nodes" ]; then
    # shellcheck disable=SC2086
    kubectl_ label node $nodes "$KUBELET_LABEL=true" --overwrite >/dev/null
  else
    kubectl_ label node -l dspark.dev/fake-gpu-node=true "$KUBELET_LABEL=true" --overwrite >/dev/null
  fi
  mkdir -p "$CLUSTER_DIR/kubelet" "$CLUSTER_DIR/logs" "$CLUSTER_DIR/run"
  kill_pod_processes
  log "  starting $KUBELET"
  KUBECONFIG="$CLUSTER_DIR/kubeconfig" \
    setsid "$bin" --state-dir "$CLUSTER_DIR/kubelet" --node-selector "$KUBELET_LABEL=true" \
    >>"$CLUSTER_DIR/logs/$KUBELET.log" 2>&1 </dev/null &
  echo $! >"$(pidfile "$KUBELET")"
  local i
  for i in $(seq 1 100); do
    alive "$KUBELET" && grep -q 'test kubelet starting' "$CLUSTER_DIR/logs/$KUBELET.log" && break
    sleep 0.1
  done
  alive "$KUBELET" || { tail -n 20 "$CLUSTER_DIR/logs/$KUBELET.log" >&2; die "$KUBELET did not start"; }
  log "test kubelet up: nodes $(kubectl_ get nodes -l "$KUBELET_LABEL=true" -o name | sed 's|node/||' | tr '\n' ' ')(log: $CLUSTER_DIR/logs/$KUBELET.log, pods: $CLUSTER_DIR/kubelet/pods)"
}

cmd_kubelet_down() {
  if alive "$KUBELET"; then
    stop "$KUBELET"
  fi
  rm -f "$(pidfile "$KUBELET")"
  kill_pod_processes
  if apiserver_ready 2>/dev/null; then
    BIN_DIR="$(bindir)"
    kubectl_ label node -l "$KUBELET_LABEL=true" "$KUBELET_LABEL-" >/dev/null 2>&1 || true
  fi
}

cmd_status() {
  BIN_DIR="$(bindir)"
  local rc=0 c pid health
  for c in "${COMPONENTS[@]}"; do
    if alive "$c"; then
      pid="$(cat "$(pidfile "$c")")"
      case "$c" in
        etcd) health="$(curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health" 2>&1 || true)" ;;
        kube-apiserver) health="readyz=$(kget "https://127.0.0.1:$APISERVER_PORT/readyz" 2>&1 || true)" ;;
        kube-controller-manager) health="healthz=$(hget "https://127.0.0.1:$KCM_PORT/healthz" 2>&1 || true)" ;;
        kube-scheduler) health="healthz=$(hget "https://127.0.0.1:$SCHEDULER_PORT/healthz" 2>&1 || true)" ;;
        kwok) health="healthz=$(curl -fsS --max-time 2 "http://127.0.0.1:$KWOK_PORT/healthz" 2>&1 || true)" ;;
      esac
      printf '%-24s running  pid %-7s %s\n' "$c" "$pid" "$health"
    else
      printf '%-24s stopped\n' "$c"
      rc=1
    fi
  done
  if alive "$KUBELET"; then
    printf '%-24s running  pid %-7s pods in %s\n' "$KUBELET" "$(cat "$(pidfile "$KUBELET")")" "$CLUSTER_DIR/kubelet/pods"
  fi
  if [ "$rc" = 0 ]; then
    kubectl_ get nodes -L dspark.dev/node-type -L "$KUBELET_LABEL" 2>&1 || rc=1
  fi
  return "$rc"
}

cmd_logs() {
  local n="${1:-40}" f
  if [ "$n" = -f ]; then
    exec tail -n 20 -F "$CLUSTER_DIR"/logs/*.log
  fi
  for f in "$CLUSTER_DIR"/logs/*.log; do
    [ -f "$f" ] || { log "no logs in $CLUSTER_DIR/logs"; return 0; }
    echo "===== $f (last $n lines) ====="
    tail -n "$n" "$f"
  done
}

cmd_env() {
  local b; b="$(bindir)"
  printf 'export KUBECONFIG=%q\n' "$CLUSTER_DIR/kubeconfig"
  printf 'export DSPARK_CLUSTER_DIR=%q\n' "$CLUSTER_DIR"
  printf 'export DSPARK_K8S_BIN=%q\n' "$b"
  printf 'export DSPARK_APISERVER_URL=%q\n' "https://127.0.0.1:$APISERVER_PORT"
  printf 'export PATH=%q:"$PATH"\n' "$b"
}

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

main() {
  local cmd="${1:-}"
  [ $# -gt 0 ] && shift
  case "$cmd" in
    build) cmd_build ;;
    up) cmd_up ;;
    kubelet-up) cmd_kubelet_up ;;
    kubelet-down) cmd_kubelet_down ;;
    down) cmd_down ;;
    status) cmd_status ;;
    logs) cmd_logs "$@" ;;
    kubeconfig) echo "$CLUSTER_DIR/kubeconfig" ;;
    env) cmd_env ;;
    bindir) bindir ;;
    gen-k8s-mod) cmd_gen_k8s_mod "$@" ;;
    smoke) exec "$HERE/smoke.sh" "$@" ;;
    -h|--help|help|"") usage ;;
    *) usage >&2; die "unknown command: $cmd" ;;
  esac
}

# On one line, so that editing this file while it runs cannot make bash read on.
main "$@"; exit $?
