"""charts/aether-cni rendered and linted by Helm v4's engine (helm-python-sdk, offline), every
object validated against the Kubernetes schemas (kubernetes-validate), and the DaemonSet's
mounts, env, args and probes asserted for the default values and two non-default sets."""

import copy
import json
import os
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "aether-cni"
RELEASE, NAMESPACE = "aether", "kube-system"

# A k3s-like node with everything non-default on the installer side.
K3S = {
    "hostPaths": {
        "cniBinDir": "/var/lib/rancher/k3s/data/cni",
        "cniConfDir": "/var/lib/rancher/k3s/agent/etc/cni/net.d",
        "stateDir": "/run/aether",
        "netnsDir": "",
    },
    "installer": {
        "port": 19095,
        "uninstallOnStop": True,
        "conflistName": "000-aether.conflist",
        "resyncSeconds": 3,
        "maxConnections": 64,
    },
    "metrics": {"enabled": False},
    "reconciler": {"enabled": False},
    "servicesSocket": {"enabled": False},
    "events": {"enabled": False},
    "image": {"repository": "images.invalid/mesh/aether-cni", "tag": "v9", "pullSecrets": ["regcred"]},
}
# Every plugin setting given.
TUNED = {
    "plugin": {
        "captureMode": "scoped",
        "captureDNS": False,
        "capturePort": 15001,
        "meshL4Port": 15082,
        "scopedPorts": [15081, 15082],
        "dnsProxyPort": 15054,
        "divertMark": "0x1e71",
        "passthroughMark": "0x1e7e",
        "routeTable": 100,
        "rulePriority": 1000,
        "excludeOutboundCIDRs": ["10.0.0.0/24", "192.0.2.7"],
        "excludeOutboundPorts": [22, "9000-9100"],
        "excludeNamespaces": ["kube-system", "infra"],
        "logFile": "/var/log/aether-cni.log",
        "logLevel": "debug",
    },
    "installer": {"hostIPsFromNode": True},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "mesh", "effect": "NoSchedule"}],
    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    "updateStrategy": {"type": "OnDelete"},
}


def render(values):
    chart = helm.Chart.load(CHART)
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects, notes = [], None
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects, notes


def daemonset(values):
    objects, _ = render(values)
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    return ds


def container(ds):
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("values", [{}, K3S, TUNED], ids=["defaults", "k3s", "tuned"])
def test_lint_is_clean_and_every_object_is_valid_kubernetes(values):
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not bad, bad
    objects, notes = render(values)
    rbac = [] if values is K3S else ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    assert [o["kind"] for o in objects] == ["DaemonSet", *rbac]
    version = kubernetes_validate.utils.latest_version()
    for o in objects:
        kubernetes_validate.validate(o, version, strict=True)
    assert "rollout status daemonset/aether-aether-cni" in notes


def test_validation_can_fail():
    """Negative control: a misspelled field is caught by the schema check used above."""
    ds = daemonset({})
    broken = copy.deepcopy(ds)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.utils.latest_version(), strict=True)


def test_defaults():
    ds = daemonset({})
    spec = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert ds["metadata"]["namespace"] == NAMESPACE
    assert spec["hostNetwork"] is True and spec["automountServiceAccountToken"] is False
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}], "every taint tolerated"
    assert spec["terminationGracePeriodSeconds"] == 30
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert c["image"] == "localhost/aether-cni:0.1.0"
    assert c["command"] == ["/aether-cni-installer"]
    assert c["args"] == [
        "--cni-bin-dir=/host/opt/cni/bin",
        "--cni-conf-dir=/host/etc/cni/net.d",
        "--state-dir=/var/run/aether-cni",
        "--netns-dir=/var/run/netns",
        "--conflist-name=00-aether-cni.conflist",
        "--listen=127.0.0.1:18095",
        "--metrics-listen=$(HOST_IP):18096",
        "--http-max-connections=256",
        "--resync-seconds=10",
        "--upgrade",
        "--cri-socket=/run/containerd/containerd.sock",
        "--cri-max-message-mib=16",
        "--cri-timeout-seconds=5",
        "--cri-pass-budget-seconds=10",
        "--missed-pods=restart",
        "--reconcile-period-seconds=10",
        "--reconcile-max-actions=5",
        "--reconcile-backoff-seconds=30",
        "--reconcile-attempts=3",
        "--leftover-grace-seconds=60",
        "--events",
        "--events-writes-per-second=1",
        "--services-socket=/var/run/aether-cni/agent/services.sock",
    ]
    assert c["env"] == [
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    assert c["ports"] == [
        {"name": "probes", "containerPort": 18095, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 18096, "protocol": "TCP"},
    ]
    # The probes on loopback, out of every pod's reach; only /metrics on the node's address.
    assert c["readinessProbe"]["httpGet"] == {"host": "127.0.0.1", "path": "/readyz", "port": "probes"}
    assert c["livenessProbe"]["httpGet"] == {"host": "127.0.0.1", "path": "/healthz", "port": "probes"}
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "SYS_ADMIN"]}
    assert "privileged" not in sc and sc["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert {n: m["mountPath"] for n, m in mounts.items()} == {
        "cni-bin": "/host/opt/cni/bin",
        "cni-conf": "/host/etc/cni/net.d",
        "state": "/var/run/aether-cni",
        "netns": "/var/run/netns",
        "cri-socket": "/run/containerd/containerd.sock",
        "events-token": "/var/run/secrets/kubernetes.io/serviceaccount",
    }
    assert mounts["netns"]["readOnly"] is True and mounts["netns"]["mountPropagation"] == "HostToContainer"
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert volumes == {
        "cni-bin": "/opt/cni/bin",
        "cni-conf": "/etc/cni/net.d",
        "state": "/var/run/aether-cni",
        "netns": "/var/run/netns",
        "cri-socket": "/run/containerd/containerd.sock",
    }
    (socket,) = [v for v in spec["volumes"] if v["name"] == "cri-socket"]
    assert socket["hostPath"]["type"] == "Socket", "a missing socket fails the pod's start, naming it"
    assert c["resources"]["limits"] == {"memory": "658Mi"}, "computed from serviceLayerMemory's defaults"


MIB = 1 << 20


def expected_limit(services, pods, dual_stack, per_service, base_mib):
    """docs/operating.md's formula, in whole MiB rounded up."""
    needed = base_mib * MIB + pods * services * (2 if dual_stack else 1) * per_service
    with_headroom = -(-needed * 10 // 9)
    return f"{-(-with_headroom // MIB)}Mi"


def memory_limit(values):
    return container(daemonset(values))["resources"]["limits"]["memory"]


def test_the_memory_limit_follows_the_expected_services_and_pods():
    # The defaults: 10,000 Services, 110 pods, dual-stack, 221 bytes a Service, 128 MiB.
    assert memory_limit({}) == expected_limit(10000, 110, True, 221, 128) == "658Mi"
    cases = [
        (100000, 30, False, 221, 128),
        (2000, 250, True, 80, 64),
        (0, 1, False, 1, 16),
    ]
    for services, pods, dual, per, base in cases:
        values = {
            "serviceLayerMemory": {
                "services": services,
                "podsPerNode": pods,
                "dualStack": dual,
                "bytesPerService": per,
                "baseMiB": base,
            }
        }
        assert memory_limit(values) == expected_limit(services, pods, dual, per, base), values
    # Each input moves the limit (the formula is not a constant).
    base = {"services": 10000, "podsPerNode": 110, "dualStack": True, "bytesPerService": 221, "baseMiB": 128}
    for key, other in [("services", 20000), ("podsPerNode", 50), ("dualStack", False), ("bytesPerService", 80)]:
        assert memory_limit({"serviceLayerMemory": {**base, key: other}}) != "658Mi", key
    # A limit given is used as it is; the requests are left alone.
    c = container(daemonset({"resources": {"limits": {"memory": "1Gi"}}}))
    assert c["resources"] == {"requests": {"cpu": "10m", "memory": "48Mi"}, "limits": {"memory": "1Gi"}}


def test_reconciler_values_become_flags_and_the_socket_mount():
    values = {
        "reconciler": {
            "criSocket": "/run/k3s/containerd/containerd.sock",
            "criMaxMessageMiB": 32,
            "criTimeoutSeconds": 2,
            "criPassBudgetSeconds": 7,
            "missedPods": "capture",
            "periodSeconds": 3,
            "maxActionsPerPass": 2,
            "backoffSeconds": 5,
            "attempts": 7,
            "leftoverGraceSeconds": 15,
        }
    }
    ds = daemonset(values)
    c = container(ds)
    assert c["args"][10:-3] == [
        "--cri-socket=/run/k3s/containerd/containerd.sock",
        "--cri-max-message-mib=32",
        "--cri-timeout-seconds=2",
        "--cri-pass-budget-seconds=7",
        "--missed-pods=capture",
        "--reconcile-period-seconds=3",
        "--reconcile-max-actions=2",
        "--reconcile-backoff-seconds=5",
        "--reconcile-attempts=7",
        "--leftover-grace-seconds=15",
    ]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["cri-socket"] == "/run/k3s/containerd/containerd.sock"
    # On without a socket: no mount, and the binary is told no socket.
    c = container(daemonset({"reconciler": {"criSocket": ""}}))
    assert not any(a.startswith("--cri-socket") for a in c["args"])
    assert "cri-socket" not in {m["name"] for m in c["volumeMounts"]}
    # The binary accepts these flags (and refuses a policy it does not know, naming it: the
    # schema refuses it first in the chart, test_schema.py).
    entry_from_args(values)
    out = subprocess.run(
        [os.environ["AETHER_INSTALLER_BIN"], "--missed-pods=delete", "--print-entry"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and '"delete" is not a missed-pod policy' in out.stderr, out.stderr


def test_the_services_socket_is_in_the_state_directory_and_can_be_turned_off():
    c = container(daemonset({"hostPaths": {"stateDir": "/run/aether"}}))
    assert c["args"][-1] == "--services-socket=/run/aether/agent/services.sock"
    # The installer's state mount holds the socket's directory: nothing else is mounted for it.
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/run/aether" in mounts and not any(m.startswith("/run/aether/") for m in mounts)
    _, notes = render({"hostPaths": {"stateDir": "/run/aether"}})
    assert "--socket /run/aether/agent/services.sock" in notes
    c = container(daemonset({"servicesSocket": {"enabled": False}}))
    assert c["args"][-1] == "--services-socket=", "off: the binary is told no socket"
    _, notes = render({"servicesSocket": {"enabled": False}})
    assert "services.sock" not in notes
    # Without the pods' network namespaces the socket could reach no pod: refused, naming both.
    with pytest.raises(Exception, match="servicesSocket.enabled needs hostPaths.netnsDir"):
        render({"hostPaths": {"netnsDir": ""}})
    # The binary accepts both forms.
    for enabled in (True, False):
        entry_from_args({"servicesSocket": {"enabled": enabled}})


def test_k3s_paths_port_and_uninstall_on_stop():
    ds = daemonset(K3S)
    spec = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert c["image"] == "images.invalid/mesh/aether-cni:v9"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert c["args"] == [
        "--cni-bin-dir=/host/var/lib/rancher/k3s/data/cni",
        "--cni-conf-dir=/host/var/lib/rancher/k3s/agent/etc/cni/net.d",
        "--state-dir=/run/aether",
        "--conflist-name=000-aether.conflist",
        "--listen=127.0.0.1:19095",
        "--http-max-connections=64",
        "--resync-seconds=3",
        "--uninstall-wait-seconds=20",
        "--reconcile=false",
        "--services-socket=",
    ], "no --upgrade but the uninstall's wait: a stopped installer uninstalls; no --netns-dir (none mounted); no --metrics-listen: /metrics on loopback only; no reconciler, no CRI socket; no Service-layer socket"
    assert c["ports"] == [{"name": "probes", "containerPort": 19095, "protocol": "TCP"}]
    assert [m["mountPath"] for m in c["volumeMounts"]] == [
        "/host/var/lib/rancher/k3s/data/cni",
        "/host/var/lib/rancher/k3s/agent/etc/cni/net.d",
        "/run/aether",
    ], "no netns mount when netnsDir is empty, no CRI socket when the reconciler is off"
    assert [v["hostPath"]["path"] for v in spec["volumes"]] == [
        "/var/lib/rancher/k3s/data/cni",
        "/var/lib/rancher/k3s/agent/etc/cni/net.d",
        "/run/aether",
    ]
    _, notes = render(K3S)
    assert "uninstallOnStop is true" in notes
    assert "curl http://127.0.0.1:19095/metrics" in notes


def test_the_uninstall_wait_must_fit_in_the_grace_period():
    # At the bound (the wait plus 5 s is the grace period) it renders, and reaches the flag.
    c = container(daemonset({"installer": {"uninstallOnStop": True, "uninstallWaitSeconds": 25}}))
    assert "--uninstall-wait-seconds=25" in c["args"]
    # One second over: refused, naming both values and what would fit.
    for values in (
        {"installer": {"uninstallOnStop": True, "uninstallWaitSeconds": 26}},
        {"installer": {"uninstallWaitSeconds": 20}, "terminationGracePeriodSeconds": 24},
    ):
        with pytest.raises(Exception, match=r"installer.uninstallWaitSeconds \((26|20)\) does not fit in terminationGracePeriodSeconds \((30|24)\).*at least (31|25)"):
            render(values)
    # A longer wait with the grace period raised to hold it.
    big = {"installer": {"uninstallOnStop": True, "uninstallWaitSeconds": 50}, "terminationGracePeriodSeconds": 55}
    ds = daemonset(big)
    assert ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 55
    assert "--uninstall-wait-seconds=50" in container(ds)["args"]
    # Checked whatever uninstallOnStop says (it may be turned on later with --reuse-values),
    # and passed only with it: an upgrade's stop waits for nothing.
    with pytest.raises(Exception, match="does not fit in terminationGracePeriodSeconds"):
        render({"installer": {"uninstallWaitSeconds": 26}})
    assert not any(a.startswith("--uninstall-wait-seconds") for a in container(daemonset({}))["args"])
    # The binary accepts the flag as the chart passes it.
    entry_from_args(big)


def test_every_plugin_setting_becomes_a_flag():
    ds = daemonset(TUNED)
    spec = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert c["args"][10:-13] == [
        "--capture-mode=scoped",
        "--capture-dns=false",
        "--capture-port=15001",
        "--mesh-l4-port=15082",
        "--scoped-ports=15081,15082",
        "--dns-proxy-port=15054",
        "--divert-mark=0x1e71",
        "--passthrough-mark=0x1e7e",
        "--route-table=100",
        "--rule-priority=1000",
        "--exclude-outbound-cidrs=10.0.0.0/24,192.0.2.7",
        "--exclude-outbound-ports=22,9000-9100",
        "--exclude-namespaces=kube-system,infra",
        "--log-file=/var/log/aether-cni.log",
        "--log-level=debug",
    ]
    assert spec["tolerations"] == TUNED["tolerations"]
    assert c["resources"] == TUNED["resources"]
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    # Probes and env do not depend on the plugin settings.
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"


NODE_ENV = {"status.hostIP": "10.0.0.21", "status.hostIPs": "10.0.0.21,fd00::21", "spec.nodeName": "node-a"}


def entry_from_args(values, node=NODE_ENV):
    """The DaemonSet's args and env, as the kubelet expands them for a node with `node`'s
    fields, given to the real installer's `--print-entry`: the entry the plugin will
    receive, checked by its own parser."""
    c = container(daemonset(values))
    env = {e["name"]: node[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in c["env"]}
    args = [a.replace("$(HOST_IP)", env["HOST_IP"]) for a in c["args"]]
    out = subprocess.run(
        [os.environ["AETHER_INSTALLER_BIN"], *c["command"][1:], *args, "--print-entry"],
        env={**env, "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_binary_accepts_the_default_args():
    assert entry_from_args({}) == {
        "type": "aether-cni",
        "name": "print-entry",
        "cniVersion": "1.1.0",
        "capabilities": {"io.kubernetes.cri.pod-annotations": True},
        "hostIP": "10.0.0.21",
        "stateDir": "/var/run/aether-cni",
    }
    assert entry_from_args(K3S)["stateDir"] == "/run/aether"


def test_every_plugin_value_reaches_the_entry_through_the_binary():
    entry = entry_from_args(TUNED)
    for key, value in TUNED["plugin"].items():
        assert entry[key] == value, key


def test_a_bad_plugin_value_is_refused_by_the_binary_naming_it():
    # A value the chart's schema cannot tell is wrong (it has the shape of a CIDR), so it
    # reaches the node, where the plugin's own parser refuses it by name. Values the schema
    # does refuse are in test_schema.py.
    c = container(daemonset({"plugin": {"excludeOutboundCIDRs": ["10.0.0.0/33"]}}))
    out = subprocess.run(
        [os.environ["AETHER_INSTALLER_BIN"], *[a.replace("$(HOST_IP)", "10.0.0.21") for a in c["args"]], "--print-entry"],
        env={"HOST_IP": "10.0.0.21", "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and 'field "excludeOutboundCIDRs" has "10.0.0.0/33"' in out.stderr, out.stderr


def test_node_addresses_of_both_families_reach_the_entry():
    c = container(daemonset({"installer": {"hostIPsFromNode": True}}))
    assert c["env"][1] == {"name": "HOST_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIPs"}}}
    entry = entry_from_args({"installer": {"hostIPsFromNode": True}})
    assert (entry["hostIP"], entry["hostIPv6"]) == ("10.0.0.21", "fd00::21")
    # An IPv6-only node: status.hostIP is IPv6; it becomes hostIPv6 and the listen address.
    entry = entry_from_args({}, {"status.hostIP": "fd00::22", "spec.nodeName": "node-a"})
    assert "hostIP" not in entry and entry["hostIPv6"] == "fd00::22"
