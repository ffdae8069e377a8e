//! ADD, CHECK and DEL of the capture ruleset against the real kernel, each test in a fresh
//! netns: golden files of what the kernel holds, CHECK against six tampers, DEL restoring
//! the netns exactly, and failures at each step of ADD leaving nothing behind.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, run_plugin};
use serde_json::{json, Value};

const TABLE: u32 = 44657;

/// ADD, compare with the golden file, CHECK, DEL, compare with the netns before ADD.
fn golden_case(tag: &str, golden: &str, conf: Value) {
    if !root_or_skip(tag) {
        return;
    }
    let ns = TestNetns::new(tag);
    let before = ns.snapshot(TABLE);
    let add = run_plugin("ADD", Some(&ns.path()), &conf, &[]);
    assert!(add.ok, "ADD failed: {}\n{}", add.stdout, add.stderr);
    aether_testkit::assert_golden(golden, &ns.snapshot(TABLE));
    let check = run_plugin("CHECK", Some(&ns.path()), &conf, &[]);
    assert!(check.ok, "CHECK after ADD failed: {}\n{}", check.stdout, check.stderr);
    assert_eq!(check.stdout, "", "CHECK prints nothing on success");
    let del = run_plugin("DEL", Some(&ns.path()), &conf, &[]);
    assert!(del.ok && del.stdout.is_empty(), "DEL: {}\n{}", del.stdout, del.stderr);
    assert_eq!(ns.snapshot(TABLE), before, "DEL must leave the netns as it was before ADD");
}

#[test]
fn golden_default_redirect_all() {
    golden_case("gdef", "redirect-all.txt", conf("1.0.0", json!({})));
}

#[test]
fn golden_scoped() {
    golden_case("gscp", "scoped.txt", conf("1.0.0", json!({"captureMode": "scoped"})));
}

#[test]
fn golden_extra_exclusions() {
    golden_case(
        "gexc",
        "exclusions.txt",
        conf(
            "1.0.0",
            json!({
                "excludeOutboundCIDRs": ["10.96.0.1/32", "192.168.0.0/16", "240.0.0.0/4"],
                "excludeOutboundPorts": [22, "8080", "9000-9100", "15000-15010"],
            }),
        ),
    );
}

#[test]
fn golden_dns_off() {
    golden_case("gdns", "dns-off.txt", conf("1.0.0", json!({"captureDNS": false, "hostIP": null})));
}

#[test]
fn golden_annotations_scoped_with_exclusions() {
    let c = conf(
        "1.1.0",
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
            "aether.io/capture": "scoped",
            "aether.io/exclude-outbound-ports": "8443,9000-9001",
            "aether.io/exclude-outbound-cidrs": "10.50.0.0/16",
            "aether.io/capture-dns": "false"
        }}}),
    );
    golden_case("gann", "annotations.txt", c);
}

/// The handle of the rule in `chain` whose comment contains `comment`.
fn handle_of(ns: &TestNetns, chain: &str, comment: &str) -> String {
    let listing = ns.exec("nft", &["-a", "list", "chain", "ip", "aether_capture", chain]);
    let line =
        listing.lines().find(|l| l.contains(comment)).unwrap_or_else(|| panic!("no rule {comment:?} in\n{listing}"));
    line.rsplit("# handle ").next().unwrap().trim().to_string()
}

/// Six ways a ruleset can stop being ours; CHECK must catch each, naming what differs.
#[test]
fn check_catches_each_tamper() {
    if !root_or_skip("check_catches_each_tamper") {
        return;
    }
    type Tamper = fn(&TestNetns);
    let tampers: [(&str, Tamper, &str); 6] = [
        (
            "rule deleted",
            |ns| {
                let h = handle_of(ns, "egress_divert", "excluded TCP ports");
                ns.exec("nft", &["delete", "rule", "ip", "aether_capture", "egress_divert", "handle", &h]);
            },
            "excluded TCP ports are not captured",
        ),
        (
            "rule added to our chain",
            |ns| {
                ns.exec(
                    "nft",
                    &["add", "rule", "ip", "aether_capture", "egress_divert", "tcp", "dport", "9999", "accept"],
                );
            },
            "unexpected rule",
        ),
        (
            "port changed",
            |ns| {
                let h = handle_of(ns, "loopback_tproxy", "transparent capture listener");
                ns.exec(
                    "nft",
                    &[
                        "replace",
                        "rule",
                        "ip",
                        "aether_capture",
                        "loopback_tproxy",
                        "handle",
                        &h,
                        "iif",
                        "lo",
                        "meta",
                        "mark",
                        "0xae71",
                        "meta",
                        "l4proto",
                        "tcp",
                        "tproxy",
                        "to",
                        ":18002",
                        "accept",
                        "comment",
                        "\"diverted TCP goes to the transparent capture listener\"",
                    ],
                );
            },
            "chain loopback_tproxy rule 1",
        ),
        (
            "set element removed",
            |ns| {
                ns.exec(
                    "nft",
                    &["delete", "element", "ip", "aether_capture", "excluded_nets", "{", "169.254.0.0/16", "}"],
                );
            },
            "element 169.254.0.0 is missing",
        ),
        (
            "ip rule removed",
            |ns| {
                ns.exec("ip", &["rule", "del", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
            },
            "policy rule",
        ),
        (
            "route removed",
            |ns| {
                ns.exec("ip", &["route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "44657"]);
            },
            "route 'local 0.0.0.0/0 dev lo table 44657' is missing",
        ),
    ];
    let c = conf("1.0.0", json!({}));
    for (what, tamper, expect) in tampers {
        let ns = TestNetns::new("tamp");
        assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
        // The control: the same CHECK passes before the tamper.
        let intact = run_plugin("CHECK", Some(&ns.path()), &c, &[]);
        assert!(intact.ok, "{what}: CHECK before tampering failed: {}", intact.stdout);
        tamper(&ns);
        let (code, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
        assert_eq!(code, 100, "{what}: {text}");
        assert!(text.contains(expect), "{what}: CHECK should name {expect:?}, said: {text}");
    }
}

#[test]
fn check_catches_a_changed_chain_priority_and_a_missing_table() {
    if !root_or_skip("check_catches_a_changed_chain_priority_and_a_missing_table") {
        return;
    }
    let ns = TestNetns::new("chpr");
    let c = conf("1.0.0", json!({}));
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    // Recreate the dns chain at another priority, rules and all.
    let dns = ns.exec("nft", &["list", "chain", "ip", "aether_capture", "dns_dnat"]);
    ns.exec("nft", &["delete", "chain", "ip", "aether_capture", "dns_dnat"]);
    let script = dns.replace("priority dstnat", "priority -90").replace("priority -100", "priority -90");
    let file = std::env::temp_dir().join(format!("aether-chain-{}.nft", std::process::id()));
    std::fs::write(&file, script).unwrap();
    ns.exec("nft", &["-f", file.to_str().unwrap()]);
    let _ = std::fs::remove_file(&file);
    let (code, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
    assert_eq!(code, 100);
    assert!(text.contains("chain dns_dnat: hook"), "{text}");
    ns.exec("nft", &["delete", "table", "ip", "aether_capture"]);
    let (_, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
    assert!(text.contains("table ip aether_capture is missing"), "{text}");
}

/// DEL removes exactly what ADD made: another table, rule and route in the netns survive.
#[test]
fn del_removes_exactly_what_add_made() {
    if !root_or_skip("del_removes_exactly_what_add_made") {
        return;
    }
    let ns = TestNetns::new("delx");
    ns.exec("nft", &["add", "table", "ip", "mainplugin"]);
    ns.exec("nft", &["add", "chain", "ip", "mainplugin", "post", "{ type nat hook postrouting priority 100 ; }"]);
    ns.exec("nft", &["add", "rule", "ip", "mainplugin", "post", "masquerade"]);
    ns.exec("ip", &["rule", "add", "fwmark", "0x4000", "lookup", "100", "priority", "100"]);
    ns.exec("ip", &["route", "add", "local", "10.99.0.0/16", "dev", "lo", "table", "44657"]);
    let before = ns.snapshot(TABLE);
    let c = conf("1.0.0", json!({}));
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    assert_ne!(ns.snapshot(TABLE), before);
    assert!(run_plugin("DEL", Some(&ns.path()), &c, &[]).ok);
    assert_eq!(ns.snapshot(TABLE), before);
    // Twice is fine, and so is a netns that is gone.
    assert!(run_plugin("DEL", Some(&ns.path()), &c, &[]).ok);
    let path = ns.path();
    drop(ns);
    assert!(run_plugin("DEL", Some(&path), &c, &[]).ok);
    assert!(run_plugin("DEL", None, &c, &[]).ok);
}

/// A failure at each step of ADD leaves the netns exactly as it was.
#[test]
fn a_failure_at_each_step_of_add_leaves_the_netns_unchanged() {
    if !root_or_skip("a_failure_at_each_step_of_add_leaves_the_netns_unchanged") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    for step in ["nftables", "policy-rule", "local-route", "record", "services"] {
        let ns = TestNetns::new("fail");
        let before = ns.snapshot(TABLE);
        let out = run_plugin("ADD", Some(&ns.path()), &c, &[("AETHER_CNI_INJECT_FAILURE", step)]);
        assert!(!out.ok, "ADD ignored AETHER_CNI_INJECT_FAILURE={step}: the binary under test was built without --features fault-injection (make test builds it with)");
        let (code, text) = out.error();
        assert_eq!(code, 5, "{step}: {text}");
        assert!(text.contains(&format!("injected failure at step {step}")), "{step}: {text}");
        assert_eq!(ns.snapshot(TABLE), before, "ADD failing at {step} left something behind");
        let records = std::path::Path::new(c["stateDir"].as_str().unwrap()).join("attachments");
        let left = std::fs::read_dir(&records).map(|d| d.count()).unwrap_or(0);
        assert_eq!(left, 0, "ADD failing at {step} left an attachment record");
    }
    // The control: without the injection the same ADD changes the netns.
    let ns = TestNetns::new("fail");
    let before = ns.snapshot(TABLE);
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    assert_ne!(ns.snapshot(TABLE), before);
}

/// A re-ADD (a runtime retrying) replaces the table rather than failing or duplicating.
#[test]
fn add_twice_leaves_one_intact_ruleset() {
    if !root_or_skip("add_twice_leaves_one_intact_ruleset") {
        return;
    }
    let ns = TestNetns::new("twice");
    let c = conf("1.0.0", json!({}));
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let first = ns.snapshot(TABLE);
    let again = run_plugin("ADD", Some(&ns.path()), &c, &[]);
    assert!(again.ok, "{}", again.stdout);
    assert_eq!(ns.snapshot(TABLE), first);
    assert!(run_plugin("CHECK", Some(&ns.path()), &c, &[]).ok);
}

#[test]
fn the_host_namespace_is_refused_by_any_path() {
    if !root_or_skip("the_host_namespace_is_refused_by_any_path") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let host_rules = aether_testkit::run("ip", &["rule"]);
    for path in ["/proc/self/ns/net", "/proc/thread-self/ns/net", "/proc/1/ns/net"] {
        let same = std::fs::metadata(path).ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            == std::fs::metadata("/proc/self/ns/net").ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m));
        if !same {
            continue; // pid 1 in another netns (a container): not the host's
        }
        for cmd in ["ADD", "DEL", "CHECK"] {
            let (code, text) = run_plugin(cmd, Some(path), &c, &[]).error();
            assert_eq!(code, 4, "{cmd} {path}: {text}");
            assert!(text.contains("CNI_NETNS") && text.contains("own (host) network namespace"), "{text}");
        }
    }
    assert_eq!(aether_testkit::run("ip", &["rule"]), host_rules, "the host's rules changed");
}

#[test]
fn unmanaged_pods_get_nothing_and_their_prev_result_back() {
    if !root_or_skip("unmanaged_pods_get_nothing_and_their_prev_result_back") {
        return;
    }
    let ns = TestNetns::new("unm");
    let before = ns.snapshot(TABLE);
    let disabled = conf(
        "1.0.0",
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"aether.io/capture": "disabled"}}}),
    );
    let out = run_plugin("ADD", Some(&ns.path()), &disabled, &[]);
    assert!(out.ok);
    assert_eq!(out.json(), disabled["prevResult"]);
    assert_eq!(ns.snapshot(TABLE), before);
    assert!(run_plugin("CHECK", Some(&ns.path()), &disabled, &[]).ok);
    let c = conf("1.0.0", json!({}));
    let kube = run_plugin(
        "ADD",
        Some(&ns.path()),
        &c,
        &[("CNI_ARGS", "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns-1")],
    );
    assert!(kube.ok);
    assert_eq!(ns.snapshot(TABLE), before);
    // The control: the same pod in another namespace is captured.
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    assert_ne!(ns.snapshot(TABLE), before);
}

#[test]
fn a_malformed_annotation_fails_add_and_programs_nothing() {
    if !root_or_skip("a_malformed_annotation_fails_add_and_programs_nothing") {
        return;
    }
    let ns = TestNetns::new("bada");
    let before = ns.snapshot(TABLE);
    let c = conf(
        "1.0.0",
        json!({"runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"aether.io/exclude-outbound-ports": "80,https"}}}),
    );
    let (code, text) = run_plugin("ADD", Some(&ns.path()), &c, &[]).error();
    assert_eq!(code, 7);
    assert!(text.contains("aether.io/exclude-outbound-ports") && text.contains("80,https"), "{text}");
    assert_eq!(ns.snapshot(TABLE), before);
}

/// A dormant table keeps every rule and hooks none: nothing is captured. CHECK must see it.
#[test]
fn check_catches_a_dormant_table() {
    if !root_or_skip("check_catches_a_dormant_table") {
        return;
    }
    let ns = TestNetns::new("dorm");
    let c = conf("1.0.0", json!({}));
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    assert!(run_plugin("CHECK", Some(&ns.path()), &c, &[]).ok, "the control: intact before");
    ns.exec("nft", &["add", "table", "ip", "aether_capture", "{ flags dormant; }"]);
    let (code, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
    assert_eq!(code, 100);
    assert!(text.contains("dormant"), "{text}");
}

/// The node configuration changed between ADD and DEL (another route table and mark): DEL
/// still removes exactly what ADD made, from the record.
#[test]
fn del_removes_what_add_made_even_after_the_node_settings_changed() {
    if !root_or_skip("del_removes_what_add_made_even_after_the_node_settings_changed") {
        return;
    }
    let ns = TestNetns::new("chg");
    let before = ns.snapshot(100);
    let at_add = conf("1.0.0", json!({"routeTable": 100, "divertMark": "0x1e71"}));
    assert!(run_plugin("ADD", Some(&ns.path()), &at_add, &[]).ok);
    assert!(aether_testkit::run("ip", &["netns", "exec", &ns.name, "ip", "rule"]).contains("fwmark 0x1e71 lookup 100"));
    let mut at_del = conf("1.0.0", json!({}));
    at_del["stateDir"] = at_add["stateDir"].clone();
    let out = run_plugin("DEL", Some(&ns.path()), &at_del, &[]);
    assert!(out.ok, "{}", out.stdout);
    assert_eq!(ns.snapshot(100), before, "DEL left ADD's rule or route behind");
}
