#!/usr/bin/env bash
# The release binary's software bill of materials, CycloneDX 1.5 JSON (make image):
#   installer/image/sbom.sh CARGO_CYCLONEDX TARGET OUT [BINARY]
# cargo-cyclonedx describes the aether-cni binary target for TARGET from Cargo.lock (every
# crate with its version, license, package URL and checksum; build-time-only crates left
# out); with BINARY, the file's own SHA-256 is added to the described component, so the
# SBOM names the very binary the image holds.
set -euo pipefail
cyclonedx=$1 target=$2 out=$3 bin=${4:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
made=cni-plugin/aether-cni_bin.cdx.json
rm -f "$made"
"$cyclonedx" cyclonedx --quiet --manifest-path cni-plugin/Cargo.toml --format json --describe binaries \
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
