#!/usr/bin/env bash
# Compiles the engine with `--features cuda` (candle's CUDA backend through cudarc) on a
# machine without a GPU or driver: the CUDA toolkit comes from PyPI wheels
# (images/engine-cuda/requirements-cuda.txt), so this only proves it compiles and links; the
# binary needs a real driver (libcuda.so.1) at run time.
#
#   scripts/cuda-build.sh          toolkit (cached) + the engine's binary with --features cuda
#   scripts/cuda-build.sh env      print the exports (CUDA_ROOT, PATH, ...) for a shell
#   scripts/cuda-build.sh target   print the output dir (the binary is <dir>/release/dspark-engine)
#
# Caches: toolkit in $DSPARK_CACHE/cuda/<key> (key: requirements + recipe). The build runs in
# the CPU build's target dir ($CARGO_TARGET_DIR, default $DSPARK_CACHE/cargo-target) with the
# workspace's feature resolution (`--workspace --features dspark-engine/cuda --bin
# dspark-engine`), so the ~270 dependencies the two builds share are compiled once and only the
# CUDA-specific crates (cudarc, candle-kernels, candle-core/-nn, the engine) build again; cargo
# keeps both variants side by side (features are part of each artifact's hash). The CUDA binary
# is copied to $DSPARK_CACHE/cargo-target-cuda/<key>/release/dspark-engine (key: rustc -vV,
# toolkit key, CUDA_COMPUTE_CAP) and the CPU binary is put back under its name.
# CUDA_COMPUTE_CAP (default 80) picks the kernels' architecture: there is no GPU to ask.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
REQ=images/engine-cuda/requirements-cuda.txt
RECIPE_REV=1
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
log() { printf '[cuda] %s\n' "$*" >&2; }
die() { printf '[cuda] ERROR: %s\n' "$*" >&2; exit 1; }

TK_KEY="$({ echo "recipe=$RECIPE_REV"; cat "$REQ"; } | sha256sum | cut -c1-16)"
TK="$CACHE/cuda/$TK_KEY"
ROOT="$TK/py/nvidia/cu13"
TGT_KEY="$({ rustc -vV; echo "$TK_KEY cap=$CUDA_COMPUTE_CAP"; } | sha256sum | cut -c1-16)"
TARGET="${DSPARK_CUDA_TARGET_DIR:-$CACHE/cargo-target-cuda/$TGT_KEY}"
BUILD_DIR="${CARGO_TARGET_DIR:-$CACHE/cargo-target}"

toolkit() {
  [ -f "$TK/.done" ] && return 0
  mkdir -p "$TK"; exec 9>"$TK.lock"; flock 9
  [ -f "$TK/.done" ] && return 0
  log "installing the CUDA toolkit wheels into $TK"
  rm -rf "$TK/py"
  nice -n 10 "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$TK/py" -r "$REQ"
  [ -x "$ROOT/bin/nvcc" ] || die "no nvcc in $ROOT/bin"
  # The linker wants unversioned names (-lcublas ...): the wheels ship only libX.so.N.
  local f
  for f in "$ROOT"/lib/lib*.so.*; do
    local base="${f%%.so.*}.so"; [ -e "$base" ] || ln -s "$(basename "$f")" "$base"
  done
  # cudarc links the driver (-lcuda). The toolkit's answer for driverless build machines is a
  # link stub (lib64/stubs/libcuda.so, soname libcuda.so.1) which no wheel ships: generate the
  # same from the driver API names cudarc declares. Never on the library path at run time.
  local sys; sys="$(cargo metadata --format-version 1 --locked --features dspark-engine/cuda |
    python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')"
  sys="$(dirname "$sys")/src/driver/sys/mod.rs"
  mkdir -p "$ROOT/lib/stubs"
  grep -oE '\bfn cu[A-Za-z0-9_]+\(' "$sys" | sed 's/^fn //; s/($//' | sort -u |
    awk '{ print "int " $1 "(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }" }' >"$ROOT/lib/stubs/libcuda-stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/libcuda-stub.c"
  touch "$TK/.done"
  log "toolkit: $("$ROOT/bin/nvcc" --version | tail -n 2 | head -n 1)"
}

exports() {
  cat <<SH
export CUDA_ROOT="$ROOT" CUDA_PATH="$ROOT" CUDA_HOME="$ROOT" CUDA_TOOLKIT_ROOT_DIR="$ROOT"
export PATH="$ROOT/bin:\$PATH"
export LIBRARY_PATH="$ROOT/lib:$ROOT/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CUDA_COMPUTE_CAP="$CUDA_COMPUTE_CAP"
SH
}

case "${1:-build}" in
  env) toolkit; exports ;;
  target) echo "$TARGET" ;;
  build)
    toolkit
    t0=$SECONDS
    export CARGO_TARGET_DIR="$BUILD_DIR"
    # Whatever happens, the CPU binary goes back to its name in the shared target dir (cargo
    # re-links it from its own, untouched artifact: a no-op when the CPU build is current).
    trap 'nice -n 10 "${CARGO:-cargo}" build --release --locked --workspace --bin dspark-engine -q' EXIT
    log "cargo build --release --workspace --features dspark-engine/cuda --bin dspark-engine (target $BUILD_DIR, sm_$CUDA_COMPUTE_CAP)"
    (
      eval "$(exports)"
      nice -n 10 "${CARGO:-cargo}" build --release --locked --workspace --features dspark-engine/cuda \
        --bin dspark-engine
    )
    # An output dir from before the shared build held a whole target tree: keep the binary only.
    rm -rf "$TARGET/release/deps" "$TARGET/release/build" "$TARGET/release/.fingerprint" \
      "$TARGET/release/incremental" "$TARGET/release/examples"
    mkdir -p "$TARGET/release"
    cp "$BUILD_DIR/release/dspark-engine" "$TARGET/release/dspark-engine.tmp"
    mv -f "$TARGET/release/dspark-engine.tmp" "$TARGET/release/dspark-engine"
    log "built $TARGET/release/dspark-engine in $((SECONDS - t0))s"
    ;;
  *) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
