#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU (the `device` tool, when a session is
# lent one: check `status` first, run it once, keep the report). That machine gets the working
# tree plus at most 64 MiB of carried files and has no network: no model can travel (SmolLM2's
# GGUF is 98 MB), so scripts/gpu_check.py writes random-weight models of real shapes there, and
# the engine travels as the stripped, xz-compressed CUDA build (~12 MB).
#
#   scripts/gpu-check.sh prepare   here: scripts/cuda-build.sh (cached), strip + xz the binary
#                                  into .gpu/ (ignored by git; carry it: carry=[".gpu"])
#   scripts/gpu-check.sh run       there: unpack, put the CUDA libraries on the library path (the
#                                  toolkit's or the nvidia-* Python wheels'; libcuda.so.1 is the
#                                  driver's), run scripts/gpu_check.py; report in $OUT/gpu-check.md
#
# On the device: run(command="scripts/gpu-check.sh run", carry=[".gpu"], timeout_s=600).
# Dry run without a GPU (the whole path, CPU against CPU, tiny shapes):
#   GPU_CHECK_BIN=$CARGO_TARGET_DIR/release/dspark-engine GPU_CHECK_DEVICE=cpu \
#   GPU_CHECK_SHAPES=tiny,tiny OUT=/tmp/gpu-check-out scripts/gpu-check.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '[gpu-check] %s\n' "$*" >&2; }

case "${1:-run}" in
  prepare)
    # Always through cargo: its fingerprints rebuild what changed and skip the rest.
    scripts/cuda-build.sh
    bin="$(scripts/cuda-build.sh target)/release/dspark-engine"
    mkdir -p .gpu
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    strip -o .gpu/dspark-engine "$bin"
    xz -T0 -6 -f .gpu/dspark-engine
    log "carry .gpu: $(du -h .gpu/dspark-engine.xz | cut -f1) ($(git rev-parse --short HEAD))"
    ;;
  run)
    OUT="${OUT:-/tmp/gpu-check-out}"
    WORK="${GPU_CHECK_WORK:-/tmp/gpu-check}"
    mkdir -p "$OUT" "$WORK"
    BIN="${GPU_CHECK_BIN:-}"
    if [ -z "$BIN" ]; then
      [ -s .gpu/dspark-engine.xz ] || { log "no .gpu/dspark-engine.xz: run 'scripts/gpu-check.sh prepare' here and carry .gpu"; exit 2; }
      xz -dc .gpu/dspark-engine.xz >"$WORK/dspark-engine"
      chmod +x "$WORK/dspark-engine"
      BIN="$WORK/dspark-engine"
    fi
    # The CUDA user-space libraries the binary links (the driver's libcuda.so.1 is found by the
    # system loader): the first directory that holds each.
    LIBS="$("${PYTHON:-python3}" - <<'PY'
import glob, os, site, sys
want = ["libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libnvrtc.so.13"]
roots = ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"] + site.getsitepackages()
dirs = []
for w in want:
    for r in roots:
        hits = glob.glob(os.path.join(r, "**", w), recursive=True)
        if hits:
            d = os.path.dirname(hits[0])
            if d not in dirs:
                dirs.append(d)
            break
    else:
        print(f"[gpu-check] {w} not found", file=sys.stderr)
print(":".join(dirs))
PY
)"
    export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    { uname -a; nproc; ldd "$BIN"; "$BIN" --version; } >"$OUT/env.txt" 2>&1 || true
    log "binary $BIN; libraries from ${LIBS:-the system}"
    PYTHONUNBUFFERED=1 "${PYTHON:-python3}" scripts/gpu_check.py --bin "$BIN" --work "$WORK" --out "$OUT"
    ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
