#!/usr/bin/env bash
# make demo: the whole product on a simulated node (network namespaces only; the real host is
# never touched): the capture through the CNI protocol, the agent's Service layer, STATUS, GC
# and the logs. Root only. The demo removes its namespaces and state directory itself, also
# when a step fails; if it is interrupted or killed, this script removes them (they carry the
# demo process's PID in their names: aeth-<tag>-<pid>-<n>, <tmp>/aeth-demo-<pid>-<n>-state).
set -euo pipefail
BIN=${1:-target/release/aether-cni}
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "make demo needs root: it builds network namespaces for a simulated node" >&2
	exit 1
fi
[ -x "$BIN" ] || { echo "no binary at $BIN (run make build)" >&2; exit 1; }
"${CARGO:-cargo}" build -q -p aether-conformance --example demo
DEMO=${CARGO_TARGET_DIR:-target}/debug/examples/demo

leftovers() {
	local pid=$1 ns
	for ns in $(ip netns list | awk '{print $1}' | grep -E "^aeth-[a-z0-9]+-$pid-[0-9]+$" || true); do
		ip netns del "$ns" && echo "removed netns $ns the demo left" >&2
	done
	rm -rf "${TMPDIR:-/tmp}"/aeth-demo-"$pid"-*-state
}

"$DEMO" "$(realpath "$BIN")" &
pid=$!
# A background job of a script ignores SIGINT, so an interrupt is passed on as SIGTERM.
trap 'kill -TERM "$pid" 2>/dev/null || true; wait "$pid" || true; leftovers "$pid"; exit 130' INT TERM
rc=0
wait "$pid" || rc=$?
trap - INT TERM
leftovers "$pid"
exit "$rc"
