#!/bin/bash
# Builds the previous release's plugin binary from this clone's history, for the upgrade tests
# (conformance/tests/reconcile.rs): `git archive` of the commit into
# target/previous-release/src, built there with a target directory of its own (its dependencies
# are those of its own Cargo.lock), the binary copied to target/previous-release/aether-cni.
# Cached: nothing is done when that binary was built from the same commit.
#   scripts/previous-release.sh COMMIT
set -euo pipefail
rev=$(git rev-parse --verify "${1:?usage: previous-release.sh COMMIT}^{commit}")
out=target/previous-release
if [ -x "$out/aether-cni" ] && [ "$(cat "$out/commit" 2>/dev/null)" = "$rev" ]; then
	exit 0
fi
rm -rf "$out/src" "$out/aether-cni"
mkdir -p "$out/src"
git archive "$rev" | tar -x -C "$out/src"
CARGO_TARGET_DIR="$PWD/$out/target" ${CARGO:-cargo} build --locked -q --manifest-path "$out/src/Cargo.toml" -p aether-cni
install -m 0755 "$out/target/debug/aether-cni" "$out/aether-cni"
echo "$rev" >"$out/commit"
rm -rf "$out/src"
