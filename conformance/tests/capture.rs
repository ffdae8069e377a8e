//! ADD, CHECK and DEL of the capture ruleset against the real kernel, each test in a fresh
//! netns: golden files of what the kernel holds, CHECK against six tampers, DEL restoring
//! the netns exactly, and failures at each step of ADD leaving nothing behind.

mod common;

use aether_testkit::{root_or_skip, TestNetns};
use common::{conf, prev_result_with, run_plugin};
use serde_json::{json, Value};

const TABLE: u32 = 44657;

/// The netns as a golden file shows it: with the IPv6 rule and route when the pod (the
/// configuration's `prevResult`) has an IPv6 address, so IPv4-only golden files stay as
/// they were.
fn snapshot(ns: &TestNetns, conf: &Value) -> String {
    let ipv6 = conf["prevResult"]["ips"]
        .as_array()
        .is_some_and(|ips| ips.iter().any(|ip| ip["address"].as_str().is_some_and(|a| a.contains(':'))));
    if ipv6 {
        ns.snapshot_with_ipv6(TABLE)
    } else {
        ns.snapshot(TABLE)
    }
}

/// `conf` for an IPv6-only pod (fd00:10:244::5/64) on a node whose DNS proxy is on fd00::1.
fn conf6(version: &str, extra: Value) -> Value {
    pod_conf(version, &["fd00:10:244::5/64"], extra)
}

/// `conf` for a dual-stack pod (10.244.1.5/24 and fd00:10:244::5/64).
fn conf_dual(version: &str, extra: Value) -> Value {
    pod_conf(version, &["10.244.1.5/24", "fd00:10:244::5/64"], extra)
}

fn pod_conf(version: &str, addresses: &[&str], extra: Value) -> Value {
    let mut c = conf(version, json!({"hostIPv6": "fd00::1", "prevResult": prev_result_with(version, addresses)}));
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    c
}

/// ADD, compare with the golden file, CHECK, DEL, compare with the netns before ADD.
fn golden_case(tag: &str, golden: &str, conf: Value) {
    if !root_or_skip(tag) {
        return;
    }
    let ns = TestNetns::new(tag);
    let before = snapshot(&ns, &conf);
    let add = run_plugin("ADD", Some(&ns.path()), &conf, &[]);
    assert!(add.ok, "ADD failed: {}\n{}", add.stdout, add.stderr);
    aether_testkit::assert_golden(golden, &snapshot(&ns, &conf));
    let check = run_plugin("CHECK", Some(&ns.path()), &conf, &[]);
    assert!(check.ok, "CHECK after ADD failed: {}\n{}", check.stdout, check.stderr);
    assert_eq!(check.stdout, "", "CHECK prints nothing on success");
    let del = run_plugin("DEL", Some(&ns.path()), &conf, &[]);
    assert!(del.ok && del.stdout.is_empty(), "DEL: {}\n{}", del.stdout, del.stderr);
    assert_eq!(snapshot(&ns, &conf), before, "DEL must leave the netns as it was before ADD");
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

#[test]
fn golden_ipv6_redirect_all() {
    golden_case("g6def", "ipv6-redirect-all.txt", conf6("1.0.0", json!({})));
}

#[test]
fn golden_ipv6_scoped() {
    golden_case("g6scp", "ipv6-scoped.txt", conf6("1.0.0", json!({"captureMode": "scoped"})));
}

#[test]
fn golden_ipv6_dns_off() {
    golden_case("g6dns", "ipv6-dns-off.txt", conf6("1.0.0", json!({"captureDNS": false, "hostIPv6": null})));
}

/// Exclusions of both families from the configuration and the annotation, on a dual-stack
/// pod: each table takes its own family's.
#[test]
fn golden_dual_stack_exclusions() {
    let c = conf_dual(
        "1.1.0",
        json!({
            "excludeOutboundCIDRs": ["10.96.0.1/32", "fd00:10:96::1", "2001:db8::/32", "fd00:10:96::/112"],
            "excludeOutboundPorts": [22, "9000-9100"],
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
                "aether.io/exclude-outbound-cidrs": "10.50.0.0/16, fd00:50::/48"
            }}
        }),
    );
    golden_case("gdexc", "dual-stack-exclusions.txt", c);
}

#[test]
fn golden_dual_stack_redirect_all() {
    golden_case("gddef", "dual-stack-redirect-all.txt", conf_dual("1.0.0", json!({})));
}

#[test]
fn golden_dual_stack_scoped() {
    golden_case("gdscp", "dual-stack-scoped.txt", conf_dual("0.4.0", json!({"captureMode": "scoped"})));
}

/// The handle of the rule in chain `chain` of the capture table of `family` (`ip` or `ip6`)
/// whose comment contains `comment`.
fn handle_in(ns: &TestNetns, family: &str, chain: &str, comment: &str) -> String {
    let listing = ns.exec("nft", &["-a", "list", "chain", family, "aether_capture", chain]);
    let line =
        listing.lines().find(|l| l.contains(comment)).unwrap_or_else(|| panic!("no rule {comment:?} in\n{listing}"));
    line.rsplit("# handle ").next().unwrap().trim().to_string()
}

/// One family's capture table, as the tamper tests break it.
struct Half {
    /// `ip` or `ip6`.
    nft: &'static str,
    /// `-4` or `-6`.
    ip_flag: &'static str,
    any: &'static str,
    /// An element of `excluded_nets`, and how CHECK names its removal.
    element: (&'static str, &'static str),
    /// How CHECK's differences in this half begin.
    prefix: &'static str,
}

const HALF4: Half = Half {
    nft: "ip",
    ip_flag: "-4",
    any: "0.0.0.0/0",
    element: ("169.254.0.0/16", "element 169.254.0.0 is missing"),
    prefix: "",
};
const HALF6: Half = Half {
    nft: "ip6",
    ip_flag: "-6",
    any: "::/0",
    element: ("fe80::/10", "element fe80:: is missing"),
    prefix: "IPv6 half: ",
};

/// Six ways a half can stop being ours; CHECK must catch each, naming what differs, after a
/// passing CHECK (the control). `conf`'s pod has the half's family.
fn check_catches_each_tamper_in(h: &Half, conf: &Value) {
    type Tamper = fn(&Half, &TestNetns);
    let tampers: [(&str, Tamper, String); 6] = [
        (
            "rule deleted",
            |h, ns| {
                let hd = handle_in(ns, h.nft, "egress_divert", "excluded TCP ports");
                ns.exec("nft", &["delete", "rule", h.nft, "aether_capture", "egress_divert", "handle", &hd]);
            },
            "excluded TCP ports are not captured".into(),
        ),
        (
            "rule added to our chain",
            |h, ns| {
                ns.exec(
                    "nft",
                    &["add", "rule", h.nft, "aether_capture", "egress_divert", "tcp", "dport", "9999", "accept"],
                );
            },
            "unexpected rule".into(),
        ),
        (
            "port changed",
            |h, ns| {
                let hd = handle_in(ns, h.nft, "loopback_tproxy", "transparent capture listener");
                let tproxy = format!("iif lo meta mark 0xae71 meta l4proto tcp tproxy {} to :18002 accept", h.nft);
                let mut args = vec!["replace", "rule", h.nft, "aether_capture", "loopback_tproxy", "handle", &hd];
                args.extend(tproxy.split(' '));
                args.extend(["comment", "\"diverted TCP goes to the transparent capture listener\""]);
                ns.exec("nft", &args);
            },
            "chain loopback_tproxy rule 1".into(),
        ),
        (
            "set element removed",
            |h, ns| {
                ns.exec("nft", &["delete", "element", h.nft, "aether_capture", "excluded_nets", "{", h.element.0, "}"]);
            },
            h.element.1.into(),
        ),
        (
            "ip rule removed",
            |h, ns| {
                ns.exec("ip", &[h.ip_flag, "rule", "del", "fwmark", "0xae71", "lookup", "44657", "priority", "32000"]);
            },
            format!("{}policy rule 'fwmark 0xae71 lookup 44657 priority 32000' is missing", h.prefix),
        ),
        (
            "route removed",
            |h, ns| {
                ns.exec("ip", &[h.ip_flag, "route", "del", "local", h.any, "dev", "lo", "table", "44657"]);
            },
            format!("{}route 'local {} dev lo table 44657' is missing", h.prefix, h.any),
        ),
    ];
    for (what, tamper, expect) in tampers {
        let ns = TestNetns::new("tamp");
        assert!(run_plugin("ADD", Some(&ns.path()), conf, &[]).ok);
        // The control: the same CHECK passes before the tamper.
        let intact = run_plugin("CHECK", Some(&ns.path()), conf, &[]);
        assert!(intact.ok, "{} {what}: CHECK before tampering failed: {}", h.nft, intact.stdout);
        tamper(h, &ns);
        let (code, text) = run_plugin("CHECK", Some(&ns.path()), conf, &[]).error();
        assert_eq!(code, 100, "{} {what}: {text}", h.nft);
        assert!(text.contains(&expect), "{} {what}: CHECK should name {expect:?}, said: {text}", h.nft);
        assert!(text.contains(h.prefix), "{} {what}: CHECK should say which half: {text}", h.nft);
    }
}

#[test]
fn check_catches_each_tamper() {
    if root_or_skip("check_catches_each_tamper") {
        check_catches_each_tamper_in(&HALF4, &conf("1.0.0", json!({})));
    }
}

/// The same tampers in the IPv6 half of a dual-stack pod: CHECK catches each, though the
/// IPv4 half is intact, and says it is the IPv6 half; and a missing IPv6 table.
#[test]
fn check_catches_each_tamper_in_the_ipv6_half() {
    if !root_or_skip("check_catches_each_tamper_in_the_ipv6_half") {
        return;
    }
    let c = conf_dual("1.0.0", json!({}));
    check_catches_each_tamper_in(&HALF6, &c);
    let ns = TestNetns::new("tamp6");
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    ns.exec("nft", &["delete", "table", "ip6", "aether_capture"]);
    let (_, text) = run_plugin("CHECK", Some(&ns.path()), &c, &[]).error();
    assert!(text.contains("table ip6 aether_capture is missing"), "{text}");
}

/// A failure at each step of a dual-stack ADD leaves both families exactly as they were.
#[test]
fn a_failure_at_each_step_of_a_dual_stack_add_leaves_the_netns_unchanged() {
    if !root_or_skip("a_failure_at_each_step_of_a_dual_stack_add_leaves_the_netns_unchanged") {
        return;
    }
    let c = conf_dual("1.0.0", json!({}));
    for step in ["nftables", "policy-rule", "local-route", "record", "services"] {
        let ns = TestNetns::new("fail6");
        let before = ns.snapshot_with_ipv6(TABLE);
        let out = run_plugin("ADD", Some(&ns.path()), &c, &[("AETHER_CNI_INJECT_FAILURE", step)]);
        let (code, text) = out.error();
        assert_eq!(code, 5, "{step}: {text}");
        assert_eq!(ns.snapshot_with_ipv6(TABLE), before, "ADD failing at {step} left something behind");
    }
    // The control: without the injection the same ADD changes both families.
    let ns = TestNetns::new("fail6");
    let before = ns.snapshot_with_ipv6(TABLE);
    assert!(run_plugin("ADD", Some(&ns.path()), &c, &[]).ok);
    let after = ns.snapshot_with_ipv6(TABLE);
    assert!(after.contains("table ip aether_capture") && after.contains("table ip6 aether_capture"), "{after}");
    assert_ne!(after, before);
}

/// An IPv6 pod on a node without `hostIPv6` while DNS capture is on: refused, naming the
/// field, and nothing programmed in either family.
#[test]
fn an_ipv6_pod_without_the_nodes_ipv6_dns_address_is_refused() {
    if !root_or_skip("an_ipv6_pod_without_the_nodes_ipv6_dns_address_is_refused") {
        return;
    }
    let ns = TestNetns::new("no6");
    let before = ns.snapshot_with_ipv6(TABLE);
    let c = conf6("1.0.0", json!({"hostIPv6": null}));
    let (code, text) = run_plugin("ADD", Some(&ns.path()), &c, &[]).error();
    assert_eq!(code, 7, "{text}");
    assert!(text.contains("hostIPv6"), "{text}");
    assert_eq!(ns.snapshot_with_ipv6(TABLE), before);
}

/// GC of a dual-stack pod the runtime no longer has removes both halves (from the record's
/// families); the control: the pod GC keeps is left with both.
#[test]
fn gc_removes_both_halves_of_a_stale_dual_stack_pod() {
    if !root_or_skip("gc_removes_both_halves_of_a_stale_dual_stack_pod") {
        return;
    }
    let c = conf_dual("1.1.0", json!({}));
    let (stale, keep) = (TestNetns::new("gc6s"), TestNetns::new("gc6k"));
    let before = stale.snapshot_with_ipv6(TABLE);
    for (ns, id) in [(&stale, "stale-6"), (&keep, "keep-6")] {
        assert!(run_plugin("ADD", Some(&ns.path()), &c, &[("CNI_CONTAINERID", id)]).ok);
    }
    let mut gc = c.clone();
    gc["prevResult"] = Value::Null;
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "keep-6", "ifname": "eth0"}]);
    let out = run_plugin("GC", None, &gc, &[("CNI_CONTAINERID", ""), ("CNI_IFNAME", ""), ("CNI_NETNS", "")]);
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(stale.snapshot_with_ipv6(TABLE), before, "GC left part of the stale pod's capture");
    let kept = keep.snapshot_with_ipv6(TABLE);
    assert!(kept.contains("table ip aether_capture") && kept.contains("table ip6 aether_capture"), "{kept}");
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

/// A panic inside the pod's netns (injected) still answers the runtime with one CNI error on
/// stdout, code 5 with the panic's message, and leaves the netns and the records as they were.
/// The shipped plugin aborts on a panic where this test build unwinds: the answer is the
/// panic hook's in both, given before either.
#[test]
fn a_panic_inside_the_pods_netns_answers_a_cni_error() {
    if !root_or_skip("a_panic_inside_the_pods_netns_answers_a_cni_error") {
        return;
    }
    let c = conf("1.0.0", json!({}));
    let ns = TestNetns::new("panic");
    let before = ns.snapshot(TABLE);
    let out = run_plugin("ADD", Some(&ns.path()), &c, &[("AETHER_CNI_INJECT_FAILURE", "panic")]);
    assert!(!out.ok, "ADD ignored AETHER_CNI_INJECT_FAILURE=panic: the binary under test was built without --features fault-injection (make test builds it with)");
    // One JSON document on stdout (`error` parses all of it as one).
    let (code, text) = out.error();
    assert_eq!(code, 5, "{text}");
    assert!(text.contains("a panic") && text.contains("injected panic inside the pod's network namespace"), "{text}");
    assert_eq!(out.json()["cniVersion"], "1.0.0", "{}", out.stdout);
    assert_eq!(ns.snapshot(TABLE), before, "a panicking ADD left something behind");
    let records = std::path::Path::new(c["stateDir"].as_str().unwrap()).join("attachments");
    assert_eq!(std::fs::read_dir(&records).map(|d| d.count()).unwrap_or(0), 0, "a panicking ADD left a record");
    // The control: without the injection the same ADD succeeds and programs the netns.
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
