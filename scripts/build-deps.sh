#!/usr/bin/env bash
# System libraries the Rust build links: fontconfig + freetype (and a font) for the
# `dspark-train`'s `plots` feature (`eval --plots` draws text with a system font). Run by
# `make build`, so `make demo` and `make test` both get them on a fresh machine; a no-op
# when they are present.
set -euo pipefail
if pkg-config --exists fontconfig freetype2 2>/dev/null && fc-list : family 2>/dev/null | grep -q .; then
  exit 0
fi
echo "installing fontconfig, freetype and a font (Debian packages)"
fonts_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    pkg-config libfontconfig-dev libfreetype-dev fonts-dejavu-core
}
fonts_install || { apt-get update && fonts_install; }
