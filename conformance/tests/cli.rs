//! The operator commands: `doctor` and `inspect`, driven as an operator would.

mod common;

use std::process::Command;

use aether_testkit::{root_or_skip, TestNetns};
use common::{bin, conf, run_plugin};
use serde_json::json;

fn cli(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin()).args(args).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn doctor_proves_the_kernel_can_hold_the_ruleset_without_touching_the_node() {
    if !root_or_skip("doctor") {
        return;
    }
    let host_before = aether_testkit::run("nft", &["list", "ruleset"]);
    let (ok, text) = cli(&["doctor"]);
    assert!(ok, "{text}");
    assert_eq!(text.matches("\nok ").count() + text.starts_with("ok ") as usize, 2, "{text}");
    assert_eq!(aether_testkit::run("nft", &["list", "ruleset"]), host_before, "doctor changed the host's ruleset");
}

#[test]
fn inspect_shows_the_pod_and_says_whether_the_kernel_holds_it() {
    if !root_or_skip("inspect") {
        return;
    }
    let ns = TestNetns::new("insp");
    let c = conf("1.0.0", json!({"excludeOutboundPorts": [2222]}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let (ok, text) = cli(&["inspect", "ctr-0123", "--state-dir", &state]);
    assert!(ok, "{text}");
    for want in [
        "pod shop/cart-0 container ctr-0123",
        "elements = { 2222 }",
        "tproxy to :18001",
        "kernel: intact",
        "no snapshot applied",
    ] {
        assert!(text.contains(want), "inspect should show {want:?}:\n{text}");
    }
    // The same by netns path.
    assert!(cli(&["inspect", &ns.path(), "--state-dir", &state]).0);
    // Tampered: inspect says what differs and exits non-zero.
    ns.exec("nft", &["flush", "set", "ip", "aether_capture", "excluded_ports"]);
    let (ok, text) = cli(&["inspect", "ctr-0123", "--state-dir", &state]);
    assert!(!ok && text.contains("NOT INTACT") && text.contains("element 2222 is missing"), "{text}");
    // Unknown target.
    let (ok, text) = cli(&["inspect", "no-such-container", "--state-dir", &state]);
    assert!(!ok && text.contains("neither a recorded container nor a usable netns"), "{text}");
}
