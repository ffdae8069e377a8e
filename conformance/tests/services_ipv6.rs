//! The Service layer for IPv6 Service ranges, proved with real sockets on
//! the simulated node behind the real capture, as `services_datapath.rs` proves it for IPv4:
//! pods attached by the built `aether-cni` through the CNI protocol, the snapshot applied with
//! `aether-cni services apply` from the node's netns, the counts read with `services
//! counters`. Each positive case has a control that shows the same check can fail (`RIG
//! BROKEN` if it does not).
//!
//! | claim | test | control (must fail) |
//! | --- | --- | --- |
//! | a dual-stack snapshot gives each pod a `table ip6 aether_services` beside the `ip` one; each IPv6 class counted once per connection, the path unchanged; a pod's counters are the sum of both tables | `ipv6_classes_are_counted_...` | the same probes before the snapshot (no counts); the ip6 table's classify jump deleted |
//! | `refuse`: each IPv6 refusal reason refused (TCP reset, UDP an immediate error), never reaching the listener; the IPv6 API server address never refused | `ipv6_refusals_...` | the same connections before the snapshot and after mode `off`; the API server address removed from the ip6 `never_refused` set |
//! | an IPv6-only snapshot gives only the ip6 table; demand lists IPv6 VIPs as `[vip]:port/proto`; DEL folds the ip6 table's counts | `an_ipv6_only_pod_...` | a pod whose ip6 table is deleted before DEL: its counts leave the totals |
//! | a snapshot that drops the IPv6 ranges removes the ip6 table and keeps its counts in the pod's totals | `dropping_the_ipv6_ranges_...` | IPv6 connections after the drop are no longer counted |
//!
//! Addresses: pods at fd00:10:244::a+n (and 10.244.0.x when dual), the IPv6 ServiceCIDR
//! fd00:10:96::/108 (local to the host netns, where the upstream answers), fd00:10:97::/64
//! outside every range (also local there). Nothing leaves the namespaces made here. Root
//! only: without root each test skips loudly; with `AETHER_REQUIRE_ROOT_TESTS=1` a skip fails.

use std::net::{Ipv6Addr, SocketAddr};

use aether_conformance::layer::{apply, as_counts, counters, delta, only, pod_counts};
use aether_conformance::{control, sa, Pod, Probe, Proxy, SimNode, Stack, MESH_L4_PORT, VIP, VIP6};
use aether_testkit::root_or_skip;
use serde_json::json;

/// The IPv6 ServiceCIDR (a /108, as clusters commonly use).
const RANGE6: &str = "fd00:10:96::/108";
const RANGE4: &str = "10.96.0.0/16";
/// The first address of the range: the API server Service (declared on 443 only).
const API6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 1);
/// The range's second address: no Service.
const API6_NEXT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 2);
const MESH6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 5, 5);
/// A Service (TCP 80) without a usable endpoint.
const EMPTY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 1, 2);
/// In the range, and no Service owns it.
const NO_SERVICE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0xe, 7);
/// Outside every Service range.
const EXTERNAL6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x97, 0, 0, 0, 0, 5);

fn node(test: &str, tag: &str) -> Option<SimNode> {
    root_or_skip(test).then(|| SimNode::new(tag))
}

/// The agent's snapshot: the IPv6 Services `default/kubernetes-v6` (API6, TCP 443),
/// `shop/cart-v6` (VIP6, TCP 80 and UDP 18082), `shop/legacy-v6` (EMPTY6, TCP 80, no
/// endpoint) and the mesh VIP MESH6; with `ipv4`, also the IPv4 range and `shop/cart` (VIP,
/// TCP 80).
fn snapshot(generation: u64, mode: &str, ipv4: bool, ipv6: bool) -> Vec<u8> {
    let mut ranges = Vec::new();
    let mut mesh = Vec::new();
    let mut services = Vec::new();
    if ipv4 {
        ranges.push(json!(RANGE4));
        services.push(json!({"namespace": "shop", "name": "cart", "vip": VIP.to_string(),
            "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}));
    }
    if ipv6 {
        ranges.push(json!(RANGE6));
        mesh.push(json!(MESH6.to_string()));
        services.extend([
            json!({"namespace": "default", "name": "kubernetes-v6", "vip": API6.to_string(),
                "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": true}),
            json!({"namespace": "shop", "name": "cart-v6", "vip": VIP6.to_string(),
                "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "UDP", "port": MESH_L4_PORT}],
                "usableEndpoints": true}),
            json!({"namespace": "shop", "name": "legacy-v6", "vip": EMPTY6.to_string(),
                "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": false}),
        ]);
    }
    json!({"generation": generation, "mode": mode, "serviceRanges": ranges, "meshVIPs": mesh, "services": services})
        .to_string()
        .into_bytes()
}

fn capture(pod: &Pod, proto: &str, dst: SocketAddr) -> Probe {
    Probe::Answer(format!("capture[{}] {proto} dst={dst} from={} got=probe", pod.name, pod.ip_for(dst)))
}

/// The families of the pod's Service layer tables, as `nft list tables` shows them.
fn layer_tables(p: &Pod) -> Vec<String> {
    p.nft(&["list", "tables"])
        .lines()
        .filter(|l| l.ends_with(" aether_services"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
        .collect()
}

/// One IPv6 connection from the pod and the class it must be counted as.
struct Case {
    what: &'static str,
    udp: bool,
    dst: SocketAddr,
    class: &'static str,
}

impl Case {
    fn run(&self, pod: &Pod) -> Probe {
        if self.udp {
            pod.udp(self.dst)
        } else {
            pod.tcp(self.dst)
        }
    }

    fn captured(&self, pod: &Pod) -> Probe {
        capture(pod, if self.udp { "udp" } else { "tcp" }, self.dst)
    }

    fn refused(&self) -> bool {
        self.class.starts_with("refused_")
    }
}

fn cases() -> Vec<Case> {
    let tcp = |what, dst: SocketAddr, class| Case { what, udp: false, dst, class };
    vec![
        tcp("known IPv6 Service VIP:80", sa(VIP6, 80), "service"),
        Case { what: "known IPv6 Service VIP:18082/udp", udp: true, dst: sa(VIP6, MESH_L4_PORT), class: "service" },
        tcp("IPv6 mesh VIP", sa(MESH6, 80), "mesh"),
        tcp("outside every IPv6 range", sa(EXTERNAL6, 80), "external"),
        tcp("IPv6 API server, undeclared port", sa(API6, 81), "service"),
        tcp("IPv6 range, no Service", sa(NO_SERVICE6, 80), "refused_no_service"),
        Case {
            what: "IPv6 range, no Service, UDP 18082",
            udp: true,
            dst: sa(NO_SERVICE6, MESH_L4_PORT),
            class: "refused_no_service",
        },
        tcp("the IPv6 range's second address", sa(API6_NEXT, 81), "refused_no_service"),
        tcp("IPv6 Service without endpoints", sa(EMPTY6, 80), "refused_no_endpoints"),
        tcp("IPv6 Service VIP, undeclared port", sa(VIP6, 81), "refused_port_not_declared"),
    ]
}

/// `count` mode on a dual-stack pod: both tables present, each IPv6 class counted once (in
/// the pod's row, which sums the two tables), IPv4 still counted, paths unchanged.
#[test]
fn ipv6_classes_are_counted_once_per_connection_beside_ipv4() {
    let Some(mut node) = node("ipv6_classes_are_counted_once_per_connection_beside_ipv4", "svc6cnt") else {
        return;
    };
    let a = node.add_pod_with("a", Stack::Dual);
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let cases = cases();
    // Control: before any snapshot, no layer and no counts; each connection is captured.
    assert_eq!(layer_tables(&a), Vec::<String>::new());
    for c in &cases {
        assert_eq!(c.run(&a), c.captured(&a), "{} ({}), without the layer", c.what, c.dst);
    }
    control(pod_counts(&counters(&node), &a).is_none(), "a row before any snapshot", counters(&node));

    let report = apply(&node, &snapshot(1, "count", true, true));
    assert_eq!(report["pods"][0]["result"], "rebuilt", "{report}");
    assert_eq!(layer_tables(&a), ["ip", "ip6"], "{}", a.ruleset());
    // Read back, both tables are exactly what the snapshot says.
    let v = node.services(&["verify"], b"").json();
    assert_eq!(v["pods"][0]["result"], "intact", "{v}");
    let seen_before = proxy.seen().len();
    let mut now = pod_counts(&counters(&node), &a).expect("a row");
    assert_eq!(now, only(None, 0));
    for c in &cases {
        assert_eq!(c.run(&a), c.captured(&a), "{} ({}): count mode changes nothing on the path", c.what, c.dst);
        let after = pod_counts(&counters(&node), &a).unwrap();
        assert_eq!(delta(&now, &after), only(Some(c.class), 1), "{} ({}): counted once", c.what, c.dst);
        now = after;
    }
    let seen: Vec<SocketAddr> = proxy.seen()[seen_before..].iter().map(|s| s.dst).collect();
    assert_eq!(seen, cases.iter().map(|c| c.dst).collect::<Vec<_>>(), "the listener saw each, as sent");
    // The IPv4 half still counts, into the same row.
    assert_eq!(a.tcp(sa(VIP, 80)), capture(&a, "tcp", sa(VIP, 80)));
    let after = pod_counts(&counters(&node), &a).unwrap();
    assert_eq!(delta(&now, &after), only(Some("service"), 1), "an IPv4 connection, counted by the ip table");
    now = after;

    // Control: with the ip6 table's jump to `classify` deleted, an IPv6 connection is not
    // counted (the IPv6 counts come from the ip6 table's rules).
    a.delete_rule_of("ip6", "aether_services", "egress_classify", "jump classify");
    assert_eq!(a.tcp(sa(VIP6, 80)), capture(&a, "tcp", sa(VIP6, 80)));
    let after = pod_counts(&counters(&node), &a).unwrap();
    control(after == now, "the ip6 classify jump deleted", format!("{now:?} -> {after:?}\n{}", a.ruleset()));
    // `services verify` finds the ip6 table's missing rule and repairs it.
    let out = node.services(&["verify"], b"");
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    let v = out.json();
    assert!(v["pods"][0]["result"].as_str().unwrap_or("").starts_with("repaired"), "{v}");
    assert!(v["pods"][0]["differences"].to_string().contains("table ip6 aether_services"), "{v}");
    assert_eq!(a.tcp(sa(VIP6, 80)), capture(&a, "tcp", sa(VIP6, 80)));
    let repaired = pod_counts(&counters(&node), &a).unwrap();
    assert_eq!(delta(&now, &repaired), only(Some("service"), 1), "counted again once repaired, counters kept");
}

/// `refuse` mode: each IPv6 refusal reason refused, never reaching the listener; the IPv6
/// API server address is never refused.
#[test]
fn ipv6_refusals_reject_what_no_service_can_serve() {
    let Some(mut node) = node("ipv6_refusals_reject_what_no_service_can_serve", "svc6ref") else { return };
    let a = node.add_pod_with("a", Stack::Dual);
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let cases = cases();
    let refused: Vec<&Case> = cases.iter().filter(|c| c.refused()).collect();
    assert_eq!(refused.len(), 5);
    for c in &refused {
        let got = c.run(&a);
        control(got == c.captured(&a), &format!("{} ({}) before any snapshot", c.what, c.dst), &got);
    }
    apply(&node, &snapshot(1, "refuse", true, true));
    let seen_before = proxy.seen().len();
    let mut now = pod_counts(&counters(&node), &a).unwrap();
    for c in &cases {
        let got = c.run(&a);
        if c.refused() && c.udp {
            // As for IPv4: `reject` in OUTPUT makes send() fail at once (EPERM) or the
            // socket see port unreachable; nothing reaches the listener (checked below).
            assert!(got == Probe::Refused || got.to_string().contains("PermissionDenied"), "{}: {got}", c.what);
        } else if c.refused() {
            assert_eq!(got, Probe::Refused, "{} ({}) in refuse mode", c.what, c.dst);
        } else {
            assert_eq!(got, c.captured(&a), "{} ({}) in refuse mode", c.what, c.dst);
        }
        let after = pod_counts(&counters(&node), &a).unwrap();
        assert_eq!(delta(&now, &after), only(Some(c.class), 1), "{} ({}): counted once", c.what, c.dst);
        now = after;
    }
    let passed: Vec<SocketAddr> = cases.iter().filter(|c| !c.refused()).map(|c| c.dst).collect();
    let seen: Vec<SocketAddr> = proxy.seen()[seen_before..].iter().map(|s| s.dst).collect();
    assert_eq!(seen, passed, "refused connections never reached the listener");

    // Control for "never refused": without API6 in the ip6 never_refused set, refused.
    a.nft(&["delete", "element", "ip6", "aether_services", "never_refused", "{", &API6.to_string(), "}"]);
    let got = a.tcp(sa(API6, 81));
    control(got == Probe::Refused, "fd00:10:96::1 removed from never_refused", format!("{got}\n{}", a.ruleset()));

    // Control: mode off removes both tables; the refused connections reach the listener.
    let report = apply(&node, &snapshot(2, "off", true, true));
    assert_eq!(report["pods"][0]["result"], "removed", "{report}");
    assert_eq!(layer_tables(&a), Vec::<String>::new(), "{}", a.ruleset());
    for c in &refused {
        let got = c.run(&a);
        control(got == c.captured(&a), &format!("{} ({}) in mode off", c.what, c.dst), &got);
    }
}

/// An IPv6-only pod and an IPv6-only snapshot: the ip6 table alone; demand lists what was
/// dialled as `[vip]:port/proto`; DEL folds the ip6 table's counts into the node totals.
#[test]
fn an_ipv6_only_pod_gets_the_ip6_table_alone_and_del_folds_its_counts() {
    let Some(mut node) = node("an_ipv6_only_pod_gets_the_ip6_table_alone_and_del_folds_its_counts", "svc6only") else {
        return;
    };
    apply(&node, &snapshot(1, "count", false, true));
    let a = node.add_pod_with("a", Stack::Ipv6);
    let b = node.add_pod_with("b", Stack::Ipv6);
    let (conf_a, conf_b) = (a.add(json!({})), b.add(json!({})));
    let (_pa, _pb) = (Proxy::start(&a), Proxy::start(&b));
    assert_eq!(layer_tables(&a), ["ip6"], "ADD applied the stored IPv6 snapshot:\n{}", a.ruleset());
    for dst in [sa(VIP6, 80), sa(VIP6, 80), sa(NO_SERVICE6, 80)] {
        assert_eq!(a.tcp(dst), capture(&a, "tcp", dst));
    }
    assert_eq!(b.tcp(sa(EXTERNAL6, 80)), capture(&b, "tcp", sa(EXTERNAL6, 80)));
    let demand = node.services(&["demand", "--format", "text"], b"");
    assert!(demand.ok, "{}", demand.stderr);
    assert_eq!(
        demand.stdout.trim(),
        format!("[{VIP6}]:80/tcp\n[{NO_SERVICE6}]:80/tcp"),
        "what a dialled, in its ranges"
    );
    let c = counters(&node);
    let mut want_a = only(Some("service"), 2);
    want_a.insert("refused_no_service".into(), 1);
    assert_eq!(pod_counts(&c, &a), Some(want_a.clone()), "{c}");
    let totals = as_counts(&c["node"]);

    a.del(&conf_a);
    assert_eq!(layer_tables(&a), Vec::<String>::new(), "DEL removed the ip6 table");
    let c = counters(&node);
    assert_eq!(as_counts(&c["removedPods"]), want_a, "DEL folded a's ip6 counts: {c}");
    assert_eq!(as_counts(&c["node"]), totals, "the node totals still include a: {c}");

    // Control: b's ip6 table deleted before its DEL: nothing to fold, its count leaves.
    b.nft(&["delete", "table", "ip6", "aether_services"]);
    b.del(&conf_b);
    let after = as_counts(&counters(&node)["node"]);
    control(after != totals, "pod b's ip6 table deleted before its DEL", format!("{totals:?} -> {after:?}"));
}

/// A dual-stack snapshot followed by one without the IPv6 range: the pod's ip6 table goes
/// (one transaction with the ip table's rebuild) and what it counted stays in the pod's row.
#[test]
fn dropping_the_ipv6_ranges_removes_the_ip6_table_and_keeps_its_counts() {
    let Some(mut node) = node("dropping_the_ipv6_ranges_removes_the_ip6_table_and_keeps_its_counts", "svc6drop") else {
        return;
    };
    let a = node.add_pod_with("a", Stack::Dual);
    a.add(json!({}));
    let _p = Proxy::start(&a);
    apply(&node, &snapshot(1, "count", true, true));
    for dst in [sa(VIP6, 80), sa(MESH6, 80), sa(VIP, 80)] {
        assert_eq!(a.tcp(dst), capture(&a, "tcp", dst));
    }
    let before = pod_counts(&counters(&node), &a).unwrap();
    let mut want = only(Some("service"), 2);
    want.insert("mesh".into(), 1);
    assert_eq!(before, want);

    let report = apply(&node, &snapshot(2, "count", true, false));
    assert_eq!(report["pods"][0]["result"], "rebuilt", "a family less is a rebuild: {report}");
    assert_eq!(layer_tables(&a), ["ip"], "{}", a.ruleset());
    let after = pod_counts(&counters(&node), &a).unwrap();
    assert_eq!(after, before, "the ip6 table's counts were carried into the ip table");
    // Control: IPv6 connections are captured still, but no longer counted.
    assert_eq!(a.tcp(sa(VIP6, 80)), capture(&a, "tcp", sa(VIP6, 80)));
    let last = pod_counts(&counters(&node), &a).unwrap();
    control(last == after, "an IPv6 connection after the IPv6 range was dropped", format!("{after:?} -> {last:?}"));
    // And back: the ip6 table returns, counting from where the pod's totals are.
    apply(&node, &snapshot(3, "count", true, true));
    assert_eq!(layer_tables(&a), ["ip", "ip6"]);
    assert_eq!(a.tcp(sa(VIP6, 80)), capture(&a, "tcp", sa(VIP6, 80)));
    let back = pod_counts(&counters(&node), &a).unwrap();
    assert_eq!(delta(&last, &back), only(Some("service"), 1), "{last:?} -> {back:?}");
}

/// `inspect` of a dual-stack pod with a dual-stack snapshot: both capture halves, both
/// policy routes and the Service layer of both families, each said intact; a tampered IPv6
/// Service set is named, and the exit status says so.
#[test]
fn inspect_shows_both_families_of_a_dual_stack_pod_and_names_an_ipv6_tamper() {
    let Some(mut node) = node("inspect_shows_both_families_of_a_dual_stack_pod_and_names_an_ipv6_tamper", "svc6insp")
    else {
        return;
    };
    let a = node.add_pod_with("a", Stack::Dual);
    a.add(json!({}));
    apply(&node, &snapshot(1, "refuse", true, true));
    let state = node.state_dir().display().to_string();
    let inspect = || {
        aether_conformance::cni::run_cli(&node.host.path(), &["inspect", &a.container_id, "--state-dir", &state], b"")
    };
    let out = inspect();
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    for want in [
        "table ip aether_capture",
        "table ip6 aether_capture",
        "ip -6 rule",
        "snapshot generation 1, mode refuse: 2 ranges, 1 mesh VIPs, 5 Service ports \
         (table ip aether_services and table ip6 aether_services)",
        "kernel: intact (matches the snapshot)",
    ] {
        assert!(out.stdout.contains(want), "inspect should show {want:?}:\n{}", out.stdout);
    }
    // Control: an IPv6 Service element deleted by hand is named, with its table.
    a.nft(&["delete", "element", "ip6", "aether_services", "service_ports", "{", &format!("{VIP6} . tcp . 80"), "}"]);
    let out = inspect();
    assert!(!out.ok, "a tampered layer must fail inspect:\n{}", out.stdout);
    assert!(
        out.stdout.contains("table ip6 aether_services: ") && out.stdout.contains(&format!("{VIP6} . tcp . 80")),
        "{}",
        out.stdout
    );
}
