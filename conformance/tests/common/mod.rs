//! Drives the built binary exactly as a runtime does: env, stdin, stdout, exit status.

#![allow(dead_code)]

use serde_json::{json, Value};

/// The binary under test (see `aether_conformance::cni::cni_bin`).
pub fn bin() -> &'static std::path::Path {
    aether_conformance::cni::cni_bin()
}

pub use aether_conformance::cni::Outcome;

/// Runs the plugin as a runtime does, from the test's own netns, with a pod's usual
/// environment (`extra_env` overrides or adds; an empty value stands for an unset variable).
pub fn run_plugin(command: &str, netns: Option<&str>, conf: &Value, extra_env: &[(&str, &str)]) -> Outcome {
    let mut env: Vec<(&str, &str)> = vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "ctr-0123"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-0"),
    ];
    if let Some(ns) = netns {
        env.push(("CNI_NETNS", ns));
    }
    for (k, v) in extra_env {
        env.retain(|(e, _)| e != k);
        env.push((k, v));
    }
    aether_conformance::cni::run_here(&env, conf)
}

/// A realistic prevResult from a main plugin (bridge + host-local).
pub fn prev_result(version: &str) -> Value {
    let mut ips = json!([{"address": "10.244.1.5/24", "gateway": "10.244.1.1", "interface": 2}]);
    if version == "0.4.0" {
        ips[0]["version"] = json!("4");
    }
    json!({
        "cniVersion": version,
        "interfaces": [
            {"name": "cni0", "mac": "6a:2c:18:1b:33:01"},
            {"name": "veth1a2b3c4d", "mac": "b2:7d:1e:00:40:12"},
            {"name": "eth0", "mac": "0a:58:0a:f4:01:05", "sandbox": "/var/run/netns/cni-1234"}
        ],
        "ips": ips,
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}],
        "dns": {"nameservers": ["10.96.0.10"], "search": ["shop.svc.cluster.local", "svc.cluster.local"], "options": ["ndots:5"]}
    })
}

/// A `prevResult` of `version` whose pod has `addresses` (CIDRs of either family, each
/// with its family's gateway), otherwise as [`prev_result`].
pub fn prev_result_with(version: &str, addresses: &[&str]) -> Value {
    let mut prev = prev_result(version);
    let v6 = |a: &str| a.contains(':');
    prev["ips"] = addresses
        .iter()
        .map(|a| {
            let (gw, ver) = if v6(a) { ("fd00:10:244::1", "6") } else { ("10.244.1.1", "4") };
            let mut ip = json!({"address": a, "gateway": gw, "interface": 2});
            if version == "0.4.0" {
                ip["version"] = json!(ver);
            }
            ip
        })
        .collect();
    prev["routes"] = addresses
        .iter()
        .map(|a| {
            if v6(a) {
                json!({"dst": "::/0", "gw": "fd00:10:244::1"})
            } else {
                json!({"dst": "0.0.0.0/0", "gw": "10.244.1.1"})
            }
        })
        .collect();
    prev
}

static STATE_DIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A state directory of the test's own under cargo's target/tmp (the node's default is
/// never touched by tests).
pub fn state_dir() -> String {
    let n = STATE_DIRS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("state-{}-{n}", std::process::id()));
    dir.display().to_string()
}

/// The network configuration the installer writes, plus a prevResult.
pub fn conf(version: &str, extra: Value) -> Value {
    let mut c = json!({
        "stateDir": state_dir(),
        "cniVersion": version,
        "name": "k8s-pod-network",
        "type": "aether-cni",
        "hostIP": "10.0.0.1",
        "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        "prevResult": prev_result(version),
    });
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    c
}
