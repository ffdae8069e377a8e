#!/usr/bin/env bash
# Real CNI clients for conformance/tests/real_clients.rs and containerd.rs (run by
# `make clients-deps`, as root, on Debian bookworm). Idempotent and fast on reruns:
#   - Debian's CNI plugins (bridge, host-local, portmap, loopback in /usr/lib/cni), podman 4.3
#     with runc, busybox-static (the podman test's rootfs), containerd 1.6, Go and libcni's
#     sources, protoc with Python's grpcio and protobuf (the CRI client), gcc (the pause binary);
#   - cnitool, built offline from Debian's source package golang-github-appc-cni with Debian's
#     Go in GOPATH mode against libcni 1.1.2 from golang-github-appc-cni-dev, cached at
#     $OUT/cnitool;
#   - containerd 2.x and CNI plugins 1.9 from Debian unstable, unpacked into $OUT/containerd2/root
#     (nothing installed; see below);
#   - for containerd: $OUT/pause (static), $OUT/pause-oci.tar (it, as an OCI image archive for
#     `ctr images import`), $OUT/cri/runtime_v1_pb2.py (protoc's code for cri/proto/runtime_v1.proto,
#     the proto the installer's CRI client is built from too).
set -euo pipefail
cd "$(dirname "$0")/../.."
CLIENTS=conformance/clients
OUT=${AETHER_CLIENTS_DIR:-target/clients}
PACKAGES=(golang-go golang-github-appc-cni-dev containernetworking-plugins podman runc conmon
          busybox-static dpkg-dev xz-utils util-linux iproute2 nftables
          containerd protobuf-compiler python3-grpcio python3-protobuf gcc libc6-dev)
SRC_LIST=/etc/apt/sources.list.d/aether-deb-src.sources
# containerd's postinst must not start the machine's own service: the tests run their own.
export DEBIAN_FRONTEND=noninteractive

tmp_log=$(mktemp) && trap 'rm -f "$tmp_log"' EXIT
missing=()
for p in "${PACKAGES[@]}"; do
    # "install ok installed" only: a removed package keeps a status ("rc") that dpkg -s accepts.
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
cnitool_built() { [ -x "$OUT/cnitool" ] && { "$OUT/cnitool" 2>&1 || true; } | grep -q 'cnitool add'; }

# The deb-src entries matching the machine's own `deb` sources: each deb822 paragraph of
# /etc/apt/sources.list.d/*.sources whose Types has "deb" (URIs, Suites, Components and
# Signed-By copied, continuation lines included), and each one-line `deb` entry of
# /etc/apt/sources.list. No host name is written here: they come from the machine.
derive_deb_src() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] && [ "$f" != "$SRC_LIST" ] || continue
        awk '
            function flush() {
                if (types ~ /(^|[ \t])deb([ \t]|$)/ && tolower(enabled) != "no" && uris != "")
                    printf "Types: deb-src\n%s\n", body
                types = ""; enabled = ""; uris = ""; body = ""; keep = 0
            }
            /^#/ { next }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]/ { if (keep) body = body $0 "\n"; next }
            {
                field = tolower($0); sub(/:.*/, "", field)
                value = $0; sub(/^[^:]*:[ \t]*/, "", value)
                keep = (field == "uris" || field == "suites" || field == "components" || field == "signed-by")
                if (field == "types") types = value
                if (field == "enabled") enabled = value
                if (field == "uris") uris = value
                if (keep) body = body $0 "\n"
            }
            END { flush() }
        ' "$f"
    done
    [ ! -f /etc/apt/sources.list ] || awk '
        /^[ \t]*deb[ \t]/ {
            line = $0; sub(/^[ \t]*deb[ \t]+/, "", line); opts = ""
            if (line ~ /^\[/) { opts = line; sub(/\].*/, "", opts); sub(/^[^]]*\][ \t]*/, "", line) }
            n = split(line, w, /[ \t]+/)
            printf "Types: deb-src\nURIs: %s\nSuites: %s\n", w[1], w[2]
            comps = ""; for (i = 3; i <= n; i++) comps = comps (i > 3 ? " " : "") w[i]
            if (comps != "") printf "Components: %s\n", comps
            if (match(opts, /signed-by=[^ \t\]]+/)) printf "Signed-By: %s\n", substr(opts, RSTART + 10, RLENGTH - 10)
            print ""
        }
    ' /etc/apt/sources.list
}

update=
[ ${#missing[@]} -eq 0 ] || update=1
# apt-get source needs a deb-src entry. The machine's own sources are left as they are; a
# separate file adds the source index, derived from them (rewritten when they changed).
if ! cnitool_built && ! apt-cache showsrc golang-github-appc-cni 2>/dev/null | grep -q '^Package: golang-github-appc-cni'; then
    entries=$(derive_deb_src)
    [ -n "$entries" ] || { echo "clients-deps: no 'deb' entry in the machine's apt sources to derive deb-src from" >&2; exit 1; }
    wanted=$(printf '# Added by aether-cni `make clients-deps`: the source index of the machine'"'"'s own apt sources,\n# for cnitool (golang-github-appc-cni).\n%s\n' "$entries")
    if [ "$(cat "$SRC_LIST" 2>/dev/null)" != "$wanted" ]; then
        echo "clients-deps: writing $SRC_LIST from the machine's apt sources"
        printf '%s\n' "$wanted" >"$SRC_LIST"
    fi
    update=1
fi
[ -z "$update" ] || apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
    echo "clients-deps: installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>"$tmp_log" \
        || { cat "$tmp_log" >&2; exit 1; }
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# --- containerd: the pause image and the CRI client's generated code (cheap: always rebuilt
# when their sources are newer).
if [ ! "$OUT/pause" -nt "$CLIENTS/pause.c" ]; then
    gcc -static -Os -o "$OUT/pause" "$CLIENTS/pause.c"
fi
if [ ! "$OUT/pause-oci.tar" -nt "$OUT/pause" ] || [ "$CLIENTS/pause-image.sh" -nt "$OUT/pause-oci.tar" ]; then
    bash "$CLIENTS/pause-image.sh" "$OUT/pause" localhost/aether-pause:test "$OUT/pause-oci.tar"
fi
if [ ! "$OUT/cri/runtime_v1_pb2.py" -nt cri/proto/runtime_v1.proto ]; then
    mkdir -p "$OUT/cri"
    protoc --python_out="$OUT/cri" -I cri/proto cri/proto/runtime_v1.proto
fi
echo "clients-deps: containerd $(dpkg-query -W -f='${Version}' containerd), $OUT/pause-oci.tar, $OUT/cri/runtime_v1_pb2.py"

# --- containerd 2 and CNI plugins 1.9 (CNI 1.1), unpacked into $OUT/containerd2/, installing
# nothing: Debian unstable's `containerd` and `containernetworking-plugins`, fetched with
# `apt-get download` through an apt state of our own (its sources list names the machine's
# own Debian mirror, read from its apt sources, with the suite `sid`; its lists and cache
# under $OUT/containerd2/apt), and `dpkg-deb -x`. Cached: fetched again only when the wanted
# versions change. runc stays bookworm's (unstable's needs a newer glibc).
C2_PACKAGES=(containerd containernetworking-plugins)
C2=$OUT/containerd2
# The first `deb` URI of the machine's sources that is not a security archive.
machine_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] && [ "$f" != "$SRC_LIST" ] || continue
        awk '
            function flush() {
                if (types ~ /(^|[ \t])deb([ \t]|$)/ && tolower(enabled) != "no" && suites !~ /-security/ && uris != "") {
                    split(uris, u, /[ \t]+/); print u[1]; found = 1; exit
                }
                types = ""; enabled = ""; uris = ""; suites = ""
            }
            /^#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                field = tolower($0); sub(/:.*/, "", field)
                value = $0; sub(/^[^:]*:[ \t]*/, "", value)
                if (field == "types") types = value
                if (field == "enabled") enabled = value
                if (field == "uris") uris = value
                if (field == "suites") suites = value
            }
            END { if (!found) flush() }
        ' "$f"
    done
    [ ! -f /etc/apt/sources.list ] || awk '
        /^[ \t]*deb[ \t]/ {
            line = $0; sub(/^[ \t]*deb[ \t]+/, "", line)
            if (line ~ /^\[/) sub(/^[^]]*\][ \t]*/, "", line)
            split(line, w, /[ \t]+/)
            if (w[2] !~ /-security/) { print w[1]; exit }
        }
    ' /etc/apt/sources.list
}
c2_wanted() { cat "$C2/wanted" 2>/dev/null; }
if [ ! -x "$C2/root/usr/bin/containerd" ] || [ ! -x "$C2/root/usr/lib/cni/bridge" ] \
    || [ -n "${AETHER_REFRESH_CONTAINERD2:-}" ] || [ -z "$(c2_wanted)" ]; then
    mirror=$(machine_mirror | head -n1)
    [ -n "$mirror" ] || { echo "clients-deps: no Debian mirror in the machine's apt sources" >&2; exit 1; }
    apt_dir=$C2/apt
    mkdir -p "$apt_dir"/etc/sources.list.d "$apt_dir"/etc/preferences.d "$apt_dir"/state/lists/partial \
        "$apt_dir"/cache/archives/partial "$C2/debs"
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    printf 'deb [signed-by=%s] %s sid main\n' "$keyring" "$mirror" >"$apt_dir/etc/sources.list"
    apt_private=(-o "Dir::Etc::SourceList=$apt_dir/etc/sources.list"
                 -o "Dir::Etc::SourceParts=$apt_dir/etc/sources.list.d"
                 -o "Dir::Etc::Preferences=$apt_dir/etc/preferences"
                 -o "Dir::Etc::PreferencesParts=$apt_dir/etc/preferences.d"
                 -o "Dir::State=$apt_dir/state" -o "Dir::Cache=$apt_dir/cache"
                 -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
                 -o "Debug::NoLocking=1")
    apt-get "${apt_private[@]}" update -qq >"$tmp_log" 2>&1 || { cat "$tmp_log" >&2; exit 1; }
    wanted=$(for p in "${C2_PACKAGES[@]}"; do
        printf '%s=%s\n' "$p" "$(apt-cache "${apt_private[@]}" show "$p" | awk '/^Version:/ { print $2; exit }')"
    done)
    if [ "$wanted" != "$(c2_wanted)" ] || [ ! -x "$C2/root/usr/bin/containerd" ]; then
        echo "clients-deps: fetching $(echo $wanted) from unstable into $C2"
        rm -rf "$C2/debs" "$C2/root" && mkdir -p "$C2/debs" "$C2/root"
        # shellcheck disable=SC2046
        (cd "$C2/debs" && apt-get "${apt_private[@]}" download -qq $(echo "$wanted") >"$tmp_log" 2>&1) \
            || { cat "$tmp_log" >&2; exit 1; }
        for deb in "$C2"/debs/*.deb; do dpkg-deb -x "$deb" "$C2/root"; done
        printf '%s\n' "$wanted" >"$C2/wanted"
    fi
fi
echo "clients-deps: containerd 2 and CNI plugins in $C2/root: $("$C2/root/usr/bin/containerd" --version | cut -d' ' -f3), plugins $(tr '\n' ' ' <"$C2/wanted")"

# --- cnitool
if cnitool_built; then
    echo "clients-deps: $OUT/cnitool is built"
    exit 0
fi
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
