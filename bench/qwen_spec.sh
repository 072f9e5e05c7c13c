#!/usr/bin/env bash
# Speculation on the real-size target (issue #50): Qwen2.5-Coder-1.5B-Instruct Q4_K_M served
# by dspark-engine (plain and with its shipped DSpark drafter) and by llama-server (plain, the
# Qwen2.5-Coder-0.5B draft model at several --spec-draft-n-max, n-gram lookup), one server at
# a time, each driven by bench/loadgen.py (closed loop, streaming) on HumanEval prompts and on
# held-out chat prompts (data/prompts/chat.jsonl, never trained on), natural lengths up to
# MAX_TOKENS. Rounds alternate the order of the configurations. Then
# bench/qwen_spec_report.py prints the table (median [min-max] over rounds, ratios against
# engine-none) and draws qwen-spec.png.
#
# Usage: bench/qwen_spec.sh OUT_DIR
# Env (defaults): LEVELS=1,4  REQUESTS=6 (per level and prompt set)  ROUNDS=2
#   MAX_TOKENS=256  TEMPERATURE=0  CONFIGS="engine-none engine-dspark llama-plain
#   llama-draft3 llama-ngram" (also engine-ngram: prompt lookup, fixed 4; llama-draft2,
#   llama-draft5; engine-dspark-alt: as engine-dspark with the drafter found in ALT_DRAFTERS,
#   a drafter folder, e.g. the previous one for an old-vs-new sitting; engine-dspark-nolookup:
#   as engine-dspark with --prompt-lookup false; engine-dspark-altbin: as engine-dspark served
#   by the binary ALT_ENGINE_BIN, e.g. a build of the previous commit for an A/B in one
#   sitting)  SETS="humaneval chat"
#   ENGINE_ARGS (extra serve flags for both engine configurations, e.g. --cost-table T.json
#   with a table `dspark-engine profile` measured once, instead of each start-up's profile)
# Servers listen on 127.0.0.1 only. llama-server runs with --load-mode none (the VM keeps
# ~1.1 GB of page cache; a mapped 1.1 GB model pages from disk). Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: bench/qwen_spec.sh OUT_DIR}"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
BIN="${DSPARK_ENGINE_BIN:-$CACHE/cargo-target/release/dspark-engine}"
LLAMA="${LLAMA_BIN:-$CACHE/llama.cpp/0.3.36/bin}"
M="$CACHE/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
D="$CACHE/models/qwen2.5-coder-0.5b-instruct.gguf"
LEVELS="${LEVELS:-1,4}"; REQUESTS="${REQUESTS:-6}"; ROUNDS="${ROUNDS:-2}"
MAX_TOKENS="${MAX_TOKENS:-256}"; TEMPERATURE="${TEMPERATURE:-0}"
CONFIGS="${CONFIGS:-engine-none engine-dspark llama-plain llama-draft3 llama-ngram}"
SETS="${SETS:-humaneval chat}"
PORT="${PORT:-18350}"
mkdir -p "$OUT"
[ -s "$M" ] && [ -s "$D" ] || scripts/fetch-models.sh qwen >/dev/null
[ -s "$CACHE/data/HumanEval.jsonl" ] || scripts/fetch-models.sh >/dev/null

prompts() {
  case "$1" in
    humaneval) echo "$CACHE/data/HumanEval.jsonl" ;;
    *) echo "data/prompts/$1.jsonl" ;;
  esac
}

PID=""
stop() { [ -n "$PID" ] && { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true; }; PID=""; }
trap stop EXIT

start() {
  local cfg="$1" log="$OUT/$2.server.log" slots=16
  case "$cfg" in
    engine-none) "$BIN" serve --model "$M" --host 127.0.0.1 --port "$PORT" --speculation none ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    engine-dspark) "$BIN" serve --model "$M" --host 127.0.0.1 --port "$PORT" ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    engine-dspark-alt) "$BIN" serve --model "$M" --host 127.0.0.1 --port "$PORT" \
      --drafters "${ALT_DRAFTERS:?engine-dspark-alt needs ALT_DRAFTERS}" ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    engine-dspark-altbin) "${ALT_ENGINE_BIN:?engine-dspark-altbin needs ALT_ENGINE_BIN}" serve --model "$M" \
      --host 127.0.0.1 --port "$PORT" ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    engine-dspark-nolookup) "$BIN" serve --model "$M" --host 127.0.0.1 --port "$PORT" --prompt-lookup false ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    engine-ngram) "$BIN" serve --model "$M" --host 127.0.0.1 --port "$PORT" --speculation ngram ${ENGINE_ARGS:-} >"$log" 2>&1 & ;;
    llama-*)
      local extra=()
      case "$cfg" in
        llama-draft*) extra=(-md "$D" --spec-type draft-simple --spec-draft-n-max "${cfg#llama-draft}" -ngld 0) ;;
        llama-ngram) extra=(--spec-type ngram-mod) ;;
      esac
      "$LLAMA/llama-server" -m "$M" -t 2 -tb 2 --load-mode none --host 127.0.0.1 --port "$PORT" \
        -np "$slots" -c $((slots * 1024)) "${extra[@]}" >"$log" 2>&1 & ;;
  esac
  PID=$!
  for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 \
       && curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1; then
      [ "${cfg%%-*}" = llama ] || curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || { sleep 0.5; continue; }
      return 0
    fi
    kill -0 "$PID" 2>/dev/null || { tail -20 "$log"; echo "$cfg failed to start" >&2; exit 1; }
    sleep 0.5
  done
  echo "$cfg did not become ready" >&2; exit 1
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/load.txt"
for round in $(seq 1 "$ROUNDS"); do
  order=($CONFIGS)
  if [ $((round % 2)) -eq 0 ]; then order=($(printf '%s\n' "${order[@]}" | tac)); fi
  for cfg in "${order[@]}"; do
    tag="r$round-$cfg"
    echo "== round $round: $cfg ($(date +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
    start "$cfg" "$tag"
    for set in $SETS; do
      python3 bench/loadgen.py --url "http://127.0.0.1:$PORT" --model auto \
        --concurrency "$LEVELS" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
        --temperature "$TEMPERATURE" --seed "$round" --prompts "$(prompts "$set")" \
        --request-timeout 600 --json-out "$OUT/$tag-$set.json" | tail -n +3
    done
    [ "${cfg%%-*}" = engine ] && curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/$tag.metrics" || true
    stop
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
python3 bench/qwen_spec_report.py "$OUT" | tee "$OUT/report.md"
