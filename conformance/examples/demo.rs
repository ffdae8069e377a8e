//! `make demo`: the main job of aether-cni, end to end, on a simulated node.
//!
//! A pod is attached through the real CNI protocol; a curl-like client in the pod reaches a
//! ClusterIP and the mesh proxy's capture listener (bound inside the pod netns) prints the
//! original destination it received; DNS is answered by the node's DNS proxy; then DEL, and
//! the same client goes straight to the Service.
//!
//! Usage (as root): `cargo run -p aether-conformance --example demo -- [path/to/aether-cni]`

use aether_conformance::{dns, probe, sa, sock, Proxy, SimNode, DNS_PROXY_PORT, DNS_VIP, HOST_IP, VIP};

fn say(s: &str) {
    println!("\n\x1b[1m== {s}\x1b[0m");
}

fn main() {
    if let Some(bin) = std::env::args().nth(1) {
        std::env::set_var("AETHER_CNI_BIN", bin);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("make demo needs root: it builds network namespaces for a simulated node");
        std::process::exit(1);
    }
    let bin = aether_conformance::cni_bin();
    let started = std::time::Instant::now();

    say("A simulated node: a host netns with bridge br0 (10.244.0.1, the node's hostIP), Services in 10.96.0.0/16");
    let mut node = SimNode::new("demo");
    println!("host netns {}: an upstream answers for every Service address; the node DNS proxy listens on {HOST_IP}:{DNS_PROXY_PORT}", node.host.name);
    let pod = node.add_pod("cart-0");
    println!("pod netns {}: eth0 {}/16, default via {HOST_IP}", pod.ns.name, pod.ip);

    say(&format!("CNI ADD, as a container runtime runs it ({}, env + stdin with prevResult)", bin.display()));
    let conf = pod.conf(serde_json::json!({}));
    println!("CNI_COMMAND=ADD CNI_CONTAINERID={} CNI_NETNS={} CNI_IFNAME=eth0", pod.container_id, pod.path());
    let out = pod.cni("ADD", &conf);
    assert!(out.ok, "ADD failed: {}\n{}", out.stdout, out.stderr);
    println!("result (prevResult passed through): {}", out.stdout.trim());

    say("What ADD wrote in the pod netns (nft list ruleset; ip rule; ip route show table 44657)");
    print!("{}", pod.ruleset());
    for line in pod.ip(&["rule"]).lines().filter(|l| l.contains("fwmark")) {
        println!("ip rule: {line}");
    }
    for line in pod.ip(&["route", "show", "table", "44657"]).lines() {
        println!("ip route (table 44657): {line}");
    }

    say("CNI CHECK (silent when the capture is intact)");
    let check = pod.cni("CHECK", &conf);
    println!("CHECK {}", if check.ok && check.stdout.is_empty() { "passed" } else { "FAILED" });

    say("The mesh proxy stand-in binds its transparent listeners inside the pod: TCP 127.0.0.1:18001, UDP 127.0.0.1:18082");
    let proxy = Proxy::start(&pod);

    let url = sa(VIP, 80);
    let request = "GET / HTTP/1.0\r\nHost: cart.shop.svc:80\r\n\r\n";
    let curl = || sock::in_netns(&pod.path(), || probe::tcp(url, None, request.as_bytes()));
    say(&format!("In the pod: curl http://{url}/  (a ClusterIP)"));
    println!("client got: {}", curl());
    for s in proxy.seen() {
        println!(
            "capture listener accepted a connection from {}; getsockname() = original destination {}",
            s.peer, s.dst
        );
    }

    say(&format!("In the pod: DNS query for {} to {DNS_VIP}:53 (UDP, then TCP)", dns::NAME));
    println!("udp: {}", pod.dns_udp(sa(DNS_VIP, 53)));
    println!("tcp: {}", pod.dns_tcp(sa(DNS_VIP, 53)));
    for s in node.dns_seen() {
        println!("node DNS proxy received a {} query from {} at {}", s.proto, s.peer, s.dst);
    }
    println!("the capture listener saw none of it ({} connection in all: the curl)", proxy.seen().len());

    say("Someone deletes the passthrough rule in the pod; CHECK names what changed");
    pod.delete_rule("egress_divert", "passthrough");
    let check = pod.cni("CHECK", &conf);
    let msg = check.json()["msg"].as_str().unwrap_or_default().to_string();
    println!("CHECK failed (code {}): {msg}", check.json()["code"]);

    say("CNI DEL");
    pod.del(&conf);
    let left = pod.ruleset();
    println!("pod ruleset after DEL: {}", if left.is_empty() { "(empty)" } else { &left });
    let rules: Vec<String> = pod.ip(&["rule"]).lines().map(str::to_string).collect();
    println!("ip rule after DEL: {}", rules.join(" | "));

    say(&format!("In the pod again: curl http://{url}/"));
    let before = proxy.seen().len();
    println!("client got: {}", curl());
    println!(
        "capture listener saw {} new connections; the client went straight to the Service",
        proxy.seen().len() - before
    );

    drop(proxy);
    drop(pod);
    drop(node);
    say(&format!("Done in {:.1}s; the simulated node is gone.", started.elapsed().as_secs_f64()));
}
