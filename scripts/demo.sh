#!/usr/bin/env bash
# Serves MODEL on 127.0.0.1:PORT, shows a sample chat answer and how to query the server,
# then keeps serving until Ctrl-C. DEMO_ONESHOT=1 stops after the sample answer.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$1"; PORT="${2:-8000}"
BIN="${DSPARK_ENGINE_BIN:-target/release/dspark-engine}"
LOG="$(mktemp -t dspark-demo.XXXXXX.log)"
# Speculation as `serve` picks it by default: the model's shipped drafter from drafters/
# (found by the `target_models` of its manifest), the dspark policy, the drafter's own block.
# DEMO_SPECULATION=none (or ngram, ...) overrides.
SPEC=()
if [ -n "${DEMO_SPECULATION:-}" ]; then
  SPEC=(--speculation "$DEMO_SPECULATION")
fi
"$BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" "${SPEC[@]}" >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $PID 2>/dev/null || { cat "$LOG"; echo "engine failed to start"; exit 1; }
  sleep 0.2
done
grep -m1 "^dspark-engine .* serving" "$LOG" || true
curl -s "http://127.0.0.1:$PORT/ready" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("speculation:", r["speculation"], "| policy:", r["policy"], "| block:", r.get("gamma"), "(DEMO_SPECULATION=none to disable)" if r["speculation"] != "none" else "")' || true
REQ='{"model":"default","messages":[{"role":"user","content":"Write a Python function that checks whether a number is prime."}],"max_tokens":120,"temperature":0}'
echo
echo "Sample request: $REQ"
echo
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' -d "$REQ" |
  python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["choices"][0]["message"]["content"]); print("\nusage:", r["usage"])'
cat <<EOT

Query it yourself (OpenAI-compatible):
  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"default","messages":[{"role":"user","content":"Hello!"}],"stream":true}'
  python3 -c 'import openai; c=openai.OpenAI(base_url="http://127.0.0.1:$PORT/v1", api_key="x"); print(c.chat.completions.create(model="default", messages=[{"role":"user","content":"Hi"}]).choices[0].message.content)'
Metrics: http://127.0.0.1:$PORT/metrics   Probes: /health /ready
EOT
[ "${DEMO_ONESHOT:-0}" = 1 ] && exit 0
echo "Serving until Ctrl-C (log: $LOG)"
wait $PID
