//! The capture ruleset proved with real packets on a simulated node (see
//! `aether_conformance`): each test names the row of docs/design.md "The pod ruleset" it proves,
//! drives the built `aether-cni` through the CNI protocol, and pairs its positive case with
//! a negative control that removes the rule (with `nft`/`ip`, as only a test may) and shows
//! the same check then fails. A control that does not fail means the rig cannot tell, and is
//! reported as `RIG BROKEN`, never as a pass.
//!
//! | docs/design.md row | test | control (must fail) |
//! | --- | --- | --- |
//! | TCP, any port (`redirect-all`) | `row_tcp_redirect_all_...` | divert rule, policy route, policy rule, tproxy rule deleted |
//! | TCP to 18081 or 18082 only (`scoped`) | `row_tcp_scoped_...` | port 80 from a redirect-all pod; 18081 rule deleted |
//! | UDP to 18082 / any other UDP | `row_udp_18082_...` | UDP to 18083; UDP tproxy rule, UDP divert rule deleted |
//! | TCP or UDP to port 53 | `row_dns_udp_and_tcp_...`, `row_dns_capture_off_...` | DNAT rules deleted; `tcp dport 53 accept` deleted; DNS on vs off |
//! | excluded network / excluded port or range | `row_excluded_...` | each element deleted; the neighbours of each exclusion |
//! | a reply on a tracked flow | `row_ct_reply_...` | `ct direction reply accept` deleted |
//! | passthrough mark `0xae7e` | `row_passthrough_...` | no mark; passthrough rule deleted |
//! | a TCP connection established before the capture | `row_established_before_...` | mid-stream rule deleted; `ct mark` rule deleted |
//! | DEL removes exactly what ADD made | `del_restores_...` | every probe changes under capture |
//! | per-pod netns isolation | `two_pods_...` | pod a detached |
//!
//! Every row is proved for each family: the tests run once in `mod ipv4` (pods at 10.244.0.x
//! behind the gateway 10.244.0.1, the node's `hostIP`; Services at 10.96.x.x) and once in
//! `mod ipv6` (IPv6-only pods at fd00:10:244::x behind fd00:10:244::1, the node's
//! `hostIPv6`; Services in fd00:10:96::/64), with the same cases and the same controls in
//! `table ip6 aether_capture`; `mod dual_stack` proves one ADD captures both families of a
//! dual-stack pod and DEL restores both. Traffic is routed by the pods' default routes into
//! the host netns, where an upstream answers on every address of its local ranges. Nothing
//! leaves the namespaces made here.
//!
//! Root only: without root each test skips with a loud line; with
//! `AETHER_REQUIRE_ROOT_TESTS=1` a skip is a failure.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use aether_conformance::{
    control, sa, sock, Pod, Probe, Proxy, Seen, SimNode, Stack, APP_PORT, DNS_PROXY_PORT, DNS_VIP, DNS_VIP6, HOST_IP,
    HOST_IP6, MESH_L4_PORT, PASSTHROUGH_MARK, SCOPED_PORT, VIP, VIP6,
};
use aether_testkit::root_or_skip;
use serde_json::json;

fn node(test: &str, tag: &str) -> Option<SimNode> {
    root_or_skip(test).then(|| SimNode::new(tag))
}

/// One address family of the simulated node: its pods, addresses and capture table.
struct Fam {
    stack: Stack,
    /// nft's family keyword: the capture table is `table <nft> aether_capture`.
    nft: &'static str,
    /// `ip -4` / `ip -6`.
    ip_flag: &'static str,
    /// Every destination, as `ip route` writes it.
    any: &'static str,
    vip: IpAddr,
    /// An address in the Service range that no Service has.
    other_vip: IpAddr,
    dns_vip: IpAddr,
    /// A resolver address outside every range the node knows (DNS is DNATed before it leaves).
    outside_dns: IpAddr,
    host_ip: IpAddr,
    /// A loopback address and the element of `excluded_nets` that covers it.
    loopback: (IpAddr, &'static str),
    /// A link-local destination the host answers on, and its element. IPv6 has none to
    /// prove: a link-local destination names its interface, and IPv6 routes such a flow by
    /// that interface only (strict), so the divert route on `lo` never takes it, with or
    /// without the exclusion; a control could not fail. The golden files cover fe80::/10.
    link_local: Option<(SocketAddr, &'static str)>,
    /// What a client gets when a diverted packet is delivered on `lo` with nothing to take
    /// it: IPv4 cannot answer (the reset's or port unreachable's source, the Service
    /// address, is not an address of the pod), so the client times out; IPv6 answers from
    /// the destination address, so the client is refused.
    unclaimed: Probe,
    /// The extra range the exclusion test configures, an address in it, and one next to it.
    extra: (&'static str, IpAddr, IpAddr),
    /// A node-local resolver on an excluded address (never DNATed), and its element.
    local_dns: (IpAddr, &'static str),
}

const V4: Fam = Fam {
    stack: Stack::Ipv4,
    nft: "ip",
    ip_flag: "-4",
    any: "0.0.0.0/0",
    vip: IpAddr::V4(VIP),
    other_vip: IpAddr::V4(Ipv4Addr::new(10, 96, 200, 7)),
    dns_vip: IpAddr::V4(DNS_VIP),
    outside_dns: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 53)),
    host_ip: IpAddr::V4(HOST_IP),
    loopback: (IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.0/8"),
    link_local: Some((
        SocketAddr::V4(std::net::SocketAddrV4::new(Ipv4Addr::new(169, 254, 169, 254), 80)),
        "169.254.0.0/16",
    )),
    unclaimed: Probe::TimedOut,
    extra: ("10.97.0.0/16", IpAddr::V4(Ipv4Addr::new(10, 97, 0, 5)), IpAddr::V4(Ipv4Addr::new(10, 98, 0, 5))),
    local_dns: (IpAddr::V4(Ipv4Addr::new(169, 254, 20, 10)), "169.254.0.0/16"),
};

const V6: Fam = Fam {
    stack: Stack::Ipv6,
    nft: "ip6",
    ip_flag: "-6",
    any: "::/0",
    vip: IpAddr::V6(VIP6),
    other_vip: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0xc8, 7)),
    dns_vip: IpAddr::V6(DNS_VIP6),
    outside_dns: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x53)),
    host_ip: IpAddr::V6(HOST_IP6),
    loopback: (IpAddr::V6(Ipv6Addr::LOCALHOST), "::1"),
    link_local: None,
    unclaimed: Probe::Refused,
    extra: (
        "fd00:10:97::/64",
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x97, 0, 0, 0, 0, 5)),
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x98, 0, 0, 0, 0, 5)),
    ),
    // IPv6 node-local DNS caches listen on a configured ULA (link-local needs a scope).
    local_dns: (IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x97, 0, 0, 0, 0, 0x53)), "fd00:10:97::/64"),
};

impl Fam {
    fn pod(&self, node: &mut SimNode, name: &str) -> Pod {
        node.add_pod_with(name, self.stack)
    }

    /// Deletes the one rule of this family's capture chain `chain` matching `needle`.
    fn delete_rule(&self, pod: &Pod, chain: &str, needle: &str) -> String {
        pod.delete_rule_in(self.nft, chain, needle)
    }
}

/// The rows, once per family: `rows!(V4, "ipv4")` in `mod ipv4`, `rows!(V6, "ipv6")` in
/// `mod ipv6`; each test is `<row function>(family, its own name)`.
macro_rules! rows {
    ($fam:expr, $tag:literal) => {
        rows!(@ $fam, $tag,
            row_tcp_redirect_all_is_captured_with_its_original_destination => row_tcp_redirect_all,
            row_tcp_scoped_captures_only_18081_and_18082 => row_tcp_scoped,
            row_udp_18082_is_tproxied_with_its_port_kept_and_the_reply_reaches_a_connected_client => row_udp_18082,
            row_dns_udp_and_tcp_to_any_address_reach_the_node_dns_proxy => row_dns,
            row_dns_capture_off_leaves_port_53_alone => row_dns_capture_off,
            row_excluded_networks_and_ports_are_not_captured => row_excluded,
            row_ct_reply_inbound_connections_work_and_their_replies_are_not_diverted => row_ct_reply,
            row_passthrough_marked_sockets_are_not_captured => row_passthrough,
            row_established_before_the_capture_keeps_working_uncaptured => row_established_before,
            del_restores_the_path_of_every_connection => del_restores,
            two_pods_are_each_captured_by_their_own_listeners => two_pods
        );
    };
    (@ $fam:expr, $tag:literal, $($test:ident => $row:ident),*) => {
        use super::*;
        $(
            #[test]
            fn $test() {
                super::$row(&$fam, concat!($tag, "::", stringify!($test)));
            }
        )*
    };
}

mod ipv4 {
    rows!(V4, "ipv4");
}

mod ipv6 {
    rows!(V6, "ipv6");
}

/// The capture listener of `pod` answered, and saw `dst` as the destination.
fn captured_by(probe: &Probe, pod: &Pod, proto: &str, dst: SocketAddr) -> bool {
    probe.text().starts_with(&format!("capture[{}] {proto} dst={dst} ", pod.name))
}

/// What the upstream in the host netns says when `pod`'s probe reaches it at `dst` directly.
fn upstream(pod: &Pod, proto: &str, dst: SocketAddr) -> Probe {
    Probe::Answer(format!("upstream {proto} dst={dst} from={} got=probe", pod.ip_for(dst)))
}

/// What the capture listener says when it accepts `pod`'s probe to `dst`.
fn capture(pod: &Pod, proto: &str, dst: SocketAddr) -> Probe {
    Probe::Answer(format!("capture[{}] {proto} dst={dst} from={} got=probe", pod.name, pod.ip_for(dst)))
}

/// `ip <-4|-6> route show table 44657` in `pod`; "" when the table does not exist (IPv6
/// says so with an error where IPv4 prints nothing).
fn divert_routes(pod: &Pod, flag: &str) -> String {
    let (ok, out, err) = aether_testkit::try_run("ip", &["-n", &pod.ns.name, flag, "route", "show", "table", "44657"]);
    assert!(ok || err.contains("FIB table does not exist"), "ip {flag} route show table 44657: {err}");
    out
}

fn count(seen: &[Seen], proto: &str, dst: SocketAddr) -> usize {
    seen.iter().filter(|s| s.proto == proto && s.dst == dst).count()
}

/// Row "TCP, any port (`redirect-all`, the managed-pod default)": OUTPUT sets mark 0xae71,
/// the policy route delivers the packet to `lo` with its header intact, PREROUTING on `lo`
/// tproxies it to the capture listener on :18001.
fn row_tcp_redirect_all(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "tcp") else { return };
    let vip80 = sa(f.vip, 80);
    let other = sa(f.other_vip, 5432);

    let a = f.pod(&mut node, "a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    assert_eq!(a.tcp(vip80), capture(&a, "tcp", vip80), "bytes both ways through the capture listener");
    assert_eq!(a.tcp(other), capture(&a, "tcp", other), "any port, any address");
    let seen = proxy.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (s, dst) in seen.iter().zip([vip80, other]) {
        assert_eq!(s.dst, dst, "getsockname() on the accepted socket is the original destination");
        assert_eq!(s.peer.ip(), a.ip, "the peer is the pod");
        assert_eq!(s.dst.is_ipv6(), f.stack == Stack::Ipv6, "the {} listener took it", f.nft);
        assert_eq!(s.payload, b"probe");
    }
    assert!(node.upstream_seen().is_empty(), "nothing reached the upstream: {:?}", node.upstream_seen());

    // Controls, one fresh pod each: without the divert rule, the policy route, or the tproxy
    // rule, the same connection does not reach the listener.
    type BreakIt = fn(&Fam, &Pod);
    let controls: [(&str, BreakIt); 4] = [
        ("divert rule deleted", |f, p| {
            f.delete_rule(p, "egress_divert", "meta l4proto tcp meta mark set");
        }),
        ("policy route deleted", |f, p| {
            p.ip(&[f.ip_flag, "route", "del", "local", f.any, "dev", "lo", "table", "44657"]);
        }),
        ("policy rule deleted", |f, p| {
            p.ip(&[f.ip_flag, "rule", "del", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
        }),
        ("tproxy rule deleted", |f, p| {
            f.delete_rule(p, "loopback_tproxy", "meta l4proto tcp tproxy");
        }),
    ];
    for (i, (what, break_it)) in controls.into_iter().enumerate() {
        let p = f.pod(&mut node, &format!("ctl{i}"));
        p.add(json!({}));
        let proxy = Proxy::start(&p);
        assert!(captured_by(&p.tcp(vip80), &p, "tcp", vip80), "{what}: the pod is captured before the rule goes");
        break_it(f, &p);
        let got = p.tcp(vip80);
        control(
            !captured_by(&got, &p, "tcp", vip80) && proxy.seen().len() == 1,
            what,
            format!("{got}\n{}", p.ruleset()),
        );
        if what != "tproxy rule deleted" {
            // Not marked, or marked but routed by the main table: out through eth0.
            assert_eq!(got, upstream(&p, "tcp", vip80), "{what}");
        } else {
            // Marked and delivered locally on lo, but nothing tproxies it and no socket has
            // VIP:80 (see `Fam::unclaimed`).
            assert_eq!(got, f.unclaimed, "{what}");
        }
    }
}

/// Row "TCP to 18081 or 18082 only (`scoped` mode)": the same capture, for those two ports
/// only; TCP to 80 leaves the pod untouched.
fn row_tcp_scoped(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "scp") else { return };
    let vip = f.vip;
    let a = f.pod(&mut node, "a");
    a.add(json!({"captureMode": "scoped"}));
    let proxy = Proxy::start(&a);
    for port in [SCOPED_PORT, MESH_L4_PORT] {
        assert_eq!(a.tcp(sa(vip, port)), capture(&a, "tcp", sa(vip, port)));
    }
    assert_eq!(a.tcp(sa(vip, 80)), upstream(&a, "tcp", sa(vip, 80)), "scoped: TCP to 80 is not captured");
    // Row "UDP to 18082" holds in scoped mode too.
    assert_eq!(a.udp(sa(vip, MESH_L4_PORT)), capture(&a, "udp", sa(vip, MESH_L4_PORT)));
    assert_eq!(proxy.seen().len(), 3, "{:?}", proxy.seen());
    assert_eq!(node.upstream_seen().len(), 1);

    // Control for "not captured": the same probe from a redirect-all pod is captured.
    let b = f.pod(&mut node, "b");
    b.add(json!({}));
    let proxy_b = Proxy::start(&b);
    let got = b.tcp(sa(vip, 80));
    control(got == capture(&b, "tcp", sa(vip, 80)), "port 80 from a redirect-all pod", &got);
    drop(proxy_b);

    // Control for "captured": without the 18081 rule, 18081 goes straight out.
    f.delete_rule(&a, "egress_divert", "tcp dport 18081 meta mark set");
    let got = a.tcp(sa(vip, SCOPED_PORT));
    control(
        got == upstream(&a, "tcp", sa(vip, SCOPED_PORT)),
        "scoped 18081 rule deleted",
        format!("{got}\n{}", a.ruleset()),
    );
    assert_eq!(a.tcp(sa(vip, MESH_L4_PORT)), capture(&a, "tcp", sa(vip, MESH_L4_PORT)), "18082 still captured");
}

/// Row "UDP to 18082": marked 0xae71 and tproxied to :18082 with the destination port kept;
/// the reply (from VIP:18082) reaches a *connected* client. Row "any other UDP": not captured.
fn row_udp_18082(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "udp") else { return };
    let vip = f.vip;
    let vip_l4 = sa(vip, MESH_L4_PORT);
    let a = f.pod(&mut node, "a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    assert_eq!(a.udp(vip_l4), capture(&a, "udp", vip_l4), "the connected client got the proxy's reply");
    let seen = proxy.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].pktinfo_dst, Some(vip), "IP(V6)_PKTINFO reports the vip as the destination");
    assert_eq!(seen[0].dst, vip_l4, "IP_RECVORIGDSTADDR: address and port as sent");
    assert_eq!(seen[0].peer.ip(), a.ip);

    // Control (the row "any other UDP"): UDP to another port is not captured.
    let other = sa(vip, 18083);
    let got = a.udp(other);
    control(got == upstream(&a, "udp", other) && proxy.seen().len() == 1, "UDP to port 18083", &got);

    // Control: without the UDP tproxy rule the listener on 127.0.0.1:18082 hears nothing
    // (the datagram is delivered locally to vip:18082, where no socket is).
    f.delete_rule(&a, "loopback_tproxy", "udp dport 18082 tproxy");
    let got = a.udp(vip_l4);
    control(!captured_by(&got, &a, "udp", vip_l4) && proxy.seen().len() == 1, "UDP tproxy rule deleted", &got);
    // Nothing has vip:18082 in the pod (see `Fam::unclaimed`).
    assert_eq!(got, f.unclaimed, "nothing answers vip:18082 in the pod");
    // ...and without the UDP divert rule it leaves the pod for the upstream.
    f.delete_rule(&a, "egress_divert", "udp dport 18082 meta mark set");
    let got = a.udp(vip_l4);
    control(got == upstream(&a, "udp", vip_l4), "UDP divert rule deleted", &got);
}

/// Row "TCP or UDP to port 53": not marked; DNATed to HOST_IP:18054, the node DNS proxy,
/// whatever the address; never seen by the capture listener.
fn row_dns(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "dns") else { return };
    let (dns_vip, host_ip) = (f.dns_vip, f.host_ip);
    let answer = Probe::Answer(format!("dns {} A {}", aether_conformance::dns::NAME, aether_conformance::dns::ANSWER));
    let a = f.pod(&mut node, "a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let servers = [sa(dns_vip, 53), sa(f.outside_dns, 53)];
    for s in servers {
        assert_eq!(a.dns_udp(s), answer, "DNS over UDP to {s}");
        assert_eq!(a.dns_tcp(s), answer, "DNS over TCP to {s}");
    }
    let stub = node.dns_seen();
    assert_eq!(stub.len(), 4, "{stub:?}");
    assert!(stub.iter().all(|s| s.dst == sa(host_ip, DNS_PROXY_PORT) && s.peer.ip() == a.ip), "{stub:?}");
    assert_eq!(stub.iter().filter(|s| s.proto == "udp").count(), 2);
    assert!(proxy.seen().is_empty(), "the capture listener saw DNS: {:?}", proxy.seen());
    assert!(node.upstream_seen().is_empty(), "DNS reached the upstream: {:?}", node.upstream_seen());

    // Control: without the UDP DNAT the query reaches the upstream's :53, not the stub.
    f.delete_rule(&a, "dns_dnat", "udp dport 53 dnat");
    let got = a.dns_udp(sa(dns_vip, 53));
    control(got != answer && node.dns_seen().len() == 4, "UDP DNAT rule deleted", &got);
    assert_eq!(
        got,
        Probe::Answer(format!("not a DNS answer: upstream udp dst={} from={} got=<45 bytes>", sa(dns_vip, 53), a.ip))
    );
    // Control: without the TCP DNAT, likewise.
    f.delete_rule(&a, "dns_dnat", "tcp dport 53 dnat");
    let got = a.dns_tcp(sa(dns_vip, 53));
    control(got != answer && node.dns_seen().len() == 4, "TCP DNAT rule deleted", &got);

    // Control for "never the capture listener": without the `tcp dport 53 accept` in
    // egress_divert, TCP DNS is marked and the capture listener takes it.
    let b = f.pod(&mut node, "b");
    b.add(json!({}));
    let proxy_b = Proxy::start(&b);
    f.delete_rule(&b, "egress_divert", "tcp dport 53 accept");
    let got = b.dns_tcp(sa(dns_vip, 53));
    control(
        proxy_b.seen().len() == 1 && got != answer,
        "egress_divert `tcp dport 53 accept` deleted",
        format!("{got}; {:?}", proxy_b.seen()),
    );
}

/// Row "TCP or UDP to port 53", second half: with DNS capture off, port 53 is left alone
/// entirely, neither DNATed nor captured (even in redirect-all).
fn row_dns_capture_off(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "dnsoff") else { return };
    let dns53 = sa(f.dns_vip, 53);
    let a = f.pod(&mut node, "a");
    a.add(json!({"captureDNS": false}));
    let proxy = Proxy::start(&a);
    let via_upstream = |proto: &str| {
        Probe::Answer(format!(
            "not a DNS answer: upstream {proto} dst={dns53} from={} got=<{} bytes>",
            a.ip,
            if proto == "udp" { 45 } else { 47 }
        ))
    };
    assert_eq!(a.dns_udp(dns53), via_upstream("udp"), "UDP :53 goes where the pod sent it");
    assert_eq!(a.dns_tcp(dns53), via_upstream("tcp"), "TCP :53 goes where the pod sent it");
    assert!(proxy.seen().is_empty() && node.dns_seen().is_empty(), "{:?} {:?}", proxy.seen(), node.dns_seen());

    // Control for "not DNATed": the same queries from a pod with DNS capture on reach the stub.
    let b = f.pod(&mut node, "b");
    b.add(json!({}));
    let got = b.dns_udp(dns53);
    control(got.text().starts_with("dns ") && node.dns_seen().len() == 1, "DNS capture on", &got);
    // Control for "not captured": without `tcp dport 53 accept`, TCP :53 is captured.
    f.delete_rule(&a, "egress_divert", "tcp dport 53 accept");
    let got = a.dns_tcp(dns53);
    control(
        proxy.seen().len() == 1 && proxy.seen()[0].dst == dns53,
        "egress_divert `tcp dport 53 accept` deleted (DNS off)",
        &got,
    );
}

/// Row "to an excluded network" and row "TCP to an excluded port or port range": not
/// captured. Loopback and link-local always (127.0.0.0/8 and 169.254.0.0/16; ::1/128, and
/// fe80::/10 which no packet can prove: see `Fam::link_local`); a configured CIDR, a
/// configured port, a port inside a configured range.
fn row_excluded(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "exc") else { return };
    let a = f.pod(&mut node, "a");
    let (extra_net, extra_addr, next_to_extra) = f.extra;
    a.add(json!({"excludeOutboundCIDRs": [extra_net], "excludeOutboundPorts": [8080, "9000-9100"]}));
    let proxy = Proxy::start(&a);
    let app = a.start_app();
    let (lo, lo_element) = f.loopback;
    let loopback = sa(lo, APP_PORT);
    let mut cases = vec![
        (
            lo_element,
            "excluded_nets",
            loopback,
            Probe::Answer(format!("app[a] tcp dst={loopback} from={lo} got=probe")),
        ),
        (extra_net, "excluded_nets", sa(extra_addr, 80), upstream(&a, "tcp", sa(extra_addr, 80))),
        ("8080", "excluded_ports", sa(f.vip, 8080), upstream(&a, "tcp", sa(f.vip, 8080))),
        ("9000-9100", "excluded_ports", sa(f.vip, 9050), upstream(&a, "tcp", sa(f.vip, 9050))),
    ];
    if let Some((link_local, element)) = f.link_local {
        cases.insert(1, (element, "excluded_nets", link_local, upstream(&a, "tcp", link_local)));
    }
    for (element, _, dst, want) in &cases {
        assert_eq!(&a.tcp(*dst), want, "{dst} (excluded by {element}) goes where it was sent");
    }
    // "...not captured, not DNATed": DNS to an excluded address (a node-local cache)
    // goes where it was sent, not to the node DNS proxy.
    let (local_dns, local_dns_element) = (sa(f.local_dns.0, 53), f.local_dns.1);
    let want_local_dns =
        Probe::Answer(format!("not a DNS answer: upstream udp dst={local_dns} from={} got=<45 bytes>", a.ip));
    assert_eq!(a.dns_udp(local_dns), want_local_dns);
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());
    assert!(node.dns_seen().is_empty(), "{:?}", node.dns_seen());
    assert_eq!(app.seen().len(), 1);

    // Controls at the edges: the neighbours just outside each exclusion are captured.
    for dst in [sa(f.vip, 9101), sa(f.vip, 8081), sa(next_to_extra, 80)] {
        let got = a.tcp(dst);
        control(got == capture(&a, "tcp", dst), &format!("{dst}, next to an exclusion"), &got);
    }
    // Controls: with each exclusion removed from its set, the same connection is captured.
    for (element, set, dst, _) in &cases {
        a.delete_element_in(f.nft, set, element);
        let got = a.tcp(*dst);
        control(
            captured_by(&got, &a, "tcp", *dst),
            &format!("{element} removed from {set}"),
            format!("{got}\n{}", a.ruleset()),
        );
    }
    // Multicast (224.0.0.0/4, ff00::/8) is not proved here: UDP to a group's :18082 is not
    // delivered to the listener even with the exclusion removed (the control cannot fail),
    // so a check of it would prove nothing; TCP has no multicast. The golden files cover it.
    // Control for "not DNATed": with the resolver's exclusion gone (above), the query is DNATed.
    let got = a.dns_udp(local_dns);
    control(
        got.text().starts_with("dns ") && node.dns_seen().len() == 1,
        &format!("{local_dns_element} removed (DNS)"),
        &got,
    );
}

/// Row "a reply on a tracked flow (`ct direction reply`)": accepted first, never captured;
/// replies of inbound connections leave through OUTPUT too.
fn row_ct_reply(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "inb") else { return };
    let a = f.pod(&mut node, "a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let app = a.start_app();
    let dst = sa(a.ip, APP_PORT);
    let want = Probe::Answer(format!("app[a] tcp dst={dst} from={} got=probe from host", f.host_ip));
    assert_eq!(node.tcp_from_host(dst), want, "the host reaches the pod's app, and its replies come back");
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());

    // Control: without the rule, the SYN-ACK is marked and diverted to lo; the connection
    // never completes.
    f.delete_rule(&a, "egress_divert", "ct direction reply accept");
    let got = node.tcp_from_host(dst);
    control(
        got != want && app.seen().len() == 1,
        "`ct direction reply accept` deleted",
        format!("{got}\n{}", a.ruleset()),
    );
}

/// Row "packets carrying the proxy passthrough mark 0xae7e": accepted, never re-captured.
fn row_passthrough(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "pth") else { return };
    let vip = f.vip;
    let a = f.pod(&mut node, "a");
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    let (vip80, vip_l4) = (sa(vip, 80), sa(vip, MESH_L4_PORT));
    assert_eq!(a.tcp_marked(vip80, PASSTHROUGH_MARK), upstream(&a, "tcp", vip80));
    assert_eq!(a.udp_marked(vip_l4, PASSTHROUGH_MARK), upstream(&a, "udp", vip_l4));
    assert!(proxy.seen().is_empty(), "{:?}", proxy.seen());

    // Control: the same probes without the mark are captured.
    let got = a.tcp(vip80);
    control(got == capture(&a, "tcp", vip80), "TCP without the mark", &got);
    let got = a.udp(vip_l4);
    control(got == capture(&a, "udp", vip_l4), "UDP without the mark", &got);
    // Control: without the passthrough rule, the marked socket is captured.
    f.delete_rule(&a, "egress_divert", "meta mark 0x0000ae7e accept");
    let got = a.tcp_marked(vip80, PASSTHROUGH_MARK);
    control(got == capture(&a, "tcp", vip80), "passthrough rule deleted (TCP)", format!("{got}\n{}", a.ruleset()));
    let got = a.udp_marked(vip_l4, PASSTHROUGH_MARK);
    control(got == capture(&a, "udp", vip_l4), "passthrough rule deleted (UDP)", &got);
}

/// Row "a TCP connection established before the capture existed": conntrack first sees it
/// mid-stream (`ct state new`, SYN clear) and it is marked `0xae7c`, never captured: it keeps
/// exchanging bytes both ways, whichever end speaks first, while a new connection is captured.
fn row_established_before(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "est") else { return };
    let a = f.pod(&mut node, "a");
    // A server of the test's own on a Service address of the host (transparent: IPv6 binds
    // an address a local route makes ours only so), and connections opened before ADD.
    let vip = f.vip;
    let listener = sock::in_netns(&node.host.path(), move || sock::tcp_listener(sa(vip, 0), true)).unwrap();
    let pod_first = sock::connection_from(&a.path(), &listener);
    let host_first = sock::connection_from(&a.path(), &listener);
    let silent = sock::connection_from(&a.path(), &listener);
    for (p, h) in [&pod_first, &host_first, &silent] {
        sock::exchange(p, h, "before ADD").unwrap();
    }
    a.add(json!({}));
    let proxy = Proxy::start(&a);
    for round in ["after 1", "after 2"] {
        let (p, h) = &pod_first;
        sock::exchange(p, h, round).unwrap_or_else(|e| panic!("pod speaks first, {round} ADD: {e}\n{}", a.ruleset()));
        let (p, h) = &host_first;
        sock::exchange(h, p, round).unwrap_or_else(|e| panic!("host speaks first, {round} ADD: {e}"));
    }
    let vip80 = sa(vip, 80);
    assert_eq!(a.tcp(vip80), capture(&a, "tcp", vip80), "a new connection is captured");
    let port = listener.local_addr().unwrap().port();
    assert!(proxy.seen().iter().all(|s| s.dst.port() != port), "{:?}", proxy.seen());

    // Control: without the rule that marks a flow first seen mid-stream, the connection silent
    // since ADD is diverted on its next packet, and breaks.
    f.delete_rule(&a, "egress_divert", "first seen mid-stream");
    let (p, h) = &silent;
    let got = sock::exchange(p, h, "control");
    control(got.is_err(), "mid-stream rule deleted", format!("{got:?}\n{}", a.ruleset()));
    // Control: without the `ct mark` rule, so does a connection already marked.
    let (p, h) = &pod_first;
    sock::exchange(p, h, "marked").expect("a marked connection needs only the `ct mark` rule");
    f.delete_rule(&a, "egress_divert", "ct mark 0x0000ae7c accept");
    let got = sock::exchange(p, h, "control");
    control(got.is_err(), "`ct mark` rule deleted", format!("{got:?}\n{}", a.ruleset()));
}

/// The whole table, undone: after DEL every connection goes where it went with no mesh.
fn del_restores(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "del") else { return };
    let (vip, dns_vip) = (f.vip, f.dns_vip);
    let a = f.pod(&mut node, "a");
    // The proxy is up before, during and after: only the rules decide.
    let _proxy = Proxy::start(&a);
    let probes = |p: &Pod| -> Vec<(String, Probe)> {
        vec![
            ("tcp VIP:80".into(), p.tcp(sa(vip, 80))),
            ("tcp VIP:18081".into(), p.tcp(sa(vip, SCOPED_PORT))),
            ("udp VIP:18082".into(), p.udp(sa(vip, MESH_L4_PORT))),
            ("dns/udp DNS VIP".into(), p.dns_udp(sa(dns_vip, 53))),
            ("dns/tcp DNS VIP".into(), p.dns_tcp(sa(dns_vip, 53))),
        ]
    };
    let before = probes(&a);
    for (what, got) in &before {
        assert!(got.who() == Some("upstream") || got.text().contains("upstream"), "no mesh yet: {what}: {got}");
    }
    let conf = a.add(json!({}));
    let during = probes(&a);
    // Control: every probe sees the mesh (or it could not see DEL undo it).
    for ((what, b), (_, d)) in before.iter().zip(&during) {
        control(b != d, &format!("{what} changes under capture"), format!("before: {b}\nduring: {d}"));
    }
    a.del(&conf);
    assert_eq!(probes(&a), before, "after DEL, as with no mesh");
    assert_eq!(a.ruleset(), "", "DEL leaves no ruleset");
    for flag in ["-4", "-6"] {
        assert!(!a.ip(&[flag, "rule"]).contains("0xae71"), "DEL leaves no policy rule ({flag})");
        assert_eq!(divert_routes(&a, flag), "", "DEL leaves no route ({flag})");
    }
}

/// Two pods on one node, each captured by its own listeners, neither seeing the other's
/// traffic (the rules and the listeners live in each pod's own netns).
fn two_pods(f: &Fam, test: &str) {
    let Some(mut node) = node(test, "two") else { return };
    let vip = f.vip;
    let a = f.pod(&mut node, "a");
    let b = f.pod(&mut node, "b");
    let conf_a = a.add(json!({}));
    b.add(json!({}));
    let (pa, pb) = (Proxy::start(&a), Proxy::start(&b));
    let vip_l4 = sa(vip, MESH_L4_PORT);
    assert_eq!(a.tcp(sa(vip, 80)), capture(&a, "tcp", sa(vip, 80)));
    assert_eq!(b.tcp(sa(vip, 81)), capture(&b, "tcp", sa(vip, 81)));
    assert_eq!(a.udp(vip_l4), capture(&a, "udp", vip_l4));
    assert_eq!(b.udp(vip_l4), capture(&b, "udp", vip_l4));
    let (sa_, sb) = (pa.seen(), pb.seen());
    assert_eq!((sa_.len(), sb.len()), (2, 2), "{sa_:?}\n{sb:?}");
    assert!(sa_.iter().all(|s| s.peer.ip() == a.ip), "a's listener saw only a: {sa_:?}");
    assert!(sb.iter().all(|s| s.peer.ip() == b.ip), "b's listener saw only b: {sb:?}");
    assert_eq!((count(&sa_, "tcp", sa(vip, 81)), count(&sb, "tcp", sa(vip, 80))), (0, 0));

    // Control: with a detached, a's traffic reaches no listener at all (b's included),
    // and b is still captured by its own.
    a.del(&conf_a);
    let got = a.tcp(sa(vip, 80));
    control(got == upstream(&a, "tcp", sa(vip, 80)), "pod a detached", &got);
    assert_eq!((pa.seen().len(), pb.seen().len()), (2, 2));
    assert_eq!(b.tcp(sa(vip, 80)), capture(&b, "tcp", sa(vip, 80)), "b unaffected by a's DEL");
}

/// Dual-stack pods: one ADD programs both halves, each family's traffic goes through its
/// own half, and DEL undoes both.
mod dual_stack {
    use super::*;

    /// Families follow the pod's addresses: an IPv4-only pod gets no IPv6 half, an
    /// IPv6-only pod no IPv4 half, a dual-stack pod both.
    #[test]
    fn each_pod_gets_the_halves_of_the_families_it_has() {
        let Some(mut node) = node("dual_stack::each_pod_gets_the_halves_of_the_families_it_has", "fam") else {
            return;
        };
        for (stack, v4, v6) in [(Stack::Ipv4, true, false), (Stack::Ipv6, false, true), (Stack::Dual, true, true)] {
            let p = node.add_pod_with(&format!("{stack:?}").to_lowercase(), stack);
            p.add(json!({}));
            let rs = p.ruleset();
            assert_eq!(rs.contains("table ip aether_capture"), v4, "{stack:?}: IPv4 half\n{rs}");
            assert_eq!(rs.contains("table ip6 aether_capture"), v6, "{stack:?}: IPv6 half\n{rs}");
            assert_eq!(p.ip(&["-4", "rule"]).contains("fwmark 0xae71"), v4, "{stack:?}: IPv4 rule");
            assert_eq!(p.ip(&["-6", "rule"]).contains("fwmark 0xae71"), v6, "{stack:?}: IPv6 rule");
            assert_eq!(!divert_routes(&p, "-4").is_empty(), v4, "{stack:?}: IPv4 route");
            assert_eq!(!divert_routes(&p, "-6").is_empty(), v6, "{stack:?}: IPv6 route");
        }
    }

    /// One ADD: TCP, UDP 18082 and DNS captured in both families, each DNATed to the node
    /// address of its family; breaking the IPv6 half leaves the IPv4 half working.
    #[test]
    fn one_add_captures_both_families() {
        let Some(mut node) = node("dual_stack::one_add_captures_both_families", "dual") else { return };
        let a = node.add_pod_with("a", Stack::Dual);
        a.add(json!({}));
        let proxy = Proxy::start(&a);
        let answer =
            Probe::Answer(format!("dns {} A {}", aether_conformance::dns::NAME, aether_conformance::dns::ANSWER));
        for vip in [IpAddr::V4(VIP), IpAddr::V6(VIP6)] {
            assert_eq!(a.tcp(sa(vip, 80)), capture(&a, "tcp", sa(vip, 80)), "TCP to {vip}");
            let l4 = sa(vip, MESH_L4_PORT);
            assert_eq!(a.udp(l4), capture(&a, "udp", l4), "UDP to {l4}");
        }
        for (dns_vip, host) in
            [(IpAddr::V4(DNS_VIP), IpAddr::V4(HOST_IP)), (IpAddr::V6(DNS_VIP6), IpAddr::V6(HOST_IP6))]
        {
            assert_eq!(a.dns_udp(sa(dns_vip, 53)), answer, "DNS over UDP to {dns_vip}");
            assert_eq!(a.dns_tcp(sa(dns_vip, 53)), answer, "DNS over TCP to {dns_vip}");
            let to_host: Vec<_> = node.dns_seen().into_iter().filter(|s| s.dst == sa(host, DNS_PROXY_PORT)).collect();
            assert_eq!(to_host.len(), 2, "{dns_vip}'s queries reach the proxy on {host}: {:?}", node.dns_seen());
            assert!(to_host.iter().all(|s| s.peer.ip() == a.ip_for(sa(dns_vip, 53))));
        }
        assert_eq!(proxy.seen().len(), 4, "{:?}", proxy.seen());
        assert!(node.upstream_seen().is_empty(), "{:?}", node.upstream_seen());

        // Control: without the IPv6 divert rule, IPv6 TCP goes straight out; IPv4 is untouched.
        V6.delete_rule(&a, "egress_divert", "meta l4proto tcp meta mark set");
        let got = a.tcp(sa(VIP6, 80));
        control(
            got == upstream(&a, "tcp", sa(VIP6, 80)),
            "IPv6 divert rule deleted",
            format!("{got}\n{}", a.ruleset()),
        );
        assert_eq!(a.tcp(sa(VIP, 80)), capture(&a, "tcp", sa(VIP, 80)), "the IPv4 half stands alone");
        // ...and the other way round.
        V4.delete_rule(&a, "egress_divert", "meta l4proto tcp meta mark set");
        let got = a.tcp(sa(VIP, 80));
        control(got == upstream(&a, "tcp", sa(VIP, 80)), "IPv4 divert rule deleted", &got);
        assert_eq!(
            a.udp(sa(VIP6, MESH_L4_PORT)),
            capture(&a, "udp", sa(VIP6, MESH_L4_PORT)),
            "IPv6 UDP still captured"
        );
    }

    /// DEL undoes both halves: every probe of both families goes where it went with no mesh.
    #[test]
    fn del_restores_both_families() {
        let Some(mut node) = node("dual_stack::del_restores_both_families", "ddel") else { return };
        let a = node.add_pod_with("a", Stack::Dual);
        let _proxy = Proxy::start(&a);
        let probes = |p: &Pod| -> Vec<(String, Probe)> {
            [(IpAddr::V4(VIP), IpAddr::V4(DNS_VIP)), (IpAddr::V6(VIP6), IpAddr::V6(DNS_VIP6))]
                .into_iter()
                .flat_map(|(vip, dns)| {
                    [
                        (format!("tcp {vip}:80"), p.tcp(sa(vip, 80))),
                        (format!("udp {vip}:18082"), p.udp(sa(vip, MESH_L4_PORT))),
                        (format!("dns/udp {dns}"), p.dns_udp(sa(dns, 53))),
                        (format!("dns/tcp {dns}"), p.dns_tcp(sa(dns, 53))),
                    ]
                })
                .collect()
        };
        let before = probes(&a);
        let conf = a.add(json!({}));
        let during = probes(&a);
        for ((what, b), (_, d)) in before.iter().zip(&during) {
            control(b != d, &format!("{what} changes under capture"), format!("before: {b}\nduring: {d}"));
        }
        a.del(&conf);
        assert_eq!(probes(&a), before, "after DEL, as with no mesh");
        assert_eq!(a.ruleset(), "", "DEL leaves no ruleset");
        for flag in ["-4", "-6"] {
            assert!(!a.ip(&[flag, "rule"]).contains("0xae71"), "DEL leaves no policy rule ({flag})");
            assert_eq!(divert_routes(&a, flag), "", "DEL leaves no route ({flag})");
        }
    }
}
