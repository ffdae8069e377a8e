//! Root-gated: the Service layer programmed in a fresh netns, read back, changed by
//! elements only, and its counters and demand read, with real packets.

use std::net::{IpAddr, Ipv4Addr};

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

/// `layer(mode)` with every Service's ports declared again by enough Services (VIPs 4,096
/// apart in the range) that each profile has a chain of its own.
fn chained(mode: LayerMode) -> ServiceLayer {
    let mut l = layer(mode);
    let base = l.ports.clone();
    for k in 1..services::MIN_SERVICES_PER_PROFILE as u32 {
        l.ports.extend(base.iter().map(|p| {
            let IpAddr::V4(a) = p.vip else { unreachable!() };
            ServicePort { vip: Ipv4Addr::from(u32::from(a) + 0x1000 * k).into(), ..*p }
        }));
    }
    l
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

/// The listing with each `elements = { ... }` block on one line, sorted: hash sets list
/// their elements in an order seeded at random per set.
fn sorted_elements(listing: &str) -> String {
    let mut out = String::new();
    let mut pending: Option<(String, String)> = None;
    for line in listing.lines() {
        if let Some((indent, mut body)) = pending.take() {
            body.push(' ');
            body.push_str(line.trim());
            if line.trim_end().ends_with('}') {
                out.push_str(&finish(&indent, &body));
            } else {
                pending = Some((indent, body));
            }
            continue;
        }
        match line.find("elements = {") {
            Some(i) if !line.trim_end().ends_with('}') => {
                pending = Some((line[..i].to_string(), line[i..].to_string()))
            }
            Some(i) => out.push_str(&finish(&line[..i], &line[i..])),
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    fn finish(indent: &str, body: &str) -> String {
        let inner = body.trim_start_matches("elements = {").trim_end().trim_end_matches('}');
        let mut items: Vec<&str> = inner.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        items.sort();
        format!("{indent}elements = {{ {} }}\n", items.join(", "))
    }
    out
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
    aether_testkit::assert_golden("services-refuse.txt", &sorted_elements(&listing));
    for want in [
        "counter refused_no_service",
        "type filter hook output priority mangle + 10; policy accept;",
        "ip daddr . meta l4proto . th dport @service_ports counter name \"service\" accept",
        "ip daddr != @service_ranges counter name \"external\" accept",
        "update @dialled { ip daddr . meta l4proto . th dport }",
        "reject with tcp reset",
        "10.96.1.1 . tcp . 80",
        "ct state new ct status ! confirmed jump classify",
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
    assert_eq!(in_ns(&ns, || services::verify(&l3)).unwrap(), Vec::<String>::new());
    // A mode change is data: the refusing set loses tcp and udp; rules and counters stay.
    let l4 = ServiceLayer { mode: LayerMode::Count, ..l3.clone() };
    assert_eq!(in_ns(&ns, || services::apply(&l4)).unwrap(), Applied::Elements { added: 0, removed: 2 });
    assert_eq!(ns.exec("nft", &["-a", "list", "chain", "ip", services::TABLE, services::CHAIN_CLASSIFY]), handle_after);
    assert_eq!(in_ns(&ns, || services::verify(&l4)).unwrap(), Vec::<String>::new());
    let off = ServiceLayer { mode: LayerMode::Off, ..l3 };
    assert_eq!(in_ns(&ns, || services::apply(&off)).unwrap(), Applied::Removed(true));
    assert!(in_ns(&ns, services::counters).unwrap().is_none());
}

/// A layer whose profiles are shared widely enough to have chains: the kernel's own listing
/// (reviewed in `services-refuse-profiles.txt`), read back intact.
#[test]
fn profile_chains_as_the_kernel_lists_them() {
    if !root_or_skip("profile_chains_as_the_kernel_lists_them") {
        return;
    }
    let ns = TestNetns::new("svc-prof");
    let l = chained(LayerMode::Refuse);
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Rebuilt);
    let listing = ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    aether_testkit::assert_golden("services-refuse-profiles.txt", &sorted_elements(&listing));
    assert_eq!(in_ns(&ns, || services::verify(&l)).unwrap(), Vec::<String>::new());
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Unchanged);
}

#[test]
fn tampering_is_reported() {
    if !root_or_skip("tampering_is_reported") {
        return;
    }
    let ns = TestNetns::new("svc-tamper");
    let l = layer(LayerMode::Count);
    in_ns(&ns, || services::apply(&l)).unwrap();
    ns.exec(
        "nft",
        &["delete", "element", "ip", services::TABLE, services::SET_SERVICE_PORTS, "{ 10.96.1.1 . tcp . 80 }"],
    );
    let diffs = in_ns(&ns, || services::verify(&l)).unwrap();
    assert!(diffs.iter().any(|d| d.contains("10.96.1.1 . tcp . 80")), "{diffs:#?}");
    // apply repairs it with one element.
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Elements { added: 1, removed: 0 });
    let _ = Ipv4Addr::LOCALHOST;
}

/// The two maps changed behind our back: a Service's number changed (its VIP now leads to
/// another profile's chain) and a number's chain taken out of the verdict map. Both are
/// reported, each in its map's notation, and apply puts both back by elements.
#[test]
fn a_changed_number_and_a_missing_profile_chain_element_are_reported() {
    if !root_or_skip("a_changed_number_and_a_missing_profile_chain_element_are_reported") {
        return;
    }
    let ns = TestNetns::new("svc-tamper-map");
    let l = chained(LayerMode::Refuse);
    in_ns(&ns, || services::apply(&l)).unwrap();
    assert_eq!(in_ns(&ns, || services::verify(&l)).unwrap(), Vec::<String>::new());
    // Profiles in order: tcp80-noep (1), tcp80 with udp18082 (2), tcp443 (3).
    let nft = |args: &[&str]| ns.exec("nft", args);
    nft(&["delete", "element", "ip", services::TABLE, services::SET_VIPS, "{ 10.96.1.1 }"]);
    nft(&["add", "element", "ip", services::TABLE, services::SET_VIPS, "{ 10.96.1.1 : 3 }"]);
    nft(&["delete", "element", "ip", services::TABLE, services::SET_PROFILE_CHAINS, "{ 1 }"]);
    let mut diffs = in_ns(&ns, || services::verify(&l)).unwrap();
    diffs.sort();
    assert_eq!(
        diffs,
        [
            "set profile_chains: element 0x00000001 : goto ports_tcp80-noep is missing",
            "set service_vips: element 10.96.1.1 : 0x00000002 is missing",
            "set service_vips: unexpected element 10.96.1.1 : 0x00000003",
        ]
    );
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Elements { added: 2, removed: 1 });
    assert_eq!(in_ns(&ns, || services::verify(&l)).unwrap(), Vec::<String>::new());
}

/// A pod netns and a peer netns joined by a veth. The peer holds the Service VIPs and an
/// external address on its `lo`, with TCP listeners on 53, 80, 443, 8080 and a UDP socket
/// on 18082. In the pod, a stand-in for capture's divert decision marks TCP and UDP 18082
/// with the divert mark in a route chain at -150 (no policy route: packets leave normally),
/// so the layer is tested alone, on real packets.
struct Pair {
    pod: TestNetns,
    peer: TestNetns,
    _listeners: Vec<std::net::TcpListener>,
    /// One UDP socket per peer address on 18082, so replies come from the dialled VIP.
    udp: std::collections::BTreeMap<&'static str, std::net::UdpSocket>,
}

const VIPS: [&str; 6] = ["10.96.0.1", "10.96.1.1", "10.96.1.2", "10.96.5.5", "10.96.9.9", "192.0.2.10"];

fn pair(tag: &str) -> Pair {
    let pod = TestNetns::new(&format!("{tag}-pod"));
    let peer = TestNetns::new(&format!("{tag}-peer"));
    pod.exec("ip", &["link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", &peer.name]);
    pod.exec("ip", &["addr", "add", "10.244.1.5/24", "dev", "eth0"]);
    pod.exec("ip", &["link", "set", "eth0", "up"]);
    pod.exec("ip", &["route", "add", "default", "via", "10.244.1.1"]);
    peer.exec("ip", &["addr", "add", "10.244.1.1/24", "dev", "eth0"]);
    peer.exec("ip", &["link", "set", "eth0", "up"]);
    for vip in VIPS {
        peer.exec("ip", &["addr", "add", &format!("{vip}/32"), "dev", "lo"]);
    }
    let (listeners, udp) = in_ns(&peer, || {
        let l = [53u16, 80, 443, 8080].map(|p| std::net::TcpListener::bind(("0.0.0.0", p)).unwrap());
        let u = VIPS.map(|v| (v, std::net::UdpSocket::bind((v, 18082)).unwrap()));
        (l.into_iter().collect::<Vec<_>>(), u.into_iter().collect::<std::collections::BTreeMap<_, _>>())
    });
    for u in udp.values() {
        u.set_read_timeout(Some(std::time::Duration::from_millis(500))).unwrap();
    }
    let marker = "table ip test_divert_standin {\n\tchain out {\n\t\ttype route hook output priority -150; policy accept;\n\t\tmeta l4proto tcp meta mark set 0xae71\n\t\tudp dport 18082 meta mark set 0xae71\n\t}\n}\n";
    let path = std::env::temp_dir().join(format!("{}.nft", pod.name));
    std::fs::write(&path, marker).unwrap();
    pod.exec("nft", &["-f", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(path);
    Pair { pod, peer, _listeners: listeners, udp }
}

/// TCP connect from the pod: Ok, or the error kind.
fn tcp(p: &Pair, addr: &str, port: u16) -> Result<(), std::io::ErrorKind> {
    let sa: std::net::SocketAddr = format!("{addr}:{port}").parse().unwrap();
    in_ns(&p.pod, || {
        std::net::TcpStream::connect_timeout(&sa, std::time::Duration::from_secs(2)).map(|mut s| {
            use std::io::Write;
            // Established packets: never counted again.
            for _ in 0..3 {
                s.write_all(b"established").unwrap();
            }
        })
    })
    .map_err(|e| e.kind())
}

/// A UDP exchange from the pod to port 18082: a datagram, the peer's reply, a second
/// datagram. Ok when the peer received both. (conntrack calls a UDP flow new until its
/// first reply, so the reply is what makes the second datagram part of a known flow.)
fn udp(p: &Pair, addr: &str) -> Result<(), String> {
    let sa: std::net::SocketAddr = format!("{addr}:18082").parse().unwrap();
    let s = in_ns(&p.pod, || std::net::UdpSocket::bind("0.0.0.0:0").unwrap());
    s.set_read_timeout(Some(std::time::Duration::from_millis(500))).unwrap();
    s.connect(sa).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 16];
    let peer = p.udp.iter().find(|(v, _)| **v == addr).map(|(_, u)| u).expect("a peer address");
    s.send(b"one").map_err(|e| format!("send: {e}"))?;
    let (_, from) = peer.recv_from(&mut buf).map_err(|e| format!("peer did not receive: {e}"))?;
    peer.send_to(b"reply", from).unwrap();
    s.recv(&mut buf).map_err(|e| format!("no reply: {e}"))?;
    s.send(b"two").map_err(|e| format!("send: {e}"))?;
    peer.recv_from(&mut buf).map_err(|e| format!("peer did not receive: {e}"))?;
    Ok(())
}

fn counts(p: &Pair) -> std::collections::BTreeMap<String, u64> {
    in_ns(&p.pod, services::counters).unwrap().expect("layer present")
}

fn expect_counts(p: &Pair, want: [u64; 6]) {
    let c = counts(p);
    let got: Vec<u64> = services::COUNTERS.iter().map(|n| c[*n]).collect();
    assert_eq!(got, want, "counters {:?} (order {:?})", c, services::COUNTERS);
}

#[test]
fn count_mode_counts_each_class_once_and_changes_nothing() {
    if !root_or_skip("count_mode_counts_each_class_once_and_changes_nothing") {
        return;
    }
    count_mode(&pair("svc-count"), &layer(LayerMode::Count));
}

/// The same through the Services' profile chains.
#[test]
fn count_mode_counts_each_class_once_through_profile_chains() {
    if !root_or_skip("count_mode_counts_each_class_once_through_profile_chains") {
        return;
    }
    count_mode(&pair("svc-countp"), &chained(LayerMode::Count));
}

fn count_mode(p: &Pair, l: &ServiceLayer) {
    // Negative control: without the layer every connection reaches the peer.
    for (a, port) in [("10.96.9.9", 80), ("10.96.1.2", 80), ("10.96.1.1", 8080)] {
        assert_eq!(tcp(p, a, port), Ok(()), "{a}:{port} without the layer");
    }
    in_ns(&p.pod, || services::apply(l)).unwrap();
    expect_counts(p, [0; 6]);
    // [mesh, service, external, no_endpoints, port_not_declared, no_service]
    assert_eq!(tcp(p, "10.96.5.5", 80), Ok(()));
    expect_counts(p, [1, 0, 0, 0, 0, 0]);
    assert_eq!(tcp(p, "10.96.1.1", 80), Ok(()));
    expect_counts(p, [1, 1, 0, 0, 0, 0]);
    assert_eq!(tcp(p, "192.0.2.10", 80), Ok(()));
    expect_counts(p, [1, 1, 1, 0, 0, 0]);
    assert_eq!(tcp(p, "10.96.1.2", 80), Ok(()));
    expect_counts(p, [1, 1, 1, 1, 0, 0]);
    assert_eq!(tcp(p, "10.96.1.1", 8080), Ok(()));
    expect_counts(p, [1, 1, 1, 1, 1, 0]);
    assert_eq!(tcp(p, "10.96.9.9", 80), Ok(()));
    expect_counts(p, [1, 1, 1, 1, 1, 1]);
    // Port 53 is never classified; UDP is counted once per flow.
    assert_eq!(tcp(p, "10.96.9.9", 53), Ok(()));
    expect_counts(p, [1, 1, 1, 1, 1, 1]);
    assert_eq!(udp(p, "10.96.1.1"), Ok(()));
    expect_counts(p, [1, 2, 1, 1, 1, 1]);
    assert_eq!(udp(p, "10.96.9.9"), Ok(()));
    expect_counts(p, [1, 2, 1, 1, 1, 2]);
    let demand = in_ns(&p.pod, services::demand).unwrap();
    let shown: Vec<String> = demand.iter().map(|(a, pr, port)| format!("{a}/{}:{port}", pr.name())).collect();
    assert_eq!(
        shown,
        [
            "10.96.1.1/tcp:80",
            "10.96.1.1/tcp:8080",
            "10.96.1.1/udp:18082",
            "10.96.1.2/tcp:80",
            "10.96.9.9/tcp:80",
            "10.96.9.9/udp:18082"
        ]
    );
    drop(p.peer.name.clone());
}

#[test]
fn refuse_mode_refuses_by_reason_and_passes_the_rest() {
    if !root_or_skip("refuse_mode_refuses_by_reason_and_passes_the_rest") {
        return;
    }
    refuse_mode(&pair("svc-refuse"), &layer(LayerMode::Refuse));
}

/// The same through the Services' profile chains; and the negative control: without the
/// profile chain's rule for port 80, that port is refused as not declared.
#[test]
fn refuse_mode_refuses_by_reason_through_profile_chains() {
    if !root_or_skip("refuse_mode_refuses_by_reason_through_profile_chains") {
        return;
    }
    let p = pair("svc-refusep");
    let l = chained(LayerMode::Refuse);
    refuse_mode(&p, &l);
    let chain = "ports_tcp80_udp18082";
    let listing = p.pod.exec("nft", &["-a", "list", "chain", "ip", services::TABLE, chain]);
    let handle = listing
        .lines()
        .find(|l| l.contains("tcp dport 80 "))
        .and_then(|l| l.rsplit("# handle ").next())
        .unwrap_or_else(|| panic!("no rule for port 80 in\n{listing}"))
        .trim()
        .to_string();
    p.pod.exec("nft", &["delete", "rule", "ip", services::TABLE, chain, "handle", &handle]);
    assert_eq!(tcp(&p, "10.96.1.1", 80), Err(std::io::ErrorKind::ConnectionRefused), "port 80 without its rule");
    expect_counts(&p, [1, 3, 1, 1, 2, 2]);
    // And apply puts the chain right again (rebuilt: a chain's rules are not elements).
    assert_eq!(in_ns(&p.pod, || services::apply(&l)).unwrap(), Applied::Rebuilt);
    assert_eq!(tcp(&p, "10.96.1.1", 80), Ok(()));
    expect_counts(&p, [1, 4, 1, 1, 2, 2]);
}

fn refuse_mode(p: &Pair, l: &ServiceLayer) {
    in_ns(&p.pod, || services::apply(l)).unwrap();
    let refused = Err(std::io::ErrorKind::ConnectionRefused);
    assert_eq!(tcp(p, "10.96.1.2", 80), refused, "no endpoints");
    assert_eq!(tcp(p, "10.96.1.1", 8080), refused, "port not declared");
    assert_eq!(tcp(p, "10.96.9.9", 80), refused, "no service");
    expect_counts(p, [0, 0, 0, 1, 1, 1]);
    assert_eq!(tcp(p, "10.96.5.5", 80), Ok(()), "mesh");
    assert_eq!(tcp(p, "10.96.1.1", 80), Ok(()), "service");
    assert_eq!(tcp(p, "192.0.2.10", 80), Ok(()), "external");
    assert_eq!(tcp(p, "10.96.0.1", 8080), Ok(()), "the API server address, even on an undeclared port");
    assert_eq!(tcp(p, "10.96.9.9", 53), Ok(()), "port 53");
    expect_counts(p, [1, 2, 1, 1, 1, 1]);
    let err = udp(p, "10.96.9.9").unwrap_err();
    assert!(err.starts_with("send:"), "UDP refusal is an error on send: {err}");
    assert_eq!(udp(p, "10.96.1.1"), Ok(()));
    expect_counts(p, [1, 3, 1, 1, 1, 2]);
}

#[test]
fn demand_forgets_after_the_timeout() {
    if !root_or_skip("demand_forgets_after_the_timeout") {
        return;
    }
    let p = pair("svc-demand");
    let mut l = layer(LayerMode::Count);
    l.dialled_timeout_secs = 1;
    in_ns(&p.pod, || services::apply(&l)).unwrap();
    assert_eq!(tcp(&p, "10.96.1.1", 80), Ok(()));
    assert_eq!(in_ns(&p.pod, services::demand).unwrap().len(), 1);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    assert_eq!(in_ns(&p.pod, services::demand).unwrap(), vec![]);
}

/// 100,000 Service ports: hundreds of element messages in one transaction, built, changed
/// by a large deletion, and read back; the kernel's answers must not overflow the socket.
#[test]
fn a_hundred_thousand_service_ports_apply_and_verify() {
    if !root_or_skip("a_hundred_thousand_service_ports_apply_and_verify") {
        return;
    }
    let ns = TestNetns::new("svc-100k");
    let big = |n: u32| {
        let mut l = ServiceLayer::new(LayerMode::Refuse);
        l.ranges = vec!["10.64.0.0/10".parse().unwrap()];
        l.ports = (0..n)
            .map(|i| ServicePort {
                vip: Ipv4Addr::from(0x0a40_0002 + i).into(),
                proto: Proto::Tcp,
                port: 80,
                has_endpoints: i % 10 != 0,
            })
            .collect();
        l
    };
    let (l100k, l30k) = (big(100_000), big(30_000));
    assert_eq!(in_ns(&ns, || services::apply(&l100k)).unwrap(), Applied::Rebuilt);
    assert_eq!(in_ns(&ns, || services::verify(&l100k)).unwrap(), Vec::<String>::new());
    match in_ns(&ns, || services::apply(&l30k)).unwrap() {
        // 70,000 VIPs leave service_vips (their two profiles have chains: no keyed port).
        Applied::Elements { removed, .. } => assert_eq!(removed, 70_000),
        other => panic!("expected an element-only update, got {other:?}"),
    }
    assert_eq!(in_ns(&ns, || services::verify(&l30k)).unwrap(), Vec::<String>::new());
}

/// The demand timeout is part of the layer: changing only it rebuilds the `dialled` set, and
/// verify notices a set left with another timeout.
#[test]
fn a_new_dialled_timeout_reaches_existing_pods() {
    if !root_or_skip("a_new_dialled_timeout_reaches_existing_pods") {
        return;
    }
    let ns = TestNetns::new("svc-tmo");
    let mut l = layer(LayerMode::Count);
    l.dialled_timeout_secs = 3600;
    in_ns(&ns, || services::apply(&l)).unwrap();
    let mut shorter = l.clone();
    shorter.dialled_timeout_secs = 60;
    let diffs = in_ns(&ns, || services::verify(&shorter)).unwrap();
    assert!(
        diffs.iter().any(|d| d.contains("set dialled: element timeout is 3600000 ms, expected 60000 ms")),
        "{diffs:#?}"
    );
    assert_eq!(in_ns(&ns, || services::apply(&shorter)).unwrap(), Applied::Rebuilt);
    assert!(ns.exec("nft", &["list", "set", "ip", "aether_services", "dialled"]).contains("timeout 1m"));
    assert_eq!(in_ns(&ns, || services::verify(&shorter)).unwrap(), Vec::<String>::new());
}

/// `layer()` plus an IPv6 ServiceCIDR, its API server, a Service with a port of each
/// protocol, one without endpoints, and a mesh VIP.
fn dual(mode: LayerMode) -> ServiceLayer {
    let mut l = layer(mode);
    l.ranges.push("fd00:10:96::/108".parse().unwrap());
    l.mesh_vips.push("fd00:10:96::5:5".parse().unwrap());
    l.ports.extend([
        port("fd00:10:96::1", Proto::Tcp, 443, true),
        port("fd00:10:96::1:1", Proto::Tcp, 80, true),
        port("fd00:10:96::1:1", Proto::Udp, 18082, true),
        port("fd00:10:96::1:2", Proto::Tcp, 80, false),
    ]);
    l
}

/// A dual-stack layer: the ip table exactly as for IPv4 alone (the same golden file), the
/// ip6 table the kernel's own listing reviewed in `services-refuse-ip6.txt`; an IPv6 change
/// is an element change of the ip6 table alone; a tampered IPv6 element is found and
/// restored.
#[test]
fn dual_stack_layer_round_trip_and_ipv6_element_updates() {
    if !root_or_skip("dual_stack_layer_round_trip_and_ipv6_element_updates") {
        return;
    }
    let ns = TestNetns::new("svc-rt6");
    let l = dual(LayerMode::Refuse);
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Rebuilt);
    let v4 = ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    aether_testkit::assert_golden("services-refuse.txt", &sorted_elements(&v4));
    let v6 = ns.exec("nft", &["list", "table", "ip6", services::TABLE]);
    aether_testkit::assert_golden("services-refuse-ip6.txt", &sorted_elements(&v6));
    for want in [
        "ip6 daddr . meta l4proto . th dport @service_ports counter name \"service\" accept",
        "ip6 daddr != @service_ranges counter name \"external\" accept",
        "update @dialled { ip6 daddr . meta l4proto . th dport }",
        "type ipv6_addr . inet_proto . inet_service",
        "fd00:10:96::1:1 . tcp . 80",
        // nft prints the family's default, ICMPv6 port unreachable (code 4), as a bare reject.
        "reject comment \"refused: the client sees port unreachable\"",
    ] {
        assert!(v6.contains(want), "missing {want:?} in\n{v6}");
    }
    assert!(!v6.contains("10.96."), "no IPv4 element in the ip6 table:\n{v6}");
    assert!(!v4.contains("fd00:"), "no IPv6 element in the ip table:\n{v4}");
    assert_eq!(in_ns(&ns, || services::verify(&l)).unwrap(), Vec::<String>::new());
    assert_eq!(in_ns(&ns, || services::apply(&l)).unwrap(), Applied::Unchanged);

    // One IPv6 Service more: two elements of the ip6 table; no rule of either table touched.
    let handles = |family: &str| ns.exec("nft", &["-a", "list", "chain", family, services::TABLE, "classify"]);
    let (h4, h6) = (handles("ip"), handles("ip6"));
    let mut l2 = l.clone();
    l2.ports.push(port("fd00:10:96::1:3", Proto::Tcp, 8443, true));
    let change = services::LayerChange::between(&l, &l2).unwrap().expect("an element change");
    assert_eq!(in_ns(&ns, || change.send()).unwrap(), Applied::Elements { added: 2, removed: 0 });
    assert_eq!((handles("ip"), handles("ip6")), (h4, h6), "rules untouched");
    assert!(ns
        .exec("nft", &["list", "set", "ip6", services::TABLE, "service_ports"])
        .contains("fd00:10:96::1:3 . tcp . 8443"));
    assert_eq!(in_ns(&ns, || services::verify(&l2)).unwrap(), Vec::<String>::new());

    // Tamper: an IPv6 element deleted by hand is a named difference, and apply restores it.
    ns.exec("nft", &["delete", "element", "ip6", services::TABLE, "service_ports", "{ fd00:10:96::1:1 . tcp . 80 }"]);
    let diffs = in_ns(&ns, || services::verify(&l2)).unwrap();
    assert!(
        diffs.iter().any(|d| d.starts_with("table ip6 aether_services: ") && d.contains("fd00:10:96::1:1 . tcp . 80")),
        "{diffs:#?}"
    );
    assert_eq!(in_ns(&ns, || services::apply(&l2)).unwrap(), Applied::Elements { added: 1, removed: 0 });
    assert_eq!(in_ns(&ns, || services::verify(&l2)).unwrap(), Vec::<String>::new());

    // Control: the IPv4-only layer finds the ip6 table it no longer wants, and a rebuild
    // removes it in the same transaction.
    let v4_only = layer(LayerMode::Refuse);
    let diffs = in_ns(&ns, || services::verify(&v4_only)).unwrap();
    assert_eq!(diffs, ["table ip6 aether_services is present, but the snapshot has no IPv6 Service range"]);
    assert_eq!(in_ns(&ns, || services::rebuild(&v4_only)).unwrap(), Applied::Rebuilt);
    assert!(!ns.exec("nft", &["list", "tables"]).contains("ip6"), "{}", ns.exec("nft", &["list", "ruleset"]));
    assert!(in_ns(&ns, services::remove).unwrap(), "removed");
    assert!(!in_ns(&ns, services::remove).unwrap(), "nothing left to remove");
}

/// The layer names what it holds in its own table (a counter named after the stored layer),
/// and an element change swaps that name in the same transaction as its elements: the
/// kernel refuses the whole transaction when the table names anything else (a
/// compare-and-swap), leaving every element as it was. Golden: the kernel's own listing of
/// the named table. Controls: the same change to a table of the layer it starts from is
/// taken; a change between unnamed layers (the rules' own, as before names) is taken
/// whatever the table names.
fn layer_id(generation: u64, digest: u64) -> Option<services::LayerId> {
    Some(services::LayerId { generation, digest })
}

/// Two named layers, the second one Service port more than the first: an element change
/// apart.
fn named_one_and_two() -> (ServiceLayer, ServiceLayer) {
    let one = ServiceLayer { identity: layer_id(7, 0x0123_4567_89ab_cdef), ..layer(LayerMode::Refuse) };
    let mut two = ServiceLayer { identity: layer_id(8, 0xfedc_ba98_7654_3210), ..one.clone() };
    two.ports.push(port("10.96.1.3", Proto::Tcp, 8080, true));
    (one, two)
}

#[test]
fn a_named_layer_is_changed_only_from_the_name_it_holds() {
    if !root_or_skip("a_named_layer_is_changed_only_from_the_name_it_holds") {
        return;
    }
    let ns = TestNetns::new("svc-named");
    let (one, two) = named_one_and_two();
    let mut three = ServiceLayer { identity: layer_id(9, 0x1111_2222_3333_4444), ..two.clone() };
    three.ports.push(port("10.96.1.4", Proto::Tcp, 8080, true));
    assert_eq!(in_ns(&ns, || services::rebuild(&one)).unwrap(), Applied::Rebuilt);
    let listing = ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    aether_testkit::assert_golden("services-named.txt", &sorted_elements(&listing));
    let named = |l: &ServiceLayer| services::Named {
        shape: services::SHAPE,
        id: l.identity.unwrap(),
        divert_mark: l.divert_mark,
    };
    assert_eq!(in_ns(&ns, services::held).unwrap(), services::HeldLayer::Named(named(&one)));
    // A change built for `two` (as from a pod believed to hold it) is refused whole.
    let from_two = services::LayerChange::between(&two, &three).unwrap().unwrap();
    let before = ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    let refused = in_ns(&ns, || from_two.send());
    assert!(refused.is_err(), "the kernel took a change built for a layer the table does not name");
    assert_eq!(ns.exec("nft", &["list", "table", "ip", services::TABLE]), before, "a refused change left a trace");
    // Control: from the name it holds, taken; the elements and the name move together.
    let from_one = services::LayerChange::between(&one, &two).unwrap().unwrap();
    assert!(matches!(in_ns(&ns, || from_one.send()).unwrap(), Applied::Elements { added: 2, .. }));
    assert_eq!(in_ns(&ns, services::held).unwrap(), services::HeldLayer::Named(named(&two)));
    assert_eq!(in_ns(&ns, || services::verify(&two)).unwrap(), Vec::<String>::new());
    assert!(in_ns(&ns, || from_two.send()).is_ok(), "the change from the name the table holds was refused");
    assert_eq!(in_ns(&ns, services::held).unwrap(), services::HeldLayer::Named(named(&three)));
    // A rename alone (the same content, another generation).
    let renamed =
        services::Named { id: services::LayerId { generation: 10, ..three.identity.unwrap() }, ..named(&three) };
    let rename = services::LayerChange::renamed(&three.families(), &named(&three), &renamed);
    in_ns(&ns, || rename.send()).unwrap();
    assert_eq!(in_ns(&ns, services::held).unwrap(), services::HeldLayer::Named(renamed));
    assert!(in_ns(&ns, || rename.send()).is_err(), "a rename from a name the table no longer holds was taken");
    // Unnamed layers change as they always did (no name to compare).
    let bare = |l: &ServiceLayer| ServiceLayer { identity: None, ..l.clone() };
    let ns2 = TestNetns::new("svc-unnamed");
    in_ns(&ns2, || services::rebuild(&bare(&one))).unwrap();
    assert_eq!(in_ns(&ns2, services::held).unwrap(), services::HeldLayer::Unnamed { shape: Some(services::SHAPE) });
    let unnamed = services::LayerChange::between(&bare(&one), &bare(&two)).unwrap().unwrap();
    assert!(in_ns(&ns2, || unnamed.send()).is_ok());
}

/// The identity counter's name reads back as what wrote it, and nothing else reads as one.
#[test]
fn a_layer_name_reads_back_and_other_counters_are_not_names() {
    let n = services::Named {
        shape: services::SHAPE,
        id: services::LayerId { generation: 42, digest: 0x00ab_cdef_0123_4567 },
        divert_mark: 0xae71,
    };
    assert_eq!(n.counter_name(), "layer_s3_g42_mae71_d00abcdef01234567");
    assert_eq!(services::Named::parse(&n.counter_name()), Some(n));
    for other in [
        "service",
        "refused_no_service",
        "layer_s3_g42_mae71",
        "layer_s3_g42_mae71_d00abcdef0123456",
        "layer_s3_g42_mae71_d00abcdef01234567_x",
        "layer_sx_g1_m1_d0000000000000000",
    ] {
        assert_eq!(services::Named::parse(other), None, "{other}");
    }
}

/// A change sent guarded by the netns's ruleset generation: committed when nothing else
/// committed there since (the generation after it is the guard's next, as GETGEN reads it);
/// unsent, whole, when anything did (even a commit in another table); and refused by the
/// layer's own compare-and-swap under a fresh guard, naming what it refused.
#[test]
fn a_guarded_change_commits_only_at_the_generation_it_names() {
    if !root_or_skip("a_guarded_change_commits_only_at_the_generation_it_names") {
        return;
    }
    use aether_rules::nft::{Guarded, KeptSocket};
    let ns = TestNetns::new("svc-guard");
    let (one, two) = named_one_and_two();
    in_ns(&ns, || services::rebuild(&one)).unwrap();
    let (forth, back) = (
        services::LayerChange::between(&one, &two).unwrap().unwrap().encode(),
        services::LayerChange::between(&two, &one).unwrap().unwrap().encode(),
    );
    let mut sock = in_ns(&ns, KeptSocket::open).unwrap();
    let listing = || ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    // Committed at the generation it names; the next is known without asking.
    let g = sock.generation().unwrap();
    let Guarded::Committed(next) = forth.send_guarded_on(&mut sock, g).unwrap() else {
        panic!("a fresh guard was stale")
    };
    assert_eq!(next, sock.generation().unwrap(), "the generation after a guarded change is not the guard's next");
    assert_eq!(in_ns(&ns, || services::verify(&two)).unwrap(), Vec::<String>::new());
    // Anything committed since (here another table) makes the guard stale: nothing sent.
    ns.exec("nft", &["add", "table", "ip", "someone_else"]);
    let held = listing();
    assert_eq!(back.send_guarded_on(&mut sock, next).unwrap(), Guarded::Stale, "a stale guard was taken");
    assert_eq!(listing(), held, "a stale guard's change left a trace");
    // Control: the same change under the generation the netns is at is taken.
    let now = sock.generation().unwrap();
    assert!(matches!(back.send_guarded_on(&mut sock, now).unwrap(), Guarded::Committed(_)));
    assert_eq!(in_ns(&ns, || services::verify(&one)).unwrap(), Vec::<String>::new());
    // The layer's own compare-and-swap still refuses, whole, under a fresh guard: `back`
    // again starts from `two`, which the table no longer names.
    let now = sock.generation().unwrap();
    let held = listing();
    let refused = back.send_guarded_on(&mut sock, now).expect_err("a change from a name the table does not hold");
    assert!(refused.to_string().contains("counter"), "the refusal names no object: {refused}");
    assert_eq!(listing(), held, "a refused guarded change left a trace");
    assert_eq!(sock.generation().unwrap(), now, "a refused guarded change moved the generation");
}

#[test]
fn a_repair_read_from_one_layer_is_refused_whole_once_the_layer_moved() {
    if !root_or_skip("a_repair_read_from_one_layer_is_refused_whole_once_the_layer_moved") {
        return;
    }
    let ns = TestNetns::new("svc-moved");
    let (one, two) = named_one_and_two();
    let listing = || ns.exec("nft", &["list", "table", "ip", services::TABLE]);
    let holds = |l: &ServiceLayer| {
        let named = services::Named { shape: services::SHAPE, id: l.identity.unwrap(), divert_mark: l.divert_mark };
        assert_eq!(in_ns(&ns, services::held).unwrap(), services::HeldLayer::Named(named));
    };
    in_ns(&ns, || services::rebuild(&one)).unwrap();
    // Drift under the same name: a port the change below leaves alone is gone.
    let drifted = ServiceLayer { ports: one.ports[1..].to_vec(), ..one.clone() };
    let Applied::Elements { added: 0, removed: lost } = in_ns(&ns, || services::apply(&drifted)).unwrap() else {
        panic!("the drift was not an element change")
    };
    holds(&one);
    assert!(!in_ns(&ns, || services::verify(&one)).unwrap().is_empty(), "no drift to repair");
    // What `read` makes of `from` is sent after an apply's change to `to` (which takes no pod
    // lock) came first: refused whole, naming the generation it was read at, nothing left.
    let refused_once_moved = |what: &str, from: &ServiceLayer, to: &ServiceLayer| {
        let reading = in_ns(&ns, || services::read(from)).unwrap();
        in_ns(&ns, || services::LayerChange::between(from, to).unwrap().unwrap().send()).unwrap();
        let moved = listing();
        let refused = in_ns(&ns, || reading.commit()).expect_err(what);
        let read_at = format!("generation {}", from.identity.unwrap().generation);
        assert!(matches!(&refused, aether_rules::Error::LayerMoved { named } if named.contains(&read_at)), "{refused}");
        assert_eq!(listing(), moved, "{what}: refused, it left a trace");
        holds(to);
    };
    // A repair of the elements.
    refused_once_moved("a repair read from a layer the table no longer names", &one, &two);
    // Control: read again, the repair is taken.
    let repaired = in_ns(&ns, || services::apply(&two)).unwrap();
    assert_eq!(repaired, Applied::Elements { added: lost, removed: 0 }, "the repair puts back what the drift took");
    assert_eq!(in_ns(&ns, || services::verify(&two)).unwrap(), Vec::<String>::new());
    // A rebuild read from `two` (its structure drifted: a chain emptied), and a change back
    // to `one` before it is sent: refused whole too, the counters' reading unused.
    ns.exec("nft", &["flush", "chain", "ip", services::TABLE, services::CHAIN_CLASSIFY]);
    refused_once_moved("a rebuild read from a layer the table no longer names", &two, &one);
    // Control: read again, the rebuild is taken.
    assert_eq!(in_ns(&ns, || services::apply(&one)).unwrap(), Applied::Rebuilt);
    assert_eq!(in_ns(&ns, || services::verify(&one)).unwrap(), Vec::<String>::new());
}
