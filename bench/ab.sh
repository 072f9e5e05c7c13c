#!/usr/bin/env bash
# A/B of two engine builds in one sitting: bench/engine.sh (SPS(B) profile and loadgen
# throughput at 1/4/16/32 streams) for binary A, B, B, A (ABBA, so drift hits both alike),
# then bench/ab.py prints the per-build medians and the B/A ratios.
# Usage: bench/ab.sh BIN_A BIN_B MODEL.gguf [-- extra serve args for B]
# Env: DURATION (s per loadgen level, default 15), LEVELS (stream counts, default 1,4,16,32),
# PROFILE_RUNS (default 1), A_ARGS (extra
# serve args for A). Run it on a quiet machine (the load average is recorded).
set -euo pipefail
cd "$(dirname "$0")/.."
A="${1:?usage: bench/ab.sh BIN_A BIN_B MODEL.gguf [-- B serve args]}"; B="${2:?}"; MODEL="${3:?}"
shift 3; [ "${1:-}" = "--" ] && shift
ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}/bench/ab-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$ROOT"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$ROOT/load.txt"
n=0
for side in A B B A; do
  n=$((n + 1))
  if [ "$side" = A ]; then bin="$A"; args=(${A_ARGS:-}); else bin="$B"; args=("$@"); fi
  echo "== run $n: $side ($bin ${args[*]:-})"
  DSPARK_ENGINE_BIN="$bin" DURATION="${DURATION:-15}" LEVELS="${LEVELS:-1,4,16,32}" PROFILE_RUNS="${PROFILE_RUNS:-1}" \
    OUT_DIR="$ROOT/$side-$n" bench/engine.sh "$MODEL" "${args[@]}" >"$ROOT/$side-$n.log" 2>&1
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$ROOT/load.txt"
python3 bench/ab.py "$ROOT" | tee "$ROOT/ab.md"
