#!/usr/bin/env bash
# One run, both engines, same model, same prompts: dspark-engine (bench/engine.sh) then
# llama.cpp (bench/peer-llamacpp.sh), then bench/compare.py prints one table and draws
# compare-sps.png (both SPS(B) curves) and compare-throughput.png.
# Usage: bench/compare.sh MODEL.gguf     Env: DURATION (s per loadgen level, default 30)
# Run it on a quiet machine (the load average is printed with the results).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:?usage: bench/compare.sh MODEL.gguf}"
export DURATION="${DURATION:-30}"
ROOT="${DSPARK_CACHE:-$HOME/.cache/dspark}/bench/compare-$(basename "$MODEL" .gguf)-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$ROOT"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$ROOT/load.txt"
OUT_DIR="$ROOT/dspark" bench/engine.sh "$MODEL" 2>&1 | tee "$ROOT/dspark.log"
OUT_DIR="$ROOT/llamacpp" bench/peer-llamacpp.sh "$MODEL" 2>&1 | tee "$ROOT/llamacpp.log"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$ROOT/load.txt"
python3 bench/compare.py "$ROOT" | tee "$ROOT/compare.md"
