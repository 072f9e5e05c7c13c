#!/usr/bin/env bash
# The shared cargo target dir ($CARGO_TARGET_DIR, cached outside the repo) remembers which
# checkout last built into it. When that was another checkout (CI's clean clone, then a
# developer's tree, or the other way round), the workspace's own crates are cleaned so they
# rebuild here: cargo judges freshness by modification times, and sources older than the
# other checkout's binaries would reuse them, with CARGO_MANIFEST_DIR (and every repository
# file a test reads through it) pointing into the other checkout. Dependencies stay cached.
# Run by `make build`.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${CARGO_TARGET_DIR:?CARGO_TARGET_DIR is not set}"
stamp="$dir/.dspark-checkout"
here="$(pwd -P)"
if [ -s "$stamp" ] && [ "$(cat "$stamp")" != "$here" ]; then
  echo "target dir $dir was last built from $(cat "$stamp"): rebuilding the workspace's crates for $here"
  pkgs=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(" ".join("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))')
  # shellcheck disable=SC2086
  cargo clean --release $pkgs
fi
mkdir -p "$dir"
printf '%s\n' "$here" > "$stamp"
