//! Root-gated: program the capture ruleset in a fresh netns, read it back, remove it.

use aether_netns::Netns;
use aether_rules::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert};
use aether_testkit::{root_or_skip, TestNetns};

fn in_ns<T: Send>(ns: &TestNetns, f: impl FnOnce() -> T + Send) -> T {
    Netns::open_foreign(ns.path()).unwrap().run(f).unwrap()
}

#[test]
fn install_verify_remove_round_trip() {
    if !root_or_skip("install_verify_remove_round_trip") {
        return;
    }
    let ns = TestNetns::new("rt");
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    cfg.excluded_cidrs = vec!["10.1.0.0/16".parse().unwrap(), "240.0.0.0/4".parse().unwrap()];
    cfg.excluded_ports = vec!["8080".parse().unwrap(), "9000-9100".parse().unwrap(), "65535".parse().unwrap()];
    let rs = capture_ruleset(&cfg).unwrap();
    in_ns(&ns, || aether_rules::install(&rs, None)).unwrap();
    println!("{}", ns.snapshot(cfg.route_table));
    let diffs = in_ns(&ns, || aether_rules::verify(&rs)).unwrap();
    assert!(diffs.is_empty(), "{diffs:#?}");
}

/// A dual-stack pod: both halves installed in one go, verified, removed.
#[test]
fn dual_stack_install_verify_remove_round_trip() {
    if !root_or_skip("dual_stack_install_verify_remove_round_trip") {
        return;
    }
    let ns = TestNetns::new("rt6");
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.families = aether_rules::Family::ALL.to_vec();
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    cfg.dns_ipv6 = Some(DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
    cfg.excluded_cidrs = vec!["10.1.0.0/16".parse().unwrap(), "fd00:1::/32".parse().unwrap()];
    let rs = capture_ruleset(&cfg).unwrap();
    in_ns(&ns, || aether_rules::install(&rs, None)).unwrap();
    let diffs = in_ns(&ns, || aether_rules::verify(&rs)).unwrap();
    assert!(diffs.is_empty(), "{diffs:#?}");
    let listing = ns.exec("nft", &["list", "ruleset"]);
    assert!(listing.contains("table ip aether_capture") && listing.contains("table ip6 aether_capture"), "{listing}");
    let prs = cfg.policy_routes();
    let removed = in_ns(&ns, || aether_rules::remove(aether_rules::capture::TABLE, &prs)).unwrap();
    assert_eq!((removed.table, removed.rule, removed.route), (true, true, true));
    assert_eq!(ns.exec("nft", &["list", "ruleset"]), "");
    let again = in_ns(&ns, || aether_rules::remove(aether_rules::capture::TABLE, &prs)).unwrap();
    assert_eq!(again, aether_rules::Removed::default(), "nothing left the second time");
}
