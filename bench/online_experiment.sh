#!/bin/bash
# The online on/off experiment as a benchmark: one server alternates `dspark` and `none`
# window by window (`serve --policy-experiment dspark,none`) under a closed-loop load at one
# concurrency level, so a drifting machine hits both arms alike; `dspark-engine
# experiment-report` then pairs each window with the neighbouring `none` window of closest
# load and prints the throughput ratio with a 95 % confidence interval.
#
#   bench/online_experiment.sh STREAMS SECONDS WINDOW OUT [loadgen args...]
#
# Env: DSPARK_ENGINE_BIN (default target/release/dspark-engine), MODEL (default the embedded
# SmolLM2 GGUF), DRAFTER, COST_TABLE (a `dspark-engine profile` table; else the start-up
# profile), PROMPTS (default tests/peer/prompts.jsonl), MAX_RUNNING (128), PORT (18400).
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,13p "$0"; exit 2; }
STREAMS=$1 SECS=$2 WINDOW=$3 OUT=$4
shift 4
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${DSPARK_ENGINE_BIN:-$ROOT/target/release/dspark-engine}
MODEL=${MODEL:-$HOME/.cache/dspark/models/SmolLM2-135M-Instruct.Q4_1.gguf}
DRAFTER=${DRAFTER:-$ROOT/drafters/smollm2-135m-dspark-markov}
PROMPTS=${PROMPTS:-$ROOT/tests/peer/prompts.jsonl}
PORT=${PORT:-18400}
mkdir -p "$OUT"
TABLE=()
[ -n "${COST_TABLE:-}" ] && TABLE=(--cost-table "$COST_TABLE")
"$BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name bench \
  --max-running "${MAX_RUNNING:-128}" --speculation dspark-markov --drafter "$DRAFTER" \
  --policy dspark --gamma 7 --policy-experiment dspark,none --experiment-window "$WINDOW" \
  "${TABLE[@]}" > "$OUT/serve-c$STREAMS.log" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break
  kill -0 $PID 2> /dev/null || { cat "$OUT/serve-c$STREAMS.log"; exit 1; }
  sleep 1
done
python3 "$ROOT/bench/loadgen.py" --url "http://127.0.0.1:$PORT" --model bench \
  --concurrency "$STREAMS" --duration "$SECS" --max-tokens 256 --warmup "$STREAMS" \
  --prompts "$PROMPTS" "$@" | tee "$OUT/loadgen-c$STREAMS.txt"
curl -sf "http://127.0.0.1:$PORT/experiment" > "$OUT/experiment-c$STREAMS.json"
"$BIN" experiment-report --file "$OUT/experiment-c$STREAMS.json" | tee "$OUT/report-c$STREAMS.txt"
