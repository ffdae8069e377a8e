//! The pod capture ruleset (docs/design.md "The pod ruleset"), built from a `CaptureConfig`.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::error::{Error, Result};
use crate::family::Family;
use crate::model::*;

/// Mark set in OUTPUT on egress to divert; the policy route sends it to `lo`.
pub const DIVERT_MARK: u32 = 0xae71;
/// Mark the proxy puts on its own forwarded egress; never re-captured.
pub const PASSTHROUGH_MARK: u32 = 0xae7e;
/// Conntrack mark of a TCP connection established before the capture existed: it stays
/// uncaptured (docs/design.md "Connections established before the capture"). A ct mark, not
/// a packet mark: it lives with the flow's conntrack entry, in the pod netns only. Fixed.
pub const PREEXISTING_CT_MARK: u32 = 0xae7c;
/// The transparent TCP capture listener.
pub const CAPTURE_PORT: u16 = 18001;
/// The L4 mesh port, TCP and UDP; UDP to it is tproxied with its port kept.
pub const MESH_L4_PORT: u16 = 18082;
/// `scoped` mode captures TCP to these ports only.
pub const SCOPED_PORTS: [u16; 2] = [18081, 18082];
/// The node DNS proxy on `HOST_IP`.
pub const DNS_PROXY_PORT: u16 = 18054;
/// Routing table for the divert route (0xae71, easy to recognise next to the mark).
pub const ROUTE_TABLE: u32 = 0xae71;
/// Rule priority: after `local` (0), before `main` (32766), clear of the priorities Calico,
/// Cilium and the AWS VPC CNI use.
pub const RULE_PRIORITY: u32 = 32000;
/// kube-proxy's masquerade and drop marks. Our marks live only in the pod netns (the skb
/// mark is scrubbed crossing the veth), so "no collision" means never equal to these, as
/// Proposal 038 D2 decided for 0xae71 (which shares a bit with 0x8000).
pub const KUBE_PROXY_MARKS: [u32; 2] = [0x4000, 0x8000];

/// Networks never captured nor DNATed: loopback, link-local, multicast.
pub const FIXED_EXCLUDED_NETS: [&str; 3] = ["127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4"];
/// The same for IPv6.
pub const FIXED_EXCLUDED_NETS6: [&str; 3] = ["::1/128", "fe80::/10", "ff00::/8"];

/// Table and set names, shared by builders and readers.
pub const TABLE: &str = "aether_capture";
pub const SET_EXCLUDED_NETS: &str = "excluded_nets";
pub const SET_EXCLUDED_PORTS: &str = "excluded_ports";
/// Chain names avoid nft keywords (`tproxy`, `dnat`...), so operators can name them in `nft`.
pub const CHAIN_DIVERT: &str = "egress_divert";
pub const CHAIN_TPROXY: &str = "loopback_tproxy";
pub const CHAIN_DNS: &str = "dns_dnat";

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CaptureMode {
    /// All TCP is captured (the managed-pod default).
    RedirectAll,
    /// TCP to the scoped ports only.
    Scoped,
}

/// The mode's name as configurations and annotations write it.
impl std::fmt::Display for CaptureMode {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            CaptureMode::RedirectAll => "redirect-all",
            CaptureMode::Scoped => "scoped",
        })
    }
}

/// Serializable so the attachment record can keep exactly what ADD programmed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CaptureConfig {
    pub mode: CaptureMode,
    pub capture_port: u16,
    pub mesh_l4_port: u16,
    pub scoped_ports: Vec<u16>,
    /// Where the IPv4 table sends `:53`; `None` leaves IPv4 DNS alone entirely.
    pub dns: Option<DnsDivert>,
    /// Where the IPv6 table sends `:53` (the node's IPv6 address); `None` leaves it alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_ipv6: Option<DnsDivert>,
    /// Networks of either family; each family's table takes its own.
    pub excluded_cidrs: Vec<IpNet>,
    pub excluded_ports: Vec<PortRange>,
    pub divert_mark: u32,
    pub passthrough_mark: u32,
    pub route_table: u32,
    pub rule_priority: u32,
    /// The families the pod has addresses in: one table, one policy rule and one route
    /// each. Records from before IPv6 have none written: IPv4.
    #[serde(default = "ipv4_only")]
    pub families: Vec<Family>,
}

fn ipv4_only() -> Vec<Family> {
    vec![Family::Ipv4]
}

/// A DNS proxy address and port; the address is of the family of the table that DNATs to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsDivert {
    pub host_ip: IpAddr,
    pub port: u16,
}

impl CaptureConfig {
    /// The docs/design.md defaults; DNS needs the node's address, so it starts off.
    pub fn new(mode: CaptureMode) -> Self {
        CaptureConfig {
            mode,
            capture_port: CAPTURE_PORT,
            mesh_l4_port: MESH_L4_PORT,
            scoped_ports: SCOPED_PORTS.to_vec(),
            dns: None,
            dns_ipv6: None,
            excluded_cidrs: Vec::new(),
            excluded_ports: Vec::new(),
            divert_mark: DIVERT_MARK,
            passthrough_mark: PASSTHROUGH_MARK,
            route_table: ROUTE_TABLE,
            rule_priority: RULE_PRIORITY,
            families: ipv4_only(),
        }
    }

    /// Where `family`'s table sends `:53`, if anywhere.
    pub fn dns_for(&self, family: Family) -> Option<DnsDivert> {
        match family {
            Family::Ipv4 => self.dns,
            Family::Ipv6 => self.dns_ipv6,
        }
    }

    /// Refuses settings that would make capture loop, collide or silently do nothing.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidConfig(msg));
        let (d, p) = (self.divert_mark, self.passthrough_mark);
        if d == 0 || p == 0 {
            return bad(format!("marks must be non-zero (divert {d:#x}, passthrough {p:#x})"));
        }
        if d == p {
            return bad(format!("divert mark {d:#x} equals the passthrough mark"));
        }
        if d & p == d || d & p == p {
            return bad(format!(
                "divert mark {d:#x} and passthrough mark {p:#x} mask each other (one's bits contain the other's)"
            ));
        }
        for k in KUBE_PROXY_MARKS {
            for (name, m) in [("divert", d), ("passthrough", p)] {
                if m == k {
                    return bad(format!("{name} mark {m:#x} is kube-proxy's mark {k:#x}"));
                }
            }
        }
        for (name, port) in [("capture port", self.capture_port), ("mesh L4 port", self.mesh_l4_port)] {
            if port == 0 {
                return bad(format!("{name} must not be 0"));
            }
        }
        if self.mode == CaptureMode::Scoped && self.scoped_ports.is_empty() {
            return bad("scoped mode needs at least one scoped port".into());
        }
        if self.scoped_ports.contains(&0) {
            return bad("scoped port 0 is not a port".into());
        }
        if self.families.is_empty() {
            return bad("no address family to capture".into());
        }
        for family in Family::ALL {
            let Some(dns) = self.dns_for(family) else { continue };
            if dns.port == 0 {
                return bad("DNS proxy port must not be 0".into());
            }
            if Family::of(dns.host_ip) != family {
                return bad(format!("host IP {} is not an {family} address, for the {family} table", dns.host_ip));
            }
            if dns.host_ip.is_unspecified() || dns.host_ip.is_loopback() || dns.host_ip.is_multicast() {
                return bad(format!(
                    "host IP {} cannot receive the pod's DNS (it must be the node's address)",
                    dns.host_ip
                ));
            }
        }
        // 0 = unspec, 253-255 = default/main/local.
        if matches!(self.route_table, 0 | 253..=255) {
            return bad(format!("route table {} is reserved by the kernel", self.route_table));
        }
        if self.rule_priority == 0 || self.rule_priority >= 32766 {
            return bad(format!(
                "rule priority {} must be between 1 and 32765 (after local, before main)",
                self.rule_priority
            ));
        }
        Ok(())
    }

    /// The policy rules and routes of the pod's families.
    pub fn policy_routes(&self) -> Vec<PolicyRoute> {
        self.families.iter().map(|f| self.policy_route(*f)).collect()
    }

    /// The policy rule and route that deliver `family`'s diverted packets to `lo`.
    pub fn policy_route(&self, family: Family) -> PolicyRoute {
        PolicyRoute { family, fwmark: self.divert_mark, table: self.route_table, priority: self.rule_priority }
    }
}

/// A shape of the capture ruleset: what ADD of some release programs for a configuration.
/// Every shape a release has programmed stays buildable, so that CHECK, `inspect` and the
/// reconciler compare a pod with the shape its attachment record says it holds, and an
/// upgrade is told apart from a tamper (docs/operating.md, "Upgrade and rollback").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RulesetVersion(u32);

/// What tells one shape from another: data, one row per version.
struct Shape {
    version: u32,
    /// The releases that program it, as people name them.
    release: &'static str,
    /// The two rules at the top of `egress_divert` that keep a TCP connection established
    /// before the capture uncaptured (`ct mark 0xae7c accept`, `ct state new tcp flags ! syn
    /// ct mark set 0xae7c accept`).
    keeps_preexisting_connections: bool,
}

const SHAPES: [Shape; 2] = [
    Shape {
        version: 1,
        release: "the releases before connections established before the capture were kept",
        keeps_preexisting_connections: false,
    },
    Shape {
        version: 2,
        release: "the releases that keep connections established before the capture",
        keeps_preexisting_connections: true,
    },
];

impl RulesetVersion {
    /// The first shape; an attachment record without a ruleset version holds it.
    pub const FIRST: RulesetVersion = RulesetVersion(1);
    /// The shape this build's ADD programs.
    pub const CURRENT: RulesetVersion = RulesetVersion(2);

    /// The version numbered `n`, if this build knows it (a later release's is unknown here).
    pub fn known(n: u32) -> Option<RulesetVersion> {
        SHAPES.iter().any(|s| s.version == n).then_some(RulesetVersion(n))
    }

    pub fn number(self) -> u32 {
        self.0
    }

    fn shape(self) -> &'static Shape {
        SHAPES.iter().find(|s| s.version == self.0).expect("only known versions are made")
    }

    /// The releases that program this shape, for people (`inspect`, the reconciler's log).
    pub fn release(self) -> &'static str {
        self.shape().release
    }
}

impl std::fmt::Display for RulesetVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "capture ruleset {} ({})", self.0, self.release())
    }
}

/// Builds the capture ruleset ADD programs now ([`RulesetVersion::CURRENT`]).
pub fn capture_ruleset(cfg: &CaptureConfig) -> Result<Ruleset> {
    capture_ruleset_of(cfg, RulesetVersion::CURRENT)
}

/// Builds the capture ruleset of shape `version`: one half per family of the pod
/// (`cfg.families`), each the same table of docs/design.md, top to bottom, in its family.
pub fn capture_ruleset_of(cfg: &CaptureConfig, version: RulesetVersion) -> Result<Ruleset> {
    cfg.validate()?;
    let shape = version.shape();
    let halves = Family::ALL
        .into_iter()
        .filter(|f| cfg.families.contains(f))
        .map(|family| Half { table: capture_table(cfg, family, shape), policy_route: cfg.policy_route(family) })
        .collect();
    Ok(Ruleset { halves })
}

/// The excluded networks of `family`: the fixed ones and the configured ones of that family,
/// merged so interval elements never overlap (the kernel refuses overlapping intervals).
fn excluded_nets(cfg: &CaptureConfig, family: Family) -> Vec<Element> {
    let parse = |n: &&str| n.parse::<IpNet>().expect("constant");
    let nets = match family {
        Family::Ipv4 => FIXED_EXCLUDED_NETS.iter().map(parse),
        Family::Ipv6 => FIXED_EXCLUDED_NETS6.iter().map(parse),
    }
    .chain(cfg.excluded_cidrs.iter().copied())
    .filter(|n| Family::of(n.addr()) == family)
    .map(|n| n.trunc());
    let mut merged = IpNet::aggregate(&nets.collect());
    merged.sort();
    merged
        .into_iter()
        .map(|n| match n {
            IpNet::V4(n) => Element::Net(n),
            IpNet::V6(n) => Element::Net6(n),
        })
        .collect()
}

/// One family's capture table, of `shape`.
fn capture_table(cfg: &CaptureConfig, family: Family, shape: &Shape) -> Table {
    let rule =
        |matches: Vec<Match>, action: Action, comment: &str| Rule { matches, action, comment: comment.to_string() };

    let mut ports = cfg.excluded_ports.clone();
    let excluded_nets = Set {
        name: SET_EXCLUDED_NETS.into(),
        key: match family {
            Family::Ipv4 => KeyType::Ipv4Addr,
            Family::Ipv6 => KeyType::Ipv6Addr,
        },
        interval: true,
        elements: excluded_nets(cfg, family),
        comment: "destinations never captured nor DNATed".into(),
        timeout_secs: None,
        data: SetData::None,
    };
    ports.sort();
    let excluded_ports = Set {
        name: SET_EXCLUDED_PORTS.into(),
        key: KeyType::InetService,
        interval: true,
        elements: merge_ports(ports).into_iter().map(Element::Ports).collect(),
        comment: "TCP destination ports never captured".into(),
        timeout_secs: None,
        data: SetData::None,
    };

    let dns = cfg.dns_for(family);
    let dns_comment = match dns {
        Some(_) => "DNS is not captured (the dns_dnat chain sends it to the node DNS proxy)",
        None => "DNS is not captured (DNS capture is off: it goes where the pod sends it)",
    };
    let mut divert = vec![
        rule(
            vec![Match::CtDirectionReply],
            Action::Accept,
            "replies of tracked flows (inbound connections too) are never captured",
        ),
        rule(
            vec![Match::Mark(cfg.passthrough_mark)],
            Action::Accept,
            "the proxy's own passthrough traffic is never re-captured",
        ),
    ];
    if shape.keeps_preexisting_connections {
        divert.extend([
            rule(
                vec![Match::CtMark(PREEXISTING_CT_MARK)],
                Action::Accept,
                "a connection established before the capture stays uncaptured",
            ),
            // Conntrack runs in the pod netns from the moment this table exists. A TCP packet
            // of a flow it never saw, without SYN, is picked up mid-stream
            // (nf_conntrack_tcp_loose) as `new`: that connection was open before the capture,
            // and no new connection ever starts without SYN.
            rule(
                vec![Match::CtStateNew, Match::TcpWithoutSyn],
                Action::SetCtMarkAccept(PREEXISTING_CT_MARK),
                "a TCP flow first seen mid-stream was established before the capture: marked, not captured",
            ),
        ]);
    }
    divert.extend([
        rule(
            vec![Match::DaddrInSet(SET_EXCLUDED_NETS.into())],
            Action::Accept,
            "excluded destinations are not captured",
        ),
        rule(vec![Match::Dport(Proto::Udp, 53)], Action::Accept, dns_comment),
        rule(vec![Match::Dport(Proto::Tcp, 53)], Action::Accept, dns_comment),
        rule(
            vec![Match::DportInSet(Proto::Tcp, SET_EXCLUDED_PORTS.into())],
            Action::Accept,
            "excluded TCP ports are not captured",
        ),
    ]);
    match cfg.mode {
        CaptureMode::RedirectAll => divert.push(rule(
            vec![Match::L4Proto(Proto::Tcp)],
            Action::SetMarkAccept(cfg.divert_mark),
            "redirect-all: divert TCP to lo, where prerouting tproxies it to the capture listener",
        )),
        CaptureMode::Scoped => {
            for &port in &cfg.scoped_ports {
                divert.push(rule(
                    vec![Match::Dport(Proto::Tcp, port)],
                    Action::SetMarkAccept(cfg.divert_mark),
                    "scoped: divert TCP to this mesh port to lo, where prerouting tproxies it",
                ));
            }
        }
    }
    divert.push(rule(
        vec![Match::Dport(Proto::Udp, cfg.mesh_l4_port)],
        Action::SetMarkAccept(cfg.divert_mark),
        "divert UDP to the L4 mesh port to lo, where prerouting tproxies it with its port kept",
    ));

    let tproxy = vec![
        rule(
            vec![Match::InputLoopback, Match::Mark(cfg.divert_mark), Match::L4Proto(Proto::Tcp)],
            Action::TproxyAccept(cfg.capture_port),
            "diverted TCP goes to the transparent capture listener",
        ),
        rule(
            vec![Match::InputLoopback, Match::Mark(cfg.divert_mark), Match::Dport(Proto::Udp, cfg.mesh_l4_port)],
            // Same port as the destination: a UDP reply's source port is the listener's
            // bound port, so rewriting it would break connected clients.
            Action::TproxyAccept(cfg.mesh_l4_port),
            "diverted UDP goes to the transparent L4 listener, destination port kept",
        ),
    ];

    let mut chains = vec![
        Chain {
            name: CHAIN_DIVERT.into(),
            hook: Some(BaseHook { kind: ChainKind::Route, hook: Hook::Output, priority: -150 }),
            rules: divert,
        },
        Chain {
            name: CHAIN_TPROXY.into(),
            hook: Some(BaseHook { kind: ChainKind::Filter, hook: Hook::Prerouting, priority: -150 }),
            rules: tproxy,
        },
    ];
    if let Some(dns) = dns {
        chains.push(Chain {
            name: CHAIN_DNS.into(),
            hook: Some(BaseHook { kind: ChainKind::Nat, hook: Hook::Output, priority: -100 }),
            rules: vec![
                rule(
                    vec![Match::Mark(cfg.passthrough_mark)],
                    Action::Accept,
                    "the proxy's own passthrough traffic is left alone",
                ),
                rule(
                    vec![Match::DaddrInSet(SET_EXCLUDED_NETS.into())],
                    Action::Accept,
                    "excluded destinations are not DNATed",
                ),
                rule(
                    vec![Match::Dport(Proto::Udp, 53)],
                    Action::Dnat(dns.host_ip, dns.port),
                    "DNS over UDP goes to the node DNS proxy",
                ),
                rule(
                    vec![Match::Dport(Proto::Tcp, 53)],
                    Action::Dnat(dns.host_ip, dns.port),
                    "DNS over TCP goes to the node DNS proxy",
                ),
            ],
        });
    }

    Table { family, name: TABLE.into(), sets: vec![excluded_nets, excluded_ports], counters: Vec::new(), chains }
}

/// Sorted ranges in, overlapping or adjacent ranges joined.
fn merge_ports(sorted: Vec<PortRange>) -> Vec<PortRange> {
    let mut out: Vec<PortRange> = Vec::new();
    for r in sorted {
        match out.last_mut() {
            Some(last) if u32::from(r.first) <= u32::from(last.last) + 1 => last.last = last.last.max(r.last),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_of<'a>(rs: &'a Ruleset, chain: &str) -> &'a [Rule] {
        &rs.halves[0].table.chains.iter().find(|c| c.name == chain).expect("chain").rules
    }

    #[test]
    fn constants_are_pinned() {
        assert_eq!(DIVERT_MARK, 0xae71);
        assert_eq!(PASSTHROUGH_MARK, 0xae7e);
        assert_eq!(PREEXISTING_CT_MARK, 0xae7c);
        assert_eq!(CAPTURE_PORT, 18001);
        assert_eq!(MESH_L4_PORT, 18082);
        assert_eq!(SCOPED_PORTS, [18081, 18082]);
        assert_eq!(DNS_PROXY_PORT, 18054);
        assert_eq!(ROUTE_TABLE, 44657);
        assert_eq!(RULE_PRIORITY, 32000);
        assert_eq!(FIXED_EXCLUDED_NETS, ["127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4"]);
    }

    #[test]
    fn divert_and_passthrough_marks_differ_and_neither_masks_the_other() {
        assert_ne!(DIVERT_MARK, PASSTHROUGH_MARK);
        assert_ne!(DIVERT_MARK & PASSTHROUGH_MARK, DIVERT_MARK);
        assert_ne!(DIVERT_MARK & PASSTHROUGH_MARK, PASSTHROUGH_MARK);
        for k in KUBE_PROXY_MARKS {
            assert_ne!(DIVERT_MARK, k);
            assert_ne!(PASSTHROUGH_MARK, k);
        }
        CaptureConfig::new(CaptureMode::RedirectAll).validate().unwrap();
    }

    #[test]
    fn colliding_marks_are_refused() {
        for (d, p, why) in [
            (0xae71, 0xae71, "equals"),
            (0xae71, 0xae70, "mask"),
            (0x1, 0x3, "mask"),
            (0x8000, 0x1, "kube-proxy"),
            (0x1, 0x4000, "kube-proxy"),
            (0, 0x1, "non-zero"),
        ] {
            let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
            c.divert_mark = d;
            c.passthrough_mark = p;
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(why), "{d:#x}/{p:#x}: {err}");
        }
    }

    #[test]
    fn bad_numbers_are_refused() {
        let base = CaptureConfig::new(CaptureMode::RedirectAll);
        type Tweak = Box<dyn Fn(&mut CaptureConfig)>;
        let cases: Vec<(Tweak, &str)> = vec![
            (Box::new(|c| c.route_table = 254), "reserved"),
            (Box::new(|c| c.route_table = 0), "reserved"),
            (Box::new(|c| c.rule_priority = 0), "between"),
            (Box::new(|c| c.rule_priority = 32766), "between"),
            (Box::new(|c| c.capture_port = 0), "capture port"),
            (Box::new(|c| c.mesh_l4_port = 0), "mesh L4 port"),
            (
                Box::new(|c| {
                    c.mode = CaptureMode::Scoped;
                    c.scoped_ports.clear()
                }),
                "scoped",
            ),
            (
                Box::new(|c| c.dns = Some(DnsDivert { host_ip: std::net::Ipv4Addr::LOCALHOST.into(), port: 18054 })),
                "host IP",
            ),
            (Box::new(|c| c.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 0 })), "DNS proxy port"),
        ];
        for (tweak, want) in cases {
            let mut c = base.clone();
            tweak(&mut c);
            let err = capture_ruleset(&c).unwrap_err().to_string();
            assert!(err.contains(want), "want {want:?} in {err}");
        }
    }

    #[test]
    fn redirect_all_diverts_all_tcp_after_the_exclusions() {
        let rs = capture_ruleset(&CaptureConfig::new(CaptureMode::RedirectAll)).unwrap();
        let divert = rules_of(&rs, CHAIN_DIVERT);
        assert_eq!(divert[0].matches, vec![Match::CtDirectionReply]);
        assert_eq!(divert[1].matches, vec![Match::Mark(PASSTHROUGH_MARK)]);
        let tcp_all = divert.iter().position(|r| r.matches == vec![Match::L4Proto(Proto::Tcp)]).unwrap();
        let excl_ports = divert.iter().position(|r| matches!(r.matches[0], Match::DportInSet(..))).unwrap();
        assert!(excl_ports < tcp_all);
        assert_eq!(divert[tcp_all].action, Action::SetMarkAccept(DIVERT_MARK));
        assert_eq!(divert.last().unwrap().matches, vec![Match::Dport(Proto::Udp, 18082)]);
        assert!(rs.halves[0].table.chains.iter().all(|c| c.name != CHAIN_DNS), "DNS off by default");
        let tproxy = rules_of(&rs, CHAIN_TPROXY);
        assert_eq!(tproxy[0].action, Action::TproxyAccept(18001));
        assert_eq!(tproxy[1].action, Action::TproxyAccept(18082));
        assert!(rs.halves[0].table.chains.iter().flat_map(|c| &c.rules).all(|r| !r.comment.is_empty()));
    }

    #[test]
    fn connections_established_before_the_capture_are_exempted_before_anything_is_diverted() {
        for mode in [CaptureMode::RedirectAll, CaptureMode::Scoped] {
            let rs = capture_ruleset(&CaptureConfig::new(mode)).unwrap();
            let divert = rules_of(&rs, CHAIN_DIVERT);
            let marked = divert.iter().position(|r| r.matches == vec![Match::CtMark(PREEXISTING_CT_MARK)]).unwrap();
            assert_eq!(divert[marked].action, Action::Accept);
            let first_seen =
                divert.iter().position(|r| r.matches == vec![Match::CtStateNew, Match::TcpWithoutSyn]).unwrap();
            assert_eq!(divert[first_seen].action, Action::SetCtMarkAccept(PREEXISTING_CT_MARK));
            let first_divert =
                divert.iter().position(|r| matches!(r.action, Action::SetMarkAccept(_))).expect("a divert rule");
            assert!(marked < first_divert && first_seen < first_divert, "{mode}: exemptions come first");
            assert_eq!(
                divert[first_seen].to_string(),
                "ct state new tcp flags ! syn ct mark set 0x0000ae7c accept comment \"a TCP flow first seen mid-stream was established before the capture: marked, not captured\""
            );
        }
        // The mark differs from the packet marks: a restored ct mark never diverts.
        assert!(![DIVERT_MARK, PASSTHROUGH_MARK].contains(&PREEXISTING_CT_MARK));
    }

    /// The first shape is the current one without the two rules that keep connections
    /// established before the capture, in every table and nothing else: what the releases
    /// before them programmed (their golden files differ by exactly these lines).
    #[test]
    fn the_first_ruleset_is_the_current_one_without_the_preexisting_connection_rules() {
        let exemption = |r: &Rule| {
            r.matches == vec![Match::CtMark(PREEXISTING_CT_MARK)]
                || r.action == Action::SetCtMarkAccept(PREEXISTING_CT_MARK)
        };
        for mode in [CaptureMode::RedirectAll, CaptureMode::Scoped] {
            let mut cfg = CaptureConfig::new(mode);
            cfg.families = vec![Family::Ipv4, Family::Ipv6];
            let now = capture_ruleset(&cfg).unwrap();
            let first = capture_ruleset_of(&cfg, RulesetVersion::FIRST).unwrap();
            assert_eq!(now.halves.len(), first.halves.len());
            for (n, f) in now.halves.iter().zip(&first.halves) {
                let mut stripped = n.table.clone();
                for c in &mut stripped.chains {
                    c.rules.retain(|r| !exemption(r));
                }
                assert_eq!(stripped, f.table, "{mode}: only the two rules differ");
                let removed: usize = n.table.chains.iter().map(|c| c.rules.len()).sum::<usize>()
                    - f.table.chains.iter().map(|c| c.rules.len()).sum::<usize>();
                assert_eq!(removed, 2, "{mode}");
            }
        }
        assert_eq!(RulesetVersion::known(1), Some(RulesetVersion::FIRST));
        assert_eq!(RulesetVersion::known(RulesetVersion::CURRENT.number()), Some(RulesetVersion::CURRENT));
        assert_eq!(RulesetVersion::known(0), None);
        assert_eq!(RulesetVersion::known(RulesetVersion::CURRENT.number() + 1), None, "a later release's");
        assert!(RulesetVersion::FIRST < RulesetVersion::CURRENT);
    }

    #[test]
    fn scoped_diverts_only_the_scoped_ports() {
        let rs = capture_ruleset(&CaptureConfig::new(CaptureMode::Scoped)).unwrap();
        let divert = rules_of(&rs, CHAIN_DIVERT);
        assert!(!divert.iter().any(|r| r.matches == vec![Match::L4Proto(Proto::Tcp)]));
        for port in [18081, 18082] {
            assert!(divert
                .iter()
                .any(|r| r.matches == vec![Match::Dport(Proto::Tcp, port)]
                    && r.action == Action::SetMarkAccept(DIVERT_MARK)));
        }
    }

    #[test]
    fn dns_on_adds_the_nat_chain_with_exclusions_first() {
        let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
        c.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        let rs = capture_ruleset(&c).unwrap();
        let dns = rules_of(&rs, CHAIN_DNS);
        assert_eq!(dns[1].matches, vec![Match::DaddrInSet(SET_EXCLUDED_NETS.into())]);
        assert_eq!(dns[2].action, Action::Dnat("10.0.0.1".parse().unwrap(), 18054));
        assert_eq!(dns[3].matches, vec![Match::Dport(Proto::Tcp, 53)]);
    }

    #[test]
    fn exclusions_are_merged_into_non_overlapping_elements() {
        let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
        c.excluded_cidrs =
            vec!["10.1.0.0/16".parse().unwrap(), "10.1.2.0/24".parse().unwrap(), "127.5.0.0/16".parse().unwrap()];
        c.excluded_ports = vec![
            "9000-9100".parse().unwrap(),
            "8080".parse().unwrap(),
            "9050-9200".parse().unwrap(),
            "9201".parse().unwrap(),
        ];
        let rs = capture_ruleset(&c).unwrap();
        let nets: Vec<String> = rs.halves[0].table.sets[0].elements.iter().map(|e| e.to_string()).collect();
        assert_eq!(nets, ["10.1.0.0/16", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4"]);
        let ports: Vec<String> = rs.halves[0].table.sets[1].elements.iter().map(|e| e.to_string()).collect();
        assert_eq!(ports, ["8080", "9000-9201"]);
    }

    #[test]
    fn port_ranges_parse_and_refuse_nonsense() {
        assert_eq!("8080".parse::<PortRange>().unwrap(), PortRange::single(8080));
        assert_eq!("1-65535".parse::<PortRange>().unwrap(), PortRange { first: 1, last: 65535 });
        for bad in ["0", "65536", "9100-9000", "abc", "", "80-", "-80", "1-2-3"] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad:?} accepted");
        }
    }

    fn v6_cfg() -> CaptureConfig {
        let mut c = CaptureConfig::new(CaptureMode::RedirectAll);
        c.families = vec![Family::Ipv6];
        c.dns_ipv6 = Some(DnsDivert { host_ip: "fd00::1".parse().unwrap(), port: 18054 });
        c.excluded_cidrs =
            vec!["10.1.0.0/16".parse().unwrap(), "fd00:1::/32".parse().unwrap(), "fe80::1/128".parse().unwrap()];
        c
    }

    #[test]
    fn an_ipv6_pod_gets_the_same_table_in_family_ip6() {
        let rs = capture_ruleset(&v6_cfg()).unwrap();
        assert_eq!(rs.halves.len(), 1);
        let half = &rs.halves[0];
        assert_eq!((half.table.family, half.policy_route.family), (Family::Ipv6, Family::Ipv6));
        assert_eq!(half.table.sets[0].key, KeyType::Ipv6Addr);
        let nets: Vec<String> = half.table.sets[0].elements.iter().map(|e| e.to_string()).collect();
        assert_eq!(nets, ["::1/128", "fd00:1::/32", "fe80::/10", "ff00::/8"], "IPv6 exclusions only, merged");
        let dns = rules_of(&rs, CHAIN_DNS);
        assert_eq!(dns[2].action, Action::Dnat("fd00::1".parse().unwrap(), 18054));
        // The same rows as IPv4's, in the same order.
        let mut v4 = v6_cfg();
        v4.families = vec![Family::Ipv4];
        v4.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        let rs4 = capture_ruleset(&v4).unwrap();
        for (c4, c6) in rs4.halves[0].table.chains.iter().zip(&half.table.chains) {
            assert_eq!((&c4.name, c4.hook), (&c6.name, c6.hook));
            let m4: Vec<_> = c4.rules.iter().map(|r| (&r.matches, &r.comment)).collect();
            let m6: Vec<_> = c6.rules.iter().map(|r| (&r.matches, &r.comment)).collect();
            assert_eq!(m4, m6, "chain {}", c4.name);
        }
        let text = half.table.to_string();
        assert!(text.starts_with("table ip6 aether_capture {"), "{text}");
        assert!(text.contains("ip6 daddr @excluded_nets accept") && !text.contains(" ip daddr"), "{text}");
        assert!(text.contains("dnat to [fd00::1]:18054"), "{text}");
    }

    #[test]
    fn a_dual_stack_pod_gets_both_halves_ipv4_first_and_ipv4_is_unchanged() {
        let mut dual = v6_cfg();
        dual.families = vec![Family::Ipv6, Family::Ipv4];
        dual.dns = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        let rs = capture_ruleset(&dual).unwrap();
        let fams: Vec<Family> = rs.halves.iter().map(|h| h.table.family).collect();
        assert_eq!(fams, [Family::Ipv4, Family::Ipv6]);
        let mut v4 = dual.clone();
        v4.families = vec![Family::Ipv4];
        assert_eq!(rs.halves[0], capture_ruleset(&v4).unwrap().halves[0], "the IPv4 half is the IPv4-only ruleset");
        let nets: Vec<String> = rs.halves[0].table.sets[0].elements.iter().map(|e| e.to_string()).collect();
        assert_eq!(nets, ["10.1.0.0/16", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4"]);
    }

    #[test]
    fn a_family_without_its_dns_address_or_with_the_wrong_one_is_refused() {
        let mut c = v6_cfg();
        c.dns_ipv6 = Some(DnsDivert { host_ip: "10.0.0.1".parse().unwrap(), port: 18054 });
        assert!(capture_ruleset(&c).unwrap_err().to_string().contains("not an IPv6 address"));
        c.dns_ipv6 = Some(DnsDivert { host_ip: "::1".parse().unwrap(), port: 18054 });
        assert!(capture_ruleset(&c).unwrap_err().to_string().contains("cannot receive"));
        c.families.clear();
        assert!(capture_ruleset(&c).unwrap_err().to_string().contains("no address family"));
    }
}
