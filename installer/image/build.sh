#!/usr/bin/env bash
# Builds aether-cni's OCI image from its two binaries, offline, with Debian's podman:
#   installer/image/build.sh PLUGIN INSTALLER IMAGE [OCI_ARCHIVE]
# (PLUGIN becomes /aether-cni, INSTALLER /aether-cni-installer, the entrypoint.) The binaries'
# third-party notices go in beside LICENSE: NOTICES, by default THIRD-PARTY-NOTICES beside
# PLUGIN (make notices writes it beside the release binaries).
# PODMAN_FLAGS (e.g. "--root DIR --runroot DIR --storage-driver vfs") selects a private
# storage; the tests use one so that nobody else's podman images are touched.
set -euo pipefail
bin=$1 installer=$2 image=$3 archive=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
command -v podman >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman >/dev/null
}
[ -f "$bin" ] || { echo "build.sh: binary $bin does not exist (make build)" >&2; exit 1; }
[ -f "$installer" ] || { echo "build.sh: binary $installer does not exist (make build)" >&2; exit 1; }
notices=${NOTICES:-$(dirname "$bin")/THIRD-PARTY-NOTICES}
[ -f "$notices" ] || { echo "build.sh: no third-party notices at $notices (make notices)" >&2; exit 1; }
ctx=$(mktemp -d "${TMPDIR:-/tmp}/aether-image-ctx.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
cp "$bin" "$ctx/aether-cni"
cp "$installer" "$ctx/aether-cni-installer"
cp "$repo/LICENSE" "$ctx/LICENSE"
cp "$notices" "$ctx/THIRD-PARTY-NOTICES"
cp "$here/Containerfile" "$ctx/Containerfile"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -1)
# shellcheck disable=SC2086 # PODMAN_FLAGS is a list of flags
podman ${PODMAN_FLAGS:-} build --quiet --layers=false --pull=never --network=none --build-arg "VERSION=$version" \
    -t "$image" -f "$ctx/Containerfile" "$ctx" >/dev/null
if [ -n "$archive" ]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    # shellcheck disable=SC2086
    podman ${PODMAN_FLAGS:-} save --quiet --format oci-archive -o "$archive" "$image"
fi
echo "built $image from $bin and $installer${archive:+ (and $archive)}"
