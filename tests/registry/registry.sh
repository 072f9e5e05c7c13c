#!/usr/bin/env bash
# A real OCI registry on loopback for the image tests: the CNCF distribution registry
# (github.com/distribution/distribution/v3 cmd/registry), built from Go modules pinned by this
# directory's go.mod and cached like the test cluster's binaries.
#
#   tests/registry/registry.sh build   build once into $DSPARK_CACHE/registry/<key>/bin/registry
#   tests/registry/registry.sh up      start it on 127.0.0.1:$DSPARK_REGISTRY_PORT (default 15000)
#   tests/registry/registry.sh down    stop it (storage is kept: $DSPARK_REGISTRY_DIR)
#   tests/registry/registry.sh addr    print host:port
#
# <key> = sha256 of go.mod, go.sum, tools.go, this recipe's revision and `go env GOVERSION GOOS
# GOARCH`. Storage: $DSPARK_REGISTRY_DIR (default $DSPARK_CACHE/registry/storage): pushed blobs
# are content-addressed, so re-pushing an unchanged image uploads nothing.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RECIPE_REV=1
CACHE_ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PORT="${DSPARK_REGISTRY_PORT:-15000}"
DATA="${DSPARK_REGISTRY_DIR:-$CACHE_ROOT/registry/storage}"
RUN="${DSPARK_REGISTRY_RUN:-/tmp/dspark-registry-$PORT}"
log() { printf '[registry] %s\n' "$*" >&2; }
die() { printf '[registry] ERROR: %s\n' "$*" >&2; exit 1; }

key() {
  { echo "recipe=$RECIPE_REV"; go env GOVERSION GOOS GOARCH; cat "$HERE/go.mod" "$HERE/go.sum" "$HERE/tools.go"; } |
    sha256sum | cut -c1-16
}
bin() { echo "$CACHE_ROOT/registry/$(key)/bin/registry"; }

cmd_build() {
  local b; b="$(bin)"
  [ -x "$b" ] && { log "cached: $b"; return 0; }
  mkdir -p "$(dirname "$b")"
  exec 9>"$(dirname "$b")/../build.lock"; flock 9
  [ -x "$b" ] && return 0
  local v t0=$SECONDS
  v="$(awk '$1 == "require" && $2 == "github.com/distribution/distribution/v3" { print $3 }' "$HERE/go.mod")"
  log "building distribution $v (log: $(dirname "$b")/../build.log) ..."
  (cd "$HERE" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly \
     -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=$v" \
     -o "$b.tmp" github.com/distribution/distribution/v3/cmd/registry) \
     >"$(dirname "$b")/../build.log" 2>&1 || { tail -n 20 "$(dirname "$b")/../build.log" >&2; die "build failed"; }
  mv -f "$b.tmp" "$b"
  log "built in $((SECONDS - t0))s"
}

cmd_up() {
  cmd_build
  mkdir -p "$RUN" "$DATA"
  if [ -f "$RUN/pid" ] && kill -0 "$(cat "$RUN/pid")" 2>/dev/null; then
    log "already running on 127.0.0.1:$PORT"; return 0
  fi
  cat >"$RUN/config.yml" <<YAML
version: 0.1
log: { level: warn, accesslog: { disabled: true } }
storage:
  filesystem: { rootdirectory: $DATA }
  delete: { enabled: true }
http:
  addr: 127.0.0.1:$PORT
  debug: { addr: "" }
health: { storagedriver: { enabled: false } }
YAML
  # OTEL_TRACES_EXPORTER=none: distribution v3 otherwise tries to export traces to localhost:4318.
  OTEL_TRACES_EXPORTER=none OTEL_METRICS_EXPORTER=none OTEL_SDK_DISABLED=true \
    setsid "$(bin)" serve "$RUN/config.yml" >"$RUN/registry.log" 2>&1 </dev/null &
  echo $! >"$RUN/pid"
  local i
  for i in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$PORT/v2/" >/dev/null 2>&1 && { log "up on 127.0.0.1:$PORT (pid $(cat "$RUN/pid"))"; return 0; }
    kill -0 "$(cat "$RUN/pid")" 2>/dev/null || break
    sleep 0.1
  done
  tail -n 20 "$RUN/registry.log" >&2; die "registry did not start"
}

cmd_down() {
  [ -f "$RUN/pid" ] || return 0
  local p; p="$(cat "$RUN/pid")"
  kill "$p" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$p" 2>/dev/null || true
  rm -f "$RUN/pid"; log "stopped"
}

case "${1:-}" in
  build) cmd_build ;;
  up) cmd_up ;;
  down) cmd_down ;;
  addr) echo "127.0.0.1:$PORT" ;;
  bin) bin ;;
  *) die "usage: $0 build|up|down|addr|bin" ;;
esac
