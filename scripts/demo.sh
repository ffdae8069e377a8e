#!/usr/bin/env bash
# make demo: a simulated node (network namespaces only; the real host is never touched),
# a pod attached through the CNI protocol, its traffic captured, DNS answered by the node
# DNS proxy, then DEL and the same traffic going straight through. Root only.
set -euo pipefail
BIN=${1:-target/release/aether-cni}
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "make demo needs root: it builds network namespaces for a simulated node" >&2
	exit 1
fi
[ -x "$BIN" ] || { echo "no binary at $BIN (run make build)" >&2; exit 1; }
exec "${CARGO:-cargo}" run -q -p aether-conformance --example demo -- "$(realpath "$BIN")"
