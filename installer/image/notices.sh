#!/usr/bin/env bash
# THIRD-PARTY-NOTICES for the release binaries (make notices), shipped in the image beside
# LICENSE:
#   installer/image/notices.sh CARGO_ABOUT TARGET OUT
# First every crate linked into `aether-cni-installer` for TARGET (which links every crate the
# plugin `aether-cni` does: conformance/tests/notices.rs checks the notices against both
# binaries' crates) with the text of its license, made by
# cargo-about from Cargo.lock; it fails, naming the crate, on a license about.toml does not
# accept. Then what the static link adds that is not a crate: Rust's standard library and
# glibc's static start-up, with the license texts Debian ships.
set -euo pipefail
about=$1 target=$2 out=$3
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
mkdir -p "$(dirname "$out")"
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# cargo-about reads `cargo metadata`, which wants the source of every package in Cargo.lock,
# also those of other platforms that no build here downloads; fetch them first (from the
# registry the machine's cargo is set up for), then read offline.
cargo fetch --locked --manifest-path installer/Cargo.toml >/dev/null
"$about" generate --frozen --fail -c about.toml -m installer/Cargo.toml --target "$target" \
    installer/image/THIRD-PARTY-NOTICES.hbs -o "$tmp"
rust=$(rustc --version)
glibc=$(dpkg-query -W -f='${Version}' libc6-dev 2>/dev/null || echo unknown)
{
    cat <<EOT

================================================================================
Linked in by the toolchain, not a crate
--------------------------------------------------------------------------------
Rust's standard library ($rust): core, alloc, std and the crates they use, under
"MIT OR Apache-2.0" (the MIT and Apache-2.0 texts are above).

glibc's static parts (Debian's libc6-dev $glibc): the static start-up and the C library
functions the binary calls, under the GNU Lesser General Public License 2.1 or later, some
files with more permissive terms (listed in glibc's own COPYING and LICENSES files). Its
source is Debian's source package glibc, version $glibc. aether-cni's own source is
published under Apache-2.0, so the binary can be rebuilt and relinked against a modified
glibc (make build). The LGPL's text follows.

EOT
    cat /usr/share/common-licenses/LGPL-2.1
} >> "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out: $(grep -c '^[^ ].* [0-9][^ ]*: ' "$out") crates"
