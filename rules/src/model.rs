//! The ruleset as plain data: what the kernel should hold, independent of how it is sent.
//!
//! Builders (`capture`) produce it, the renderer (`nft::render`) turns it into netlink
//! messages, the reader (`nft::read`) compares the kernel's dump against it, and `Display`
//! prints it for people. Nothing here talks to the kernel.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

use crate::family::Family;

/// A pod's policy routing for one family: the rule sending marked packets to `table`, where
/// a local route delivers them to `lo` (programmed and read by `route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyRoute {
    pub family: Family,
    pub fwmark: u32,
    pub table: u32,
    pub priority: u32,
}

/// Everything one capture attachment programs in a pod netns: for each address family the
/// pod has, a table and the policy rule and route that go with it (IPv4 first). All tables
/// go to the kernel in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    pub halves: Vec<Half>,
}

/// One family's part of a [`Ruleset`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Half {
    pub table: Table,
    pub policy_route: PolicyRoute,
}

impl Ruleset {
    /// The half of `family`, if the pod has that family.
    pub fn half(&self, family: Family) -> Option<&Half> {
        self.halves.iter().find(|h| h.table.family == family)
    }

    pub fn tables(&self) -> impl Iterator<Item = &Table> {
        self.halves.iter().map(|h| &h.table)
    }

    pub fn policy_routes(&self) -> Vec<PolicyRoute> {
        self.halves.iter().map(|h| h.policy_route).collect()
    }
}

/// An nftables table: `table ip` or `table ip6` (the family decides the network header
/// layout of address matches and the family of tproxy and NAT).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub family: Family,
    pub name: String,
    pub sets: Vec<Set>,
    /// Named counter objects (`counter <name> { }`), created before the rules that use them.
    pub counters: Vec<String>,
    pub chains: Vec<Chain>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Set {
    pub name: String,
    pub key: KeyType,
    /// Interval sets hold ranges and prefixes; elements are sent as [start, end) pairs.
    pub interval: bool,
    pub elements: Vec<Element>,
    pub comment: String,
    /// Elements added by the datapath (`update @set`) expire after this many seconds; such a
    /// set is `dynamic` and its contents are the kernel's, never compared.
    pub timeout_secs: Option<u32>,
    /// What the set maps its keys to: nothing (a plain set), a number, or a chain.
    pub data: SetData,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SetData {
    /// A plain set: keys only.
    #[default]
    None,
    /// A data map to a 32-bit number (`type <key> : mark`: nft's 32-bit type it prints as a
    /// number; nothing to do with a packet's mark): its elements are `Element::Numbered`.
    Number,
    /// A verdict map (`type <key> : verdict`): each element (`Element::Goto`) goes to one of
    /// these chains, by index.
    Goto(Vec<String>),
}

impl SetData {
    /// The chains of a verdict map (none for another set).
    pub fn chains(&self) -> &[String] {
        match self {
            SetData::Goto(c) => c,
            _ => &[],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    Ipv4Addr,
    Ipv6Addr,
    InetService,
    /// `ipv4_addr . inet_proto . inet_service`: a Service port, kube-proxy's key.
    ServiceKey,
    /// `ipv6_addr . inet_proto . inet_service`: an IPv6 Service port.
    ServiceKey6,
    /// `inet_proto`: a transport protocol.
    InetProto,
    /// `mark`: a 32-bit number (a profile's number; its bytes: `nft::key::number_bytes`).
    Mark,
}

/// nft's concatenated datatype: each component's type in 6 bits, first one highest.
const fn concat_type(types: &[u32]) -> u32 {
    let mut t = 0;
    let mut i = 0;
    while i < types.len() {
        t = (t << 6) | types[i];
        i += 1;
    }
    t
}

impl KeyType {
    /// nft's datatype number (`TYPE_IPADDR`, `TYPE_INET_SERVICE`), stored in the set so `nft
    /// list` prints the elements in their own notation.
    pub fn nft_type(self) -> u32 {
        match self {
            KeyType::Ipv4Addr => 7,
            KeyType::Ipv6Addr => 8,
            KeyType::InetService => 13,
            // TYPE_IPADDR . TYPE_INET_PROTOCOL . TYPE_INET_SERVICE
            KeyType::ServiceKey => concat_type(&[7, 12, 13]),
            // TYPE_IP6ADDR . TYPE_INET_PROTOCOL . TYPE_INET_SERVICE
            KeyType::ServiceKey6 => concat_type(&[8, 12, 13]),
            KeyType::InetProto => 12,
            // TYPE_MARK
            KeyType::Mark => 19,
        }
    }

    pub fn byte_len(self) -> u32 {
        match self {
            KeyType::Ipv4Addr => 4,
            KeyType::Ipv6Addr => 16,
            KeyType::InetService => 2,
            // Each component padded to a 32-bit register.
            KeyType::ServiceKey => 12,
            // The address fills four registers, then protocol and port one each.
            KeyType::ServiceKey6 => 24,
            KeyType::InetProto => 1,
            KeyType::Mark => 4,
        }
    }

    /// An address of `family`.
    pub fn addr(family: Family) -> KeyType {
        match family {
            Family::Ipv4 => KeyType::Ipv4Addr,
            Family::Ipv6 => KeyType::Ipv6Addr,
        }
    }

    /// A Service port (`address . proto . port`) of `family`.
    pub fn service(family: Family) -> KeyType {
        match family {
            Family::Ipv4 => KeyType::ServiceKey,
            Family::Ipv6 => KeyType::ServiceKey6,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KeyType::Ipv4Addr => "ipv4_addr",
            KeyType::Ipv6Addr => "ipv6_addr",
            KeyType::InetService => "inet_service",
            KeyType::ServiceKey => "ipv4_addr . inet_proto . inet_service",
            KeyType::ServiceKey6 => "ipv6_addr . inet_proto . inet_service",
            KeyType::InetProto => "inet_proto",
            KeyType::Mark => "mark",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Element {
    Net(Ipv4Net),
    Net6(Ipv6Net),
    Ports(PortRange),
    /// One address, in a set without intervals.
    Addr(Ipv4Addr),
    /// One IPv6 address, in a set without intervals.
    Addr6(Ipv6Addr),
    /// `VIP . proto . port`
    Service(Ipv4Addr, Proto, u16),
    /// `VIP . proto . port`, an IPv6 VIP.
    Service6(Ipv6Addr, Proto, u16),
    /// A transport protocol.
    Proto(Proto),
    /// In a data map to numbers: an address (of the map's family) and its number
    /// (`10.96.1.1 : 0x00000001`).
    Numbered(IpAddr, u32),
    /// In a verdict map keyed by number: the number and the index in the map's chains
    /// (`SetData::Goto`) of the chain it goes to (`0x00000001 : goto ports_tcp80`).
    Goto(u32, u16),
}

/// An inclusive port range; a single port is `first == last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    pub fn single(port: u16) -> Self {
        PortRange { first: port, last: port }
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

impl std::str::FromStr for PortRange {
    type Err = String;

    /// `"8080"` or `"9000-9100"`; port 0 and reversed ranges are refused.
    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |p: &str| -> Result<u16, String> {
            match p.trim().parse::<u16>() {
                Ok(0) => Err(format!("port 0 in {s:?} is not a port")),
                Ok(n) => Ok(n),
                Err(_) => Err(format!("{s:?} is not a port or a port range (1-65535, e.g. 8080 or 9000-9100)")),
            }
        };
        let range = match s.split_once('-') {
            Some((a, b)) => PortRange { first: parse(a)?, last: parse(b)? },
            None => PortRange::single(parse(s)?),
        };
        if range.first > range.last {
            return Err(format!("port range {s:?} ends before it starts"));
        }
        Ok(range)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    pub hook: Option<BaseHook>,
    pub rules: Vec<Rule>,
}

/// What makes a chain a base chain: where the kernel calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseHook {
    pub kind: ChainKind,
    pub hook: Hook,
    pub priority: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainKind {
    Filter,
    /// `type route`: a mark set here makes the kernel route the packet again.
    Route,
    Nat,
}

impl ChainKind {
    pub fn name(self) -> &'static str {
        match self {
            ChainKind::Filter => "filter",
            ChainKind::Route => "route",
            ChainKind::Nat => "nat",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    Prerouting,
    Output,
}

impl Hook {
    /// `NF_INET_*` hook number.
    pub fn number(self) -> u32 {
        match self {
            Hook::Prerouting => 0,
            Hook::Output => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Output => "output",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One rule: all matches must hold, then the action runs. Every rule says why it exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub action: Action,
    pub comment: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Match {
    /// `ct direction reply`
    CtDirectionReply,
    /// `meta mark <mark>`
    Mark(u32),
    /// `iif "lo"`: lo is ifindex 1 in every netns.
    InputLoopback,
    /// `ip daddr @set` (`ip6 daddr` in an IPv6 table)
    DaddrInSet(String),
    /// `meta l4proto <proto>`
    L4Proto(Proto),
    /// `<proto> dport <port>`
    Dport(Proto, u16),
    /// `<proto> dport @set`
    DportInSet(Proto, String),
    /// `ct state new`: the first packet of a connection.
    CtStateNew,
    /// `ct mark <mark>`: the flow's conntrack mark.
    CtMark(u32),
    /// `tcp flags ! syn` (SYN clear): a TCP packet that cannot start a connection.
    TcpWithoutSyn,
    /// `ct status & confirmed == 0`: the first packet of a flow, exactly once.
    CtUnconfirmed,
    /// `ip daddr != @set`
    DaddrNotInSet(String),
    /// `meta l4proto != @set`
    L4ProtoNotInSet(String),
    /// `ip daddr . meta l4proto . th dport @set` (a `ServiceKey` set)
    ServiceKeyInSet(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Accept,
    /// `meta mark set <mark> accept`
    SetMarkAccept(u32),
    /// `ct mark set <mark> accept`: mark the packet's flow (conntrack), then accept.
    SetCtMarkAccept(u32),
    /// `tproxy to :<port> accept`: deliver to the transparent listener on this port.
    TproxyAccept(u16),
    /// `dnat to <addr>:<port>`, the address of the table's family.
    Dnat(IpAddr, u16),
    /// `jump <chain>`
    Jump(String),
    /// `counter name "<counter>" accept`
    CountAccept(String),
    /// `counter name "<counter>" jump <chain>`
    CountJump(String, String),
    /// `meta mark set ip daddr map @map meta mark vmap @vmap` (`ip6 daddr` in an IPv6 table):
    /// the destination's number in the data map `map`, looked up in the verdict map `vmap`;
    /// the next rule when the address is not in `map` (the mark untouched), or its number not
    /// in `vmap` (the mark holding the number). The number goes from one lookup to the next
    /// through the packet's mark, not a register alone: Debian 12's nft (1.0.6) aborts
    /// listing a lookup keyed by another lookup's result. So every chain `vmap` goes to
    /// starts by setting the mark back (`SetMark`).
    DaddrMapVmap {
        map: String,
        vmap: String,
    },
    /// `meta mark set <mark>`, then the next rule.
    SetMark(u32),
    /// `update @set { ip daddr . meta l4proto . th dport }`, then the next rule.
    UpdateServiceKeySet(String),
    /// `reject with tcp reset`
    RejectTcpReset,
    /// `reject` (ICMP port unreachable)
    RejectIcmpPortUnreachable,
}

/// A model value written in nft's notation for a table of `family` (`ip daddr` or `ip6 daddr`).
pub struct InFamily<'a, T>(pub &'a T, pub Family);

impl fmt::Display for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", InFamily(self, Family::Ipv4))
    }
}

impl fmt::Display for InFamily<'_, Match> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ip = self.1.nft_name();
        match self.0 {
            Match::CtDirectionReply => write!(f, "ct direction reply"),
            Match::Mark(m) => write!(f, "meta mark {m:#010x}"),
            Match::InputLoopback => write!(f, "iif \"lo\""),
            Match::DaddrInSet(s) => write!(f, "{ip} daddr @{s}"),
            Match::L4Proto(p) => write!(f, "meta l4proto {}", p.name()),
            Match::Dport(p, port) => write!(f, "{} dport {port}", p.name()),
            Match::DportInSet(p, s) => write!(f, "{} dport @{s}", p.name()),
            Match::CtStateNew => write!(f, "ct state new"),
            Match::CtMark(m) => write!(f, "ct mark {m:#010x}"),
            Match::TcpWithoutSyn => write!(f, "tcp flags ! syn"),
            Match::CtUnconfirmed => write!(f, "ct status & confirmed == 0"),
            Match::DaddrNotInSet(s) => write!(f, "{ip} daddr != @{s}"),
            Match::L4ProtoNotInSet(s) => write!(f, "meta l4proto != @{s}"),
            Match::ServiceKeyInSet(s) => write!(f, "{ip} daddr . meta l4proto . th dport @{s}"),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", InFamily(self, Family::Ipv4))
    }
}

impl fmt::Display for InFamily<'_, Action> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ip = self.1.nft_name();
        match self.0 {
            Action::Accept => write!(f, "accept"),
            Action::SetMarkAccept(m) => write!(f, "meta mark set {m:#010x} accept"),
            Action::SetCtMarkAccept(m) => write!(f, "ct mark set {m:#010x} accept"),
            Action::TproxyAccept(port) => write!(f, "tproxy to :{port} accept"),
            Action::Dnat(addr, port) => write!(f, "dnat to {}", std::net::SocketAddr::new(*addr, *port)),
            Action::Jump(c) => write!(f, "jump {c}"),
            Action::CountAccept(c) => write!(f, "counter name {c:?} accept"),
            Action::CountJump(c, chain) => write!(f, "counter name {c:?} jump {chain}"),
            Action::DaddrMapVmap { map, vmap } => {
                write!(f, "meta mark set {ip} daddr map @{map} meta mark vmap @{vmap}")
            }
            Action::SetMark(m) => write!(f, "meta mark set {m:#010x}"),
            Action::UpdateServiceKeySet(s) => write!(f, "update @{s} {{ {ip} daddr . meta l4proto . th dport }}"),
            Action::RejectTcpReset => write!(f, "reject with tcp reset"),
            Action::RejectIcmpPortUnreachable if self.1 == Family::Ipv6 => {
                write!(f, "reject with icmpv6 port-unreachable")
            }
            Action::RejectIcmpPortUnreachable => write!(f, "reject with icmp port-unreachable"),
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", InFamily(self, Family::Ipv4))
    }
}

impl fmt::Display for InFamily<'_, Rule> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for m in &self.0.matches {
            write!(f, "{} ", InFamily(m, self.1))?;
        }
        write!(f, "{} comment {:?}", InFamily(&self.0.action, self.1), self.0.comment)
    }
}

impl fmt::Display for Element {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Element::Net(n) => write!(f, "{n}"),
            Element::Net6(n) => write!(f, "{n}"),
            Element::Ports(p) => write!(f, "{p}"),
            Element::Addr(a) => write!(f, "{a}"),
            Element::Addr6(a) => write!(f, "{a}"),
            Element::Service(a, p, port) => write!(f, "{a} . {} . {port}", p.name()),
            Element::Service6(a, p, port) => write!(f, "{a} . {} . {port}", p.name()),
            Element::Proto(p) => write!(f, "{}", p.name()),
            Element::Numbered(a, n) => write!(f, "{a} : {n:#010x}"),
            Element::Goto(n, chain) => write!(f, "{n:#010x} : goto #{chain}"),
        }
    }
}

/// A readable rendering of the model in nft's own vocabulary (for `inspect` and messages;
/// golden files are the kernel's output, never this).
impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "table {} {} {{", self.family.nft_name(), self.name)?;
        for c in &self.counters {
            writeln!(f, "\tcounter {c} {{\n\t}}")?;
        }
        for set in &self.sets {
            writeln!(f, "\tset {} {{  # {}", set.name, set.comment)?;
            let flags = match (set.interval, set.timeout_secs) {
                (true, _) => "; flags interval".to_string(),
                (false, Some(t)) => format!("; flags dynamic,timeout; timeout {t}s"),
                (false, None) => String::new(),
            };
            let data = match set.data {
                SetData::None => "",
                SetData::Number => " : mark",
                SetData::Goto(_) => " : verdict",
            };
            writeln!(f, "\t\ttype {}{data}{flags}", set.key.name())?;
            let elems: Vec<String> = set
                .elements
                .iter()
                .map(|e| match e {
                    Element::Goto(n, i) => format!("{n:#010x} : goto {}", set.data.chains()[usize::from(*i)]),
                    e => e.to_string(),
                })
                .collect();
            writeln!(f, "\t\telements = {{ {} }}", elems.join(", "))?;
            writeln!(f, "\t}}")?;
        }
        for chain in &self.chains {
            writeln!(f, "\tchain {} {{", chain.name)?;
            if let Some(h) = chain.hook {
                writeln!(
                    f,
                    "\t\ttype {} hook {} priority {}; policy accept;",
                    h.kind.name(),
                    h.hook.name(),
                    h.priority
                )?;
            }
            for rule in &chain.rules {
                writeln!(f, "\t\t{}", InFamily(rule, self.family))?;
            }
            writeln!(f, "\t}}")?;
        }
        writeln!(f, "}}")
    }
}
