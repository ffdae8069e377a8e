//! Root-gated: ctnetlink marks the TCP flows conntrack tracks in a netns, and only those.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream, UdpSocket};

use aether_netns::Netns;
use aether_testkit::{root_or_skip, TestNetns};

fn in_ns<T: Send>(ns: &TestNetns, f: impl FnOnce() -> T + Send) -> T {
    Netns::open_foreign(ns.path()).unwrap().run(f).unwrap()
}

/// Packets counted by the probe chain's `ct mark 0x0000ae7c counter` rule.
fn marked_packets(ns: &TestNetns) -> u64 {
    let out = ns.exec("nft", &["list", "chain", "ip", "probe", "out"]);
    let line = out.lines().find(|l| l.contains("ct mark 0x0000ae7c")).unwrap_or_else(|| panic!("{out}"));
    line.split("packets ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap()
}

#[test]
fn tracked_tcp_flows_are_marked_and_nothing_else() {
    if !root_or_skip("tracked_tcp_flows_are_marked_and_nothing_else") {
        return;
    }
    let ns = TestNetns::new("ctmark");
    ns.exec("ip", &["link", "set", "lo", "up"]);
    // Conntrack on in the netns (a table with a ct expression), counting marked packets.
    ns.exec("nft", &["add", "table", "ip", "probe"]);
    ns.exec("nft", &["add", "chain", "ip", "probe", "out", "{ type filter hook output priority 0; }"]);
    ns.exec("nft", &["add", "rule", "ip", "probe", "out", "ct", "mark", "0x0000ae7c", "counter"]);
    let (mut client, mut server, udp) = in_ns(&ns, || {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        u.send_to(b"udp", u.local_addr().unwrap()).unwrap();
        (c, s, u)
    });
    let mut talk = |what: &str| {
        client.write_all(what.as_bytes()).unwrap();
        let mut got = vec![0; what.len()];
        server.read_exact(&mut got).unwrap();
        assert_eq!(got, what.as_bytes());
    };
    talk("before");
    assert_eq!(marked_packets(&ns), 0, "the control: nothing carries the mark before");
    let marked = in_ns(&ns, || aether_rules::conntrack::mark_tcp_flows(aether_rules::capture::PREEXISTING_CT_MARK));
    assert_eq!(marked.unwrap(), 1, "one TCP flow tracked (the UDP one is not TCP)");
    talk("after");
    assert!(marked_packets(&ns) >= 1, "the connection's packets carry the mark");
    let before_udp = marked_packets(&ns);
    udp.send_to(b"udp", udp.local_addr().unwrap()).unwrap();
    assert_eq!(marked_packets(&ns), before_udp, "the UDP flow is not marked");
    // With conntrack off (no table using it), nothing is tracked and nothing marked.
    let quiet = TestNetns::new("ctmark0");
    assert_eq!(in_ns(&quiet, || aether_rules::conntrack::mark_tcp_flows(0xae7c)).unwrap(), 0);
}
