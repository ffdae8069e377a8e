#!/bin/bash
# Builds the previous release's plugin binary from this clone's history, for the upgrade tests
# (conformance/tests/reconcile.rs): `git archive` of the commit into
# target/previous-release/src, built there with a target directory of its own (its dependencies
# are those of its own Cargo.lock), the binary copied to target/previous-release/aether-cni.
# Cached: nothing is done when that binary was built from the same commit.
#   scripts/previous-release.sh COMMIT
set -euo pipefail
want=${1:?usage: previous-release.sh COMMIT}
# A shallow clone lacks the commit: deepen it from where it was cloned, once, before giving up.
if ! git rev-parse -q --verify "$want^{commit}" >/dev/null && [ "$(git rev-parse --is-shallow-repository)" = true ]; then
	echo "previous-release: $want is not in this shallow clone; fetching the history" >&2
	git fetch -q --unshallow || true
fi
rev=$(git rev-parse --verify "$want^{commit}")
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
