#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's reference endpoint picker (EPP) and the
# ext_proc client that stands in for a gateway in the picker test, from this folder's Go
# module (GIE v1.3.0 from the Go module proxy), into a cache keyed by the module files and
# the Go version, and copies the InferencePool CRD from the same module next to them.
# Prints the folder: <dir>/epp, <dir>/extproc-client, <dir>/inferencepools.yaml.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}"
log() { printf '[gie-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
command -v go >/dev/null || { log "go is not on PATH"; exit 1; }
key="$({ go env GOVERSION GOOS GOARCH; cat "$HERE/go.mod" "$HERE/go.sum" "$HERE"/*.go "$HERE"/extproc-client/*.go; } | sha256sum | cut -c1-16)"
BIN="$CACHE_ROOT/gie/$key"
if [ -x "$BIN/epp" ] && [ -x "$BIN/extproc-client" ] && [ -s "$BIN/inferencepools.yaml" ]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$BIN"
exec 9>"$BIN/.lock"; flock 9
if [ ! -x "$BIN/epp" ]; then
  log "building the endpoint picker (cold: several minutes on 2 cores; log $BIN/build.log)"
  (cd "$HERE" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly -ldflags "-s -w" -o "$BIN/.epp.tmp" \
    sigs.k8s.io/gateway-api-inference-extension/cmd/epp) >"$BIN/build.log" 2>&1 ||
    { tail -n 30 "$BIN/build.log" >&2; exit 1; }
  mv -f "$BIN/.epp.tmp" "$BIN/epp"
fi
if [ ! -x "$BIN/extproc-client" ]; then
  (cd "$HERE" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly -o "$BIN/.client.tmp" ./extproc-client) >>"$BIN/build.log" 2>&1 ||
    { tail -n 30 "$BIN/build.log" >&2; exit 1; }
  mv -f "$BIN/.client.tmp" "$BIN/extproc-client"
fi
mod="$(cd "$HERE" && go list -mod=readonly -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)"
cp "$mod/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$BIN/inferencepools.yaml"
chmod u+w "$BIN/inferencepools.yaml"
echo "$BIN"
