#!/usr/bin/env bash
# Packs a static pause binary as a one-layer OCI image archive (an OCI image layout in a tar)
# that `ctr images import` reads, named by the io.containerd.image.name annotation. By hand:
# no registry, no image builder; the same input gives the same bytes.
#   pause-image.sh PAUSE_BINARY IMAGE_NAME OUT.tar
set -euo pipefail
bin=$1 name=$2 out=$3
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rootfs" "$work/oci/blobs/sha256"
install -m 0755 "$bin" "$work/rootfs/pause"
blob() { # file -> prints "digest size", stores the blob
    local d s
    d=$(sha256sum "$1" | cut -d' ' -f1) s=$(stat -c %s "$1")
    cp "$1" "$work/oci/blobs/sha256/$d"
    echo "$d $s"
}
tar -C "$work/rootfs" --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -cf "$work/layer.tar" pause
read -r layer layer_size < <(blob "$work/layer.tar")
printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/pause"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$layer" >"$work/config.json"
read -r config config_size < <(blob "$work/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$config" "$config_size" "$layer" "$layer_size" >"$work/manifest.json"
read -r manifest manifest_size < <(blob "$work/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest" "$manifest_size" "$name" "${name##*:}" >"$work/oci/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$work/oci/oci-layout"
tar -C "$work/oci" --numeric-owner --owner=0 --group=0 --mtime=@0 --sort=name -cf "$out" oci-layout index.json blobs
