#!/usr/bin/env bash
# Measure the llama.cpp peer on a GGUF, on this machine:
#   1. llama-bench: tg128 single stream, and pp B for B in 1..64 (one forward of B tokens at
#      empty context -> steps/s = t/s / B, a first approximation of SPS(B));
#   2. llama-batched-bench: B parallel sequences after a short shared prompt (PP=32), TG=32
#      decode steps each -> SPS(B) = S_TG / B (one forward with B new tokens, short context:
#      the quantity in docs "cost structure");
#   3. llama-server (-np 32 slots, continuous batching, 127.0.0.1 only, 2 threads) driven by
#      bench/loadgen.py at 1/4/16/32 concurrent streams (closed loop). The server is stopped
#      at the end (also on error/interrupt).
# Binaries come from scripts/setup-peer.sh ($DSPARK_CACHE/llama.cpp/<version>/bin).
#
# Usage: bench/peer-llamacpp.sh MODEL.gguf
# Env (defaults): THREADS=2  DURATION=30 (s per loadgen level)  MAX_TOKENS=128
#   LEVELS=1,4,16,32  NP=32 (server slots)  CTX_PER_SLOT=1024  PORT (free port from 18080)
#   REPS=3 (llama-bench repetitions)  SKIP_BENCH=1 / SKIP_SERVER=1  LOADGEN_EXTRA
#   (default "--ignore-eos": fixed-length outputs)  OUT_DIR (default
#   $DSPARK_CACHE/bench/<model stem>-<timestamp>)  LLAMA_CPP_PY_VERSION=0.3.36
#   CHAT_TEMPLATE (passed as --chat-template; the Gemma 3 270M GGUF has no template, so
#   llama-server would fall back to ChatML: use CHAT_TEMPLATE=gemma for it)
# Run it on a quiet machine: the script warns when the load average says otherwise. On a
# shared machine, OMP_WAIT_POLICY=passive (inherited by the llama.cpp binaries) stops its
# OpenMP workers from spinning and makes the numbers far less bad, but it is not the
# quiet-machine configuration; say which one you ran.
set -euo pipefail

MODEL="${1:?usage: bench/peer-llamacpp.sh MODEL.gguf}"
[[ -f "$MODEL" ]] || { echo "no such model: $MODEL" >&2; exit 2; }
HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
V="${LLAMA_CPP_PY_VERSION:-0.3.36}"
BIN="${LLAMA_CPP_BIN:-$CACHE/llama.cpp/$V/bin}"
THREADS="${THREADS:-2}"
DURATION="${DURATION:-30}"
MAX_TOKENS="${MAX_TOKENS:-128}"
LEVELS="${LEVELS:-1,4,16,32}"
NP="${NP:-32}"
CTX_PER_SLOT="${CTX_PER_SLOT:-1024}"
REPS="${REPS:-3}"
LOADGEN_EXTRA="${LOADGEN_EXTRA---ignore-eos}"
STEM="$(basename "$MODEL" .gguf)"
OUT_DIR="${OUT_DIR:-$CACHE/bench/$STEM-$(date +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

for t in llama-bench llama-batched-bench llama-server; do
  [[ -x "$BIN/$t" ]] || { echo "missing $BIN/$t: run scripts/setup-peer.sh" >&2; exit 2; }
done
log() { printf '\n[peer %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
log "model $MODEL; llama.cpp from llama-cpp-python $V; threads $THREADS; results in $OUT_DIR"
log "OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-<unset>}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
# llama.cpp's worker threads spin at barriers: with other work on the cores, its numbers
# collapse (measured 7 tok/s instead of ~150 single-stream at load 7 on 2 cores).
read -r LOAD1 _ < /proc/loadavg
if awk -v l="$LOAD1" -v n="$(nproc)" 'BEGIN { exit !(l > 0.5 * n) }'; then
  echo "[peer] WARNING: load average $LOAD1 on $(nproc) cores: other work is running; these" \
       "numbers will understate llama.cpp badly. Re-run on a quiet machine." >&2
fi

if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  # ---- 1. llama-bench -------------------------------------------------------------------
  log "llama-bench tg128 and pp1..64 (-t $THREADS, -r $REPS)"
  "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -r "$REPS" -p 0 -n 128 -o jsonl \
    > "$OUT_DIR/llama-bench-tg.jsonl" 2> "$OUT_DIR/llama-bench-tg.log"
  "$BIN/llama-bench" -m "$MODEL" -t "$THREADS" -r "$REPS" -p 1,2,4,8,16,32,64 -n 0 -o jsonl \
    > "$OUT_DIR/llama-bench-pp.jsonl" 2> "$OUT_DIR/llama-bench-pp.log"
  # ---- 2. llama-batched-bench -----------------------------------------------------------
  log "llama-batched-bench PP=32 (shared) TG=32, B=1..64"
  "$BIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -c 4096 -b 2048 -ub 512 \
    -npp 32 -ntg 32 -npl 1,2,4,8,16,32,64 -pps --output-format jsonl \
    > "$OUT_DIR/batched-bench.log" 2>&1
  grep '^{' "$OUT_DIR/batched-bench.log" > "$OUT_DIR/batched-bench.jsonl" || true
  "$PY" - "$OUT_DIR" <<'EOF'
import json, sys, os
d = sys.argv[1]
rd = lambda f: [json.loads(l) for l in open(os.path.join(d, f)) if l.startswith("{")]
tg = rd("llama-bench-tg.jsonl")
pp = rd("llama-bench-pp.jsonl")
bb = rd("batched-bench.jsonl")
print("\n### llama-bench single stream\n")
print("| test | t/s | stddev |\n|---|---:|---:|")
for r in tg:
    print(f"| tg{r['n_gen']} | {r['avg_ts']:.1f} | {r['stddev_ts']:.1f} |")
print("\n### SPS(B): forward steps per second with B new tokens\n")
print("| B | llama-bench pp B: t/s | SPS = t/s / B | batched-bench S_TG t/s | SPS = S_TG / B |")
print("|---:|---:|---:|---:|---:|")
ppb = {r["n_prompt"]: r["avg_ts"] for r in pp}
bbb = {r["pl"]: r["speed_tg"] for r in bb}
summary = {"tg": {f"tg{r['n_gen']}": r["avg_ts"] for r in tg}, "pp_ts": ppb, "batched_tg_ts": bbb}
for b in sorted(set(ppb) | set(bbb)):
    a = ppb.get(b); c = bbb.get(b)
    f = lambda x, nd=1: "-" if x is None else f"{x:.{nd}f}"
    print(f"| {b} | {f(a)} | {f(a / b if a else None)} | {f(c)} | {f(c / b if c else None)} |")
json.dump(summary, open(os.path.join(d, "bench-summary.json"), "w"), indent=1)
EOF
fi

if [[ "${SKIP_SERVER:-0}" != 1 ]]; then
  # ---- 3. llama-server + loadgen --------------------------------------------------------
  PORT="${PORT:-$("$PY" - <<'EOF'
import socket
for p in range(18080, 18180):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); s.close(); print(p); break
    except OSError:
        s.close()
EOF
)}"
  CTX=$(( NP * CTX_PER_SLOT ))
  log "llama-server on 127.0.0.1:$PORT (-np $NP -c $CTX -t $THREADS)"
  "$BIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -np "$NP" -c "$CTX" \
    -t "$THREADS" -tb "$THREADS" --no-webui ${CHAT_TEMPLATE:+--chat-template "$CHAT_TEMPLATE"} \
    > "$OUT_DIR/llama-server.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then break; fi
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT_DIR/llama-server.log" >&2; exit 1; }
    sleep 0.5
  done
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server not healthy" >&2; exit 1; }
  PNG_ARGS=()
  if "$PY" -c 'import matplotlib' 2>/dev/null; then PNG_ARGS=(--png "$OUT_DIR/loadgen.png"); fi
  log "loadgen: concurrency $LEVELS, ${DURATION}s per level, max_tokens $MAX_TOKENS $LOADGEN_EXTRA"
  # shellcheck disable=SC2086
  "$PY" "$HERE/loadgen.py" --url "http://127.0.0.1:$PORT" --model "$STEM" \
    --concurrency "$LEVELS" --duration "$DURATION" --max-tokens "$MAX_TOKENS" \
    --json-out "$OUT_DIR/loadgen.json" "${PNG_ARGS[@]}" --title "llama-server $STEM" \
    $LOADGEN_EXTRA
  log "stopping llama-server (pid $SERVER_PID)"
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  trap - EXIT
fi
log "done; results in $OUT_DIR"
