//! The Service layer across releases, with the releases' own binaries built from this clone's
//! history (`make previous-release`: target/previous-release/<commit>/aether-cni):
//!
//! | release | its pods' layer | this release's first apply | then |
//! | --- | --- | --- | --- |
//! | 36df875 | the first shape (the VIPs a plain set) | a migration, once, counts kept | element changes |
//! | 3499904 | shape 3, its tables naming nothing | a migration, once, counts kept | element changes; a rollback to 3499904 keeps every pod captured and counted |
//!
//! Each pod is attached and given its layer by the release before, counts made by real
//! connections through the capture; this release then applies the same content under a new
//! generation. Controls: the release's pods name no layer before (so the migration is this
//! release's work), and a pod given a layer by this release is not migrated.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use aether_conformance::layer::{apply, counters, node_totals, only, pod_counts, sum};
use aether_conformance::{Pod, Probe, Proxy, SimNode};
use aether_testkit::root_or_skip;
use serde_json::{json, Value};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 1);

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// `shop/cart` at VIP, TCP `port` (and TCP 80 when `port` is another), with endpoints.
fn snapshot(generation: u64, port: u16) -> Vec<u8> {
    let mut ports = vec![json!({"protocol": "TCP", "port": 80})];
    if port != 80 {
        ports.push(json!({"protocol": "TCP", "port": port}));
    }
    json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"],
        "services": [{"namespace": "shop", "name": "cart", "vip": VIP.to_string(), "ports": ports,
                      "usableEndpoints": true}]})
    .to_string()
    .into_bytes()
}

/// The release's plugin, built from the history. Missing: a loud skip, or a failure under
/// AETHER_REQUIRE_ROOT_TESTS=1.
fn release(test: &str, commit: &str) -> Option<PathBuf> {
    let path = aether_conformance::clients::repo().join(format!("target/previous-release/{commit}/aether-cni"));
    if path.exists() {
        return Some(path);
    }
    let msg = format!("{test}: release {commit}'s plugin {} is missing -- run `make previous-release`", path.display());
    assert!(
        std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() != Ok("1"),
        "{msg}; AETHER_REQUIRE_ROOT_TESTS=1 forbids skipping"
    );
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED (no such release built): {msg}");
    None
}

/// The name a pod's IPv4 table carries (`layer_s<shape>_g<generation>_...`), if any.
fn layer_name(p: &Pod) -> Option<String> {
    let listing = p.nft(&["list", "counters", "table", "ip", "aether_services"]);
    listing.split_whitespace().find(|w| w.starts_with("layer_s")).map(str::to_string)
}

fn results(report: &Value) -> Vec<String> {
    report["pods"].as_array().unwrap().iter().map(|p| p["result"].as_str().unwrap().to_string()).collect()
}

fn captured(p: &Pod, dst: SocketAddr) {
    let got = p.tcp(dst);
    assert!(matches!(&got, Probe::Answer(a) if a.starts_with("capture[")), "{}: {got:?}", p.name);
}

/// Pods `a` and `b` attached and layered by `old`, with three connections counted: what the
/// node holds when this release's binary replaces `old`'s.
fn node_of(old: &std::path::Path, tag: &str) -> (SimNode, Pod, Pod, Value, Value) {
    let mut node = SimNode::new(tag);
    let (a, b) = (node.add_pod("a"), node.add_pod("b"));
    let (conf_a, conf_b) = (a.conf(json!({})), b.conf(json!({})));
    for (p, c) in [(&a, &conf_a), (&b, &conf_b)] {
        let out = p.cni_with(old, "ADD", c);
        assert!(out.ok, "the release's ADD of {}: {}{}", p.name, out.stdout, out.stderr);
    }
    let out = node.services_with(old, &["apply"], &snapshot(1, 80));
    assert!(out.ok, "the release's apply: {}{}", out.stdout, out.stderr);
    (node, a, b, conf_a, conf_b)
}

/// What this release does to a node `old` left: the first apply migrates each pod once,
/// counts kept, and the next is an element change. Returns the node totals after.
fn upgrade(node: &SimNode, a: &Pod, b: &Pod) -> aether_conformance::layer::Counts {
    for p in [a, b] {
        let name = layer_name(p);
        assert!(name.is_none(), "{}: the release's layer names no layer (it predates names): {name:?}", p.name);
    }
    let before = node_totals(&counters(node));
    assert_eq!(before, only(Some("service"), 3), "the release's pods counted three connections");
    let report = apply(node, &snapshot(2, 80));
    assert_eq!(results(&report), ["rebuilt", "rebuilt"], "{report}");
    let warnings = report["warnings"].to_string();
    assert!(warnings.contains("2 pod(s) held a Service layer a release before built"), "{report}");
    for p in [a, b] {
        let name = layer_name(p).unwrap_or_default();
        assert!(name.starts_with("layer_s3_g2_"), "{}: migrated to this release's named layer: {name}", p.name);
    }
    let c = counters(node);
    assert_eq!(node_totals(&c), before, "the migration kept the counts: {c}");
    assert_eq!(pod_counts(&c, a), Some(only(Some("service"), 2)), "{c}");
    // Migrated once: the next apply is the element change alone.
    let report = apply(node, &snapshot(3, 81));
    assert_eq!(results(&report), ["elements +1 -0", "elements +1 -0"], "{report}");
    assert!(report.get("warnings").is_none(), "no second migration: {report}");
    captured(a, sa(VIP, 80));
    let after = node_totals(&counters(node));
    assert_eq!(after, sum(&before, &only(Some("service"), 1)), "counted after the migration");
    after
}

#[test]
fn a_node_of_release_36df875_is_migrated_once_with_its_counts() {
    let test = "a_node_of_release_36df875_is_migrated_once_with_its_counts";
    if !root_or_skip(test) {
        return;
    }
    let Some(old) = release(test, "36df875") else { return };
    let (node, a, b, _, _) = node_of(&old, "rel36");
    let (_pa, _pb) = (Proxy::start(&a), Proxy::start(&b));
    captured(&a, sa(VIP, 80));
    captured(&a, sa(VIP, 80));
    captured(&b, sa(VIP, 80));
    // Its first shape: the VIPs a plain set, where this release's is a map (`held_shape` 1).
    let listing = a.nft(&["list", "table", "ip", "aether_services"]);
    assert!(listing.contains("set service_vips {"), "RIG BROKEN: not the first shape:\n{listing}");
    upgrade(&node, &a, &b);
}

#[test]
fn a_node_of_release_3499904_is_migrated_once_and_a_rollback_to_it_keeps_every_pod_counted() {
    let test = "a_node_of_release_3499904_is_migrated_once_and_a_rollback_to_it_keeps_every_pod_counted";
    if !root_or_skip(test) {
        return;
    }
    let Some(old) = release(test, "3499904") else { return };
    let (mut node, a, b, conf_a, _) = node_of(&old, "rel34");
    let (_pa, _pb) = (Proxy::start(&a), Proxy::start(&b));
    captured(&a, sa(VIP, 80));
    captured(&a, sa(VIP, 80));
    captured(&b, sa(VIP, 80));
    // Control: a pod this release attaches is not migrated by the same apply (below, after
    // the upgrade's own assertions, so they count the release's pods only).
    let upgraded = upgrade(&node, &a, &b);
    let c = node.add_pod("c");
    let conf_c = c.add(json!({}));
    let _pc = Proxy::start(&c);
    assert!(layer_name(&c).unwrap_or_default().starts_with("layer_s3_g3_"), "ADD gave c the stored layer");
    let report = apply(&node, &snapshot(4, 81));
    assert_eq!(results(&report), ["unchanged", "unchanged", "unchanged"], "{report}");
    assert!(report.get("warnings").is_none(), "{report}");

    // Rollback: the release's binary again. Its own apply reaches every pod (it finds no
    // file of its own saying what they hold, and rebuilds them, counts carried over).
    let out = node.services_with(&old, &["apply"], &snapshot(5, 80));
    assert!(out.ok, "the release's apply after the rollback: {}{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    let failed: Vec<&Value> = report["pods"].as_array().unwrap().iter().filter(|p| p["result"] == "failed").collect();
    assert!(failed.is_empty(), "{report}");
    let read = node.services_with(&old, &["counters", "--format", "json"], b"");
    assert!(read.ok, "{}", read.stderr);
    let totals = node_totals(&serde_json::from_str(&read.stdout).unwrap());
    assert_eq!(totals, upgraded, "the release counts what this one counted");
    for p in [&a, &b, &c] {
        captured(p, sa(VIP, 80));
    }
    // The release's DEL of a pod this release attached folds its counts.
    let out = c.cni_with(&old, "DEL", &conf_c);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    let out = a.cni_with(&old, "DEL", &conf_a);
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    let read = node.services_with(&old, &["counters", "--format", "json"], b"");
    let totals_after = node_totals(&serde_json::from_str(&read.stdout).unwrap());
    assert_eq!(totals_after, sum(&upgraded, &only(Some("service"), 3)), "every pod counted, also the ones gone");
    let d = node.add_pod("d");
    let out = d.cni_with(&old, "ADD", &d.conf(json!({})));
    assert!(out.ok, "{}{}", out.stdout, out.stderr);
    assert!(d.nft(&["list", "tables"]).contains("aether_services"), "the release's ADD gives a new pod the layer");
}
