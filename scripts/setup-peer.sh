#!/usr/bin/env bash
# Build the llama.cpp peer (see docs in /work/shared/peers.md) from the PyPI package
# llama-cpp-python, entirely into a cache OUTSIDE the repository:
#
#   (b) builds llama.cpp's llama-server, llama-bench and llama-batched-bench from the sdist's
#       vendored llama.cpp (vendor/llama.cpp) into $DSPARK_CACHE/llama.cpp/<version>/bin,
#       with -DGGML_NATIVE=ON (AMX off, see NOAMX below), as shared libraries (libllama,
#       libggml*, libmtmd) next to the tools (RPATH $ORIGIN);
#   (a) pip-installs llama-cpp-python (Python bindings, used by tests/peer/reference.py)
#       WITHOUT its own build of llama.cpp (LLAMA_BUILD=OFF) and puts copies of (b)'s
#       libraries into its package's lib/ directory, where the bindings load them from.
#       One compile of llama.cpp instead of two (pip's own build took ~4 min on 2 cores);
#       the same sources either way: the bindings and the tools are one sdist.
#
# Nothing from llama.cpp is ever written into the repository.
#
# A piece counts as built only if it was built with the current flags (stamp files) AND, when
# a model is in $DSPARK_CACHE/models, a multi-token smoke eval through it succeeds; so a
# re-run rebuilds a broken or stale build (e.g. one from before AMX was turned off).
#
# Builds run as ONE detached background job (setsid + nohup, `nice`d, logs under
# $DSPARK_CACHE/llama.cpp/<version>/logs) so that a caller whose shell is time-limited can
# return and re-run this script: a re-run attaches to the running job (flock) instead of
# starting a second one. Already-built pieces are skipped, so a re-run when done is instant.
#
# Usage: scripts/setup-peer.sh [--max-wait SECONDS] [--detach]
#   --max-wait S  stop polling after S seconds (the build keeps going); exit code 3
#   --detach      start/attach to the build and return at once (same as --max-wait 0)
# Env:   DSPARK_CACHE (default ~/.cache/dspark), DSPARK_BUILD_JOBS (default: nproc),
#        LLAMA_CPP_PY_VERSION (default pinned below), PYTHON (default python3)
set -euo pipefail

V="${LLAMA_CPP_PY_VERSION:-0.3.36}"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PY="${PYTHON:-python3}"
JOBS="${DSPARK_BUILD_JOBS:-$(nproc)}"
SDIST_DIR="$CACHE/sdist"
SDIST="$SDIST_DIR/llama_cpp_python-$V.tar.gz"
PEER="$CACHE/llama.cpp/$V"
BIN="$PEER/bin"
SRC="$PEER/src"             # extracted sdist (llama.cpp sources), outside the repo
BUILD="$PEER/build"
LOGDIR="$PEER/logs"
LOCK="$LOGDIR/job.lock"
JOBLOG="$LOGDIR/job.log"
RCFILE="$LOGDIR/job.rc"
TOOLS=(llama-server llama-bench llama-batched-bench)

# AMX off. With -march=native on an AMX CPU (Sapphire Rapids and later) ggml compiles in its
# AMX tile kernels (ggml-cpu/amx) and puts Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_XS weights into
# an AMX buffer. With GCC 12 (Debian 12) those kernels are miscompiled: its _tile_loadconfig
# (amxtileintrin.h) gives the asm an 8-byte "m" operand instead of the 64-byte tile config,
# so the stores filling the config are dropped as dead, ldtilecfg loads stack garbage, #GP,
# SIGSEGV in ggml_backend_amx_mul_mat on the first batch of more than one token (llama-cpp-
# python's Llama.eval, llama-bench pp, llama-server prompts). -mno-amx-* keeps every other
# native ISA extension (AVX-512, VNNI, BF16, ...), so builds on AMX and non-AMX machines run
# the same kernels.
NOAMX=""
[[ "$(uname -m)" == x86_64 ]] && NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS=(-DGGML_NATIVE=ON)
[[ -n "$NOAMX" ]] && CMAKE_FLAGS+=("-DCMAKE_C_FLAGS=$NOAMX" "-DCMAKE_CXX_FLAGS=$NOAMX")
# Stamps: what (a) and (b) were built with; a mismatch (or none) means rebuild.
BUILD_ID="llama-cpp-python $V; shared; ${CMAKE_FLAGS[*]}"
PY_STAMP="$PEER/python.build"
BIN_STAMP="$BIN/BUILD"

log() { printf '[setup-peer %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# A small model for the smoke evals (Q4_1/Q4_K: types that go to ggml's extra CPU buffers),
# or nothing when none has been fetched yet (then only version + stamp are checked).
smoke_model() {
  local m
  for m in "$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$CACHE/models/gemma-3-270m-Q4_K_M.gguf"; do
    [[ -s "$m" ]] && { printf '%s' "$m"; return 0; }
  done
  return 0
}

py_ok() {
  [[ "$(cat "$PY_STAMP" 2>/dev/null)" == "$BUILD_ID" ]] || return 1
  # Separate process (in a silenced subshell, so bash's "Segmentation fault" notice stays out
  # of the log): a crashing build exits with a signal, i.e. "not ok".
  ( "$PY" - "$V" "$(smoke_model)" <<'EOF'
import sys, llama_cpp
if llama_cpp.__version__ != sys.argv[1]:
    sys.exit(1)
if sys.argv[2]:
    import numpy as np
    llm = llama_cpp.Llama(model_path=sys.argv[2], n_ctx=64, n_batch=64, logits_all=True,
                          n_threads=2, verbose=False)
    t = llm.tokenize(b"The quick brown fox jumps over the lazy dog.", add_bos=True)
    llm.eval(t)  # one multi-token batch, as tests/peer/reference.py does
    sys.exit(0 if np.isfinite(llm.scores[:len(t)]).all() else 1)
EOF
  ) >/dev/null 2>&1
}

bins_ok() {
  local t m
  [[ "$(cat "$BIN_STAMP" 2>/dev/null)" == "$BUILD_ID" ]] || return 1
  for t in "${TOOLS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
  m="$(smoke_model)"
  [[ -z "$m" ]] || ( "$BIN/llama-bench" -m "$m" -t 2 -p 16 -n 0 -r 1 ) >/dev/null 2>&1 || return 1
  return 0
}

fetch_sdist() {
  if [[ -s "$SDIST" ]] && tar tzf "$SDIST" >/dev/null 2>&1; then return 0; fi
  log "downloading sdist llama-cpp-python==$V from PyPI"
  mkdir -p "$SDIST_DIR"
  local tmp; tmp="$(mktemp -d "$SDIST_DIR/.dl.XXXXXX")"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$V" -d "$tmp"
  mv -f "$tmp/llama_cpp_python-$V.tar.gz" "$SDIST"
  rm -rf "$tmp"
}

# ---------------------------------------------------------------------------------------
# The background job: (b) then (a), sequentially (2 cores: never both at once).
# ---------------------------------------------------------------------------------------
job() {
  exec 9>"$LOCK"
  flock -n 9 || { log "another build job holds $LOCK; exiting"; exit 0; }
  rm -f "$RCFILE"
  trap 'echo $? > "$RCFILE"' EXIT
  local t0; t0=$(date +%s)
  fetch_sdist

  if bins_ok; then
    log "(b) ${TOOLS[*]} already in $BIN; skipping"
  else
    log "(b) ${TOOLS[*]} missing, built with other flags, or failing their smoke run"
    local tb; tb=$(date +%s)
    # The bindings carry copies of this build's libraries: they are stale from here on.
    rm -f "$PY_STAMP"
    if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
      log "(b) extracting $SDIST -> $SRC"
      rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
      tar xzf "$SDIST" -C "$SRC.tmp" --strip-components=1
      rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
    fi
    log "(b) cmake configure (${CMAKE_FLAGS[*]}, shared libraries)"
    # Fresh build tree: the flags may have changed since the last one.
    rm -rf "$BUILD"
    # UI off and no prebuilt-UI download: the build must not reach the network.
    nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" \
      -DCMAKE_BUILD_TYPE=Release "${CMAKE_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
    log "(b) cmake build ${TOOLS[*]} ($JOBS jobs)"
    nice -n 10 cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TOOLS[@]}" llama ggml
    rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"
    for t in "${TOOLS[@]}"; do cp "$BUILD/bin/$t" "$BIN.tmp/$t"; done
    find "$BUILD" -name 'lib*.so*' \( -type f -o -type l \) -exec cp -a {} "$BIN.tmp/" \;
    [[ -e "$BIN.tmp/libllama.so" ]] || { log "(b) FAILED: no libllama.so in $BUILD"; exit 1; }
    printf '%s\n' "$BUILD_ID" > "$BIN.tmp/BUILD"
    rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
    bins_ok || { log "(b) FAILED: llama-bench smoke run failed"; exit 1; }
    log "(b) done in $(( $(date +%s) - tb ))s"
  fi

  if py_ok; then
    log "(a) llama_cpp $V already importable; skipping pip install"
  else
    log "(a) llama_cpp $V missing, built with other flags, or failing its smoke eval"
    log "(a) pip install llama-cpp-python==$V without its llama.cpp build; libraries from (b)"
    local ta; ta=$(date +%s)
    rm -f "$PY_STAMP"
    # Drop a broken/stale install first; --no-cache-dir: pip would otherwise reinstall the
    # wheel it cached from an earlier build of this sdist, whatever CMAKE_ARGS say now.
    if "$PY" -m pip show -q llama-cpp-python >/dev/null 2>&1; then
      "$PY" -m pip uninstall -y llama-cpp-python
    fi
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" \
      nice -n 10 "$PY" -m pip install -q --no-cache-dir --no-binary llama-cpp-python "$SDIST"
    # find_spec locates the package without importing it (the import needs the libraries).
    local lib
    lib="$("$PY" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llama_cpp").origin), "lib"))')"
    mkdir -p "$lib"
    find "$BIN" -maxdepth 1 -name 'lib*.so*' -exec cp -a {} "$lib/" \;
    printf '%s\n' "$BUILD_ID" > "$PY_STAMP"
    py_ok || { rm -f "$PY_STAMP"; log "(a) FAILED: llama_cpp $V not importable or smoke eval failed after install"; exit 1; }
    log "(a) done in $(( $(date +%s) - ta ))s"
  fi
  log "job finished in $(( $(date +%s) - t0 ))s"
}

if [[ "${1:-}" == "--job" ]]; then job; exit 0; fi

MAX_WAIT=-1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --max-wait) MAX_WAIT="$2"; shift 2 ;;
    --detach) MAX_WAIT=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

report() {
  log "llama-cpp-python $V: $("$PY" -c 'import llama_cpp,os;print(os.path.dirname(llama_cpp.__file__))')"
  for t in "${TOOLS[@]}"; do log "$BIN/$t"; done
}

if py_ok && bins_ok; then
  log "peer already set up (llama-cpp-python $V)"
  report
  exit 0
fi

mkdir -p "$LOGDIR"
if flock -n "$LOCK" true 2>/dev/null; then
  log "starting background build job; log: $JOBLOG"
  rm -f "$RCFILE"
  setsid nohup bash "$0" --job >"$JOBLOG" 2>&1 </dev/null &
  sleep 2
else
  log "a build job is already running; attaching (log: $JOBLOG)"
fi

start=$(date +%s)
last=""
while :; do
  if [[ -f "$RCFILE" ]] && flock -n "$LOCK" true 2>/dev/null; then
    rc="$(cat "$RCFILE")"
    if [[ "$rc" == "0" ]] && py_ok && bins_ok; then
      grep -E '\] \((a|b)\) done|job finished' "$JOBLOG" | sed 's/^/  /' || true
      report
      exit 0
    fi
    log "build job FAILED (rc=$rc); last lines of $JOBLOG:"
    tail -n 40 "$JOBLOG" >&2
    exit 1
  fi
  # Progress: last cmake "[ NN%]" line or our own step lines.
  cur="$(grep -E '^\[setup-peer|^ *\[ *[0-9]+%\]|^ *\[[0-9]+/[0-9]+\]' "$JOBLOG" 2>/dev/null | tail -n 1 | sed -E 's/^ *//; s/^(\[[0-9]+\/[0-9]+\]) .* -c ([^ ]+)$/\1 compiling \2/' | cut -c1-160 || true)"
  if [[ "$cur" != "$last" ]]; then log "… $cur"; last="$cur"; fi
  el=$(( $(date +%s) - start ))
  if [[ "$MAX_WAIT" -ge 0 && "$el" -ge "$MAX_WAIT" ]]; then
    log "still building after ${el}s; re-run this script to keep waiting (log: $JOBLOG)"
    exit 3
  fi
  if [[ "$MAX_WAIT" -ge 0 ]]; then sleep $(( MAX_WAIT - el < 15 ? MAX_WAIT - el : 15 )); else sleep 15; fi
done
