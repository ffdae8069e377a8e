"""Kubernetes Events (events.k8s.io/v1) from the installer: the chart's RBAC grants exactly
create and patch on Events to the installer's own ServiceAccount and nothing else, with a
short-lived projected token; events.enabled=false renders no identity and mounts no token; and
every Event body the binary makes is valid against the Kubernetes schemas."""

import copy
import json
import os
import subprocess

import kubernetes_validate
import pytest

from test_chart import NAMESPACE, container, render

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def by_kind(objects):
    out = {}
    for o in objects:
        assert o["kind"] not in out, f"two {o['kind']} objects"
        out[o["kind"]] = o
    return out


def granted(objects, sa_name, sa_namespace):
    """Every (apiGroup, resource, verb) the ServiceAccount is granted by the rendered RBAC."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    rights = set()
    for b in objects:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa_name and s.get("namespace") == sa_namespace
                   for s in b["subjects"]):
            continue
        role = roles[(b["roleRef"]["kind"], b["roleRef"]["name"])]
        for rule in role["rules"]:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        rights.add((g, r, v))
    return rights


EXACTLY = {("events.k8s.io", "events", "create"), ("events.k8s.io", "events", "patch")}


def test_the_rbac_grants_exactly_create_and_patch_on_events():
    objects, _ = render({})
    o = by_kind(objects)
    sa = o["ServiceAccount"]
    assert sa["metadata"]["namespace"] == NAMESPACE and sa["automountServiceAccountToken"] is False
    assert granted(objects, sa["metadata"]["name"], NAMESPACE) == EXACTLY
    # No wildcard anywhere, and no other role or binding.
    assert "*" not in json.dumps([r for k in ("ClusterRole",) for r in o[k]["rules"]])
    assert sorted(x["kind"] for x in objects if "Role" in x["kind"]) == ["ClusterRole", "ClusterRoleBinding"]
    spec = o["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == sa["metadata"]["name"]


def test_the_rights_check_can_fail():
    """Negative control: one verb more (get, or a wildcard) is caught by `granted` above."""
    objects, _ = render({})
    sa = by_kind(objects)["ServiceAccount"]["metadata"]["name"]
    for extra in (["get"], ["*"]):
        broken = copy.deepcopy(objects)
        (role,) = [x for x in broken if x["kind"] == "ClusterRole"]
        role["rules"][0]["verbs"] += extra
        assert granted(broken, sa, NAMESPACE) != EXACTLY
    broken = copy.deepcopy(objects)
    (role,) = [x for x in broken if x["kind"] == "ClusterRole"]
    role["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]})
    assert granted(broken, sa, NAMESPACE) != EXACTLY


def test_the_token_is_projected_short_lived_and_only_where_in_cluster_clients_look():
    objects, _ = render({"events": {"enabled": True, "tokenExpirationSeconds": 900}})
    ds = by_kind(objects)["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False, "no token the usual way"
    (vol,) = [v for v in spec["volumes"] if "projected" in v]
    sources = vol["projected"]["sources"]
    assert sources[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 900}}
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    (mount,) = [m for m in container(ds)["volumeMounts"] if m["name"] == vol["name"]]
    assert mount == {"name": vol["name"], "mountPath": TOKEN_DIR, "readOnly": True}


def test_events_off_renders_no_identity_and_mounts_no_token():
    objects, _ = render({"events": {"enabled": False}})
    assert [o["kind"] for o in objects] == ["DaemonSet"]
    ds = objects[0]
    spec = ds["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert not [v for v in spec["volumes"] if "projected" in v or "secret" in v]
    c = container(ds)
    assert not [m for m in c["volumeMounts"] if m["mountPath"].startswith("/var/run/secrets")]
    assert not [a for a in c["args"] if a.startswith("--events")]
    assert "NODE_NAME" not in [e["name"] for e in c["env"]]


def test_the_binary_accepts_the_events_args():
    """The chart's --events flags parse in the real binary (its --print-entry exits before
    anything is posted)."""
    objects, _ = render({"events": {"enabled": True, "writesPerSecond": 0.5, "apiServer": "https://10.0.0.1:6443"}})
    c = container(by_kind(objects)["DaemonSet"])
    args = [a.replace("$(HOST_IP)", "10.0.0.21") for a in c["args"] if a.startswith("--events")]
    assert args == ["--events", "--events-writes-per-second=0.5", "--events-api-server=https://10.0.0.1:6443"]
    out = subprocess.run([os.environ["AETHER_INSTALLER_BIN"], *args, "--host-ip=10.0.0.21", "--print-entry"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def event_examples():
    out = subprocess.run([os.environ["AETHER_INSTALLER_BIN"], "--print-event-examples", "--node-name=node-a"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_event_body_is_a_valid_kubernetes_event():
    bodies = event_examples()
    reasons = {b["reason"] for b in bodies}
    assert reasons == {"MissedPodRestarted", "MissedPodCaptured", "MissedPodReported", "DriftRepaired", "DriftFought",
                       "CaptureRefused", "CaptureMigrated", "AetherCNINotReady", "AetherCNIReady"}
    version = kubernetes_validate.utils.latest_version()
    for b in bodies:
        kubernetes_validate.validate(b, version, strict=True)
        # What the API requires of a new events.k8s.io/v1 Event beyond the schema's types.
        assert b["eventTime"] and b["reportingController"] == "aether-cni.io/installer"
        assert b["reportingInstance"] == "node-a" and b["action"] and b["type"] in ("Normal", "Warning")
        assert b["reason"][0].isupper() and "-" not in b["reason"] and len(b["note"].encode()) <= 1024
        assert b["regarding"]["kind"] in ("Pod", "Node")
    assert any(b.get("series", {}).get("count") == 2 for b in bodies)


@pytest.mark.parametrize("field", ["reportingInstanse", "series.cuont"])
def test_the_event_validation_can_fail(field):
    """Negative control: a misspelt field in an Event is caught by the same check."""
    body = copy.deepcopy([b for b in event_examples() if "series" in b][0])
    if field == "series.cuont":
        body["series"]["cuont"] = body["series"].pop("count")
    else:
        body[field] = "node-a"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(body, kubernetes_validate.utils.latest_version(), strict=True)
