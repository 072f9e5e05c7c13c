#!/usr/bin/env bash
# Benchmarks dspark-engine on MODEL the same way bench/peer-llamacpp.sh measures llama.cpp:
# SPS(B) with `dspark-engine profile`, single-stream decode, and total throughput at
# 1/4/16/32 concurrent streams with bench/loadgen.py against `dspark-engine serve`.
# Same prompts as bench/peer-llamacpp.sh (loadgen's default set).
# Usage: bench/engine.sh MODEL.gguf [extra serve args...]
# Env: DURATION (s per level, default 30), LEVELS (stream counts, default 1,4,16,32), OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$1"; shift
DURATION="${DURATION:-30}"
BIN="${DSPARK_ENGINE_BIN:-${CARGO_TARGET_DIR:-target}/release/dspark-engine}"
OUT="${OUT_DIR:-${DSPARK_CACHE:-$HOME/.cache/dspark}/bench/engine-$(basename "$MODEL" .gguf)-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
# The profile runs PROFILE_RUNS times (default 3), alternating decode- and verify-shaped
# steps, so that a burst of outside load hits one run, not one shape; bench/compare.py takes
# the per-B median.
for r in $(seq 1 "${PROFILE_RUNS:-3}"); do
  echo "== SPS(B): $BIN profile (decode steps: 1 token per sequence, context 256), run $r"
  "$BIN" profile --model "$MODEL" --tokens-per-seq 1 --max-reps 20 --output "$OUT/sps-decode-$r.json" 2>&1 | grep -E "B=|profiling"
  echo "== SPS(B): verify-shaped steps (4 tokens per sequence), run $r"
  "$BIN" profile --model "$MODEL" --tokens-per-seq 4 --max-reps 20 --output "$OUT/sps-verify-$r.json" 2>&1 | grep -E "B="
done
PORT=18123
"$BIN" serve --model "$MODEL" --port "$PORT" --served-model-name bench "$@" >"$OUT/serve.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break; sleep 0.2; done
echo "== throughput (loadgen, closed loop, ${DURATION}s per level, 128 output tokens, ignore EOS)"
python3 bench/loadgen.py --url "http://127.0.0.1:$PORT" --model bench --concurrency "${LEVELS:-1,4,16,32}" \
  --duration "$DURATION" --max-tokens 128 --ignore-eos \
  --json-out "$OUT/loadgen.json"
echo "results in $OUT"
