"""charts/aether-cni/values.schema.json, through the same Helm engine as test_chart.py: the
values the chart documents and the test's value sets pass; each mistyped, misspelt or out of
range value is refused by Helm, naming where it is, before anything is rendered."""

import copy

import helm_python as helm
import pytest
import yaml

from test_chart import CHART, K3S, NAMESPACE, RELEASE, TUNED, render

MONITORED = {
    "metrics": {
        "podMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "5s", "labels": {"release": "prom"}},
        "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1", "team": "mesh"}},
    }
}
DUAL_STACK = {
    "plugin": {
        "excludeOutboundCIDRs": ["10.0.0.0/24", "fd00:10::/64", "2001:db8::1"],
        "excludeOutboundPorts": [22, "9000-9100"],
        "divertMark": 7793,
        "captureDNS": True,
        "scopedPorts": None,
        "excludeNamespaces": None,
    },
    "hostPaths": {"netnsDir": "/run/netns"},
}


def refusal(values):
    """Helm's message for `values`, or None when it renders them."""
    chart = helm.Chart.load(CHART)
    try:
        chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    except helm.HelmValuesError as e:
        return str(e)
    return None


def test_the_chart_has_a_schema_and_helm_applies_it():
    chart = helm.Chart.load(CHART)
    assert chart.schema is not None and chart.schema["additionalProperties"] is False
    assert refusal({"plugin": {"captureMode": "everything"}}) is not None


def test_without_the_schema_the_same_bad_value_renders(tmp_path):
    # The negative control of this file: a copy of the chart without its schema renders the
    # bad value, so the refusals below come from the schema, not from the templates.
    copy_dir = helm.Chart.load(CHART).save_dir(tmp_path)
    (tmp_path / "aether-cni" / "values.schema.json").unlink()
    schemaless = helm.Chart.load(copy_dir)
    schemaless.render({"plugin": {"captureMode": "everything"}}, name=RELEASE, namespace=NAMESPACE, is_install=True)


@pytest.mark.parametrize(
    "values", [{}, K3S, TUNED, MONITORED, DUAL_STACK], ids=["defaults", "k3s", "tuned", "monitored", "dual-stack"]
)
def test_good_values_pass(values):
    assert refusal(values) is None
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    assert not report.get("errors"), report


def test_every_documented_value_is_in_the_schema():
    """values.yaml itself passes, and every key it has is a property the schema names (a
    value added to values.yaml without the schema would be refused by additionalProperties)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert refusal(values) is None
    schema = helm.Chart.load(CHART).schema

    def walk(v, s, where):
        if isinstance(v, dict) and "properties" in s:
            for k, sub in v.items():
                assert k in s["properties"], f"{where}{k} is in values.yaml but not in the schema"
                walk(sub, s["properties"][k], f"{where}{k}.")

    walk(values, schema, "")


BAD = [
    ({"plugin": {"captureMode": "everything"}}, "/plugin/captureMode", "must be one of"),
    ({"plugin": {"captureModee": "scoped"}}, "/plugin", "'captureModee' not allowed"),
    ({"plugn": {}}, "at ''", "'plugn' not allowed"),
    ({"plugin": {"capturePort": 70000}}, "/plugin/capturePort", ""),
    ({"plugin": {"capturePort": "18001"}}, "/plugin/capturePort", ""),
    ({"plugin": {"captureDNS": "false"}}, "/plugin/captureDNS", "got string"),
    ({"plugin": {"scopedPorts": [0]}}, "/plugin/scopedPorts/0", "minimum"),
    ({"plugin": {"excludeOutboundPorts": [22, "ssh"]}}, "/plugin/excludeOutboundPorts/1", ""),
    ({"plugin": {"excludeOutboundCIDRs": "10.0.0.0/8"}}, "/plugin/excludeOutboundCIDRs", "got string"),
    ({"plugin": {"excludeOutboundCIDRs": ["10.0.0.0/8,10.1.0.0/16"]}}, "/plugin/excludeOutboundCIDRs/0", "pattern"),
    ({"plugin": {"excludeNamespaces": ["Kube_System"]}}, "/plugin/excludeNamespaces/0", "pattern"),
    ({"plugin": {"divertMark": "ae71"}}, "/plugin/divertMark", ""),
    ({"plugin": {"routeTable": 254}}, "/plugin/routeTable", ""),
    ({"plugin": {"rulePriority": 32766}}, "/plugin/rulePriority", ""),
    ({"plugin": {"logLevel": "verbose"}}, "/plugin/logLevel", "must be one of"),
    ({"plugin": {"logFile": "aether.log"}}, "/plugin/logFile", ""),
    ({"image": {"tag": 1.2}}, "/image/tag", "want string"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", "must be one of"),
    ({"hostPaths": {"cniBinDir": "opt/cni/bin"}}, "/hostPaths/cniBinDir", "pattern"),
    ({"installer": {"port": 0}}, "/installer/port", "minimum"),
    ({"installer": {"uninstallOnStop": "yes"}}, "/installer/uninstallOnStop", "want boolean"),
    ({"installer": {"conflistName": "aether.conf"}}, "/installer/conflistName", "pattern"),
    ({"installer": {"resyncSeconds": 0}}, "/installer/resyncSeconds", "minimum"),
    ({"installer": {"uninstallWaitSeconds": -1}}, "/installer/uninstallWaitSeconds", "minimum"),
    ({"installer": {"uninstallWaitSeconds": "20s"}}, "/installer/uninstallWaitSeconds", "want integer"),
    ({"installer": {"maxConnections": 0}}, "/installer/maxConnections", "minimum"),
    ({"metrics": {"port": 70000}}, "/metrics/port", "maximum"),
    ({"metrics": {"enabled": "yes"}}, "/metrics/enabled", "want boolean"),
    ({"metrics": {"podMonitor": {"enabled": "true"}}}, "/metrics/podMonitor/enabled", "want boolean"),
    ({"metrics": {"podMonitor": {"interval": "30 seconds"}}}, "/metrics/podMonitor/interval", "pattern"),
    ({"reconciler": {"missedPods": "delete"}}, "/reconciler/missedPods", "must be one of"),
    ({"reconciler": {"periodSeconds": 0}}, "/reconciler/periodSeconds", "minimum"),
    ({"reconciler": {"criSocket": "run/containerd/containerd.sock"}}, "/reconciler/criSocket", ""),
    ({"reconciler": {"criMaxMessageMiB": 0}}, "/reconciler/criMaxMessageMiB", "minimum"),
    ({"reconciler": {"criPassBudgetSeconds": 0}}, "/reconciler/criPassBudgetSeconds", "minimum"),
    ({"reconciler": {"criTimeoutSeconds": "5s"}}, "/reconciler/criTimeoutSeconds", "want integer"),
    ({"reconciler": {"enabled": "yes"}}, "/reconciler/enabled", "want boolean"),
    ({"updateStrategy": {"type": "Recreate"}}, "/updateStrategy/type", "must be one of"),
    ({"probes": {"readiness": {"periodSeconds": 0, "failureThreshold": 1}}}, "/probes/readiness/periodSeconds", "minimum"),
    ({"podLabels": {"tier": 1}}, "/podLabels/tier", "want string"),
]


@pytest.mark.parametrize("values,where,why", BAD, ids=[w + ":" + repr(v)[:40] for v, w, _ in BAD])
def test_a_bad_value_is_refused_naming_where_it_is(values, where, why):
    message = refusal(values)
    assert message is not None, f"Helm rendered {values}"
    assert where in message and why in message, message
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    assert report.get("errors"), f"helm lint passed {values}"


def test_a_refusal_names_every_bad_value_at_once():
    values = copy.deepcopy(TUNED)
    values["plugin"]["captureMode"] = "all"
    values["installer"]["port"] = "http"
    message = refusal(values)
    assert "/plugin/captureMode" in message and "/installer/port" in message, message


def test_the_monitoring_objects_render_only_when_enabled():
    # (The Events' ServiceAccount and RBAC are on by default: test_events.py.)
    rbac = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
    kinds = [o["kind"] for o in render({})[0] if o["kind"] not in rbac]
    assert kinds == ["DaemonSet"]
    kinds = sorted(o["kind"] for o in render(MONITORED)[0] if o["kind"] not in rbac)
    assert kinds == ["ConfigMap", "DaemonSet", "PodMonitor"]
