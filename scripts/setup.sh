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

step "reference drafter code (DeepSpec, z-lab DFlash) and its PyTorch venv"
scripts/setup-reference.sh

step "models"
scripts/fetch-models.sh all

step "llama.cpp peer"
scripts/setup-peer.sh

step "llama.cpp references"
# Default llama.cpp (f16 KV cache) and, as the noise floor, llama.cpp with an f32 KV cache.
for m in SmolLM2-135M-Instruct.Q4_1 gemma-3-270m-Q4_K_M; do
  for kv in f16 f32; do
    suffix=""; [ "$kv" = f16 ] || suffix=".kv-$kv"
    if [ ! -s "$CACHE/reference/$m$suffix.json" ]; then
      "$PY" tests/peer/reference.py --model "$CACHE/models/$m.gguf" --kv-type "$kv"
    else
      echo "reference $m$suffix present"
    fi
  done
done
# The real-size target (Qwen2.5-Coder-1.5B, 1.1 GB): every second prompt of the set (all
# domains, >= 2000 positions) keeps the two llama.cpp passes near a minute each.
m=qwen2.5-coder-1.5b-instruct-q4_k_m
for kv in f16 f32; do
  suffix=""; [ "$kv" = f16 ] || suffix=".kv-$kv"
  if [ ! -s "$CACHE/reference/$m$suffix.json" ]; then
    "$PY" tests/peer/reference.py --model "$CACHE/models/$m.gguf" --kv-type "$kv" --every 2
  else
    echo "reference $m$suffix present"
  fi
done

step "prometheus (tests/otel)"
# Debian's package: prometheus + promtool for tests/otel (scrapes a real engine, checks every
# PromQL expression of config/grafana and config/prometheus). Installed without starting the
# packaged service (it would listen on all interfaces): a policy-rc.d that denies starts is
# put in place for the install when the machine has none.
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  echo "prometheus present ($(prometheus --version 2>&1 | head -n 1))"
else
  policy_created=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    policy_created=1
  fi
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; }
  apt_install || { apt-get update && apt_install; }
  if [ "$policy_created" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
  fi
fi

step "image tools (scripts/images.sh, tests/images)"
# Daemonless OCI tools from Debian: buildah builds the images, skopeo pulls them by digest,
# umoci unpacks them into a bundle, runc/crun run them.
missing=()
for t in buildah skopeo umoci runc crun; do command -v "$t" >/dev/null || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt_tools() { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; }
  apt_tools || { apt-get update && apt_tools; }
else
  echo "buildah skopeo umoci runc crun present"
fi

step "OCI registry (tests/registry)"
# The CNCF distribution registry, built once from Go modules into
# ${DSPARK_CACHE}/registry/<key>/bin/registry (~5 min cold on 2 cores; cached key: instant).
if command -v go >/dev/null; then
  tests/registry/registry.sh build
else
  echo "go not found: skipping the registry build (make images-test will fail)"
fi

step "opentelemetry collector (tests/otel)"
# Built once from Go modules into ${DSPARK_CACHE}/otel/<key>/bin/otelcol (2.5-5 min cold on
# 2 cores; a cached key returns at once).
if command -v go >/dev/null; then
  tests/otel/otelcol.sh build
else
  echo "go not found: skipping the collector build (tests/otel/test_collector.py will fail)"
fi
