#!/usr/bin/env bash
# Trains the DSpark drafter of Qwen2.5-Coder-1.5B-Instruct (issue #50) on this machine's
# CPUs, resumably, and writes it as a shippable drafter folder:
#   1. data: the target's own greedy answers (160 new tokens at most) to 800 prompts of
#      data/prompts/train-magpie2.jsonl (500 code, 150 math, 150 chat; seeded sample; none of
#      HumanEval or the held-out sets data/prompts/{code,math,chat}.jsonl), with the hidden
#      states of its layers 1, 14, 27 and the top-20 next-token probabilities;
#   2. training: one drafter layer started from the target's last layer (MLP 2,048 wide: its
#      strongest neurons), the context fed to every block row, an 8,192-token draft
#      vocabulary with a compact W1, blocks of 7, AdamW with warm-up + cosine;
#   3. more data for the second stage: the target's answers to HumanEval-shaped prompts
#      made from documented standard-library functions (data/prompts/make_function_prompts.py:
#      FN wrapped as data/prompts/code.jsonl has them, FNRAW bare as bench/loadgen.py sends
#      HumanEval; no HumanEval entry point or line), and a second magpie sample (MIX2, none of
#      the first's prompts);
#   4. a second stage from the first checkpoint on all of the data (fresh warm-up + cosine,
#      lower peak rate);
#   5. STS calibration of the confidence head on the held-out 10 % of every dataset.
# Every stage is skipped when its output exists, and training resumes from its last
# checkpoint (every 25 steps), so the script can be stopped and re-run (niced) at will.
#
# Usage: scripts/train-qwen-drafter.sh WORK_DIR [OUT_DRAFTER_DIR]
# Env: MIX (prompts per domain, default code=500,math=150,chat=150), STEPS (default 715),
#      MIX2 (code=100,math=60,chat=100), FN (400), FNRAW (160), SEQS (4), ANCHORS (24),
#      LR (1.5e-3), STEPS2 (1500), LR2 (1e-3), GEN_BATCH (32),
#      DSPARK_TRAIN_BIN (default: the workspace's release dspark-train).
# Wall time on 2 AVX2-only Zen 3 cores (docs/benchmarks.md, sessions 38-39): data 98 min
# for 159,067 tokens on the ggml-layout AVX2 kernels (27 tok/s; the packed AVX2 K-quant
# kernels of session 39 write ~50 tok/s), training 2.8 s per step of 96 blocks (715 steps:
# 45 min); session 42: the function prompts 60-70 answer tokens/s (400 in 1,619 s), training
# 2.0 s per step on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK="${1:?usage: scripts/train-qwen-drafter.sh WORK_DIR [OUT_DRAFTER_DIR]}"
OUT="${2:-drafters/qwen2.5-coder-1.5b-dspark-markov}"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
BIN="${DSPARK_TRAIN_BIN:-${CARGO_TARGET_DIR:-$CACHE/cargo-target}/release/dspark-train}"
M="$CACHE/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
STEPS="${STEPS:-715}"; SEQS="${SEQS:-4}"; ANCHORS="${ANCHORS:-24}"; LR="${LR:-1.5e-3}"
STEPS2="${STEPS2:-1500}"; LR2="${LR2:-1e-3}"
mkdir -p "$WORK"
[ -s "$M" ] || scripts/fetch-models.sh qwen >/dev/null

# A seeded magpie sample per domain; a second sample (seed 51) leaves out the first's prompts.
sample() {  # OUT MIX [EARLIER]
  python3 - "$@" <<'EOF'
import json, random, sys
used = {json.loads(l)["id"] for l in open(sys.argv[3])} if len(sys.argv) > 3 else set()
rs = [r for r in map(json.loads, open("data/prompts/train-magpie2.jsonl")) if r["id"] not in used]
random.seed(51 if used else 50)
out = []
for d, n in (kv.split("=") for kv in sys.argv[2].split(",")):
    out += random.sample([r for r in rs if r["domain"] == d], int(n))
random.shuffle(out)
with open(sys.argv[1], "w") as f:
    for r in out:
        f.write(json.dumps(r) + "\n")
EOF
}
gen() {  # PROMPTS DATASET: the target's answers, once
  [ -s "$2/meta.json" ] || "$BIN" train --model "$M" --prompts "$1" --dataset "$2" \
    --generate-only --gen-batch "${GEN_BATCH:-32}" --max-new-tokens 160
}
ARCH=(--head dspark-markov --seqs-per-step "$SEQS" --anchors "$ANCHORS" --block-size 7
  --intermediate 2048 --init-from-target --context-input --draft-vocab 8192 --compact-w1
  --rank 256 --save-every 25)

[ -s "$WORK/prompts.jsonl" ] || sample "$WORK/prompts.jsonl" "${MIX:-code=500,math=150,chat=150}"
gen "$WORK/prompts.jsonl" "$WORK/dataset"
"$BIN" train --model "$M" --dataset "$WORK/dataset" --out "$WORK/run" --steps "$STEPS" \
  --lr "$LR" "${ARCH[@]}"

[ -s "$CACHE/data/HumanEval.jsonl" ] || scripts/fetch-models.sh >/dev/null
EXCL=(--exclude "$CACHE/data/HumanEval.jsonl" --exclude data/prompts/code.jsonl)
[ -s "$WORK/fn-prompts.jsonl" ] || python3 data/prompts/make_function_prompts.py \
  --out "$WORK/fn-prompts.jsonl" --count "${FN:-400}" --seed 3 "${EXCL[@]}"
[ -s "$WORK/fnraw-prompts.jsonl" ] || python3 data/prompts/make_function_prompts.py \
  --out "$WORK/fnraw-prompts.jsonl" --count "${FNRAW:-160}" --seed 4 --raw \
  --skip "$WORK/fn-prompts.jsonl" "${EXCL[@]}"
[ -s "$WORK/prompts2.jsonl" ] ||
  sample "$WORK/prompts2.jsonl" "${MIX2:-code=100,math=60,chat=100}" "$WORK/prompts.jsonl"
gen "$WORK/fn-prompts.jsonl" "$WORK/fn"
gen "$WORK/prompts2.jsonl" "$WORK/dataset2"
gen "$WORK/fnraw-prompts.jsonl" "$WORK/fnraw"
ALL="$WORK/dataset,$WORK/fn,$WORK/dataset2,$WORK/fnraw"
"$BIN" train --model "$M" --dataset "$ALL" --out "$WORK/run2" --init "$WORK/run" \
  --steps "$STEPS2" --lr "$LR2" "${ARCH[@]}"
"$BIN" calibrate --model "$M" --drafter "$WORK/run2" --dataset "$ALL" \
  --anchors "$ANCHORS" --json "$WORK/sts.json"
mkdir -p "$OUT"
cp "$WORK/run2/config.json" "$WORK/run2/model.safetensors" "$OUT/"
echo "drafter written to $OUT (update its manifest.json: sha256, data, budget, sts)"
