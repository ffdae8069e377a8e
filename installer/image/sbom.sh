#!/usr/bin/env bash
# A release binary's software bill of materials, CycloneDX 1.5 JSON (make image):
#   installer/image/sbom.sh CARGO_CYCLONEDX TARGET PACKAGE_DIR OUT [BINARY]
# (PACKAGE_DIR: cni-plugin for aether-cni, installer for aether-cni-installer.)
# cargo-cyclonedx describes the package's binary target for TARGET from Cargo.lock (every
# crate with its version, license, package URL and checksum; build-time-only crates left
# out); with BINARY, the file's own SHA-256 is added to the described component, so the
# SBOM names the very binary the image holds.
set -euo pipefail
cyclonedx=$1 target=$2 package=$3 out=$4 bin=${5:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
name=$(sed -n '/^\[\[bin\]\]/,/^name/s/^name = "\(.*\)"/\1/p' "$package/Cargo.toml")
made=$package/${name}_bin.cdx.json
rm -f "$made"
"$cyclonedx" cyclonedx --quiet --manifest-path "$package/Cargo.toml" --format json --describe binaries \
    --target "$target" --spec-version 1.5 --no-build-deps
[ -f "$made" ] || { echo "sbom.sh: cargo-cyclonedx wrote no $made" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
if [ -n "$bin" ]; then
    sum=$(sha256sum "$bin" | cut -d' ' -f1)
    python3 - "$made" "$sum" <<'PY'
import json, sys
path, digest = sys.argv[1], sys.argv[2]
bom = json.load(open(path))
bom["metadata"]["component"]["hashes"] = [{"alg": "SHA-256", "content": digest}]
json.dump(bom, open(path, "w"), indent=2)
PY
fi
mv "$made" "$out"
echo "wrote $out: $(grep -c '"purl"' "$out") components"
