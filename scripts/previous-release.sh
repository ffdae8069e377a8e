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
#   scripts/previous-release.sh COMMIT shipped DIR
#                                                 the plugin and the installer as that release
#                                                 shipped them, made by its own `make build`
#                                                 (static, its profiles and link flags, the
#                                                 plugin stripped), for make bench's side by
#                                                 side with the release before:
#                                                 DIR/release/aether-cni and
#                                                 DIR/release/aether-cni-installer, built in
#                                                 DIR/target (the target directory the debug
#                                                 build of DIR uses: one per release)
set -euo pipefail
want=${1:?usage: previous-release.sh COMMIT [release | debug DIR | shipped DIR]}
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
shipped) dest=${3:?previous-release: shipped needs DIR}/release ;;
*) echo "previous-release: unknown profile $profile (debug, release or shipped)" >&2; exit 2 ;;
esac
if [ -x "$dest/aether-cni" ] && [ "$(cat "$dest/commit" 2>/dev/null)" = "$rev" ]; then
	[ "$profile" != shipped ] || [ -x "$dest/aether-cni-installer" ] && exit 0
fi
src=$out/src-$profile-$rev
# A target directory per release built into a directory of its own: cargo reuses a path
# package's artifacts by name and version, whatever its source, across releases.
target_dir=$PWD/$out/target
[ -n "${3:-}" ] && target_dir=$PWD/$dest/target
rm -rf "$src" "$dest/aether-cni" "$dest/aether-cni-installer"
mkdir -p "$src" "$dest"
git archive "$rev" | tar -x -C "$src"
if [ "$profile" = shipped ]; then
	# The release's own build, so that its binaries are made as it shipped them (whatever its
	# profiles, flags and stripping were then); its Makefile writes into its target/, here the
	# release's target directory.
	if ! grep -q '^build:' "$src/Makefile" || ! grep -q 'aether-cni-installer' "$src/Makefile"; then
		echo "previous-release: $want's Makefile builds no installer; shipped needs one" >&2
		exit 2
	fi
	mkdir -p "$3/target"
	ln -s "$(cd "$3/target" && pwd)" "$src/target"
	make -s -C "$src" build CARGO="${CARGO:-cargo}" >&2
	install -m 0755 "$src/target/release/aether-cni" "$dest/aether-cni"
	install -m 0755 "$src/target/release/aether-cni-installer" "$dest/aether-cni-installer"
elif [ "$profile" = release ]; then
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
