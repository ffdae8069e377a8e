"""The chart's monitoring: the PodMonitor (metrics.podMonitor.enabled) selects exactly the
installer pods and scrapes the port they serve /metrics on; the Grafana dashboard
(dashboards/aether-cni.json, also shipped as a ConfigMap) queries only series the binary
exports, read from a real installer's /metrics."""

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from test_chart import CHART, container, render

DASHBOARD = CHART / "dashboards" / "aether-cni.json"
MONITORED = {"metrics": {"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}}}
# Labels Prometheus adds to every series it scrapes through the PodMonitor.
TARGET_LABELS = {"node", "instance", "job"}


def objects(values):
    return {o["kind"]: o for o in render(values)[0]}


def test_the_pod_monitor_selects_the_installer_pods_and_their_metrics_port():
    o = objects({"metrics": {"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}})
    pm, ds = o["PodMonitor"], o["DaemonSet"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert pm["metadata"]["labels"]["release"] == "prom"
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    selector = pm["spec"]["selector"]["matchLabels"]
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items()), (selector, pod_labels)
    assert selector == ds["spec"]["selector"]["matchLabels"], "the same pods as the DaemonSet, no more"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [ds["metadata"]["namespace"]]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p for p in container(ds)["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics", endpoint
    assert endpoint["interval"] == "15s" and endpoint["honorLabels"] is True
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]


def test_the_dashboard_config_map_carries_the_dashboard_file():
    cm = objects(MONITORED)["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["aether-cni.json"]) == json.loads(DASHBOARD.read_text())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{family: (type, label names seen)} from a real installer's /metrics, on a fake node of
    temp directories (no main CNI yet, so it also reports an error), stopped by its PID."""
    node = tmp_path_factory.mktemp("node")
    for d in ("bin", "conf", "state"):
        (node / d).mkdir()
    port = free_port()
    proc = subprocess.Popen(
        [os.environ["AETHER_INSTALLER_BIN"], f"--cni-bin-dir={node / 'bin'}", f"--cni-conf-dir={node / 'conf'}",
         f"--state-dir={node / 'state'}", f"--listen=127.0.0.1:{port}", "--host-ip=10.0.0.21"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline, text = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                if "aether_cni_installer_last_error{" in text:
                    break
            except OSError:
                pass
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = (kind, set())
    for line in text.splitlines():
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? ", line)
        if m and not line.startswith("#"):
            name = m.group(1)
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in families else name
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
            families[family][1].update(labels)
    assert "aether_cni_installer_ready" in families and "aether_cni_service_connections_total" in families, text
    return families


def queries(dashboard):
    found = []
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            found.append((p["title"], t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            found.append((f"variable {v['name']}", v["definition"]))
    return found


def unknown_series(dashboard, families):
    """Each series a query names that the binary does not export, and each label a query
    groups or filters by that its series do not carry."""
    problems = []
    for where, expr in queries(dashboard):
        names = set(re.findall(r"\baether_cni_[a-z0-9_]+", expr))
        if not names:
            problems.append(f"{where}: no aether-cni series in {expr!r}")
        for name in names:
            family = name
            if name not in families:
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                if families.get(base, ("",))[0] == "histogram":
                    family = base
                else:
                    problems.append(f"{where}: {name} is not exported")
                    continue
            kind, labels = families[family]
            allowed = labels | TARGET_LABELS | ({"le"} if kind == "histogram" else set())
            used = set()
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                used |= {l.strip() for l in group.split(",") if l.strip()}
            for selector in re.findall(re.escape(name) + r"\{([^}]*)\}", expr):
                used |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
            used |= set(re.findall(r"label_values\([^,]+,\s*([a-zA-Z_]+)\)", expr))
            # A family without samples here (per-pod series, with no pod on the fake node)
            # has no label names to check against.
            if labels or kind == "histogram":
                problems += [f"{where}: {name} has no label {l!r}" for l in sorted(used - allowed)]
    return problems


def test_the_dashboard_checker_can_fail(exported):
    """Negative control: a misspelt series, a histogram suffix on a counter and a label the
    series lacks are all caught."""
    bad = {
        "panels": [
            {"title": "typo", "targets": [{"expr": "sum(rate(aether_cni_service_connection_total[5m]))"}]},
            {"title": "suffix", "targets": [{"expr": "aether_cni_installer_repairs_total_bucket"}]},
            {"title": "label", "targets": [{"expr": "sum by (class) (aether_cni_service_refused_total)"}]},
            {"title": "none", "targets": [{"expr": "up"}]},
        ],
        "templating": {"list": []},
    }
    problems = unknown_series(bad, exported)
    assert len(problems) == 4, problems


def test_the_dashboard_queries_only_series_the_binary_exports(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    assert unknown_series(dashboard, exported) == []
    used = {n for _, e in queries(dashboard) for n in re.findall(r"\baether_cni_[a-z0-9_]+", e)}
    used = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in exported else n for n in used}
    # Every series the binary exports is on the dashboard: the installer's, and the Service
    # layer's node and per-pod counters.
    assert used == set(exported), sorted(set(exported) - used)


def test_the_dashboard_is_a_grafana_dashboard():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "aether-cni" and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and p["description"], p["title"]


def test_the_pod_monitor_needs_metrics_on_the_node_address():
    # metrics.enabled false leaves /metrics on the node's loopback: a PodMonitor could not
    # reach it, so the chart refuses the pair rather than render a monitor that scrapes nothing.
    with pytest.raises(Exception, match="metrics.podMonitor.enabled needs metrics.enabled"):
        render({"metrics": {"enabled": False, "podMonitor": {"enabled": True}}})
    o = objects({"metrics": {"podMonitor": {"enabled": True}}})
    (endpoint,) = o["PodMonitor"]["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in container(o["DaemonSet"])["ports"]}
    assert endpoint["port"] == "metrics" and ports["metrics"] == 18096, (endpoint, ports)
