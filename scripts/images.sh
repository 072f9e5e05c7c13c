#!/usr/bin/env bash
# OCI images (linux/amd64) for the operator and the engine, built without a Docker daemon by
# buildah from the Containerfiles in images/, on minimal bases assembled from Debian packages.
#
#   scripts/images.sh build [NAME...]   base images + images (default: operator engine) into
#                                       buildah's storage, tagged localhost/dspark/NAME:VERSION
#   scripts/images.sh push REGISTRY [NAME...]  build, then push them to REGISTRY (e.g. 127.0.0.1:15000) and
#                                       write $DSPARK_IMAGES_OUT/digests.env (NAME_IMAGE=REG/dspark/NAME@sha256:...)
#   scripts/images.sh oci DIR [NAME...] write them into the OCI layout DIR (tags NAME)
#
# NAME: operator, engine, engine-cuda (needs scripts/cuda-build.sh first).
# Environment: DSPARK_CACHE (default ~/.cache/dspark), CARGO_TARGET_DIR (binaries come from
# its release/ dir, built by `make build`), DSPARK_CUDA_TARGET_DIR (engine-cuda's binary),
# DSPARK_BUILDAH_ROOT (buildah's storage, default $DSPARK_CACHE/containers/storage).
# Everything is content-keyed: the Debian .debs are cached by name_version, a base image is
# rebuilt only when its .debs change, and builds use --timestamp 0, so unchanged inputs give
# the same image digest (and a push uploads nothing new).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
TARGET="${CARGO_TARGET_DIR:-$CACHE/cargo-target}"
CUDA_TARGET="${DSPARK_CUDA_TARGET_DIR:-}"
IMG_CACHE="$CACHE/images"
OUT="${DSPARK_IMAGES_OUT:-$IMG_CACHE/out}"
STORE="${DSPARK_BUILDAH_ROOT:-$CACHE/containers/storage}"
RECIPE_REV=1
VERSION="$(awk -F'"' '/^version *=/ { print $2; exit }' Cargo.toml)"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION-dirty"
BUILDAH=(buildah --root "$STORE" --runroot "/run/dspark-buildah" --storage-driver overlay)
log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }
for t in buildah dpkg-deb apt-get; do command -v "$t" >/dev/null || die "$t missing (apt-get install -y buildah skopeo umoci crun)"; done

pkgs() { grep -v '^\s*\(#\|$\)' "images/base/packages-$1.txt"; }

# fetch_debs PKG...: the .debs (apt's candidate versions) into $IMG_CACHE/debs; prints paths.
fetch_debs() {
  mkdir -p "$IMG_CACHE/debs"
  local p v f missing=()
  local -A ver
  # One apt-cache call for all (it takes ~1 s per call).
  while read -r p v; do ver[$p]="$v"; done < <(apt-cache policy "$@" |
    awk '/^[^ ].*:$/ { sub(/:$/, ""); sub(/:amd64$/, ""); p = $0 } /^  Candidate:/ { print p, $2 }')
  for p in "$@"; do
    v="${ver[$p]:-}"
    [ -n "$v" ] && [ "$v" != "(none)" ] || die "no Debian candidate for $p"
    f="$(ls "$IMG_CACHE/debs/${p}_${v//:/%3a}_"*.deb 2>/dev/null | head -n 1 || true)"
    [ -n "$f" ] || missing+=("$p=$v")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "downloading ${missing[*]}"
    (cd "$IMG_CACHE/debs" && apt-get download -q "${missing[@]}" >/dev/null 2>&1) ||
      (apt-get update -q >/dev/null && cd "$IMG_CACHE/debs" && apt-get download -q "${missing[@]}" >/dev/null)
  fi
  for p in "$@"; do
    v="${ver[$p]}"
    ls "$IMG_CACHE/debs/${p}_${v//:/%3a}_"*.deb | head -n 1
  done
}

image_exists() { "${BUILDAH[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# build_base VARIANT: localhost/dspark/base-VARIANT:<key> (and :latest) from the .debs.
build_base() {
  local variant="$1" list debs key dir
  if [ "$variant" = cc ]; then list=(cc); else list=(cc "$variant"); fi
  mapfile -t debs < <(fetch_debs $(for l in "${list[@]}"; do pkgs "$l"; done))
  key="$({ echo "recipe=$RECIPE_REV"; sha256sum "${debs[@]}" | cut -d' ' -f1; cat images/base/Containerfile; } | sha256sum | cut -c1-16)"
  local tag="localhost/dspark/base-$variant:$key"
  if image_exists "$tag"; then
    log "base-$variant: cached ($key)"
  else
    log "base-$variant: assembling from ${#debs[@]} Debian packages ($key)"
    dir="$(mktemp -d "$IMG_CACHE/base-$variant.XXXXXX")"
    mkdir -p "$dir/root"
    local d
    for d in "${debs[@]}"; do dpkg-deb -x "$d" "$dir/root"; done
    local r="$dir/root"
    # What distroless adds by hand: users, nsswitch, the CA bundle, /tmp, a home.
    mkdir -p "$r/etc/ssl/certs" "$r/tmp" "$r/home/nonroot" "$r/usr/local/bin"
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$r/etc/passwd"
    printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$r/etc/group"
    printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$r/etc/nsswitch.conf"
    find "$r/usr/share/ca-certificates" -name '*.crt' | LC_ALL=C sort | xargs cat >"$r/etc/ssl/certs/ca-certificates.crt"
    # Maintainer scripts never ran: drop what only they would use (and any shell script bits).
    rm -rf "$r/usr/share/doc" "$r/usr/share/man" "$r/usr/share/lintian" "$r/usr/sbin/update-ca-certificates" "$r/etc/ca-certificates"
    [ ! -e "$r/bin/sh" ] && [ ! -e "$r/usr/bin/sh" ] || die "a shell slipped into base-$variant"
    chmod 1777 "$r/tmp"; chown 65532:65532 "$r/home/nonroot"
    tar -C "$r" --sort=name --mtime=@0 --numeric-owner --owner=0 --group=0 \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -cf "$dir/rootfs.tar" .
    # Home owned by nonroot inside the tar too (--owner=0 above maps everything to root).
    tar -C "$r" --mtime=@0 --numeric-owner --owner=65532 --group=65532 -rf "$dir/rootfs.tar" ./home/nonroot
    cp images/base/Containerfile "$dir/Containerfile"
    "${BUILDAH[@]}" bud -q --timestamp 0 --format oci --platform linux/amd64 \
      --label "dspark.dev/base-key=$key" -t "$tag" -f "$dir/Containerfile" "$dir" >/dev/null
    rm -rf "$dir"
  fi
  "${BUILDAH[@]}" tag "$tag" "localhost/dspark/base-$variant:latest"
  echo "$tag"
}

# stage NAME BIN: a build context with the stripped binary (content-keyed dir).
stage() {
  local name="$1" bin="$2" ctx="$IMG_CACHE/ctx/$1"
  [ -x "$bin" ] || die "$bin missing (make build${name/engine-cuda/ / make cuda-build})"
  mkdir -p "$ctx"
  local exe="${name%-cuda}"; exe="dspark-$exe"
  local src; src="$(stat -L -c '%n %s %Y %i' "$bin")"
  if [ ! -f "$ctx/$exe" ] || [ "$(cat "$ctx/.src" 2>/dev/null)" != "$src" ]; then
    strip -o "$ctx/$exe.tmp" "$bin" && touch -d @0 "$ctx/$exe.tmp" && mv -f "$ctx/$exe.tmp" "$ctx/$exe"
    echo "$src" >"$ctx/.src"
  fi
  echo "$ctx"
}

build_one() {
  local name="$1" base bin file="images/$1/Containerfile"
  case "$name" in
    operator) base="$(build_base cc)"; bin="$TARGET/release/dspark-operator" ;;
    engine) base="$(build_base engine)"; bin="$TARGET/release/dspark-engine" ;;
    engine-cuda) base="$(build_base engine)"; bin="${CUDA_TARGET:-$(scripts/cuda-build.sh target)}/release/dspark-engine" ;;
    *) die "unknown image $name" ;;
  esac
  local ctx; ctx="$(stage "$name" "$bin")"
  if [ "$name" != operator ]; then
    # The shipped drafters (those whose manifest names the models they serve), found by
    # `serve` without --speculation in /usr/share/dspark/drafters.
    rm -rf "$ctx/drafters"; mkdir -p "$ctx/drafters"
    local d
    for d in drafters/*/; do
      grep -q '"target_models"' "$d/manifest.json" 2>/dev/null || continue
      mkdir -p "$ctx/drafters/$(basename "$d")"
      cp "$d"/{config.json,manifest.json,model.safetensors} "$ctx/drafters/$(basename "$d")/"
    done
    touch -d @0 "$ctx/drafters" "$ctx"/drafters/* "$ctx"/drafters/*/*
  fi
  if [ "$name" = engine-cuda ]; then
    # The CUDA runtime libraries cudarc links, from the toolkit wheels (hard links: no copy).
    local lib; lib="$(eval "$(scripts/cuda-build.sh env)"; echo "$CUDA_ROOT/lib")"
    rm -rf "$ctx/cuda-lib"; mkdir -p "$ctx/cuda-lib"
    cp -al "$lib"/lib{cudart,cublas,cublasLt,curand,nvrtc,nvrtc-builtins}.so.* "$ctx/cuda-lib/"
  fi
  local t0=$SECONDS extra=()
  [ "$name" != engine-cuda ] || extra=(--build-arg "CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}")
  "${BUILDAH[@]}" bud -q --timestamp 0 --format oci --platform linux/amd64 --layers=false \
    --build-arg "BASE=$base" --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" "${extra[@]}" \
    -t "localhost/dspark/$name:$VERSION" -f "$file" "$ctx" >/dev/null
  log "$name: localhost/dspark/$name:$VERSION ($((SECONDS - t0))s)"
}

names() { if [ $# -eq 0 ]; then echo operator engine; else echo "$@"; fi; }

case "${1:-}" in
  build) shift; for n in $(names "$@"); do build_one "$n"; done ;;
  push)
    reg="${2:?usage: images.sh push REGISTRY [NAME...]}"; shift 2
    mkdir -p "$OUT"; : >"$OUT/digests.env.tmp"
    for n in $(names "$@"); do
      build_one "$n"   # always: a tag left from an older binary must not be pushed (~1 s when cached)
      "${BUILDAH[@]}" push -q --tls-verify=false --digestfile "$OUT/$n.digest" \
        "localhost/dspark/$n:$VERSION" "docker://$reg/dspark/$n:$VERSION"
      ref="$reg/dspark/$n@$(cat "$OUT/$n.digest")"
      echo "$(echo "$n" | tr 'a-z-' 'A-Z_')_IMAGE=$ref" >>"$OUT/digests.env.tmp"
      log "pushed $ref"
    done
    mv -f "$OUT/digests.env.tmp" "$OUT/digests.env"; cat "$OUT/digests.env" ;;
  oci)
    dir="${2:?usage: images.sh oci DIR [NAME...]}"; shift 2
    for n in $(names "$@"); do
      build_one "$n"   # always: a tag left from an older binary must not be pushed (~1 s when cached)
      "${BUILDAH[@]}" push -q "localhost/dspark/$n:$VERSION" "oci:$dir:$n"
      log "wrote $dir:$n"
    done ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
