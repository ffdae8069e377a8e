#!/usr/bin/env bash
# Renders, lints and validates charts/aether-cni with a real Helm engine, and feeds the
# DaemonSet's args to `aether-cni-installer --print-entry` (make chart-test).
# Installs what it needs into target/chart-venv (pip with the machine's own configuration).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/chart-venv
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" 2>/dev/null; then
        # Debian's python3 ships venv separately.
        rm -rf "$venv"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$venv"
    fi
fi
stamp="$venv/.requirements"
if ! cmp -s charts/tests/requirements.txt "$stamp"; then
    "$venv/bin/pip" install -q -r charts/tests/requirements.txt
    cp charts/tests/requirements.txt "$stamp"
fi
# The chart's args go through the real installer (--print-entry): the one `make test` built
# (AETHER_INSTALLER_BIN), or this build's (it installs the aether-cni beside it).
export AETHER_INSTALLER_BIN=${AETHER_INSTALLER_BIN:-$PWD/target/debug/aether-cni-installer}
[ -x "$AETHER_INSTALLER_BIN" ] || ${CARGO:-cargo} build -q -p aether-installer -p aether-cni
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider charts/tests "$@"
