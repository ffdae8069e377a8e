#!/usr/bin/env bash
# A pod netns, attached through the CNI protocol as a runtime would: ADD, look, CHECK, DEL.
set -euo pipefail
BIN=${1:-target/release/aether-cni}
NS=aether-demo-$$
cleanup() { ip netns del "$NS" 2>/dev/null || true; }
trap cleanup EXIT

ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" addr add 10.244.1.5/24 dev lo
export CNI_CONTAINERID=demo-$$ CNI_NETNS=/run/netns/$NS CNI_IFNAME=eth0 CNI_PATH=/opt/cni/bin
export CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0"
CONF=$(cat <<JSON
{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"aether-cni","hostIP":"10.0.0.1",
 "capabilities":{"io.kubernetes.cri.pod-annotations":true},
 "prevResult":{"cniVersion":"1.0.0",
   "interfaces":[{"name":"eth0","mac":"0a:58:0a:f4:01:05","sandbox":"/run/netns/$NS"}],
   "ips":[{"address":"10.244.1.5/24","gateway":"10.244.1.1","interface":0}],
   "routes":[{"dst":"0.0.0.0/0","gw":"10.244.1.1"}]}}
JSON
)
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "ADD (the result is prevResult, passed through)"
echo "$CONF" | CNI_COMMAND=ADD "$BIN" 2>/dev/null
say "nft list ruleset in the pod"
ip netns exec "$NS" nft list ruleset
say "ip rule / ip route show table 44657 in the pod"
ip -n "$NS" rule
ip -n "$NS" route show table 44657
say "CHECK (silent when intact)"
echo "$CONF" | CNI_COMMAND=CHECK "$BIN" 2>/dev/null && echo "intact"
say "tamper: delete the passthrough rule, CHECK again"
h=$(ip netns exec "$NS" nft -a list chain ip aether_capture egress_divert | awk '/passthrough/ {print $NF}')
ip netns exec "$NS" nft delete rule ip aether_capture egress_divert handle "$h"
echo "$CONF" | CNI_COMMAND=CHECK "$BIN" 2>/dev/null || echo "(CHECK failed, as it should)"
say "DEL, then the pod netns is clean"
echo "$CONF" | CNI_COMMAND=DEL "$BIN" 2>/dev/null
ip netns exec "$NS" nft list ruleset
ip -n "$NS" rule
