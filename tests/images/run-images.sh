#!/usr/bin/env bash
# The images, end to end without Docker or a cluster: build them (scripts/images.sh), push them
# to a real registry on loopback (tests/registry), pull the engine and the operator back BY
# DIGEST with skopeo, unpack with umoci and run them with runc (or crun) the way a kubelet would for the
# pods the operator writes: user 65532, read-only root, /tmp only through a volume, the model
# mounted read-only, host network namespace, loopback only. Checks the engine's /health and one
# chat completion with the real SmolLM2 model, and that the operator image has no shell.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
MODEL="${MODEL:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PORT="${DSPARK_IMAGES_TEST_PORT:-18431}"
# runc by default: this VM mounts cgroup v1 and v2 side by side ("hybrid"), which Debian 12's
# crun 1.8 refuses ("cgroups in hybrid mode not supported"); OCI_RUNTIME=crun on other hosts.
RUNTIME="${OCI_RUNTIME:-runc}"
export DSPARK_REGISTRY_PORT="${DSPARK_REGISTRY_PORT:-15000}"
RT=("$RUNTIME")
log() { printf '[images-test] %s\n' "$*" >&2; }
die() { printf '[images-test] FAIL: %s\n' "$*" >&2; exit 1; }
for t in skopeo umoci "$RUNTIME" buildah curl python3; do command -v "$t" >/dev/null || die "$t missing"; done
[ -s "$MODEL" ] || die "model $MODEL missing (scripts/fetch-models.sh)"
T0=$SECONDS
WORK="$(mktemp -d /tmp/dspark-images-test.XXXXXX)"
CTR="dspark-images-test-$$"
cleanup() {
  "${RT[@]}" delete -f "$CTR" >/dev/null 2>&1 || true
  tests/registry/registry.sh down || true
  [ "${DSPARK_IMAGES_TEST_KEEP:-0}" = 1 ] && log "kept $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT

tests/registry/registry.sh up
REG="$(tests/registry/registry.sh addr)"
# engine-cuda needs the CUDA build (make cuda-build); DSPARK_IMAGES_TEST_CUDA=0 leaves it out.
NAMES=(operator engine)
[ "${DSPARK_IMAGES_TEST_CUDA:-1}" = 0 ] || NAMES+=(engine-cuda)
DSPARK_IMAGES_OUT="$WORK" scripts/images.sh push "$REG" "${NAMES[@]}" >/dev/null
# shellcheck disable=SC1091
. "$WORK/digests.env"
[[ "$ENGINE_IMAGE" == "$REG"/dspark/engine@sha256:* ]] || die "engine not referenced by digest: $ENGINE_IMAGE"

pull() { # pull REF NAME: REF (by digest) -> OCI layout -> runtime bundle WORK/NAME
  skopeo copy -q --src-tls-verify=false "docker://$1" "oci:$WORK/layout:$2"
  local got; got="$(skopeo inspect --tls-verify=false --format '{{.Digest}}' "docker://$1")"
  [ "$got" = "${1#*@}" ] || die "$2: registry digest $got != ${1#*@}"
  umoci unpack --image "$WORK/layout:$2" "$WORK/$2" >/dev/null
}
pull "$OPERATOR_IMAGE" operator
pull "$ENGINE_IMAGE" engine
log "pulled by digest: $OPERATOR_IMAGE, $ENGINE_IMAGE"

# The operator image: no shell, its entrypoint, labels.
R="$WORK/operator/rootfs"
for sh in bin/sh usr/bin/sh bin/bash usr/bin/bash bin/dash usr/bin/dash; do
  [ ! -e "$R/$sh" ] || die "operator image has a shell: /$sh"
done
[ -x "$R/usr/local/bin/dspark-operator" ] || die "operator binary missing"
cfg="$(skopeo inspect --tls-verify=false --config "docker://$OPERATOR_IMAGE")"
python3 - "$cfg" <<'PY' || die "operator image config"
import json, sys
c = json.loads(sys.argv[1]); cc = c["config"]
assert c["architecture"] == "amd64" and c["os"] == "linux", c
assert cc["User"] == "65532:65532", cc["User"]
assert cc["Entrypoint"] == ["/usr/local/bin/dspark-operator"], cc
l = cc["Labels"]
assert l["org.opencontainers.image.version"] and len(l["org.opencontainers.image.revision"]) >= 40, l
PY

# The engine as the operator's pod spec runs it (command dspark-engine serve ..., uid 65532,
# readOnlyRootFilesystem, an emptyDir at /tmp, the model volume read-only).
mkdir -p "$WORK/tmpvol" && chown 65532:65532 "$WORK/tmpvol"
# pod_bundle NAME [SRC:DST ...]: the bundle's config.json as a pod's container: the image's own
# environment, `dspark-engine serve` of the model on $PORT, extra read-only binds SRC -> DST.
pod_bundle() {
python3 - "$WORK/$1/config.json" "$MODEL" "$WORK/tmpvol" "$PORT" "${@:2}" <<'PY'
import json, sys
path, model, tmp, port, *binds = sys.argv[1:]
s = json.load(open(path))
p = s["process"]
p["terminal"] = False
p["args"] = ["dspark-engine", "serve", "--model", "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
             "--host", "127.0.0.1", "--port", port]
p["user"] = {"uid": 65532, "gid": 65532}
p["cwd"] = "/"
p["noNewPrivileges"] = True
p.setdefault("capabilities", {})
for k in ("bounding", "effective", "inheritable", "permitted", "ambient"):
    p["capabilities"][k] = []
s["root"]["readonly"] = True
s["hostname"] = "engine"
s["mounts"] = [m for m in s["mounts"] if m["destination"] != "/tmp"] + [
    {"destination": "/tmp", "type": "bind", "source": tmp, "options": ["rbind", "rw"]},
    {"destination": "/models/SmolLM2-135M-Instruct.Q4_1.gguf", "type": "bind", "source": model, "options": ["rbind", "ro"]},
] + [{"destination": b.split(":", 1)[1], "type": "bind", "source": b.split(":", 1)[0],
      "options": ["rbind", "ro"]} for b in binds]
# Host network namespace, as the test kubelet's pods have (loopback pod IPs).
s["linux"]["namespaces"] = [n for n in s["linux"]["namespaces"] if n["type"] not in ("network", "cgroup")]
# No resource limits in the test (the runtime's default cgroup, no cgroup namespace).
s["linux"].pop("resources", None); s["linux"].pop("cgroupsPath", None)
s["mounts"] = [m for m in s["mounts"] if m["type"] != "cgroup"]
json.dump(s, open(path, "w"), indent=1)
PY
}
pod_bundle engine
# An OCI bundle's command resolves in the image's PATH: crun looks `dspark-engine` up there.
"${RT[@]}" run --bundle "$WORK/engine" "$CTR" >"$WORK/engine.log" 2>&1 &
RPID=$!
for _ in $(seq 1 300); do
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 "$RPID" 2>/dev/null || { cat "$WORK/engine.log" >&2; die "engine container exited"; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null || { tail -n 30 "$WORK/engine.log" >&2; die "no /health"; }
REQ='{"model":"default","messages":[{"role":"user","content":"Say hello."}],"max_tokens":8,"temperature":0}'
RESP="$(curl -fsS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' -d "$REQ")" ||
  { tail -n 30 "$WORK/engine.log" >&2; die "completion failed"; }
python3 -c 'import json,sys; r=json.loads(sys.argv[1]); t=r["choices"][0]["message"]["content"]; assert r["usage"]["completion_tokens"]>0 and t, r; print("[images-test] completion:", repr(t))' "$RESP" ||
  die "bad completion: $RESP"
# No --speculation: the image's shipped drafter for this model (/usr/share/dspark/drafters).
READY="$(curl -fsS "http://127.0.0.1:$PORT/ready")" || die "no /ready"
python3 -c 'import json,sys; r=json.loads(sys.argv[1]); assert (r["speculation"], r["policy"]) == ("dspark-markov", "dspark"), r' "$READY" ||
  die "the engine image did not serve its shipped drafter by default: $READY"
# Inside: uid 65532, root read-only, /tmp writable (the volume).
"${RT[@]}" state "$CTR" | grep -q '"status": "running"' || die "container not running"
PID="$("${RT[@]}" state "$CTR" | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')"
[ "$(awk '/^Uid:/ { print $2 }' "/proc/$PID/status")" = 65532 ] || die "engine not running as 65532"
grep -E '^[^ ]+ / ' "/proc/$PID/mounts" | grep -q '[ ,]ro[ ,]' || die "root file system not read-only"
log "engine image served /health and a completion as uid 65532 on a read-only root, with its shipped drafter ($((SECONDS - T0))s)"
"${RT[@]}" kill "$CTR" TERM 2>/dev/null || true
wait "$RPID" 2>/dev/null || true

# engine-cuda: no GPU here, so it cannot serve; what it can show is that the image is complete.
# The node's driver provides libcuda.so.1 (the NVIDIA container toolkit mounts it); here the
# toolkit's link stub stands in (every entry point answers CUDA_ERROR_NO_DEVICE). The dynamic
# loader must resolve every other library from the image (a missing one fails before main),
# and `serve --device cuda` must reach cuInit and stop with a clear message.
if [ -n "${ENGINE_CUDA_IMAGE:-}" ]; then
  pull "$ENGINE_CUDA_IMAGE" engine-cuda
  cfg="$(skopeo inspect --tls-verify=false --config "docker://$ENGINE_CUDA_IMAGE")"
  python3 - "$cfg" <<'PY' || die "engine-cuda image config"
import json, sys
cc = json.loads(sys.argv[1])["config"]
assert cc["User"] == "65532:65532", cc["User"]
assert cc["Entrypoint"] == ["/usr/local/bin/dspark-engine"], cc
assert "LD_LIBRARY_PATH=/usr/local/cuda/lib64" in cc["Env"], cc["Env"]
assert cc["Labels"]["dev.dspark.cuda.compute-capability"].isdigit(), cc["Labels"]
PY
  STUB="$(eval "$(scripts/cuda-build.sh env)"; echo "$CUDA_ROOT/lib/stubs/libcuda.so")"
  [ -s "$STUB" ] || die "no libcuda stub at $STUB (make cuda-build)"
  [ ! -e "$WORK/engine-cuda/rootfs/usr/lib/x86_64-linux-gnu/libcuda.so.1" ] || die "engine-cuda carries libcuda.so.1 (the driver's)"
  pod_bundle engine-cuda "$STUB:/usr/lib/x86_64-linux-gnu/libcuda.so.1"
  python3 - "$WORK/engine-cuda/config.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); s["process"]["args"] += ["--device", "cuda"]
json.dump(s, open(sys.argv[1], "w"), indent=1)
PY
  CCTR="$CTR-cuda"
  rc=0; timeout 120 "${RT[@]}" run --bundle "$WORK/engine-cuda" "$CCTR" >"$WORK/engine-cuda.log" 2>&1 || rc=$?
  "${RT[@]}" delete -f "$CCTR" >/dev/null 2>&1 || true
  if grep -q "error while loading shared libraries" "$WORK/engine-cuda.log"; then
    cat "$WORK/engine-cuda.log" >&2; die "engine-cuda misses a library"
  fi
  [ "$rc" != 0 ] && grep -q "cannot open CUDA device 0" "$WORK/engine-cuda.log" ||
    { cat "$WORK/engine-cuda.log" >&2; die "engine-cuda --device cuda: expected a clear CUDA error, got rc $rc"; }
  log "engine-cuda image: every library but the driver's resolves in the image; without a GPU it stops with: $(grep -m1 -o 'cannot open CUDA device 0.*' "$WORK/engine-cuda.log" | cut -c1-160)"
fi
# Sizes as a registry stores them (compressed layers); the operator image must stay small.
size_mb() { skopeo inspect --raw --tls-verify=false "docker://$1" |
  python3 -c 'import json,sys; print("%.1f" % (sum(l["size"] for l in json.load(sys.stdin)["layers"]) / 1e6))'; }
OP_MB="$(size_mb "$OPERATOR_IMAGE")"
log "image sizes (compressed): operator $OP_MB MB, engine $(size_mb "$ENGINE_IMAGE") MB${ENGINE_CUDA_IMAGE:+, engine-cuda $(size_mb "$ENGINE_CUDA_IMAGE") MB}"
python3 -c 'import sys; sys.exit(float(sys.argv[1]) >= 50)' "$OP_MB" || die "the operator image is $OP_MB MB (limit 50)"
log "PASS"
