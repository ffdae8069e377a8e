//! `make demo` in CI: the whole transcript runs (each step checks what it shows), and the
//! demo leaves nothing behind.

use aether_testkit::root_or_skip;

#[test]
fn the_demo_shows_the_whole_product_and_leaves_nothing_behind() {
    if !root_or_skip("the_demo_shows_the_whole_product_and_leaves_nothing_behind") {
        return;
    }
    let mut out = Vec::new();
    let ran = aether_conformance::demo::run(&mut out);
    let text = String::from_utf8(out).unwrap();
    for want in [
        // The capture.
        "capture listener accepted a connection from",
        "node DNS proxy received a udp query",
        "CHECK failed (code 100)",
        "the client went straight to the Service",
        // The agent's view.
        "$ aether-cni services apply -f ",
        "passes: the capture listener got it (original destination 10.96.35.226:80)",
        "no Service owns this address       refused",
        "shop/cart, port 81 not declared    refused",
        "shop/legacy has no endpoints       refused",
        "aether_cni_service_refused_total{reason=\"no-endpoints\"} 1",
        "10.96.200.7:80/tcp",
        // STATUS and GC.
        "STATUS: ready",
        "STATUS: not ready, code 50: the node is marked not ready: installer: the CNI configuration is not chained yet",
        "GC with cni.dev/valid-attachments",
        "stale attachment removed container=sim-",
        "the simulated node and its state directory are gone",
    ] {
        assert!(text.contains(want), "the demo should show {want:?}:\n{text}");
    }
    assert!(!ran.state_dir.exists(), "the demo left {} behind", ran.state_dir.display());
    let left = aether_testkit::run("ip", &["netns", "list"]);
    for ns in &ran.netns {
        assert!(!left.lines().any(|l| l.split_whitespace().next() == Some(ns.as_str())), "the demo left netns {ns}");
    }
    assert_eq!(ran.netns.len(), 4, "host, cart-0, checkout-0, stale-0: {:?}", ran.netns);
}
