#!/usr/bin/env bash
# OpenTelemetry Collector for DSpark tests, built from the official Go modules.
#
#   tests/otel/otelcol.sh build     build (once, cached) the collector in tests/otel/collector
#   tests/otel/otelcol.sh up        start it on 127.0.0.1 with config/otel-collector/collector.yaml
#   tests/otel/otelcol.sh up --test start it with tests/otel/collector-test.yaml instead: the
#                                   debug exporter (verbosity: detailed) writes every span, metric
#                                   and log record it receives to $DSPARK_OTEL_DEBUG_LOG
#   tests/otel/otelcol.sh down      stop it; remove the state dir (DSPARK_KEEP_STATE=1 keeps it)
#   tests/otel/otelcol.sh env       shell exports: eval "$(tests/otel/otelcol.sh env)"
#   tests/otel/otelcol.sh logs [N|-f]  the collector's own log (and the debug-exporter output)
#   tests/otel/otelcol.sh status    running or not
#   tests/otel/otelcol.sh bin       print the path of the cached binary (builds if needed)
#
# Environment:
#   DSPARK_CACHE             build cache root (default ~/.cache/dspark); the binary goes to
#                            $DSPARK_CACHE/otel/<key>/bin/otelcol, <key> = hash of the wrapper
#                            module (go.mod, go.sum, *.go), the Go version and RECIPE_REV
#   DSPARK_OTEL_DIR          state, logs, pid file (default /tmp/dspark-otel)
#   DSPARK_OTEL_GRPC_PORT    OTLP/gRPC port (default 4317)
#   DSPARK_OTEL_HTTP_PORT    OTLP/HTTP port (default 4318)
#   DSPARK_OTEL_METRICS_PORT the collector's own Prometheus metrics (default 8888)
#   DSPARK_OTEL_CONFIG       config file for `up` (default config/otel-collector/collector.yaml,
#                            or tests/otel/collector-test.yaml with `up --test`)
#
# Everything listens on 127.0.0.1 only.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# Bump when the build recipe (flags, ldflags) changes, to force a rebuild.
RECIPE_REV=1

CACHE_ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}"
STATE_DIR="${DSPARK_OTEL_DIR:-/tmp/dspark-otel}"
# `up` records the ports it used, so that `env`, `down` etc. tell the truth without the variables.
SAVED_PORTS=()
[ -f "$STATE_DIR/ports" ] && read -r -a SAVED_PORTS <"$STATE_DIR/ports"
GRPC_PORT="${DSPARK_OTEL_GRPC_PORT:-${SAVED_PORTS[0]:-4317}}"
HTTP_PORT="${DSPARK_OTEL_HTTP_PORT:-${SAVED_PORTS[1]:-4318}}"
METRICS_PORT="${DSPARK_OTEL_METRICS_PORT:-${SAVED_PORTS[2]:-8888}}"
LOG_FILE="$STATE_DIR/otelcol.log"
DEBUG_LOG="$STATE_DIR/debug-exporter.log"
PID_FILE="$STATE_DIR/otelcol.pid"
NAME=otelcol
# shellcheck source=proc.sh
. "$HERE/proc.sh"


COL_VERSION="$(awk '$1 == "go.opentelemetry.io/collector/otelcol" { print $2; exit }' "$HERE/collector/go.mod")"

cache_key() {
  {
    echo "recipe=$RECIPE_REV"
    go env GOVERSION GOOS GOARCH
    local f
    for f in "$HERE/collector"/go.mod "$HERE/collector"/go.sum "$HERE/collector"/*.go; do
      [ -f "$f" ] && { echo "== $(basename "$f")"; cat "$f"; }
    done
  } | sha256sum | cut -c1-16
}

bin_path() {
  command -v go >/dev/null || die "go is not on PATH"
  echo "$CACHE_ROOT/otel/$(cache_key)/bin/otelcol"
}

# --- build --------------------------------------------------------------------------------

cmd_build() {
  local bin; bin="$(bin_path)"
  if [ -x "$bin" ]; then
    log "up to date: $bin"
    return 0
  fi
  local keydir; keydir="$(dirname "$(dirname "$bin")")"
  mkdir -p "$keydir/bin"
  # One build at a time per cache key (two checkouts may call build concurrently).
  exec 9>"$keydir/build.lock"
  flock 9
  if [ -x "$bin" ]; then
    log "up to date: $bin (built by a concurrent run)"
    return 0
  fi
  log "building collector $COL_VERSION into $bin (log: $keydir/build.log)"
  log "  (a cold build takes minutes on 2 cores; go build runs under nice -n 10)"
  local t0; t0=$(now)
  if ! (cd "$HERE/collector" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly -trimpath \
          -ldflags "-s -w -X main.version=$COL_VERSION" -o "$bin.tmp" .) >"$keydir/build.log" 2>&1; then
    tail -n 30 "$keydir/build.log" >&2
    die "building otelcol failed (full log: $keydir/build.log)"
  fi
  mv -f "$bin.tmp" "$bin"
  local secs; secs=$(elapsed "$t0")
  echo "otelcol ${secs}s $(date -u +%FT%TZ) $(go env GOVERSION)" >>"$keydir/build-times.txt"
  log "built in ${secs}s"
}

# --- process helpers ----------------------------------------------------------------------

port_busy() { ss -Htln "sport = :$1" | grep -q .; }

listening() { ss -Htln "src 127.0.0.1 and sport = :$1" | grep -q .; }

ready() { listening "$GRPC_PORT" && listening "$HTTP_PORT" && grep -q "Everything is ready" "$LOG_FILE"; }

cmd_up() {
  local test_mode=0
  [ "${1:-}" = "--test" ] && test_mode=1
  local config="${DSPARK_OTEL_CONFIG:-}"
  if [ -z "$config" ]; then
    if [ "$test_mode" = 1 ]; then config="$HERE/collector-test.yaml"
    else config="$ROOT/config/otel-collector/collector.yaml"; fi
  fi
  [ -f "$config" ] || die "no config file $config"
  if alive; then
    log "already running (pid $(cat "$PID_FILE")); \`down\` first to change the config"
    return 0
  fi
  cmd_build
  local bin p; bin="$(bin_path)"
  for p in "$GRPC_PORT" "$HTTP_PORT" "$METRICS_PORT"; do
    port_busy "$p" && die "port $p is in use (set DSPARK_OTEL_GRPC_PORT / _HTTP_PORT / _METRICS_PORT)"
  done
  mkdir -p "$STATE_DIR"
  : >"$DEBUG_LOG"
  echo "$config" >"$STATE_DIR/config-path"
  echo "$GRPC_PORT $HTTP_PORT $METRICS_PORT" >"$STATE_DIR/ports"
  log "starting on 127.0.0.1 (grpc :$GRPC_PORT, http :$HTTP_PORT, own metrics :$METRICS_PORT), config $config"
  local t0; t0=$(now)
  OTELCOL_GRPC_ENDPOINT="127.0.0.1:$GRPC_PORT" \
  OTELCOL_HTTP_ENDPOINT="127.0.0.1:$HTTP_PORT" \
  OTELCOL_METRICS_PORT="$METRICS_PORT" \
  OTELCOL_DEBUG_LOG="$DEBUG_LOG" \
    setsid "$bin" --config "file:$config" >>"$LOG_FILE" 2>&1 </dev/null &
  started "$!" "$t0" ready
  [ "$test_mode" = 1 ] && log "debug exporter output: $DEBUG_LOG"
  return 0
}


cmd_env() {
  cat <<EOF
export DSPARK_OTELCOL_BIN='$(bin_path)'
export DSPARK_OTEL_DIR='$STATE_DIR'
export DSPARK_OTEL_LOG='$LOG_FILE'
export DSPARK_OTEL_DEBUG_LOG='$DEBUG_LOG'
export DSPARK_OTEL_GRPC_ENDPOINT='127.0.0.1:$GRPC_PORT'
export DSPARK_OTEL_HTTP_ENDPOINT='127.0.0.1:$HTTP_PORT'
export OTEL_EXPORTER_OTLP_ENDPOINT='http://127.0.0.1:$HTTP_PORT'
export OTEL_EXPORTER_OTLP_PROTOCOL='http/protobuf'
EOF
}

cmd_logs() {
  local n="${1:-40}"
  if [ "$n" = "-f" ]; then exec tail -F "$LOG_FILE" "$DEBUG_LOG"; fi
  local f
  for f in "$LOG_FILE" "$DEBUG_LOG"; do
    [ -f "$f" ] || continue
    echo "== $f"
    tail -n "$n" "$f"
  done
}

cmd_status() {
  if alive; then
    echo "otelcol: running (pid $(cat "$PID_FILE"), config $(cat "$STATE_DIR/config-path" 2>/dev/null))"
  else
    echo "otelcol: stopped"
    return 1
  fi
}

case "${1:-}" in
  build) cmd_build ;;
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  env) cmd_env ;;
  logs) shift; cmd_logs "$@" ;;
  status) cmd_status ;;
  bin) cmd_build; bin_path ;;
  *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
