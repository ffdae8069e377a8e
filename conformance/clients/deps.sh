#!/usr/bin/env bash
# Real CNI clients for conformance/tests/real_clients.rs (run by `make clients-deps`, as root,
# on Debian bookworm). Idempotent and fast on reruns:
#   - Debian's CNI plugins (bridge, host-local, portmap in /usr/lib/cni), podman 4.3 with runc,
#     busybox-static (the test container's rootfs), Go and libcni's sources;
#   - cnitool, built offline from Debian's source package golang-github-appc-cni with Debian's
#     Go in GOPATH mode against libcni 1.1.2 from golang-github-appc-cni-dev, cached at
#     $OUT/cnitool.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${AETHER_CLIENTS_DIR:-target/clients}
PACKAGES=(golang-go golang-github-appc-cni-dev containernetworking-plugins podman runc conmon
          busybox-static dpkg-dev xz-utils util-linux iproute2 nftables)
SRC_LIST=/etc/apt/sources.list.d/aether-deb-src.sources

tmp_log=$(mktemp) && trap 'rm -f "$tmp_log"' EXIT
missing=()
for p in "${PACKAGES[@]}"; do
    # "install ok installed" only: a removed package keeps a status ("rc") that dpkg -s accepts.
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
cnitool_built() { [ -x "$OUT/cnitool" ] && { "$OUT/cnitool" 2>&1 || true; } | grep -q 'cnitool add'; }

update=
[ ${#missing[@]} -eq 0 ] || update=1
# apt-get source needs a deb-src entry. The machine's own sources (deb822, Types: deb) are left
# as they are; a separate file adds the source index, once.
if ! cnitool_built && ! apt-cache showsrc golang-github-appc-cni 2>/dev/null | grep -q '^Package: golang-github-appc-cni'; then
    if [ ! -e "$SRC_LIST" ]; then
        echo "clients-deps: adding $SRC_LIST"
        cat >"$SRC_LIST" <<'SOURCES'
# Added by aether-cni `make clients-deps`: the source index, for cnitool (golang-github-appc-cni).
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    fi
    update=1
fi
[ -z "$update" ] || apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
    echo "clients-deps: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>"$tmp_log" \
        || { cat "$tmp_log" >&2; exit 1; }
fi

if cnitool_built; then
    echo "clients-deps: $OUT/cnitool is built"
    exit 0
fi

mkdir -p "$OUT/src"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/src" "$OUT/gopath" && mkdir -p "$OUT/src"
(cd "$OUT/src" && apt-get source -qq golang-github-appc-cni >"$OUT/apt-source.log" 2>&1) \
    || { cat "$OUT/apt-source.log" >&2; exit 1; }
tool=$(ls -d "$OUT"/src/golang-github-appc-cni-*/cnitool | head -n1)
[ -f "$tool/cnitool.go" ] || { echo "clients-deps: no cnitool.go in the source package" >&2; exit 1; }

# GOPATH mode, offline: cnitool's only non-std import is libcni, found in /usr/share/gocode.
pkg="$OUT/gopath/src/aether.invalid/cnitool"
mkdir -p "$pkg" && cp "$tool"/*.go "$pkg/"
(cd "$pkg" && GO111MODULE=off GOFLAGS= GOPROXY=off GOPATH="$OUT/gopath:/usr/share/gocode" \
    GOCACHE="$OUT/gocache" go build -o "$OUT/cnitool" .)
echo "clients-deps: built $OUT/cnitool ($(go version | cut -d' ' -f3), libcni $(dpkg-query -W -f='${Version}' golang-github-appc-cni-dev))"
