# DSpark-on-Kubernetes. `make demo` serves the embedded default model; `make test` runs
# every test. Caches live outside the repo in $(DSPARK_CACHE).
SHELL := /bin/bash
DSPARK_CACHE ?= $(HOME)/.cache/dspark
export DSPARK_CACHE
# Build outputs are cached outside the repo too, so a fresh clone (CI) reuses them.
CARGO_TARGET_DIR ?= $(DSPARK_CACHE)/cargo-target
export CARGO_TARGET_DIR
DSPARK_ENGINE_BIN ?= $(CARGO_TARGET_DIR)/release/dspark-engine
export DSPARK_ENGINE_BIN
MODEL ?= $(DSPARK_CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
# `make demo MODEL=qwen2.5-coder-1.5b`: the real-size target (1.1 GB, fetched on first use)
# with its shipped drafter.
FETCH_SET ?= default
ifeq ($(MODEL),qwen2.5-coder-1.5b)
override MODEL := $(DSPARK_CACHE)/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
FETCH_SET := qwen
endif
PORT ?= 8000
CARGO ?= cargo

.PHONY: demo test setup build lint unit python-test cluster-up cluster-down print-kubeconfig e2e images images-test cuda-build

build:
	scripts/build-deps.sh
	scripts/claim-target-dir.sh
	$(CARGO) build --release --workspace

setup:
	scripts/setup.sh

demo: build
	scripts/fetch-models.sh $(FETCH_SET)
	scripts/demo.sh "$(MODEL)" "$(PORT)"

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

# Unit and integration tests; the operator's cluster tests run against the local control
# plane (built once from Go modules, cached), which is brought up for them and torn down. The
# chart test runs the operator FROM its image: built, pushed to the loopback registry and
# installed by digest (DSPARK_CHART_OPERATOR_IMAGE), run by the test kubelet through runc.
# DSPARK_REQUIRE_REFERENCE=1: the DeepSpec / DFlash reference tests fail, not skip, when
# scripts/setup-reference.sh (run by `make setup`) could not provide their environment.
unit:
	tests/cluster/cluster.sh up
	set -o pipefail; trap 'tests/cluster/cluster.sh down; tests/registry/registry.sh down' EXIT; \
	  tests/registry/registry.sh up; \
	  DSPARK_IMAGES_OUT="$(DSPARK_CACHE)/images/unit" scripts/images.sh push "$$(tests/registry/registry.sh addr)" operator; \
	  . "$(DSPARK_CACHE)/images/unit/digests.env"; \
	  eval "$$(tests/cluster/cluster.sh env)"; \
	  DSPARK_CHART_OPERATOR_IMAGE="$$OPERATOR_IMAGE" DSPARK_REQUIRE_CLUSTER=1 DSPARK_REQUIRE_REFERENCE=1 \
	    $(CARGO) test --release --workspace --no-fail-fast

python-test:
	python3 -m pytest -q tests/python tests/otel

test: setup build lint unit python-test e2e cuda-build images-test

cluster-up:
	tests/cluster/cluster.sh up

cluster-down:
	tests/cluster/cluster.sh down

print-kubeconfig:
	@tests/cluster/cluster.sh kubeconfig

# End-to-end on the local control plane with the test kubelet running every container FROM
# this tree's images (built, pushed to a loopback registry, run by digest through runc): helm
# install of the chart (the operator image as a pod), a two-pool DSparkDeployment served by
# engine containers, profiling, cost tables, load -> scale up -> scale down, deletion. Prints a
# timeline; DSPARK_E2E_KEEP=1 leaves the cluster up. See docs/operations.md.
e2e: build
	tests/e2e/e2e.sh

# OCI images (operator, engine) built by buildah from images/*/Containerfile on minimal bases
# assembled from Debian packages; into buildah's storage under $(DSPARK_CACHE)/containers.
# `scripts/images.sh push|oci` pushes them to a registry or writes an OCI layout.
images: build
	scripts/images.sh build

# The images end to end without a cluster: push to a real registry on loopback
# (tests/registry), pull by digest with skopeo, run the engine with runc as its pod would
# (uid 65532, read-only root, /tmp volume, model mounted) and check /health and a completion;
# the engine-cuda image (after `make cuda-build`) must load every library but the driver's.
images-test: build
	tests/images/run-images.sh

# The engine with --features cuda, compiled against a CUDA toolkit from PyPI wheels (no GPU or
# driver needed; it only compiles). In `make test` before images-test: it shares the CPU build's
# target dir, so a cold run compiles only the CUDA-specific crates (~8 min on 2 cores) and later
# runs rebuild only what changed.
# Then `scripts/images.sh build engine-cuda` makes the CUDA image. See docs/operations.md.
cuda-build:
	scripts/cuda-build.sh
