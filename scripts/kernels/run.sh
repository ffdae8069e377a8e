#!/usr/bin/env bash
# The kernel matrix: boots Debian's stock kernels under qemu with virtme-ng (the machine's
# root filesystem shared read-only) and runs the kernel-facing test suites inside each, from
# test executables built here beforehand (the VM never compiles). One line per kernel and
# suite, then one closing line `kernels: N passed, N failed` (counting tests; a suite that
# died without a result, or a kernel that could not be fetched or booted, counts as failed).
#
#   scripts/kernels/run.sh [SERIES...]        SERIES: 6.1, 6.12 (default: both)
#   KERNEL_SUITES="capture datapath ..."     which suites (default: all of SUITES below)
#
# Kernels come from the machine's own apt sources only (apt-get download of the newest
# linux-image-SERIES*-amd64-unsigned, unpacked under target/kernels/, never installed);
# a series the sources do not offer fails loudly. The VM's network namespaces, nftables
# and BPF are the VM kernel's own: nothing here touches the host's network configuration.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
work=$root/target/kernels
mkdir -p "$work/debs"

series=("$@")
[ ${#series[@]} -eq 0 ] && series=(6.1 6.12)

# suite name -> test source (its executable) and an optional name filter. Every suite is a
# test binary the host's `make test` also runs; the VM runs it against another kernel.
declare -A SUITE_TARGET=(
    [rules-kernel]=rules/tests/kernel.rs
    [services-kernel]=rules/tests/services_kernel.rs
    [services-memory]=rules/tests/services_memory.rs
    [node-memcg]=node/tests/memcg.rs
    [rules-conntrack]=rules/tests/conntrack.rs
    [capture]=conformance/tests/capture.rs
    [datapath]=conformance/tests/datapath.rs
    [services-datapath]=conformance/tests/services_datapath.rs
    [services-ipv6]=conformance/tests/services_ipv6.rs
    [kernel-features]=conformance/tests/kernel_features.rs
    [socket-lb]=conformance/tests/socket_lb.rs
    [doctor]=conformance/tests/cli.rs@doctor
)
ALL_SUITES="rules-kernel services-kernel services-memory node-memcg rules-conntrack capture datapath services-datapath services-ipv6 doctor socket-lb kernel-features"
read -r -a suites <<< "${KERNEL_SUITES:-$ALL_SUITES}"
for s in "${suites[@]}"; do
    [ -n "${SUITE_TARGET[$s]:-}" ] || { echo "kernels: unknown suite $s (known: $ALL_SUITES)" >&2; exit 2; }
done

# Tools: qemu, depmod (virtme-ng regenerates modules.dep for an unpacked kernel), busybox
# (virtme-ng's initramfs), clang and bpftool (the socket LB detection test's BPF program).
need=()
for p in qemu-system-x86 kmod busybox-static python3-venv clang llvm bpftool libbpf-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "kernels: installing ${need[*]}"
    apt-get -o DPkg::Lock::Timeout=600 update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        { echo "kernels: FAILED to install ${need[*]}"; echo "kernels: 0 passed, 1 failed"; exit 1; }
fi
VIRTME_NG_VERSION=1.42
venv=$work/venv
if ! "$venv/bin/vng" --version 2>/dev/null | grep -qx "virtme-ng $VIRTME_NG_VERSION"; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "virtme-ng==$VIRTME_NG_VERSION" ||
        { echo "kernels: FAILED to install virtme-ng $VIRTME_NG_VERSION"; echo "kernels: 0 passed, 1 failed"; exit 1; }
fi
export PATH=$venv/bin:$PATH

# The test executables, built here exactly as `make test` builds them (so after it, this is
# a no-op), and the plugin binary the conformance suites run.
echo "kernels: building the test executables (cargo test --no-run)"
exes=$work/executables.json
if ! cargo test --workspace --features aether-cni/fault-injection,aether-installer/fault-injection --no-run --message-format=json-render-diagnostics \
        > "$exes.raw" 2> "$work/build.log"; then
    tail -30 "$work/build.log"
    echo "kernels: FAILED to build the test executables"; echo "kernels: 0 passed, 1 failed"; exit 1
fi
python3 - "$exes.raw" "$root" > "$exes" <<'PY'
import json, os, sys
found = {}
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        found[os.path.relpath(m["target"]["src_path"], sys.argv[2])] = m["executable"]
print(json.dumps(found))
PY
# The socket-LB detection test's program, built here with Debian's clang (test-only).
bpf_obj=$work/connect4.bpf.o
if ! clang -O2 -target bpf -c "$root/conformance/tests/bpf/connect4.c" -o "$bpf_obj" 2> "$work/bpf-build.log"; then
    cat "$work/bpf-build.log"; echo "kernels: FAILED to build the test BPF program"; echo "kernels: 0 passed, 1 failed"; exit 1
fi
cni_bin=$root/target/debug/aether-cni
[ -x "$cni_bin" ] || { echo "kernels: FAILED: $cni_bin was not built"; echo "kernels: 0 passed, 1 failed"; exit 1; }

passed=0 failed=0

# The newest stock amd64 kernel of a series the apt sources offer: linux-image-6.1.0-N-amd64
# (bookworm) or linux-image-6.12.N+debNN-amd64 (bookworm-security). The plain flavour:
# the cloud one lacks 9p, which virtme-ng shares the root filesystem over.
kernel_package() {
    local s=$1 re
    case $s in
        6.1) re='^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$' ;;
        *) re="^linux-image-${s//./\\.}\\.[0-9]+\\+deb[0-9]+-amd64-unsigned\$" ;;
    esac
    apt-cache search --names-only "$re" 2>/dev/null | awk '{ print $1 }' | sort -V | tail -1
}

fetch_kernel() { # SERIES -> prints the unpacked vmlinuz path, or fails
    local s=$1 pkg ver dir deb
    pkg=$(kernel_package "$s")
    if [ -z "$pkg" ]; then
        apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1
        pkg=$(kernel_package "$s")
    fi
    [ -n "$pkg" ] || { echo "no linux-image-$s*-amd64-unsigned in this machine's apt sources" >&2; return 1; }
    ver=${pkg#linux-image-}; ver=${ver%-unsigned}
    dir=$work/root-$ver
    if [ ! -f "$dir/boot/vmlinuz-$ver" ]; then
        (cd "$work/debs" && apt-get download "$pkg" >/dev/null 2>"$work/debs/$pkg.err") ||
            { echo "apt-get download $pkg failed: $(tail -1 "$work/debs/$pkg.err")" >&2; return 1; }
        deb=$(ls "$work/debs/${pkg}_"*.deb | tail -1)
        rm -rf "$dir.tmp" && mkdir -p "$dir.tmp" && dpkg-deb -x "$deb" "$dir.tmp" &&
            depmod -b "$dir.tmp" "$ver" && mv "$dir.tmp" "$dir" && rm -f "$deb" ||
            { echo "unpacking $deb failed" >&2; return 1; }
    fi
    echo "$dir/boot/vmlinuz-$ver"
}

# KVM only when it truly boots a kernel here (a nested hypervisor may expose /dev/kvm and
# still hang); otherwise software emulation (TCG). Probed once, with the first kernel.
kvm_flag=unprobed
probe_kvm() {
    local kimg=$1 d=$work/kvm-probe
    kvm_flag=--disable-kvm
    [ -w /dev/kvm ] || { echo "kernels: no usable /dev/kvm: software emulation (TCG)"; return; }
    rm -rf "$d" && mkdir -p "$d"
    timeout --kill-after=5 40 vng --run "$kimg" --memory 512M --rwdir "$d" --exec "echo booted > $d/ok" \
        > "$d.console" 2>&1 </dev/null
    if [ -f "$d/ok" ]; then
        kvm_flag=""; echo "kernels: KVM boots a kernel here: using it"
    else
        echo "kernels: KVM did not boot a kernel within 40 s here: software emulation (TCG)"
    fi
}

# One boot of kernel image $1 (release $2) as $3 (the output directory's name, also the
# label), with kernel command line $4 added, running suites $5...: one line per suite.
boot() {
    local kimg=$1 ver=$2 label=$3 append=$4; shift 4
    local out=$work/out/$label specs=() suite t filter exe
    rm -rf "$out" && mkdir -p "$out/bin"
    # The VM runs copies: a build on the host meanwhile cannot swap a binary under a test.
    cp "$cni_bin" "$out/bin/aether-cni"
    for suite in "$@"; do
        t=${SUITE_TARGET[$suite]}; filter=""
        [[ $t == *@* ]] && { filter=@${t#*@}; t=${t%@*}; }
        exe=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' "$exes" "$t")
        if [ -z "$exe" ]; then
            echo "kernel $label  $suite: FAILED: no test executable for $t"; failed=$((failed + 1)); continue
        fi
        cp "$exe" "$out/bin/" && exe=$out/bin/${exe##*/}
        specs+=("$suite=$exe$filter")
    done
    [ ${#specs[@]} -gt 0 ] || return 0
    # The suites' state directories live under target/tmp (CARGO_TARGET_TMPDIR): writable in
    # the VM, on an overlay the host never sees; the rest of the root stays read-only.
    mkdir -p "$root/target/tmp"
    local start=$SECONDS vm_rc
    timeout --kill-after=10 "${KERNEL_TIMEOUT:-3600}" \
        vng --run "$kimg" $kvm_flag --memory "${KERNEL_MEMORY:-2G}" --cpus 2 --rwdir "$out" \
        --overlay-rwdir "$root/target/tmp" ${append:+--append "$append"} \
        --exec "AETHER_CNI_BIN=$out/bin/aether-cni AETHER_TEST_CONNECT4_OBJ=$bpf_obj $root/scripts/kernels/guest.sh $out ${specs[*]}" \
        > "$out/console.log" 2>&1 </dev/null
    vm_rc=$?
    # (virtme-ng's own exit status is not the suites': each suite's is read below.)
    echo "kernel $label: booted and ran in $((SECONDS - start)) s ($([ -z "$kvm_flag" ] && echo KVM || echo TCG)${append:+, $append})"
    local spec log p f rc secs verdict
    for spec in "${specs[@]}"; do
        suite=${spec%%=*}
        log=$out/$suite.log
        p=0 f=0
        if [ -f "$log" ]; then
            read -r p f < <(awk '/^test result: / { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } } END { print p+0, f+0 }' "$log")
        fi
        rc=$(cat "$out/$suite.rc" 2>/dev/null || echo none)
        secs=$(cat "$out/$suite.secs" 2>/dev/null || echo "?")
        if [ "$rc" = 0 ] && [ "$f" -eq 0 ] && [ "$p" -gt 0 ]; then
            verdict=ok
        else
            verdict=FAILED
            # A suite that died (or never ran) without counting its failure still fails.
            [ "$f" -eq 0 ] && f=1
        fi
        passed=$((passed + p)); failed=$((failed + f))
        printf 'kernel %-24s %-18s %-6s %3d passed, %d failed  %6s s  (%s)\n' "$label" "$suite" "$verdict" "$p" "$f" "$secs" "${log#$root/}"
        [ "$verdict" = ok ] || grep -E '^(test .* FAILED|---- |thread .* panicked)' "$log" 2>/dev/null | head -20 | sed 's/^/    /'
    done
    [ -f "$out/finished" ] || { echo "kernel $label: the VM did not finish its suites (exit $vm_rc; console: ${out#$root/}/console.log)"; tail -5 "$out/console.log" | sed 's/^/    /'; }
}

# Suites that need modules withheld run in a boot of their own, so the others see the whole
# kernel: the kernel refuses to load a module named in module_blacklist=, however asked.
WITHHELD=nft_tproxy,nft_objref
main_suites=() withheld_suites=()
for suite in "${suites[@]}"; do
    if [ "$suite" = kernel-features ]; then withheld_suites+=("$suite"); else main_suites+=("$suite"); fi
done

for s in "${series[@]}"; do
    if ! kimg=$(fetch_kernel "$s" 2>"$work/fetch-$s.err"); then
        echo "kernel $s: FAILED to fetch: $(cat "$work/fetch-$s.err")"
        failed=$((failed + 1)); continue
    fi
    [ "$kvm_flag" = unprobed ] && probe_kvm "$kimg"
    ver=${kimg##*/vmlinuz-}
    [ ${#main_suites[@]} -gt 0 ] && boot "$kimg" "$ver" "$ver" "" "${main_suites[@]}"
    [ ${#withheld_suites[@]} -gt 0 ] && boot "$kimg" "$ver" "$ver-withheld" "module_blacklist=$WITHHELD" "${withheld_suites[@]}"
done

echo "kernels: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
