#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, idempotently, with caches outside
# the repository (${DSPARK_CACHE:-~/.cache/dspark}): Rust components, Python test packages,
# the real models, the llama.cpp peer (built from the PyPI sdist) and its teacher-forced
# references.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PY="${PYTHON:-python3}"

step() { printf '\n== %s\n' "$*"; }

step "rust components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "python test packages"
"$PY" -m pip install -q -r tests/python/requirements.txt -r bench/requirements.txt

step "models"
scripts/fetch-models.sh

step "llama.cpp peer"
scripts/setup-peer.sh

step "llama.cpp references"
for m in SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-Q4_K_M; do
  if [ ! -s "$CACHE/reference/$m.json" ]; then
    "$PY" tests/peer/reference.py --model "$CACHE/models/$m.gguf"
  else
    echo "reference $m present"
  fi
done
