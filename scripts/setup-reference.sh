#!/usr/bin/env bash
# The public reference drafter code and a PyTorch (CPU) environment to run it, for
# engine/tests/reference_drafters.rs, cached outside the repository, idempotently:
# - ${CACHE}/reference-venv: torch + transformers at tests/reference/requirements.txt, from
#   wheels cached in ${CACHE}/wheels/torch (downloaded from PyPI once);
# - ${CACHE}/reference-code/{deepspec,dflash}-<commit>: the modeling files of DeepSeek's
#   DeepSpec (MIT) and z-lab's DFlash at pinned commits, extracted from local git mirrors
#   (${DSPARK_REFERENCE_MIRRORS:-/work/.mirror}/<owner>+<name>/repo); never copied into the repo;
# - ${CACHE}/reference-code/env.json: where those are, read by the test.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PY="${PYTHON:-python3}"
MIRRORS="${DSPARK_REFERENCE_MIRRORS:-/work/.mirror}"
DEEPSPEC_COMMIT=afdfa7c9382a3341a3e6f17756dd816da79f132c
DFLASH_COMMIT=44947fbf71114e241c96de194f4b382b5dd330d0
VENV="$CACHE/reference-venv"
WHEELS="$CACHE/wheels/torch"
REQ=tests/reference/requirements.txt
CODE="$CACHE/reference-code"

# extract OWNER+NAME COMMIT DEST PATH...: the files under PATHs at COMMIT into DEST.
extract() {
  local repo="$1" commit="$2" dest="$3"
  shift 3
  local git_dir="$MIRRORS/$repo/repo"
  if [ -f "$dest/.complete" ]; then
    echo "reference code $repo@${commit:0:10} present"
    return 0
  fi
  if ! git --git-dir="$git_dir" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "no mirror of $repo at $commit under $MIRRORS: cannot extract the reference code" >&2
    return 1
  fi
  rm -rf "$dest.tmp"
  git --git-dir="$git_dir" ls-tree -r --name-only "$commit" -- "$@" | while read -r f; do
    mkdir -p "$dest.tmp/$(dirname "$f")"
    git --git-dir="$git_dir" show "$commit:$f" >"$dest.tmp/$f"
  done
  touch "$dest.tmp/.complete"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
  echo "reference code $repo@${commit:0:10} extracted to $dest"
}

mkdir -p "$CODE"
ok=1
extract deepseek-ai+DeepSpec "$DEEPSPEC_COMMIT" "$CODE/deepspec-$DEEPSPEC_COMMIT" deepspec LICENSE || ok=0
extract z-lab+dflash "$DFLASH_COMMIT" "$CODE/dflash-$DFLASH_COMMIT" dflash LICENSE || ok=0
if [ "$ok" != 1 ]; then
  if [ "${DSPARK_REQUIRE_REFERENCE:-}" = 1 ]; then
    echo "reference drafter code unavailable and DSPARK_REQUIRE_REFERENCE=1: engine/tests/reference_drafters.rs will fail" >&2
    exit 1
  fi
  echo "reference drafter code unavailable: engine/tests/reference_drafters.rs will be skipped (it fails instead under DSPARK_REQUIRE_REFERENCE=1, as in make test)" >&2
  exit 0
fi
if "$VENV/bin/python" -c "import torch, transformers, safetensors" 2>/dev/null; then
  echo "reference venv present ($("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
else
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q -d "$WHEELS" -r "$REQ"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" -r "$REQ"
fi
cat >"$CODE/env.json" <<JSON
{
  "python": "$VENV/bin/python",
  "deepspec": "$CODE/deepspec-$DEEPSPEC_COMMIT",
  "deepspec_commit": "$DEEPSPEC_COMMIT",
  "dflash": "$CODE/dflash-$DFLASH_COMMIT",
  "dflash_commit": "$DFLASH_COMMIT"
}
JSON
