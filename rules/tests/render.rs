//! Netlink message building, checked without root: the batch ADD would send is parsed back
//! (as CHECK does with the kernel's dump) and its register-level expressions pinned.

use aether_rules::nft::key::RawElement;
use aether_rules::nft::{expected_view, Expr};
use aether_rules::{capture_ruleset, CaptureConfig, CaptureMode, DnsDivert};

fn view(cfg: &CaptureConfig) -> aether_rules::nft::read::TableView {
    expected_view(&capture_ruleset(cfg).unwrap().halves.remove(0).table)
}

/// An IPv6-only pod's configuration (its one half is the IPv6 table).
fn v6(mode: CaptureMode) -> CaptureConfig {
    let mut cfg = CaptureConfig::new(mode);
    cfg.families = vec![aether_rules::Family::Ipv6];
    cfg.dns_ipv6 = Some(DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
    cfg
}

fn rule_exprs(v: &aether_rules::nft::read::TableView, chain: &str, comment_part: &str) -> Vec<Expr> {
    let c = v.chains.iter().find(|c| c.name == chain).unwrap_or_else(|| panic!("no chain {chain}"));
    c.rules
        .iter()
        .find(|r| r.comment.contains(comment_part))
        .unwrap_or_else(|| panic!("no rule {comment_part:?} in {chain}"))
        .exprs
        .0
        .clone()
}

// nf_tables.h numbers, spelled out so the test does not share the encoder's constants.
const META_MARK: u32 = 3;
const META_IIF: u32 = 4;
const META_L4PROTO: u32 = 16;
const CT_DIRECTION: u32 = 1;
const CMP_EQ: u32 = 0;
const NF_ACCEPT: i32 = 1;
const TRANSPORT_HEADER: u32 = 2;
const NFPROTO_IPV4: u32 = 2;
const NFPROTO_IPV6: u32 = 10;
const NETWORK_HEADER: u32 = 1;
const NAT_DNAT: u32 = 1;

fn meta(key: u32) -> Expr {
    Expr::Meta { key, dreg: 1 }
}

fn eq(data: &[u8]) -> Expr {
    Expr::Cmp { sreg: 1, op: CMP_EQ, data: data.to_vec() }
}

fn accept() -> Expr {
    Expr::Verdict { code: NF_ACCEPT, chain: None }
}

#[test]
fn rules_lower_to_the_registers_nft_itself_uses() {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let v = view(&cfg);
    // [ ct load direction => reg 1 ] [ cmp eq reg 1 0x00000001 ] [ immediate reg 0 accept ]
    assert_eq!(
        rule_exprs(&v, "egress_divert", "replies of tracked flows"),
        [Expr::Ct { key: CT_DIRECTION, dreg: 1 }, eq(&[1]), accept()]
    );
    // [ meta load mark => reg 1 ] [ cmp eq reg 1 0x0000ae7e ] [ immediate reg 0 accept ]
    assert_eq!(
        rule_exprs(&v, "egress_divert", "passthrough"),
        [meta(META_MARK), eq(&0xae7e_u32.to_ne_bytes()), accept()]
    );
    // [ meta load l4proto => reg 1 ] [ cmp eq reg 1 0x00000006 ] [ immediate reg 1 0x0000ae71 ]
    // [ meta set mark with reg 1 ] [ immediate reg 0 accept ]
    assert_eq!(
        rule_exprs(&v, "egress_divert", "redirect-all"),
        [
            meta(META_L4PROTO),
            eq(&[6]),
            Expr::Immediate { dreg: 1, data: 0xae71_u32.to_ne_bytes().to_vec() },
            Expr::MetaSet { key: META_MARK, sreg: 1 },
            accept()
        ]
    );
    // [ meta load iif => reg 1 ] [ cmp eq reg 1 0x00000001 ] [ meta load mark => reg 1 ]
    // [ cmp eq reg 1 0x0000ae71 ] [ meta load l4proto => reg 1 ] [ cmp eq reg 1 0x00000011 ]
    // [ payload load 2b @ transport header + 2 => reg 1 ] [ cmp eq reg 1 0x0000a246 ]
    // [ immediate reg 1 0x0000a246 ] [ tproxy ip port reg 1 ] [ immediate reg 0 accept ]
    // (libnftnl prints register words in host order: 0x0000a246 is the bytes 46 a2, port 18082.)
    assert_eq!(
        rule_exprs(&v, "loopback_tproxy", "diverted UDP"),
        [
            meta(META_IIF),
            eq(&1u32.to_ne_bytes()),
            meta(META_MARK),
            eq(&0xae71_u32.to_ne_bytes()),
            meta(META_L4PROTO),
            eq(&[17]),
            Expr::Payload { base: TRANSPORT_HEADER, offset: 2, len: 2, dreg: 1 },
            eq(&18082u16.to_be_bytes()),
            Expr::Immediate { dreg: 1, data: 18082u16.to_be_bytes().to_vec() },
            Expr::Tproxy { family: NFPROTO_IPV4, reg_addr: None, reg_port: Some(1) },
            accept()
        ]
    );
    // [ nat dnat ip addr_min reg 1 addr_max reg 1 proto_min reg 2 proto_max reg 2 flags 0x3 ]
    assert!(rule_exprs(&v, "dns_dnat", "DNS over UDP").contains(&Expr::Nat {
        kind: NAT_DNAT,
        family: NFPROTO_IPV4,
        reg_addr: Some((1, 1)),
        reg_proto: Some((2, 2)),
        flags: 0x3
    }));
}

/// The notation CHECK and `inspect` print (README, "Reading CHECK's differences").
#[test]
fn expressions_print_in_our_notation() {
    let mut cfg = CaptureConfig::new(CaptureMode::RedirectAll);
    cfg.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
    let v = view(&cfg);
    let text = |chain: &str, comment: &str| aether_rules::nft::Exprs(rule_exprs(&v, chain, comment)).to_string();
    assert_eq!(text("egress_divert", "replies of tracked flows"), "r1 = ct direction; r1 == 0x01; accept");
    assert_eq!(
        text("loopback_tproxy", "diverted UDP"),
        "r1 = meta iif; r1 == 0x01000000; r1 = meta mark; r1 == 0xae71; r1 = meta l4proto; r1 == 0x11; \
         r1 = th dport; r1 == 0x46a2; r1 = 0x46a2; tproxy ip to port r1; accept"
    );
    assert_eq!(
        text("dns_dnat", "DNS over UDP"),
        "r1 = meta l4proto; r1 == 0x11; r1 = th dport; r1 == 0x0035; r1 = 0x0a000001; r2 = 0x4686; \
         dnat ip to addr r1-r1 port r2-r2 flags 0x3"
    );
    // A mark reads as the configuration writes it, never as its host-order bytes
    // (0x7eae0000 on this machine); what is not a mark keeps its bytes as they sit.
    assert_eq!(text("egress_divert", "the proxy's own passthrough"), "r1 = meta mark; r1 == 0xae7e; accept");
    assert_eq!(text("egress_divert", "a connection established before"), "r1 = ct mark; r1 == 0xae7c; accept");
    assert_eq!(
        text("egress_divert", "redirect-all: divert TCP"),
        "r1 = meta l4proto; r1 == 0x06; r1 = 0xae71; meta mark set r1; accept"
    );
    // A register loaded with something else after the mark holds bytes again.
    let reloaded = aether_rules::nft::Exprs(vec![
        meta(META_MARK),
        meta(META_L4PROTO),
        Expr::Cmp { sreg: 1, op: CMP_EQ, data: 0xae7eu32.to_ne_bytes().to_vec() },
    ]);
    assert_eq!(
        reloaded.to_string(),
        format!("r1 = meta mark; r1 = meta l4proto; r1 == 0x{}", hex(&0xae7eu32.to_ne_bytes()))
    );
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
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
    let raw = |key: Vec<u8>, end: bool| RawElement { key, end, value: None, goto: None };
    let want: Vec<RawElement> = vec![
        raw(8080u16.to_be_bytes().to_vec(), false),
        raw(8081u16.to_be_bytes().to_vec(), true),
        raw(65000u16.to_be_bytes().to_vec(), false),
    ];
    assert_eq!(ports.iter().cloned().collect::<Vec<_>>(), {
        let mut w = want.clone();
        w.sort();
        w
    });
    let nets = &v.sets.iter().find(|s| s.name == "excluded_nets").unwrap().elements;
    // 224.0.0.0/4 and 240.0.0.0/4 merge into 224.0.0.0/3, which runs to the top: no end key.
    assert!(nets.contains(&raw(vec![224, 0, 0, 0], false)));
    assert!(!nets.iter().any(|e| e.end && e.key[0] >= 224));
    assert!(nets.contains(&raw(vec![128, 0, 0, 0], true)), "127.0.0.0/8 ends at 128.0.0.0");
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

/// The IPv6 half: the same rules, with the IPv6 header's destination (offset 24, 16 bytes),
/// and tproxy and NAT of family IPv6 with a 16-byte address (what `nft` sends for
/// `ip6 daddr @set`, `tproxy ip6 to :18001`, `dnat ip6 to [fd00::1]:18054`).
#[test]
fn the_ipv6_half_lowers_to_ipv6_registers() {
    let v = view(&v6(CaptureMode::RedirectAll));
    let set_lookup = |set: &str| Expr::Lookup { set: set.into(), sreg: 1, dreg: None, invert: false };
    assert_eq!(
        rule_exprs(&v, "egress_divert", "excluded destinations"),
        [Expr::Payload { base: NETWORK_HEADER, offset: 24, len: 16, dreg: 1 }, set_lookup("excluded_nets"), accept()]
    );
    assert!(rule_exprs(&v, "loopback_tproxy", "diverted TCP").contains(&Expr::Tproxy {
        family: NFPROTO_IPV6,
        reg_addr: None,
        reg_port: Some(1)
    }));
    let dnat = rule_exprs(&v, "dns_dnat", "DNS over TCP");
    let fd00_1: std::net::Ipv6Addr = "fd00::1".parse().unwrap();
    assert!(dnat.contains(&Expr::Immediate { dreg: 1, data: fd00_1.octets().to_vec() }), "{dnat:?}");
    assert!(dnat.contains(&Expr::Nat {
        kind: NAT_DNAT,
        family: NFPROTO_IPV6,
        reg_addr: Some((1, 1)),
        reg_proto: Some((2, 2)),
        flags: 0x3
    }));
    let text = aether_rules::nft::Exprs(rule_exprs(&v, "dns_dnat", "excluded destinations")).to_string();
    assert_eq!(text, "r1 = ip6 daddr; r1 in @excluded_nets; accept");
    // Interval elements of ipv6_addr: ff00::/8 runs to the top of the key space (no end key).
    let nets = &v.sets.iter().find(|s| s.name == "excluded_nets").unwrap();
    assert_eq!((nets.key_type, nets.key_len), (8, 16));
    let ff: std::net::Ipv6Addr = "ff00::".parse().unwrap();
    let raw = |key: Vec<u8>, end: bool| RawElement { key, end, value: None, goto: None };
    assert!(nets.elements.contains(&raw(ff.octets().to_vec(), false)));
    let loopback_end: std::net::Ipv6Addr = "::2".parse().unwrap();
    assert!(nets.elements.contains(&raw(loopback_end.octets().to_vec(), true)), "::1/128 ends at ::2");
    assert_eq!(nets.elements.len(), 5, "::1/128 and fe80::/10 have ends, ff00::/8 none: {:?}", nets.elements);
}
