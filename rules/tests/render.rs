//! Netlink message building, checked without root: the batch ADD would send is parsed back
//! (as CHECK does with the kernel's dump) and its register-level expressions pinned.

use aether_rules::nft::expected_view;
use aether_rules::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert};

fn view(cfg: &CaptureConfig) -> aether_rules::nft::read::TableView {
    expected_view(&capture_ruleset(cfg).unwrap().table)
}

fn rule_exprs(v: &aether_rules::nft::read::TableView, chain: &str, comment_part: &str) -> String {
    let c = v.chains.iter().find(|c| c.name == chain).unwrap_or_else(|| panic!("no chain {chain}"));
    c.rules
        .iter()
        .find(|r| r.comment.contains(comment_part))
        .unwrap_or_else(|| panic!("no rule {comment_part:?} in {chain}"))
        .exprs
        .clone()
}

#[test]
fn rules_lower_to_the_registers_nft_itself_uses() {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let v = view(&cfg);
    assert_eq!(
        rule_exprs(&v, "egress_divert", "replies of tracked flows"),
        "[ ct load direction => reg 1 ] [ cmp eq reg 1 0x00000001 ] [ immediate reg 0 accept ]"
    );
    assert_eq!(
        rule_exprs(&v, "egress_divert", "passthrough"),
        "[ meta load mark => reg 1 ] [ cmp eq reg 1 0x0000ae7e ] [ immediate reg 0 accept ]"
    );
    assert_eq!(
        rule_exprs(&v, "egress_divert", "redirect-all"),
        "[ meta load l4proto => reg 1 ] [ cmp eq reg 1 0x00000006 ] [ immediate reg 1 0x0000ae71 ] [ meta set mark with reg 1 ] [ immediate reg 0 accept ]"
    );
    assert_eq!(
        rule_exprs(&v, "loopback_tproxy", "diverted UDP"),
        "[ meta load iif => reg 1 ] [ cmp eq reg 1 0x00000001 ] [ meta load mark => reg 1 ] [ cmp eq reg 1 0x0000ae71 ] \
         [ meta load l4proto => reg 1 ] [ cmp eq reg 1 0x00000011 ] [ payload load 2b @ transport header + 2 => reg 1 ] \
         [ cmp eq reg 1 0x0000a246 ] [ immediate reg 1 0x0000a246 ] [ tproxy ip port reg 1 ] [ immediate reg 0 accept ]"
    );
    assert!(rule_exprs(&v, "dns_dnat", "DNS over UDP")
        .contains("[ nat dnat ip addr_min reg 1 addr_max reg 1 proto_min reg 2 proto_max reg 2 flags 0x3 ]"));
}

#[test]
fn chains_hook_where_the_design_says() {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let v = view(&cfg);
    let hook = |name: &str| v.chains.iter().find(|c| c.name == name).unwrap().hook.clone().unwrap();
    // (type, NF_INET hook, priority, policy accept = 1)
    assert_eq!(hook("egress_divert"), ("route".to_string(), 3, -150, 1));
    assert_eq!(hook("loopback_tproxy"), ("filter".to_string(), 0, -150, 1));
    assert_eq!(hook("dns_dnat"), ("nat".to_string(), 3, -100, 1));
}

#[test]
fn interval_elements_are_half_open_and_stop_at_the_top_of_the_key_space() {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.excluded_ports = vec!["8080".parse().unwrap(), "65000-65535".parse().unwrap()];
    cfg.excluded_cidrs = vec!["240.0.0.0/4".parse().unwrap()];
    let v = view(&cfg);
    let ports = &v.sets.iter().find(|s| s.name == "excluded_ports").unwrap().elements;
    let want: Vec<(Vec<u8>, bool)> = vec![
        (8080u16.to_be_bytes().to_vec(), false),
        (8081u16.to_be_bytes().to_vec(), true),
        (65000u16.to_be_bytes().to_vec(), false),
    ];
    assert_eq!(ports.iter().cloned().collect::<Vec<_>>(), {
        let mut w = want.clone();
        w.sort();
        w
    });
    let nets = &v.sets.iter().find(|s| s.name == "excluded_nets").unwrap().elements;
    // 224.0.0.0/4 and 240.0.0.0/4 merge into 224.0.0.0/3, which runs to the top: no end key.
    assert!(nets.contains(&(vec![224, 0, 0, 0], false)));
    assert!(!nets.iter().any(|(k, end)| *end && k[0] >= 224));
    assert!(nets.contains(&(vec![128, 0, 0, 0], true)), "127.0.0.0/8 ends at 128.0.0.0");
}

#[test]
fn every_rule_carries_a_comment() {
    for mode in [CaptureMode::RedirectAll, CaptureMode::Scoped] {
        let mut cfg = CaptureConfig::new(mode);
        cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        for c in view(&cfg).chains {
            for r in c.rules {
                assert!(!r.comment.is_empty(), "{}: {}", c.name, r.exprs);
            }
        }
    }
}
