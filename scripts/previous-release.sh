#!/bin/bash
# Builds the previous release's plugin binary from this clone's history: `git archive` of the
# commit into target/previous-release/src, built there with a target directory of its own (its
# dependencies are those of its own Cargo.lock). Cached: nothing is done when that binary was
# built from the same commit.
#   scripts/previous-release.sh COMMIT            the debug binary, for the upgrade tests
#                                                 (conformance/tests/reconcile.rs):
#                                                 target/previous-release/aether-cni
#   scripts/previous-release.sh COMMIT release    the static release binary as that release
#                                                 shipped it, for make bench's side-by-side
#                                                 (AETHER_BENCH_OLD_BIN):
#                                                 target/previous-release/release/aether-cni
#   scripts/previous-release.sh COMMIT debug DIR  the debug binary into DIR (the Service
#                                                 layer's releases before: make test builds
#                                                 each into target/previous-release/COMMIT)
set -euo pipefail
want=${1:?usage: previous-release.sh COMMIT [release]}
profile=${2:-debug}
# A shallow clone lacks the commit: deepen it from where it was cloned, once, before giving up.
if ! git rev-parse -q --verify "$want^{commit}" >/dev/null && [ "$(git rev-parse --is-shallow-repository)" = true ]; then
	echo "previous-release: $want is not in this shallow clone; fetching the history" >&2
	git fetch -q --unshallow || true
fi
rev=$(git rev-parse --verify "$want^{commit}")
out=target/previous-release
case "$profile" in
debug) dest=${3:-$out} ;;
release) dest=$out/release ;;
*) echo "previous-release: unknown profile $profile (debug or release)" >&2; exit 2 ;;
esac
if [ -x "$dest/aether-cni" ] && [ "$(cat "$dest/commit" 2>/dev/null)" = "$rev" ]; then
	exit 0
fi
src=$out/src-$profile-$rev
# A target directory per release built into a directory of its own: cargo reuses a path
# package's artifacts by name and version, whatever its source, across releases.
target_dir=$PWD/$out/target
[ -n "${3:-}" ] && target_dir=$PWD/$dest/target
rm -rf "$src" "$dest/aether-cni"
mkdir -p "$src" "$dest"
git archive "$rev" | tar -x -C "$src"
if [ "$profile" = release ]; then
	# As that release's `make build` made it: static, for the one target (the flag kept off
	# build scripts and proc-macros).
	target=x86_64-unknown-linux-gnu
	RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$PWD/$out/target" \
		${CARGO:-cargo} build --locked -q --release --target $target \
		--manifest-path "$src/Cargo.toml" -p aether-cni
	install -m 0755 "$out/target/$target/release/aether-cni" "$dest/aether-cni"
else
	CARGO_TARGET_DIR="$target_dir" ${CARGO:-cargo} build --locked -q --manifest-path "$src/Cargo.toml" -p aether-cni
	install -m 0755 "$target_dir/debug/aether-cni" "$dest/aether-cni"
fi
echo "$rev" >"$dest/commit"
rm -rf "$src"
