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
#   3. a second stage from that checkpoint (fresh warm-up + cosine, lower peak rate);
#   4. STS calibration of the confidence head on the held-out 10 % of the data.
# Every stage is skipped when its output exists, and training resumes from its last
# checkpoint (every 25 steps), so the script can be stopped and re-run (niced) at will.
#
# Usage: scripts/train-qwen-drafter.sh WORK_DIR [OUT_DRAFTER_DIR]
# Env: MIX (prompts per domain, default code=500,math=150,chat=150), STEPS (default 715),
#      SEQS (4), ANCHORS (24), LR (1.5e-3), STEPS2 (1500), LR2 (1e-3), GEN_BATCH (32),
#      DSPARK_TRAIN_BIN (default: the workspace's release dspark-train).
# Wall time on 2 AVX2-only Zen 3 cores (docs/benchmarks.md, sessions 38-39): data 98 min
# for 159,067 tokens on the ggml-layout AVX2 kernels (27 tok/s; the packed AVX2 K-quant
# kernels of session 39 write ~50 tok/s), training 2.8 s per step of 96 blocks (715 steps:
# 45 min).
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

if [ ! -s "$WORK/prompts.jsonl" ]; then
  python3 - "$WORK/prompts.jsonl" "${MIX:-code=500,math=150,chat=150}" <<'EOF'
import json, random, sys
rs = [json.loads(l) for l in open("data/prompts/train-magpie2.jsonl")]
random.seed(50)
out = []
for d, n in (kv.split("=") for kv in sys.argv[2].split(",")):
    out += random.sample([r for r in rs if r["domain"] == d], int(n))
random.shuffle(out)
with open(sys.argv[1], "w") as f:
    for r in out:
        f.write(json.dumps(r) + "\n")
EOF
fi
if [ ! -s "$WORK/dataset/meta.json" ]; then
  "$BIN" train --model "$M" --prompts "$WORK/prompts.jsonl" --dataset "$WORK/dataset" \
    --generate-only --gen-batch "${GEN_BATCH:-32}" --max-new-tokens 160
fi
"$BIN" train --model "$M" --dataset "$WORK/dataset" --out "$WORK/run" --head dspark-markov \
  --steps "$STEPS" --seqs-per-step "$SEQS" --anchors "$ANCHORS" --block-size 7 --lr "$LR" \
  --intermediate 2048 --init-from-target --context-input --draft-vocab 8192 --compact-w1 \
  --rank 256 --save-every 25
"$BIN" train --model "$M" --dataset "$WORK/dataset" --out "$WORK/run2" --init "$WORK/run" \
  --head dspark-markov --steps "$STEPS2" --seqs-per-step "$SEQS" --anchors "$ANCHORS" \
  --block-size 7 --lr "$LR2" --intermediate 2048 --init-from-target --context-input \
  --draft-vocab 8192 --compact-w1 --rank 256 --save-every 25
"$BIN" calibrate --model "$M" --drafter "$WORK/run2" --dataset "$WORK/dataset" \
  --anchors "$ANCHORS" --json "$WORK/sts.json"
mkdir -p "$OUT"
cp "$WORK/run2/config.json" "$WORK/run2/model.safetensors" "$OUT/"
echo "drafter written to $OUT (update its manifest.json: sha256, data, budget, sts)"
