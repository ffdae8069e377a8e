//! The Service-range and refusal-counter layer (docs/design.md "The Service-range and
//! refusal-counter layer") proved with real sockets on the simulated node, behind
//! the real capture: pods are attached by the built `aether-cni` through the CNI protocol,
//! the snapshot goes in through `aether-cni services --state-dir D apply` run in the node's
//! netns as the agent would run it, and the counts come out of `services counters --format
//! json`. Each positive case is paired with a control that shows the same check can fail; a
//! control that does not fail is reported as `RIG BROKEN`, never as a pass.
//!
//! | claim | test | control (must fail) |
//! | --- | --- | --- |
//! | `count`: each class counted once per new connection (TCP and UDP), path unchanged | `count_mode_...` | the same probes before the snapshot (no counts); the layer's classify jump deleted; the neighbours of each exclusion are counted |
//! | excluded destinations, `:53`, uncaptured UDP: neither captured nor counted | `count_mode_...`, `refuse_mode_...` | 10.96.78.5 next to 10.96.77.0/24, port 8081 next to 8080 |
//! | `refuse`: ECONNREFUSED (TCP) for each reason, an immediate error for UDP, never the listener | `refuse_mode_...` | the same connections before the snapshot and after mode `off` reach the listener |
//! | the API server (first address of the range) is never refused, on any port | `refuse_mode_...` | the range's second address on the same port is refused; the address removed from `never_refused` is refused |
//! | ADD applies the stored snapshot; DEL folds a pod's counts into the node totals | `del_folds_...` | a pod whose layer is gone before DEL: its counts leave the totals |
//!
//! The addresses: pods at 10.244.0.x, the Service range 10.96.0.0/16 (local to the host
//! netns, where the upstream answers), 10.97.0.0/16 outside every Service range (also local
//! to the host netns). Nothing leaves the namespaces made here. Root only: without root each
//! test skips with a loud line; with `AETHER_REQUIRE_ROOT_TESTS=1` a skip is a failure.

use std::net::{Ipv4Addr, SocketAddr};

use aether_conformance::layer::{apply, as_counts, counters, delta, node_totals, only, pod_counts, sum};
use aether_conformance::{
    control, probe, sa, sock, Pod, Probe, Proxy, SimNode, DNS_PROXY_PORT, HOST_IP, MESH_L4_PORT, VIP,
};
use aether_testkit::root_or_skip;
use serde_json::{json, Value};

/// The cluster's one ServiceCIDR.
const RANGE: &str = "10.96.0.0/16";
/// Its first address: the API server Service (declared on 443 only).
const API: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// Its second address: no Service.
const API_NEXT: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 2);
/// A mesh Service's VIP.
const MESH: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 5);
/// A Service (TCP 80) without a usable endpoint.
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 2);
/// In the range, and no Service owns it.
const NO_SERVICE: Ipv4Addr = Ipv4Addr::new(10, 96, 200, 7);
/// Outside every Service range.
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 5);
/// A configured capture exclusion inside the Service range, an address in it, and its
/// neighbour just outside.
const EXCLUDED_NET: &str = "10.96.77.0/24";
const EXCLUDED: Ipv4Addr = Ipv4Addr::new(10, 96, 77, 5);
const NEXT_TO_EXCLUDED: Ipv4Addr = Ipv4Addr::new(10, 96, 78, 5);
/// A configured excluded TCP port (not declared by the Service at VIP).
const EXCLUDED_PORT: u16 = 8080;

fn node(test: &str, tag: &str) -> Option<SimNode> {
    root_or_skip(test).then(|| SimNode::new(tag))
}

/// The pods' extra configuration: one excluded network inside the Service range, one
/// excluded port.
fn exclusions() -> Value {
    json!({"excludeOutboundCIDRs": [EXCLUDED_NET], "excludeOutboundPorts": [EXCLUDED_PORT]})
}

/// The agent's snapshot: VIP is `shop/cart` (TCP 80, UDP 18082, with endpoints), EMPTY is
/// `shop/legacy` (TCP 80, no endpoint), API is `default/kubernetes` (TCP 443), MESH a mesh VIP.
fn snapshot(generation: u64, mode: &str) -> Vec<u8> {
    json!({
        "generation": generation,
        "mode": mode,
        "serviceRanges": [RANGE],
        "meshVIPs": [MESH.to_string()],
        "services": [
            {"namespace": "default", "name": "kubernetes", "vip": API.to_string(),
             "ports": [{"protocol": "TCP", "port": 443}], "usableEndpoints": true},
            {"namespace": "shop", "name": "cart", "vip": VIP.to_string(),
             "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "UDP", "port": MESH_L4_PORT}],
             "usableEndpoints": true},
            {"namespace": "shop", "name": "legacy", "vip": EMPTY.to_string(),
             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": false}
        ]
    })
    .to_string()
    .into_bytes()
}

/// What the capture listener says when it accepts `pod`'s probe to `dst`: `dst` is
/// `getsockname()` of the accepted socket, the original destination.
fn capture(pod: &Pod, proto: &str, dst: SocketAddr) -> Probe {
    Probe::Answer(format!("capture[{}] {proto} dst={dst} from={} got=probe", pod.name, pod.ip))
}

fn upstream(pod: &Pod, proto: &str, dst: SocketAddr) -> Probe {
    Probe::Answer(format!("upstream {proto} dst={dst} from={} got=probe", pod.ip))
}

fn dns_answer() -> Probe {
    Probe::Answer(format!("dns {} A {}", aether_conformance::dns::NAME, aether_conformance::dns::ANSWER))
}

#[derive(Clone, Copy)]
enum Kind {
    Tcp,
    Udp,
    /// A DNS query over TCP.
    DnsTcp,
}

/// One connection from the pod, where it must go, and the class it must be counted as.
struct Case {
    what: &'static str,
    kind: Kind,
    dst: SocketAddr,
    /// Where it goes in `count` mode, as without the layer.
    path: Probe,
    class: Option<&'static str>,
}

impl Case {
    fn run(&self, pod: &Pod) -> Probe {
        match self.kind {
            Kind::Tcp => pod.tcp(self.dst),
            Kind::Udp => pod.udp(self.dst),
            Kind::DnsTcp => pod.dns_tcp(self.dst),
        }
    }

    fn captured(&self) -> bool {
        self.path.text().starts_with("capture[")
    }
}

/// Every destination class, and what capture does with it (the layer must not change it).
fn cases(p: &Pod) -> Vec<Case> {
    let tcp = |what, dst: SocketAddr, class| Case { what, kind: Kind::Tcp, dst, path: capture(p, "tcp", dst), class };
    let passed = |what, kind, dst: SocketAddr, path| Case { what, kind, dst, path, class: None };
    vec![
        tcp("known Service VIP:80", sa(VIP, 80), Some("service")),
        Case {
            what: "known Service VIP:18082/udp",
            kind: Kind::Udp,
            dst: sa(VIP, MESH_L4_PORT),
            path: capture(p, "udp", sa(VIP, MESH_L4_PORT)),
            class: Some("service"),
        },
        tcp("mesh VIP", sa(MESH, 80), Some("mesh")),
        tcp("outside every range", sa(EXTERNAL, 80), Some("external")),
        tcp("API server, undeclared port", sa(API, 81), Some("service")),
        tcp("in the range, no Service", sa(NO_SERVICE, 80), Some("refused_no_service")),
        Case {
            what: "in the range, no Service, UDP 18082",
            kind: Kind::Udp,
            dst: sa(NO_SERVICE, MESH_L4_PORT),
            path: capture(p, "udp", sa(NO_SERVICE, MESH_L4_PORT)),
            class: Some("refused_no_service"),
        },
        tcp("the range's second address", sa(API_NEXT, 81), Some("refused_no_service")),
        tcp("Service without endpoints", sa(EMPTY, 80), Some("refused_no_endpoints")),
        tcp("Service VIP, undeclared port", sa(VIP, 81), Some("refused_port_not_declared")),
        // Controls for the exclusions below: their neighbours are captured and counted.
        tcp("next to the excluded network", sa(NEXT_TO_EXCLUDED, 80), Some("refused_no_service")),
        tcp("next to the excluded port", sa(VIP, 8081), Some("refused_port_not_declared")),
        // Not captured, so not classified: neither counted nor (in refuse mode) refused.
        passed("excluded network", Kind::Tcp, sa(EXCLUDED, 80), upstream(p, "tcp", sa(EXCLUDED, 80))),
        passed("excluded port", Kind::Tcp, sa(VIP, EXCLUDED_PORT), upstream(p, "tcp", sa(VIP, EXCLUDED_PORT))),
        passed("DNS over TCP, no Service at the address", Kind::DnsTcp, sa(NO_SERVICE, 53), dns_answer()),
        passed("UDP 18083 (not captured)", Kind::Udp, sa(NO_SERVICE, 18083), upstream(p, "udp", sa(NO_SERVICE, 18083))),
    ]
}

fn has_layer(p: &Pod) -> bool {
    p.nft(&["list", "tables"]).contains("aether_services")
}

/// Two datagrams and their replies on one connected UDP socket: one flow.
fn udp_twice(p: &Pod, dst: SocketAddr) -> Vec<Probe> {
    sock::in_netns(&p.path(), || {
        let s = sock::udp_connected(dst, None, probe::TIMEOUT).expect("UDP socket");
        (0..2)
            .map(|_| {
                let mut buf = [0u8; 2048];
                match s.send(b"probe").and_then(|_| s.recv(&mut buf)) {
                    Ok(n) => Probe::Answer(String::from_utf8_lossy(&buf[..n]).trim().to_string()),
                    Err(e) => Probe::Failed(e.to_string()),
                }
            })
            .collect()
    })
}

/// `count` mode: every class counted exactly once per new connection, TCP and UDP, and the
/// path unchanged (each connection goes exactly where it went before the snapshot); excluded
/// destinations, `:53` and uncaptured UDP are neither captured nor counted.
#[test]
fn count_mode_counts_each_new_captured_connection_once_by_class_and_changes_no_path() {
    let Some(mut node) =
        node("count_mode_counts_each_new_captured_connection_once_by_class_and_changes_no_path", "svccnt")
    else {
        return;
    };
    let a = node.add_pod("a");
    a.add(exclusions());
    let proxy = Proxy::start(&a);
    let cases = cases(&a);

    // Before any snapshot: ADD made no layer; every connection goes where capture sends it.
    assert!(!has_layer(&a), "no snapshot yet, yet a layer:\n{}", a.ruleset());
    for c in &cases {
        assert_eq!(c.run(&a), c.path, "{} ({}), without the layer", c.what, c.dst);
    }
    let c0 = counters(&node);
    assert_eq!(pod_counts(&c0, &a), None, "no layer, no row: {c0}");
    assert_eq!(node_totals(&c0), only(None, 0), "{c0}");
    let seen_before = proxy.seen().len();

    let report = apply(&node, &snapshot(1, "count"));
    assert_eq!(report["generation"], 1);
    let pods = report["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 1, "{report}");
    assert_eq!(
        (pods[0]["containerID"].as_str(), pods[0]["result"].as_str()),
        (Some(&*a.container_id), Some("rebuilt"))
    );
    assert!(has_layer(&a));
    let mut now = pod_counts(&counters(&node), &a).expect("a row for the pod once the layer is there");
    assert_eq!(now, only(None, 0));

    for c in &cases {
        let got = c.run(&a);
        assert_eq!(got, c.path, "{} ({}): count mode changes nothing on the path", c.what, c.dst);
        let after = pod_counts(&counters(&node), &a).unwrap();
        let d = delta(&now, &after);
        if c.what.starts_with("next to") {
            control(d != only(None, 0), &format!("{} ({}) is counted", c.what, c.dst), format!("{d:?}"));
        }
        assert_eq!(
            d,
            only(c.class, 1),
            "{} ({}): counted once, as {:?} (a TCP probe is SYN, data, FIN: several packets)",
            c.what,
            c.dst,
            c.class
        );
        now = after;
    }
    // The capture listener saw each captured connection with its original destination.
    let seen = proxy.seen();
    let captured: Vec<SocketAddr> = cases.iter().filter(|c| c.captured()).map(|c| c.dst).collect();
    assert_eq!(seen[seen_before..].iter().map(|s| s.dst).collect::<Vec<_>>(), captured, "{seen:?}");

    // UDP: two datagrams on one socket are one flow, counted once.
    let dst = sa(VIP, MESH_L4_PORT);
    assert_eq!(udp_twice(&a, dst), vec![capture(&a, "udp", dst), capture(&a, "udp", dst)]);
    let after = pod_counts(&counters(&node), &a).unwrap();
    assert_eq!(delta(&now, &after), only(Some("service"), 1), "one UDP flow, two datagrams each way");
    now = after;

    // Node totals: the one live pod.
    let c = counters(&node);
    assert_eq!(c["generation"], 1);
    assert_eq!(node_totals(&c), now, "{c}");

    // Control: the Service's profile number reaches `profile_chains` through the mark, and
    // `by_key` sets capture's divert mark back first; without that rule the connection leaves
    // the layer marked with its number (0), and capture's listener never gets it.
    a.delete_rule_of("ip", "aether_services", "by_key", "meta mark set 0x0000ae71");
    let unrestored = a.tcp(sa(VIP, 80));
    control(
        unrestored != capture(&a, "tcp", sa(VIP, 80)),
        "by_key's divert mark set back deleted",
        format!("{unrestored:?}\n{}", a.ruleset()),
    );
    now = pod_counts(&counters(&node), &a).unwrap();

    // Control: with the layer's jump to `classify` deleted, the same connection is not counted
    // (the counts above come from the layer's rules).
    a.delete_rule_of("ip", "aether_services", "egress_classify", "jump classify");
    assert_eq!(a.tcp(sa(VIP, 80)), capture(&a, "tcp", sa(VIP, 80)));
    let after = pod_counts(&counters(&node), &a).unwrap();
    control(after == now, "the classify jump deleted", format!("{now:?} -> {after:?}\n{}", a.ruleset()));
}

/// `refuse` mode: each refusal reason gives ECONNREFUSED (TCP, a reset) or, for UDP, an
/// immediate error on send (EPERM here; the ICMP port unreachable is not what the
/// kernel produces in OUTPUT) and is counted; refused connections
/// never reach the capture listener. Known Services, the API server, mesh VIPs and external
/// addresses are captured as before; excluded destinations and `:53` are untouched.
#[test]
fn refuse_mode_refuses_what_no_service_can_serve_and_passes_the_rest() {
    let Some(mut node) = node("refuse_mode_refuses_what_no_service_can_serve_and_passes_the_rest", "svcref") else {
        return;
    };
    let a = node.add_pod("a");
    a.add(exclusions());
    let proxy = Proxy::start(&a);
    let cases = cases(&a);
    let refused: Vec<&Case> = cases.iter().filter(|c| c.class.is_some_and(|k| k.starts_with("refused_"))).collect();
    assert_eq!(refused.len(), 7);

    // Control: without the layer (ADD before any snapshot) each of these reaches the listener.
    for c in &refused {
        let got = c.run(&a);
        control(got == c.path, &format!("{} ({}) before any snapshot", c.what, c.dst), &got);
    }
    let seen_before = proxy.seen().len();

    let report = apply(&node, &snapshot(1, "refuse"));
    assert_eq!(report["pods"][0]["result"], "rebuilt", "{report}");
    let mut now = pod_counts(&counters(&node), &a).unwrap();
    for c in &cases {
        let got = c.run(&a);
        let refused_here = c.class.is_some_and(|k| k.starts_with("refused_"));
        if refused_here && matches!(c.kind, Kind::Udp) {
            // The specification asks for an ICMP port unreachable (ECONNREFUSED on a connected socket).
            // What this kernel gives: `reject` in OUTPUT drops the datagram and send() fails
            // with EPERM; no ICMP is generated (see the report). Either way the client fails at
            // once and nothing reaches the listener (checked below).
            assert!(
                got == Probe::Refused || got.to_string().contains("PermissionDenied"),
                "{} ({}) in refuse mode: {got}",
                c.what,
                c.dst
            );
        } else {
            let want = if refused_here { Probe::Refused } else { c.path.clone() };
            assert_eq!(got, want, "{} ({}) in refuse mode", c.what, c.dst);
        }
        let after = pod_counts(&counters(&node), &a).unwrap();
        assert_eq!(delta(&now, &after), only(c.class, 1), "{} ({}): counted once as {:?}", c.what, c.dst, c.class);
        now = after;
    }
    // Refused connections never reached the capture listener; the others did, as sent.
    let passed: Vec<SocketAddr> =
        cases.iter().filter(|c| c.captured() && !refused.iter().any(|r| r.dst == c.dst)).map(|c| c.dst).collect();
    let seen = proxy.seen();
    assert_eq!(seen[seen_before..].iter().map(|s| s.dst).collect::<Vec<_>>(), passed, "{seen:?}");
    assert!(node.dns_seen().iter().all(|s| s.dst == sa(HOST_IP, DNS_PROXY_PORT)));

    // Control for "the API server is never refused": with its address removed from the
    // layer's never-refused set, the same connection is refused.
    a.nft(&["delete", "element", "ip", "aether_services", "never_refused", "{", &API.to_string(), "}"]);
    let got = a.tcp(sa(API, 81));
    control(got == Probe::Refused, "10.96.0.1 removed from never_refused", format!("{got}\n{}", a.ruleset()));

    // Control: mode off removes the layer, and the refused connections reach the listener again.
    let report = apply(&node, &snapshot(2, "off"));
    assert_eq!(report["pods"][0]["result"], "removed", "{report}");
    assert!(!has_layer(&a), "{}", a.ruleset());
    for c in &refused {
        let got = c.run(&a);
        control(got == c.path, &format!("{} ({}) in mode off", c.what, c.dst), &got);
    }
}

/// ADD applies the stored snapshot to a new pod; DEL folds the pod's final counts into the
/// node totals, which do not go back when the pod goes (nor count it twice on a second DEL).
#[test]
fn del_folds_the_pods_counts_into_the_node_totals() {
    let Some(mut node) = node("del_folds_the_pods_counts_into_the_node_totals", "svcdel") else { return };
    // The snapshot first, with no pod on the node: ADD must apply it.
    let report = apply(&node, &snapshot(1, "count"));
    assert_eq!(report["pods"], json!([]), "{report}");
    let a = node.add_pod("a");
    let b = node.add_pod("b");
    let conf_a = a.add(json!({}));
    let conf_b = b.add(json!({}));
    let (_pa, _pb) = (Proxy::start(&a), Proxy::start(&b));
    assert!(has_layer(&a) && has_layer(&b), "ADD applied the stored snapshot");
    for dst in [sa(VIP, 80), sa(VIP, 80), sa(NO_SERVICE, 80), sa(EXTERNAL, 80)] {
        assert_eq!(a.tcp(dst), capture(&a, "tcp", dst));
    }
    assert_eq!(b.tcp(sa(MESH, 80)), capture(&b, "tcp", sa(MESH, 80)));
    let c = counters(&node);
    let (ca, cb) = (pod_counts(&c, &a).unwrap(), pod_counts(&c, &b).unwrap());
    let mut want_a = only(Some("service"), 2);
    want_a.insert("refused_no_service".into(), 1);
    want_a.insert("external".into(), 1);
    assert_eq!((&ca, &cb), (&want_a, &only(Some("mesh"), 1)), "{c}");
    let totals = node_totals(&c);
    assert_eq!(totals, sum(&ca, &cb), "{c}");

    a.del(&conf_a);
    assert!(!has_layer(&a), "DEL removed the layer");
    let c = counters(&node);
    assert_eq!(pod_counts(&c, &a), None, "{c}");
    assert_eq!(as_counts(&c["removedPods"]), sum(&ca, &only(None, 0)), "DEL folded a's final counts: {c}");
    assert_eq!(node_totals(&c), totals, "the node totals still include a: {c}");
    a.del(&conf_a);
    assert_eq!(node_totals(&counters(&node)), totals, "a second DEL counts nothing twice");

    // Control: a pod whose layer is gone before its DEL has nothing to fold, and its counts
    // leave the totals: the totals after DEL come from the fold.
    b.nft(&["delete", "table", "ip", "aether_services"]);
    b.del(&conf_b);
    let after = node_totals(&counters(&node));
    control(after != totals, "pod b's layer deleted before its DEL", format!("{totals:?} -> {after:?}"));
    assert_eq!(after, sum(&ca, &only(None, 0)));
}

#[test]
fn mode_off_folds_the_pods_counts_so_node_totals_never_go_backwards() {
    let Some(mut node) = node("mode_off_folds_the_pods_counts_so_node_totals_never_go_backwards", "svcoff") else {
        return;
    };
    let a = node.add_pod("a");
    let _conf_a = a.add(json!({}));
    let _pa = Proxy::start(&a);
    apply(&node, &snapshot(1, "count"));
    for dst in [sa(VIP, 80), sa(EXTERNAL, 80)] {
        assert_eq!(a.tcp(dst), capture(&a, "tcp", dst));
    }
    let before = node_totals(&counters(&node));
    let mut want = only(Some("service"), 1);
    want.insert("external".into(), 1);
    assert_eq!(before, want);
    // Mode off removes the pod's table; its counts stay in the node totals.
    apply(&node, &snapshot(2, "off"));
    assert!(!has_layer(&a), "mode off removed the layer");
    assert_eq!(node_totals(&counters(&node)), before, "mode off made the node totals go backwards");
    // Back on: the pod starts from zero, the node totals keep growing from where they were.
    apply(&node, &snapshot(3, "count"));
    assert_eq!(a.tcp(sa(VIP, 80)), capture(&a, "tcp", sa(VIP, 80)));
    let after = node_totals(&counters(&node));
    assert_eq!(after, sum(&before, &only(Some("service"), 1)), "{after:?}");
}

/// Three datagrams of one UDP flow that never gets a reply (no listener: the datagrams
/// are diverted and find no socket): conntrack calls each of them `new`, yet the flow is
/// one connection and is counted once.
#[test]
fn a_udp_flow_without_replies_is_counted_once() {
    let Some(mut node) = node("a_udp_flow_without_replies_is_counted_once", "svcudp") else { return };
    let a = node.add_pod("a");
    let _conf = a.add(json!({}));
    apply(&node, &snapshot(1, "count"));
    let dst = sa(VIP, 18082);
    let send_three = |port: u16| {
        sock::in_netns(&a.path(), || {
            let s = std::net::UdpSocket::bind(("0.0.0.0", port)).expect("UDP socket");
            for _ in 0..3 {
                s.send_to(b"probe", dst).expect("send");
            }
        })
    };
    let before = node_totals(&counters(&node));
    send_three(40001);
    let after = node_totals(&counters(&node));
    assert_eq!(delta(&before, &after), only(Some("service"), 1), "one UDP flow, three datagrams, no reply");
    // Control: another source port is another flow, counted again.
    send_three(40002);
    let last = node_totals(&counters(&node));
    control(delta(&after, &last) == only(Some("service"), 1), "a second UDP flow", format!("{after:?} -> {last:?}"));
}
