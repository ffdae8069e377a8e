#!/bin/bash
# Runs inside a kernel matrix VM (virtme-ng, the host's root filesystem read-only): each
# suite's prebuilt test executable, its output into OUT/SUITE.log and its exit code into
# OUT/SUITE.rc. The VM never compiles; the host reads the results after the VM powers off.
#   guest.sh OUT SUITE=EXECUTABLE[@FILTER]...
set -u
out=$1; shift
# From the workspace root (the suites find their files by absolute, compiled-in paths).
cd "$(dirname "$0")/../.." || exit 1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export AETHER_REQUIRE_ROOT_TESTS=1 RUST_BACKTRACE=1
# The tests that must never run on the host itself (attaching BPF at the root cgroup) look
# for this, and for virtme's kernel command line.
export AETHER_KERNEL_MATRIX_VM=1
uname -r > "$out/uname"
# Modules the matrix withholds (module_blacklist= on the kernel command line) stay out
# however a test asks for them; say which were withheld beside the results.
tr ' ' '\n' < /proc/cmdline | sed -n 's/^module_blacklist=//p' > "$out/withheld"
for spec in "$@"; do
    suite=${spec%%=*}; rest=${spec#*=}
    exe=${rest%%@*}; filter=""
    [ "$rest" != "$exe" ] && filter=${rest#*@}
    start=$(date +%s.%N)
    # --show-output: what passing tests print (the messages a kernel gave) stays in the log.
    "$exe" --show-output ${filter:+"$filter"} > "$out/$suite.log" 2>&1
    echo $? > "$out/$suite.rc"
    end=$(date +%s.%N)
    echo "$start $end" | awk '{ printf "%.1f\n", $2 - $1 }' > "$out/$suite.secs"
done
echo done > "$out/finished"
