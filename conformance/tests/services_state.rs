//! The Service layer's node state when it is damaged: pods keep starting, the agent can
//! always recover, and node totals are never silently reset.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, run_plugin};
use serde_json::json;

fn services(state: &str, args: &[&str], stdin: &[u8]) -> (bool, String) {
    let args: Vec<&str> = ["services", "--state-dir", state].iter().chain(args).copied().collect();
    let out = aether_conformance::cni::run_cli_here(&args, stdin);
    (out.ok, format!("{}{}", out.stdout, out.stderr))
}

fn snapshot(generation: u64) -> Vec<u8> {
    serde_json::to_vec(&json!({"generation": generation, "mode": "count", "serviceRanges": ["10.96.0.0/16"],
        "services": [{"namespace": "shop", "name": "cart", "vip": "10.96.1.1",
            "ports": [{"protocol": "TCP", "port": 80}], "usableEndpoints": true}]}))
    .unwrap()
}

fn has_layer(ns: &TestNetns) -> bool {
    ns.exec("nft", &["list", "tables"]).contains("aether_services")
}

#[test]
fn a_damaged_stored_snapshot_neither_blocks_pods_nor_the_agent() {
    if !root_or_skip("a_damaged_stored_snapshot_neither_blocks_pods_nor_the_agent") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(services(&state, &["apply"], &snapshot(5)).0);
    // Both stored forms damaged: the JSON as the agent sent it, and `layer.bin`, the one ADD
    // loads.
    std::fs::write(std::path::Path::new(&state).join("services/snapshot.json"), b"{\"generation\": 5, \"mode\": \"enf")
        .unwrap();
    let bin = std::path::Path::new(&state).join("services/layer.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&bin, bytes).unwrap();
    // A pod still starts (without the layer), with the reason in the log.
    let ns = TestNetns::new("dmg");
    let add = run_plugin("ADD", Some(&ns.path()), &c, &[]);
    assert!(add.ok, "{}", add.stdout);
    assert!(add.stderr.contains("starts without the Service layer"), "{}", add.stderr);
    assert!(!has_layer(&ns));
    // The agent's next snapshot replaces the damaged one and reaches the pod.
    let (ok, report) = services(&state, &["apply"], &snapshot(3));
    assert!(ok, "{report}");
    assert!(report.contains("replaced by this snapshot"), "{report}");
    assert!(has_layer(&ns), "the apply reached the pod through its record");
}

#[test]
fn a_damaged_accumulator_is_reported_never_reset() {
    if !root_or_skip("a_damaged_accumulator_is_reported_never_reset") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let state = c["stateDir"].as_str().unwrap().to_string();
    assert!(services(&state, &["apply"], &snapshot(1)).0);
    let ns = TestNetns::new("acc");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let acc = std::path::Path::new(&state).join("services/accumulator.json");
    std::fs::write(&acc, b"{\"service\": 12").unwrap();
    let (ok, text) = services(&state, &["counters"], b"");
    assert!(!ok && text.contains("accumulator.json is unreadable"), "{text}");
    // DEL still succeeds, says why the counts were not folded, and leaves the file alone.
    let del = run_plugin("DEL", Some(&ns.path()), &c, &[]);
    assert!(del.ok, "{}", del.stdout);
    assert!(del.stderr.contains("are lost"), "{}", del.stderr);
    assert_eq!(std::fs::read(&acc).unwrap(), b"{\"service\": 12");
    assert!(!has_layer(&ns));
}
