//! `make demo`: the whole product, end to end, on a simulated node, as a transcript.
//!
//! 1. Capture: a pod attached through the real CNI protocol; a curl-like client in the pod
//!    reaches a ClusterIP and the mesh proxy's capture listener (bound inside the pod netns)
//!    sees the original destination; DNS goes to the node's DNS proxy; CHECK names a tamper;
//!    DEL, and the same client goes straight to the Service.
//! 2. The agent's view: a Service snapshot applied in `refuse` mode; connections refused by
//!    name (no Service, undeclared port, no endpoints) next to ones that pass; the counters
//!    in Prometheus form; the demand; `inspect` listing the node's pods.
//! 3. The node: STATUS ready, then not ready with the installer's reason; GC removing a
//!    stale attachment the runtime forgot; the log lines an engineer greps.
//!
//! Every step checks what it shows and panics otherwise, so the conformance test that runs
//! [`run`] proves the transcript. Everything lives in namespaces and a state directory of
//! the demo's own, removed on return and on panic alike.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde_json::{json, Value};

use crate::{dns, probe, sa, sock, Probe, Proxy, SimNode, DNS_PROXY_PORT, DNS_VIP, HOST_IP, VIP};

/// The Service range of the demo's cluster.
const RANGE: &str = "10.96.0.0/16";
/// `shop/legacy`: a Service whose endpoints are all gone.
const LEGACY: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 2);
/// In the range, owned by no Service (a deleted Service's address, a typo'd IP).
const NO_SERVICE: Ipv4Addr = Ipv4Addr::new(10, 96, 200, 7);
/// Outside every Service range.
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 5);

/// What a finished demo used, so a caller can check it left nothing behind.
pub struct Ran {
    pub state_dir: PathBuf,
    pub netns: Vec<String>,
}

/// Writes one transcript line; the demo's output is its product, so a failed write panics.
macro_rules! w {
    ($out:expr) => { writeln!($out).expect("demo output") };
    ($out:expr, $($t:tt)*) => { writeln!($out, $($t)*).expect("demo output") };
}

fn say(out: &mut dyn Write, s: &str) {
    w!(out, "\n\x1b[1m== {s}\x1b[0m");
}

/// Runs the demo against the binary `crate::cni_bin()` names, writing the transcript to
/// `out`. Panics, after cleaning up, if anything does not behave as shown.
pub fn run(out: &mut dyn Write) -> Ran {
    let bin = crate::cni_bin();
    let started = std::time::Instant::now();
    let mut node = SimNode::new("demo");
    let mut ran = Ran { state_dir: node.state_dir().to_path_buf(), netns: vec![node.host.name.clone()] };

    say(
        out,
        "A simulated node: a host netns with bridge br0 (10.244.0.1, the node's hostIP), Services in 10.96.0.0/16",
    );
    w!(
        out,
        "host netns {}: an upstream answers for every Service address; the node DNS proxy listens on {HOST_IP}:{DNS_PROXY_PORT}",
        node.host.name
    );
    w!(
        out,
        "node state directory (stateDir): {}; log file (logFile): aether-cni.log in it",
        node.state_dir().display()
    );
    capture_part(out, &mut node, bin, &mut ran);
    agent_part(out, &mut node, &mut ran);

    drop(node);
    say(
        out,
        &format!(
            "Done in {:.1}s; the simulated node and its state directory are gone.",
            started.elapsed().as_secs_f64()
        ),
    );
    ran
}

/// Part 1: the capture, through the CNI protocol, proved by packets.
fn capture_part(out: &mut dyn Write, node: &mut SimNode, bin: &std::path::Path, ran: &mut Ran) {
    let pod = node.add_pod("cart-0");
    ran.netns.push(pod.ns.name.clone());
    w!(out, "pod netns {}: eth0 {}/16, default via {HOST_IP}", pod.ns.name, pod.ip);

    say(out, &format!("CNI ADD, as a container runtime runs it ({}, env + stdin with prevResult)", bin.display()));
    let conf = pod.conf(json!({}));
    w!(out, "CNI_COMMAND=ADD CNI_CONTAINERID={} CNI_NETNS={} CNI_IFNAME=eth0", pod.container_id, pod.path());
    let added = pod.cni("ADD", &conf);
    assert!(added.ok, "ADD failed: {}\n{}", added.stdout, added.stderr);
    w!(out, "result (prevResult passed through): {}", added.stdout.trim());

    say(out, "What ADD wrote in the pod netns (nft list ruleset; ip rule; ip route show table 44657)");
    write!(out, "{}", pod.ruleset()).expect("demo output");
    for line in pod.ip(&["rule"]).lines().filter(|l| l.contains("fwmark")) {
        w!(out, "ip rule: {line}");
    }
    for line in pod.ip(&["route", "show", "table", "44657"]).lines() {
        w!(out, "ip route (table 44657): {line}");
    }

    say(out, "CNI CHECK (silent when the capture is intact)");
    let check = pod.cni("CHECK", &conf);
    assert!(check.ok && check.stdout.is_empty(), "CHECK of an intact capture failed: {}", check.stdout);
    w!(out, "CHECK passed");

    say(out, "The mesh proxy stand-in binds its transparent listeners inside the pod: TCP 127.0.0.1:18001, UDP 127.0.0.1:18082");
    let proxy = Proxy::start(&pod);

    let url = sa(VIP, 80);
    let request = "GET / HTTP/1.0\r\nHost: cart.shop.svc:80\r\n\r\n";
    let curl = || sock::in_netns(&pod.path(), || probe::tcp(url, None, request.as_bytes()));
    say(out, &format!("In the pod: curl http://{url}/  (a ClusterIP)"));
    let got = curl();
    assert!(got.text().starts_with("capture["), "the ClusterIP was not captured: {got}");
    w!(out, "client got: {got}");
    for s in proxy.seen() {
        assert_eq!(s.dst, url, "the capture listener must see the original destination");
        w!(
            out,
            "capture listener accepted a connection from {}; getsockname() = original destination {}",
            s.peer,
            s.dst
        );
    }

    say(out, &format!("In the pod: DNS query for {} to {DNS_VIP}:53 (UDP, then TCP)", dns::NAME));
    let (udp, tcp) = (pod.dns_udp(sa(DNS_VIP, 53)), pod.dns_tcp(sa(DNS_VIP, 53)));
    assert!(udp.text().starts_with("dns ") && tcp.text().starts_with("dns "), "DNS: {udp} / {tcp}");
    w!(out, "udp: {udp}");
    w!(out, "tcp: {tcp}");
    for s in node.dns_seen() {
        w!(out, "node DNS proxy received a {} query from {} at {}", s.proto, s.peer, s.dst);
    }
    assert_eq!(proxy.seen().len(), 1, "DNS must not reach the capture listener");
    w!(out, "the capture listener saw none of it (1 connection in all: the curl)");

    say(out, "Someone deletes the passthrough rule in the pod; CHECK names what changed");
    pod.delete_rule("egress_divert", "passthrough");
    let check = pod.cni("CHECK", &conf);
    assert!(!check.ok, "CHECK passed over a deleted rule");
    let msg = check.json()["msg"].as_str().unwrap_or_default().to_string();
    w!(out, "CHECK failed (code {}): {msg}", check.json()["code"]);

    say(out, "CNI DEL");
    pod.del(&conf);
    let left = pod.ruleset();
    assert!(left.is_empty(), "DEL left rules behind:\n{left}");
    w!(out, "pod ruleset after DEL: (empty)");
    let rules: Vec<String> = pod.ip(&["rule"]).lines().map(str::to_string).collect();
    w!(out, "ip rule after DEL: {}", rules.join(" | "));

    say(out, &format!("In the pod again: curl http://{url}/"));
    let before = proxy.seen().len();
    let got = curl();
    assert!(got.text().starts_with("upstream "), "after DEL the client must reach the Service itself: {got}");
    w!(out, "client got: {got}");
    w!(
        out,
        "capture listener saw {} new connections; the client went straight to the Service",
        proxy.seen().len() - before
    );
}

/// The agent's snapshot: `shop/cart` at VIP (TCP 80, with endpoints), `shop/legacy` at
/// LEGACY (TCP 80, no endpoints), in `refuse` mode.
fn snapshot() -> Value {
    json!({
        "generation": 7,
        "mode": "refuse",
        "serviceRanges": [RANGE],
        "meshVIPs": [],
        "services": [
            {"namespace": "shop", "name": "cart", "vip": VIP.to_string(),
             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true},
            {"namespace": "shop", "name": "legacy", "vip": LEGACY.to_string(),
             "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": false}
        ]
    })
}

/// One CLI run on the node, shown as the operator types it; panics unless it succeeds.
fn agent(out: &mut dyn Write, node: &SimNode, args: &[&str]) -> String {
    w!(out, "$ aether-cni services {}", args.join(" "));
    let run = node.services(args, b"");
    assert!(run.ok, "services {args:?} failed:\n{}\n{}", run.stdout, run.stderr);
    run.stdout
}

/// `aether-cni inspect` (every pod of the node), shown as typed.
fn inspect_node(out: &mut dyn Write, node: &SimNode) -> String {
    let dir = node.state_dir().display().to_string();
    w!(out, "$ aether-cni inspect --state-dir {dir}");
    let run = crate::cni::run_cli(&node.host.path(), &["inspect", "--state-dir", &dir], b"");
    write!(out, "{}", run.stdout).expect("demo output");
    run.stdout
}

/// Parts 2 and 3: the Service layer as the agent drives it; STATUS, GC and the log.
fn agent_part(out: &mut dyn Write, node: &mut SimNode, ran: &mut Ran) {
    say(out, "A second pod, checkout-0, is attached (ADD) and its mesh proxy started");
    let pod = node.add_pod("checkout-0");
    ran.netns.push(pod.ns.name.clone());
    let conf = pod.add(json!({}));
    let proxy = Proxy::start(&pod);
    w!(out, "pod netns {}: eth0 {}, container {}", pod.ns.name, pod.ip, pod.container_id);

    say(out, "The node agent applies a Service snapshot (refuse mode): shop/cart with endpoints, shop/legacy without");
    let file = node.state_dir().join("snapshot-7.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&snapshot()).unwrap()).expect("snapshot file");
    let report = agent(out, node, &["apply", "-f", &file.display().to_string()]);
    let report: Value = serde_json::from_str(&report).expect("apply prints JSON");
    assert_eq!(report["generation"], 7, "{report}");
    assert_eq!(report["pods"].as_array().map(Vec::len), Some(1), "one attached pod: {report}");
    w!(out, "{}", serde_json::to_string_pretty(&report).unwrap());

    say(out, "In checkout-0: connections refused by name, next to those that pass");
    let cases: [(&str, SocketAddr, bool); 5] = [
        ("shop/cart, port 80 declared", sa(VIP, 80), true),
        ("outside every Service range", sa(EXTERNAL, 80), true),
        ("no Service owns this address", sa(NO_SERVICE, 80), false),
        ("shop/cart, port 81 not declared", sa(VIP, 81), false),
        ("shop/legacy has no endpoints", sa(LEGACY, 80), false),
    ];
    for (what, dst, passes) in cases {
        let got = pod.tcp(dst);
        if passes {
            assert!(got.text().starts_with("capture["), "{dst} ({what}) must pass to the mesh proxy: {got}");
            w!(
                out,
                "  {:<20} {what:<34} passes: the capture listener got it (original destination {dst})",
                dst.to_string()
            );
        } else {
            assert_eq!(got, Probe::Refused, "{dst} ({what}) must be refused");
            w!(out, "  {:<20} {what:<34} refused: ECONNREFUSED at connect(), before any proxy", dst.to_string());
        }
    }
    assert_eq!(proxy.seen().len(), 2, "only the two passing connections reach the capture listener");

    say(out, "The agent reads the counters (Prometheus text) and the demand");
    let prom = agent(out, node, &["counters", "--format", "prometheus"]);
    for want in [
        "aether_cni_service_refused_total{reason=\"no-service\"} 1",
        "aether_cni_service_refused_total{reason=\"port-not-declared\"} 1",
        "aether_cni_service_refused_total{reason=\"no-endpoints\"} 1",
        "aether_cni_service_connections_total{class=\"service\"} 1",
        "aether_cni_service_connections_total{class=\"external\"} 1",
    ] {
        assert!(prom.contains(want), "counters should say {want}:\n{prom}");
    }
    for line in prom.lines().filter(|l| !l.starts_with("# HELP")) {
        w!(out, "{line}");
    }
    let demand = agent(out, node, &["demand", "--format", "text"]);
    for dst in [sa(VIP, 80), sa(NO_SERVICE, 80), sa(VIP, 81), sa(LEGACY, 80)] {
        assert!(demand.contains(&format!("{dst}/tcp")), "demand should list {dst}:\n{demand}");
    }
    write!(out, "{demand}").expect("demo output");
    w!(out, "(the demand is what pods dialled in the Service ranges: the agent learns 10.96.1.2 and 10.96.200.7 are wanted)");

    say(out, "CNI STATUS (CNI 1.1): ready, then the installer marks the node not ready");
    // STATUS and GC are about the node, not a pod: CNI 1.1, no prevResult.
    let node_conf = pod.conf(json!({"cniVersion": "1.1.0", "prevResult": null}));
    let status = node.cni("STATUS", &node_conf);
    assert!(status.ok && status.stdout.is_empty(), "STATUS: {}\n{}", status.stdout, status.stderr);
    w!(out, "STATUS: ready (exit 0; the kernel probe passed in a throwaway netns)");
    let marker = node.state_dir().join("node-not-ready");
    std::fs::write(&marker, "installer: the CNI configuration is not chained yet\n").expect("marker");
    w!(out, "the installer writes {}: \"installer: the CNI configuration is not chained yet\"", marker.display());
    let status = node.cni("STATUS", &node_conf);
    let err = status.json();
    assert!(!status.ok && err["code"] == 50, "STATUS must be not ready: {}", status.stdout);
    w!(out, "STATUS: not ready, code {}: {}", err["code"], err["msg"].as_str().unwrap_or_default());
    std::fs::remove_file(&marker).expect("marker removed");
    assert!(node.cni("STATUS", &node_conf).ok, "STATUS must be ready once the marker is gone");
    w!(out, "the marker removed: STATUS ready again");

    say(out, "CNI GC: the runtime forgot a pod (no DEL ever came); GC removes what is left of it");
    let stale = node.add_pod("stale-0");
    ran.netns.push(stale.ns.name.clone());
    stale.add(json!({}));
    let listing = inspect_node(out, node);
    assert!(listing.contains(&stale.container_id) && listing.contains(&pod.container_id), "{listing}");
    let mut gc = node_conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": pod.container_id, "ifname": "eth0"}]);
    w!(out, "GC with cni.dev/valid-attachments = [{}/eth0]", pod.container_id);
    let done = node.cni("GC", &gc);
    assert!(done.ok, "GC failed: {}\n{}", done.stdout, done.stderr);
    let listing = inspect_node(out, node);
    assert!(!listing.contains(&stale.container_id) && listing.contains(&pod.container_id), "{listing}");
    assert!(stale.ruleset().is_empty(), "GC must remove the stale pod's capture:\n{}", stale.ruleset());
    w!(out, "stale-0's netns after GC: no nftables table, no policy rule; checkout-0 untouched");

    say(out, "What a node engineer greps: the log file (one line per event; here the stale pod and GC)");
    let log = std::fs::read_to_string(node.state_dir().join("aether-cni.log")).expect("the log file");
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pod=sim/stale-0") || l.contains("command=GC") || l.contains(" ERROR "))
        .collect();
    assert!(lines.iter().any(|l| l.contains("stale attachment removed")), "the GC is logged:\n{log}");
    w!(out, "$ grep -e pod=sim/stale-0 -e command=GC -e ' ERROR ' aether-cni.log");
    for l in lines {
        w!(out, "{l}");
    }

    pod.del(&conf);
    drop(proxy);
}
