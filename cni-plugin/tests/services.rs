//! `aether-cni services` driven as the agent drives it: a snapshot on stdin, reports on
//! stdout, messages on stderr. Pods are attachment records in a private state directory
//! pointing at test netns.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use aether_testkit::{root_or_skip, TestNetns};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_aether-cni");

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn services(state: &Path, args: &[&str], stdin: &[u8]) -> Out {
    let mut cmd = Command::new(BIN);
    cmd.env_clear().arg("services").args(args).arg("--state-dir").arg(state);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let out = child.wait_with_output().unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn state_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("aether-svc-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("attachments")).unwrap();
    d
}

fn record(state: &Path, cid: &str, netns: &str) {
    let rec = json!({
        "network": "k8s-pod-network", "containerId": cid, "ifname": "eth0", "netns": netns,
        "podNamespace": "shop", "podName": format!("pod-{cid}"), "configDigest": "0"
    });
    std::fs::write(state.join(format!("attachments/k8s-pod-network+{cid}+eth0.json")), rec.to_string()).unwrap();
}

fn example() -> Value {
    let text = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/services/example.json")).unwrap();
    serde_json::from_slice(&text).unwrap()
}

fn list(ns: &TestNetns) -> String {
    ns.try_exec("nft", &["list", "table", "ip", "aether_services"]).1
}

#[test]
fn malformed_snapshots_change_nothing_and_name_the_place() {
    let state = state_dir("bad");
    // Without root there are no pods; the stored snapshot is still checked.
    let first = services(&state, &["apply"], example().to_string().as_bytes());
    assert_eq!(first.code, 0, "{}", first.stderr);
    let stored = std::fs::read(state.join("services/snapshot.json")).unwrap();
    let cases: Vec<(Value, &str)> = vec![
        (json!({"serviceRanges": ["10.96.0.0/33"]}), "serviceRanges[0]: \"10.96.0.0/33\" is not an IPv4 CIDR"),
        (
            json!({"serviceRanges": ["10.96.0.0/16", "10.96.8.0/24"]}),
            "serviceRanges[1]: \"10.96.8.0/24\" overlaps serviceRanges[0]",
        ),
        (json!({"mode": "block"}), "mode: \"block\" is not one of off, count, refuse"),
        (json!({"generation": 41}), "generation: 41 is older than the stored generation 42"),
        (json!({"meshVIPs": ["10.96.5.5", "10.96.5.5"]}), "meshVIPs[1]: 10.96.5.5 duplicates meshVIPs[0]"),
        (json!({"extra": 1}), "extra: unknown field"),
    ];
    for (patch, want) in cases {
        let mut doc = example();
        doc["generation"] = json!(43);
        for (k, v) in patch.as_object().unwrap() {
            doc[k] = v.clone();
        }
        let out = services(&state, &["apply"], doc.to_string().as_bytes());
        assert_eq!(out.code, 2, "{want}: {}", out.stdout);
        assert!(out.stderr.contains(want), "want {want:?} in {}", out.stderr);
        assert_eq!(
            std::fs::read(state.join("services/snapshot.json")).unwrap(),
            stored,
            "{want}: the stored snapshot changed"
        );
    }
    let mut doc = example();
    doc["services"][1]["ports"][0]["port"] = json!(0);
    let out = services(&state, &["apply"], doc.to_string().as_bytes());
    assert!(out.stderr.contains("services[1].ports[0].port: 0 is not a port"), "{}", out.stderr);
    let out = services(&state, &["apply"], b"{not json");
    assert!(out.stderr.contains("the snapshot is not JSON"), "{}", out.stderr);
    // The same generation with the same content is an idempotent re-apply; with other content
    // it is refused.
    assert_eq!(services(&state, &["apply"], &stored).code, 0);
    let mut doc = example();
    doc["mode"] = json!("refuse");
    let out = services(&state, &["apply"], doc.to_string().as_bytes());
    assert!(out.stderr.contains("generation: 42 is already stored with different content"), "{}", out.stderr);
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn apply_reaches_every_pod_incrementally_and_skips_vanished_ones() {
    if !root_or_skip("apply_reaches_every_pod_incrementally_and_skips_vanished_ones") {
        return;
    }
    let state = state_dir("apply");
    let a = TestNetns::new("svc-a");
    let b = TestNetns::new("svc-b");
    record(&state, "a", &a.path());
    record(&state, "b", &b.path());
    record(&state, "gone", "/run/netns/aeth-never-existed-svc");
    let out = services(&state, &["apply"], example().to_string().as_bytes());
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    let results: Vec<(String, String)> = report["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["containerID"].as_str().unwrap().to_string(), p["result"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(
        results,
        [("a".into(), "rebuilt".into()), ("b".into(), "rebuilt".into()), ("gone".into(), "skipped".into())],
        "{report:#}"
    );
    for ns in [&a, &b] {
        assert!(list(ns).contains("10.96.1.1 . tcp . 80"), "{}", list(ns));
    }
    // One Service more: only its elements are sent.
    let mut doc = example();
    doc["generation"] = json!(43);
    doc["services"].as_array_mut().unwrap().push(json!({
        "namespace": "shop", "name": "new", "vip": "10.96.1.3", "ports": [{"protocol": "TCP", "port": 9090}], "usableEndpoints": true
    }));
    let out = services(&state, &["apply"], doc.to_string().as_bytes());
    assert_eq!(out.code, 0, "{}", out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(report["pods"][0]["result"], "elements +2 -0", "{report:#}");
    assert_eq!(report["pods"][1]["result"], "elements +2 -0", "{report:#}");
    assert!(list(&a).contains("10.96.1.3 . tcp . 9090"));
    // Mode off removes the layer everywhere.
    doc["generation"] = json!(44);
    doc["mode"] = json!("off");
    let out = services(&state, &["apply"], doc.to_string().as_bytes());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!a.exec("nft", &["list", "tables"]).contains("aether_services"));
    let _ = std::fs::remove_dir_all(&state);
}

#[test]
fn counters_and_demand_print_node_totals_and_pod_rows() {
    if !root_or_skip("counters_and_demand_print_node_totals_and_pod_rows") {
        return;
    }
    let state = state_dir("counters");
    let a = TestNetns::new("svc-c");
    record(&state, "c", &a.path());
    assert_eq!(services(&state, &["apply"], example().to_string().as_bytes()).code, 0);
    // Traffic: the layer classifies what capture marks; mark it here as capture would, and
    // send it out of a veth whose peer stays in the same netns (nothing answers; the first
    // packet is what counts).
    a.exec("ip", &["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
    a.exec("ip", &["link", "set", "d1", "up"]);
    a.exec("ip", &["addr", "add", "10.244.9.2/24", "dev", "d0"]);
    a.exec("ip", &["link", "set", "d0", "up"]);
    a.exec("ip", &["route", "add", "default", "dev", "d0"]);
    let marker = "table ip test_divert_standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t}\n}\n";
    let path = std::env::temp_dir().join(format!("{}.nft", a.name));
    std::fs::write(&path, marker).unwrap();
    a.exec("nft", &["-f", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    let ns = aether_netns::Netns::open_foreign(a.path()).unwrap();
    ns.run(|| {
        for addr in ["10.96.1.1:80", "10.96.9.9:80", "192.0.2.1:80"] {
            let _ = std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), std::time::Duration::from_millis(100));
        }
    })
    .unwrap();
    let out = services(&state, &["counters", "--format", "json"], b"");
    assert_eq!(out.code, 0, "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["generation"], 42);
    assert_eq!(v["node"]["service"], 1, "{v:#}");
    assert_eq!(v["node"]["refused_no_service"], 1, "{v:#}");
    assert_eq!(v["node"]["external"], 1, "{v:#}");
    assert_eq!(v["pods"][0]["containerID"], "c");
    let out = services(&state, &["counters", "--format", "prometheus"], b"");
    for want in [
        "aether_cni_service_connections_total{class=\"service\"} 1",
        "aether_cni_service_connections_total{class=\"refused\"} 1",
        "aether_cni_service_refused_total{reason=\"no-service\"} 1",
        "# TYPE aether_cni_service_refused_total counter",
    ] {
        assert!(out.stdout.contains(want), "want {want:?} in\n{}", out.stdout);
    }
    let out = services(&state, &["demand", "--format", "text"], b"");
    assert_eq!(out.stdout.trim(), "10.96.1.1:80/tcp\n10.96.9.9:80/tcp");
    let _ = std::fs::remove_dir_all(&state);
}

fn results(out: &Out) -> Vec<String> {
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    report["pods"].as_array().unwrap().iter().map(|p| p["result"].as_str().unwrap().to_string()).collect()
}

fn service(name: &str, vip: &str, port: u16) -> Value {
    json!({"namespace": "shop", "name": name, "vip": vip, "ports": [{"protocol": "TCP", "port": port}], "usableEndpoints": true})
}

/// A pod that missed a generation (its record was away while the agent applied it, as when
/// an apply could not reach its netns) is rebuilt at the next apply, and ends exactly at the
/// newest generation, as does the pod that got each change.
#[test]
fn an_apply_after_a_missed_generation_leaves_the_pod_exactly_at_the_newest() {
    if !root_or_skip("an_apply_after_a_missed_generation_leaves_the_pod_exactly_at_the_newest") {
        return;
    }
    let state = state_dir("missed");
    let a = TestNetns::new("svc-ma");
    let b = TestNetns::new("svc-mb");
    record(&state, "a", &a.path());
    record(&state, "b", &b.path());
    assert_eq!(results(&services(&state, &["apply"], example().to_string().as_bytes())), ["rebuilt", "rebuilt"]);
    // Generation 43 reaches a only.
    let b_record = state.join("attachments/k8s-pod-network+b+eth0.json");
    let away = state.join("b-record-away");
    std::fs::rename(&b_record, &away).unwrap();
    let mut doc = example();
    doc["generation"] = json!(43);
    doc["services"].as_array_mut().unwrap().push(service("g43", "10.96.1.43", 4343));
    assert_eq!(results(&services(&state, &["apply"], doc.to_string().as_bytes())), ["elements +2 -0"]);
    std::fs::rename(&away, &b_record).unwrap();
    // Generation 44 drops cart and adds another: a gets the change from 43, b (at 42) is rebuilt.
    doc["generation"] = json!(44);
    doc["services"].as_array_mut().unwrap().retain(|s| s["name"] != "cart");
    doc["services"].as_array_mut().unwrap().push(service("g44", "10.96.1.44", 4444));
    assert_eq!(results(&services(&state, &["apply"], doc.to_string().as_bytes())), ["elements +2 -3", "rebuilt"]);
    for ns in [&a, &b] {
        let l = list(ns);
        assert!(l.contains("10.96.1.43 . tcp . 4343") && l.contains("10.96.1.44 . tcp . 4444"), "{l}");
        assert!(!l.contains("10.96.1.1 . tcp . 80") && !l.contains("10.96.1.1 . udp . 18082"), "{l}");
    }
    // Read back and compared with generation 44 in full: both intact.
    assert_eq!(results(&services(&state, &["verify"], b"")), ["intact", "intact"]);
    let _ = std::fs::remove_dir_all(&state);
}

/// Applies no longer read the pods' sets back, so drift stays until `services verify` reads
/// every layer back and repairs it.
#[test]
fn a_tampered_layer_is_repaired_by_verify() {
    if !root_or_skip("a_tampered_layer_is_repaired_by_verify") {
        return;
    }
    let state = state_dir("tamper");
    let a = TestNetns::new("svc-ta");
    record(&state, "a", &a.path());
    assert_eq!(results(&services(&state, &["apply"], example().to_string().as_bytes())), ["rebuilt"]);
    a.exec("nft", &["delete", "element", "ip", "aether_services", "service_ports", "{ 10.96.1.1 . tcp . 80 }"]);
    a.exec("nft", &["add", "element", "ip", "aether_services", "service_vips", "{ 10.96.7.7 : 0 }"]);
    // The same content again: nothing is sent, nothing is read back.
    assert_eq!(results(&services(&state, &["apply"], example().to_string().as_bytes())), ["unchanged"]);
    assert!(!list(&a).contains("10.96.1.1 . tcp . 80"));
    let out = services(&state, &["verify"], b"");
    assert_eq!(results(&out), ["repaired (elements +1 -1)"]);
    for want in [
        "set service_ports: element 10.96.1.1 . tcp . 80 is missing",
        "set service_vips: unexpected element 10.96.7.7 : 0x00000000",
    ] {
        assert!(out.stdout.contains(want), "want {want:?} in {}", out.stdout);
    }
    let l = list(&a);
    assert!(l.contains("10.96.1.1 . tcp . 80") && !l.contains("10.96.7.7"), "{l}");
    assert_eq!(results(&services(&state, &["verify"], b"")), ["intact"]);
    // A layer removed altogether is rebuilt.
    a.exec("nft", &["delete", "table", "ip", "aether_services"]);
    assert_eq!(results(&services(&state, &["verify"], b"")), ["repaired (rebuilt)"]);
    assert!(list(&a).contains("10.96.1.1 . tcp . 80"));
    let _ = std::fs::remove_dir_all(&state);
}
