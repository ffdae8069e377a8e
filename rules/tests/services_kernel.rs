//! Root-gated: the Service layer programmed in a fresh netns, read back, changed by
//! elements only, and its counters and demand read, with real packets.

use std::net::Ipv4Addr;

use aether_netns::Netns;
use aether_rules::model::Proto;
use aether_rules::services::{self, Applied, LayerMode, ServiceLayer, ServicePort};
use aether_testkit::{root_or_skip, TestNetns};

fn in_ns<T: Send>(ns: &TestNetns, f: impl FnOnce() -> T + Send) -> T {
    Netns::open_foreign(ns.path()).unwrap().run(f).unwrap()
}

fn port(vip: &str, proto: Proto, port: u16, has_endpoints: bool) -> ServicePort {
    ServicePort { vip: vip.parse().unwrap(), proto, port, has_endpoints }
}

fn layer(mode: LayerMode) -> ServiceLayer {
    let mut l = ServiceLayer::new(mode);
    l.ranges = vec!["10.96.0.0/16".parse().unwrap(), "10.200.0.7/32".parse().unwrap()];
    l.mesh_vips = vec!["10.96.5.5".parse().unwrap()];
    l.ports = vec![
        port("10.96.0.1", Proto::Tcp, 443, true),
        port("10.96.1.1", Proto::Tcp, 80, true),
        port("10.96.1.1", Proto::Udp, 18082, true),
        port("10.96.1.2", Proto::Tcp, 80, false),
    ];
    l
}

#[test]
fn layer_round_trip_and_element_only_updates() {
    if !root_or_skip("layer_round_trip_and_element_only_updates") {
        return;
    }
    let ns = TestNetns::new("svc-rt");
    let l = layer(LayerMode::Refuse);
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Rebuilt);
    let listing = ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    println!("{listing}");
    for want in [
        "counter refused_no_service",
        "type filter hook output priority mangle + 10; policy accept;",
        "ip daddr . meta l4proto . th dport @service_ports counter name \"service\" accept",
        "ip daddr != @service_ranges counter name \"external\" accept",
        "update @dialled { ip daddr . meta l4proto . th dport }",
        "reject with tcp reset",
        "10.96.1.1 . tcp . 80",
        "ct state new jump classify",
    ] {
        assert!(listing.contains(want), "missing {want:?} in\n{listing}");
    }
    let diffs = in_ns(&ns, || services::verify(&l)).unwrap();
    assert!(diffs.is_empty(), "{diffs:#?}");
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Unchanged);

    // One Service more: one element in the index and one VIP, nothing rebuilt.
    let mut l2 = l.clone();
    l2.ports.push(port("10.96.1.3", Proto::Tcp, 8080, true));
    let handle_before = ns.exec("nft", &["-a", "list", "chain", "ip", services::TABLE, services::CHAIN_CLASSIFY]);
    assert_eq!(in_ns(&ns, || services::apply(&l2)).unwrap(), Applied::Elements { added: 2, removed: 0 });
    let handle_after = ns.exec("nft", &["-a", "list", "chain", "ip", services::TABLE, services::CHAIN_CLASSIFY]);
    assert_eq!(handle_before, handle_after, "rules were rebuilt");
    // That Service loses its endpoints: it moves from the index to the empty set.
    let mut l3 = l2.clone();
    l3.ports.last_mut().unwrap().has_endpoints = false;
    assert_eq!(in_ns(&ns, || services::apply(&l3)).unwrap(), Applied::Elements { added: 1, removed: 1 });
    assert!(in_ns(&ns, || services::verify(&l3)).unwrap().is_empty());
    // A mode change rebuilds, keeping the counters.
    let l4 = ServiceLayer { mode: LayerMode::Count, ..l3.clone() };
    assert_eq!(in_ns(&ns, || services::apply(&l4)).unwrap(), Applied::Rebuilt);
    assert!(in_ns(&ns, || services::verify(&l4)).unwrap().is_empty());
    let off = ServiceLayer { mode: LayerMode::Off, ..l3 };
    assert_eq!(in_ns(&ns, || services::apply(&off)).unwrap(), Applied::Removed(true));
    assert!(in_ns(&ns, services::counters).unwrap().is_none());
}

#[test]
fn tampering_is_reported() {
    if !root_or_skip("tampering_is_reported") {
        return;
    }
    let ns = TestNetns::new("svc-tamper");
    let l = layer(LayerMode::Count);
    in_ns(&ns, || services::apply(&l)).unwrap();
    ns.exec("nft", &["delete", "element", "ip", services::TABLE, services::SET_SERVICE_PORTS, "{ 10.96.1.1 . tcp . 80 }"]);
    let diffs = in_ns(&ns, || services::verify(&l)).unwrap();
    assert!(diffs.iter().any(|d| d.contains("10.96.1.1 . tcp . 80")), "{diffs:#?}");
    // apply repairs it with one element.
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Elements { added: 1, removed: 0 });
    let _ = Ipv4Addr::LOCALHOST;
}
