//! Policy routing for the divert mark (docs/design.md, "The pod ruleset"):
//!
//! ```text
//! ip [-6] rule add fwmark <mark> lookup <table> priority <priority>
//! ip [-6] route add local 0.0.0.0/0 | ::/0 dev lo table <table>
//! ```
//!
//! One rule and one route per address family the pod has (the same mark, table and
//! priority in each). Programmed over a blocking rtnetlink socket opened in the network
//! namespace of the calling thread (the caller has already entered the pod netns), one for
//! all of a change's rules and routes.

use std::io;

use netlink_packet_core::{
    DecodeError, Emitable, NetlinkDeserializable, NetlinkHeader, NetlinkSerializable, Parseable, NLM_F_CREATE,
    NLM_F_EXCL,
};
use netlink_packet_route::link::{LinkFlags, LinkHeader};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleFlags, RuleMessage};
use netlink_packet_route::AddressFamily;

use crate::error::{Error, Result};
use crate::family::Family;
pub use crate::model::PolicyRoute;
use crate::netlink::{Socket, NETLINK_ROUTE};

/// `lo` is created first in every network namespace, so it is always ifindex 1.
const LOOPBACK_IFINDEX: u32 = 1;

/// rtnetlink message types (linux/rtnetlink.h).
const RTM_SETLINK: u16 = 19;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWRULE: u16 = 32;
const RTM_DELRULE: u16 = 33;
const RTM_GETRULE: u16 = 34;

/// The rtnetlink messages this crate sends and reads: rules, routes, and a link's flags set
/// (`lo` up in doctor's private netns). Not netlink-packet-route's `RouteNetlinkMessage`: a
/// message encoded or parsed as that enum links the code of every rtnetlink message (link
/// kinds, traffic control, neighbours...), about a tenth of the plugin's file, none of which
/// it runs. The messages themselves are still that crate's types.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rtnl {
    NewRule(RuleMessage),
    DelRule(RuleMessage),
    GetRule(RuleMessage),
    NewRoute(RouteMessage),
    DelRoute(RouteMessage),
    GetRoute(RouteMessage),
    /// A link's header alone: its flags, no attributes.
    SetLink(LinkHeader),
}

impl NetlinkSerializable for Rtnl {
    fn message_type(&self) -> u16 {
        match self {
            Rtnl::NewRule(_) => RTM_NEWRULE,
            Rtnl::DelRule(_) => RTM_DELRULE,
            Rtnl::GetRule(_) => RTM_GETRULE,
            Rtnl::NewRoute(_) => RTM_NEWROUTE,
            Rtnl::DelRoute(_) => RTM_DELROUTE,
            Rtnl::GetRoute(_) => RTM_GETROUTE,
            Rtnl::SetLink(_) => RTM_SETLINK,
        }
    }

    fn buffer_len(&self) -> usize {
        match self {
            Rtnl::NewRule(m) | Rtnl::DelRule(m) | Rtnl::GetRule(m) => m.buffer_len(),
            Rtnl::NewRoute(m) | Rtnl::DelRoute(m) | Rtnl::GetRoute(m) => m.buffer_len(),
            Rtnl::SetLink(h) => h.buffer_len(),
        }
    }

    fn serialize(&self, buffer: &mut [u8]) {
        match self {
            Rtnl::NewRule(m) | Rtnl::DelRule(m) | Rtnl::GetRule(m) => m.emit(buffer),
            Rtnl::NewRoute(m) | Rtnl::DelRoute(m) | Rtnl::GetRoute(m) => m.emit(buffer),
            Rtnl::SetLink(h) => h.emit(buffer),
        }
    }
}

impl NetlinkDeserializable for Rtnl {
    type Error = DecodeError;

    /// What a dump of rules or routes answers; any other message is not read.
    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> std::result::Result<Self, DecodeError> {
        match header.message_type {
            RTM_NEWRULE => RuleMessage::parse(payload).map(Rtnl::NewRule),
            RTM_NEWROUTE => RouteMessage::parse(payload).map(Rtnl::NewRoute),
            other => Err(DecodeError::from(format!("rtnetlink message type {other}: neither a rule nor a route"))),
        }
    }
}

/// What the kernel holds of one PolicyRoute, read back for CHECK.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PolicyRouteState {
    pub rule_present: bool,
    pub route_present: bool,
    pub notes: Vec<String>,
}

impl PolicyRoute {
    /// Adds the rule. Ok(true) if created, Ok(false) if an identical rule already existed.
    pub fn add_rule(&self) -> Result<bool> {
        self.add_rule_on(&mut open()?)
    }

    /// `add_rule` on a socket of the caller's (one for the rules and routes of a change).
    pub(crate) fn add_rule_on(&self, sock: &mut Socket) -> Result<bool> {
        // NLM_F_EXCL matters: without it the kernel happily adds a duplicate rule.
        let msg = Rtnl::NewRule(rule_message(self));
        absent_ok(sock.transact(msg, NLM_F_CREATE | NLM_F_EXCL), libc::EEXIST, "add rule")
    }

    /// Adds the route. Ok(true) if created, Ok(false) if exactly this route already existed.
    pub fn add_route(&self) -> Result<bool> {
        self.add_route_on(&mut open()?)
    }

    /// `add_route` on a socket of the caller's.
    pub(crate) fn add_route_on(&self, sock: &mut Socket) -> Result<bool> {
        let msg = Rtnl::NewRoute(route_message(self, false));
        let created = match sock.transact(msg, NLM_F_CREATE | NLM_F_EXCL) {
            // IPv6 refuses a route through a device that is down; runtimes bring a pod's `lo`
            // up before the network plugins run, so say which device and why.
            Err(e) if e.raw_os_error() == Some(libc::ENETDOWN) => {
                return Err(route_err(
                    "add route (lo is down in this netns; the runtime brings it up before the network plugins run)",
                    e,
                ))
            }
            res => absent_ok(res, libc::EEXIST, "add route")?,
        };
        // The kernel's EEXIST only means "some route for 0.0.0.0/0 at metric 0 is in the
        // table", whatever its type or device: make sure it is ours before calling it done.
        if !created && !self.read_state_on(sock)?.route_present {
            return Err(route_err("add route", io::Error::from_raw_os_error(libc::EEXIST)));
        }
        Ok(created)
    }

    /// Deletes the rule (matching fwmark, table, priority). Ok(false) if it was not there.
    pub fn del_rule(&self) -> Result<bool> {
        self.del_rule_on(&mut open()?)
    }

    /// `del_rule` on a socket of the caller's.
    pub(crate) fn del_rule_on(&self, sock: &mut Socket) -> Result<bool> {
        let msg = Rtnl::DelRule(rule_message(self));
        absent_ok(sock.transact(msg, 0), libc::ENOENT, "delete rule")
    }

    /// Deletes the route. Ok(false) if it was not there.
    pub fn del_route(&self) -> Result<bool> {
        self.del_route_on(&mut open()?)
    }

    /// `del_route` on a socket of the caller's.
    pub(crate) fn del_route_on(&self, sock: &mut Socket) -> Result<bool> {
        let msg = Rtnl::DelRoute(route_message(self, true));
        // A missing route is ESRCH for IPv4 (a table that never existed too); IPv6 says
        // ENOENT for a missing route and ESRCH for a table that never existed.
        match (self.family, absent_ok(sock.transact(msg, 0), libc::ESRCH, "delete route")) {
            (Family::Ipv6, Err(Error::Route { source, .. })) if source.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            (_, other) => other,
        }
    }

    /// Dumps rules and the routes of our table, and reports whether exactly our rule and our
    /// route are present, with a note for each near-miss.
    pub fn read_state(&self) -> Result<PolicyRouteState> {
        self.read_state_on(&mut open()?)
    }

    /// `read_state` on a socket of the caller's.
    pub(crate) fn read_state_on(&self, sock: &mut Socket) -> Result<PolicyRouteState> {
        let mut state = PolicyRouteState::default();
        let mut rule_copies = 0;
        for msg in dump(sock, Rtnl::GetRule(rule_dump_message(self.family)), "dump rules")? {
            let Rtnl::NewRule(rule) = msg else {
                continue;
            };
            let view = RuleView::of(&rule);
            if view.family != address_family(self.family) {
                continue;
            }
            if self.is_our_rule(&view) {
                rule_copies += 1;
            } else if view.fwmark == Some(self.fwmark) && view.priority != self.priority {
                state.notes.push(format!(
                    "a rule with fwmark {:#x} exists at priority {} instead of {}: {}",
                    self.fwmark,
                    view.priority,
                    self.priority,
                    view.describe()
                ));
            } else if view.fwmark == Some(self.fwmark) || view.table == self.table {
                state.notes.push(format!("a rule differs from ours ({}): {}", self.describe_rule(), view.describe()));
            }
        }
        state.rule_present = rule_copies > 0;
        if rule_copies > 1 {
            state.notes.push(format!("our rule is present {rule_copies} times"));
        }

        let mut others = Vec::new();
        for msg in dump(sock, Rtnl::GetRoute(route_dump_message(self.family)), "dump routes")? {
            let Rtnl::NewRoute(route) = msg else {
                continue;
            };
            if route_table(&route) != self.table || route.header.address_family != address_family(self.family) {
                continue;
            }
            if is_our_route(&route) {
                state.route_present = true;
            } else {
                others.push(describe_route(&route));
            }
        }
        let how = if state.route_present { "besides" } else { "instead of" };
        for other in others {
            state.notes.push(format!("table {} holds route {other} {how} {}", self.table, self.describe_route()));
        }
        Ok(state)
    }

    fn is_our_rule(&self, v: &RuleView) -> bool {
        v.action == RuleAction::ToTable
            && v.table == self.table
            && v.priority == self.priority
            && v.fwmark == Some(self.fwmark)
            && !matches!(v.fwmask, Some(m) if m != u32::MAX)
            && !v.extra_selectors
    }

    fn describe_rule(&self) -> String {
        format!("{}: fwmark {:#x} lookup {}", self.priority, self.fwmark, self.table)
    }

    /// `fwmark 0xae71 lookup 44657 priority 32000` (for messages; `ip -6 rule` for IPv6).
    pub fn describe_policy_rule(&self) -> String {
        format!("fwmark {:#x} lookup {} priority {}", self.fwmark, self.table, self.priority)
    }

    /// `local 0.0.0.0/0 dev lo table 44657` (or `::/0`), for messages.
    pub fn describe_route(&self) -> String {
        format!("local {} dev lo table {}", self.family.any(), self.table)
    }
}

/// rtnetlink's name for the family.
fn address_family(f: Family) -> AddressFamily {
    match f {
        Family::Ipv4 => AddressFamily::Inet,
        Family::Ipv6 => AddressFamily::Inet6,
    }
}

/// The fields of a dumped rule that matter to us, with the table resolved (FRA_TABLE wins
/// over the 8-bit header field, which is 0 for tables above 255).
struct RuleView {
    family: AddressFamily,
    action: RuleAction,
    table: u32,
    priority: u32,
    fwmark: Option<u32>,
    fwmask: Option<u32>,
    /// Anything else that narrows the match (from/to/iif/oif/uid/ports/not ...): not our rule.
    extra_selectors: bool,
}

impl RuleView {
    fn of(rule: &RuleMessage) -> Self {
        let h = &rule.header;
        let mut v = RuleView {
            family: h.family,
            action: h.action,
            table: u32::from(h.table),
            priority: 0, // the kernel omits FRA_PRIORITY for priority 0
            fwmark: None,
            fwmask: None,
            extra_selectors: h.src_len != 0 || h.dst_len != 0 || h.tos != 0 || h.flags.contains(RuleFlags::Invert),
        };
        for attr in &rule.attributes {
            match attr {
                RuleAttribute::Table(t) => v.table = *t,
                RuleAttribute::Priority(p) => v.priority = *p,
                RuleAttribute::FwMark(m) => v.fwmark = Some(*m),
                RuleAttribute::FwMask(m) => v.fwmask = Some(*m),
                // The kernel reports "unset" for these as u32::MAX.
                RuleAttribute::SuppressPrefixLen(x) | RuleAttribute::SuppressIfGroup(x) => {
                    v.extra_selectors |= *x != u32::MAX
                }
                RuleAttribute::Destination(_)
                | RuleAttribute::Source(_)
                | RuleAttribute::Iifname(_)
                | RuleAttribute::Oifname(_)
                | RuleAttribute::UidRange(_)
                | RuleAttribute::IpProtocol(_)
                | RuleAttribute::SourcePortRange(_)
                | RuleAttribute::DestinationPortRange(_)
                | RuleAttribute::TunId(_) => v.extra_selectors = true,
                _ => {}
            }
        }
        v
    }

    fn describe(&self) -> String {
        let mark = match (self.fwmark, self.fwmask) {
            (Some(m), Some(k)) if k != u32::MAX => format!(" fwmark {m:#x}/{k:#x}"),
            (Some(m), _) => format!(" fwmark {m:#x}"),
            _ => String::new(),
        };
        let extra = if self.extra_selectors { " (with other selectors)" } else { "" };
        let action = match self.action {
            RuleAction::ToTable => format!("lookup {}", self.table),
            other => format!("{other:?}").to_lowercase(),
        };
        format!("{}:{mark} {action}{extra}", self.priority)
    }
}

fn header_table(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

fn route_table(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

fn route_oif(route: &RouteMessage) -> Option<u32> {
    route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    })
}

fn is_our_route(route: &RouteMessage) -> bool {
    let h = &route.header;
    h.kind == RouteType::Local
        && h.destination_prefix_length == 0
        && h.source_prefix_length == 0
        && h.tos == 0
        && route_oif(route) == Some(LOOPBACK_IFINDEX)
        && !route.attributes.iter().any(|a| matches!(a, RouteAttribute::Gateway(_) | RouteAttribute::MultiPath(_)))
}

fn describe_route(route: &RouteMessage) -> String {
    let h = &route.header;
    let addr = |a: &RouteAddress| match a {
        RouteAddress::Inet(a) => Some(std::net::IpAddr::from(*a)),
        RouteAddress::Inet6(a) => Some(std::net::IpAddr::from(*a)),
        _ => None,
    };
    let dst = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(d) => addr(d),
        _ => None,
    });
    let via = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(g) => addr(g).map(|g| format!(" via {g}")),
        _ => None,
    });
    let oif = route_oif(route).map_or(String::new(), |i| format!(" dev ifindex {i}"));
    let unspecified = if h.address_family == AddressFamily::Inet6 { "::" } else { "0.0.0.0" };
    let dst = dst.map_or_else(|| unspecified.to_string(), |d| d.to_string());
    let kind = format!("{:?}", h.kind).to_lowercase();
    format!("{kind} {dst}/{}{}{oif}", h.destination_prefix_length, via.unwrap_or_default())
}

/// `fwmark <mark> lookup <table> priority <priority>`, for both RTM_NEWRULE and RTM_DELRULE.
/// No FRA_FWMASK: the kernel defaults the mask to 0xffffffff for a non-zero mark.
fn rule_message(pr: &PolicyRoute) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = address_family(pr.family);
    msg.header.action = RuleAction::ToTable;
    msg.header.table = header_table(pr.table);
    msg.attributes =
        vec![RuleAttribute::FwMark(pr.fwmark), RuleAttribute::Table(pr.table), RuleAttribute::Priority(pr.priority)];
    msg
}

/// `local 0.0.0.0/0 dev lo table <table>` (`::/0` for IPv6). No RTA_DST: a /0 needs none.
/// For deletion, scope "nowhere" and protocol unspec are the kernel's wildcards (iproute2
/// does the same), so the route goes whoever set its protocol.
fn route_message(pr: &PolicyRoute, for_delete: bool) -> RouteMessage {
    let mut msg = RouteMessage::default();
    let h = &mut msg.header;
    h.address_family = address_family(pr.family);
    h.table = header_table(pr.table);
    h.kind = RouteType::Local;
    (h.scope, h.protocol) = if for_delete {
        (RouteScope::NoWhere, RouteProtocol::Unspec)
    } else {
        (RouteScope::Host, RouteProtocol::Static)
    };
    msg.attributes = vec![RouteAttribute::Table(pr.table), RouteAttribute::Oif(LOOPBACK_IFINDEX)];
    msg
}

fn rule_dump_message(family: Family) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = address_family(family);
    msg
}

fn route_dump_message(family: Family) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = address_family(family);
    msg
}

/// Sets `lo` up in the current netns, as every runtime does in a pod's before the network
/// plugins run (IPv6 refuses a route through a device that is down: `ENETDOWN`). For a
/// netns of our own making (doctor's private probe), never for a pod's.
pub fn loopback_up() -> Result<()> {
    let mut link = LinkHeader::default();
    link.index = LOOPBACK_IFINDEX;
    link.flags = LinkFlags::Up;
    link.change_mask = LinkFlags::Up;
    open()?.transact(Rtnl::SetLink(link), 0).map_err(|e| route_err("set lo up", e))
}

fn route_err(op: &'static str, source: io::Error) -> Error {
    Error::Route { op, source }
}

/// Ok(true) on success, Ok(false) when the kernel said `benign` (already there / not there).
fn absent_ok(res: io::Result<()>, benign: i32, op: &'static str) -> Result<bool> {
    match res {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(benign) => Ok(false),
        Err(e) => Err(route_err(op, e)),
    }
}

/// An rtnetlink socket in the calling thread's netns: one serves every rule and route of a
/// change (a socket costs the kernel more to make and free than a request on it).
pub(crate) fn open() -> Result<Socket> {
    Socket::open(NETLINK_ROUTE).map_err(|e| route_err("open an rtnetlink socket", e))
}

/// Runs a dump (read again if interrupted by a concurrent change).
fn dump(sock: &mut Socket, payload: Rtnl, op: &'static str) -> Result<Vec<Rtnl>> {
    sock.dump(payload).map_err(|e| route_err(op, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const PR: PolicyRoute = PolicyRoute { family: Family::Ipv4, fwmark: 0xae71, table: 44657, priority: 32000 };
    const PR6: PolicyRoute = PolicyRoute { family: Family::Ipv6, ..PR };

    #[test]
    fn rule_and_route_messages_carry_the_right_attributes() {
        let rule = rule_message(&PR);
        assert_eq!(rule.header.family, AddressFamily::Inet);
        assert_eq!(rule.header.action, RuleAction::ToTable);
        assert_eq!(rule.header.table, 0, "table > 255 goes in FRA_TABLE only");
        for a in [RuleAttribute::FwMark(0xae71), RuleAttribute::Table(44657), RuleAttribute::Priority(32000)] {
            assert!(rule.attributes.contains(&a), "missing {a:?}");
        }
        let v = RuleView::of(&rule);
        assert!(PR.is_our_rule(&v), "our own message must read back as our rule");

        let route = route_message(&PR, false);
        let h = &route.header;
        assert_eq!(h.address_family, AddressFamily::Inet);
        assert_eq!((h.kind, h.scope, h.protocol), (RouteType::Local, RouteScope::Host, RouteProtocol::Static));
        assert_eq!((h.table, h.destination_prefix_length), (0, 0));
        assert!(route.attributes.contains(&RouteAttribute::Table(44657)));
        assert!(route.attributes.contains(&RouteAttribute::Oif(1)));
        assert!(is_our_route(&route) && route_table(&route) == 44657);

        let small = PolicyRoute { table: 100, ..PR };
        assert_eq!(rule_message(&small).header.table, 100);
        assert_eq!(route_message(&small, false).header.table, 100);

        // The wire form round-trips and carries the ACK/EXCL flags.
        use netlink_packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
        let payload = Rtnl::NewRule(rule);
        let bytes = crate::netlink::encode(payload.clone(), NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, 1);
        let back = NetlinkMessage::<Rtnl>::deserialize(&bytes).unwrap();
        assert_eq!(back.payload, NetlinkPayload::InnerMessage(payload));
        assert_eq!(back.header.flags, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL);
        assert_eq!(back.header.message_type, 32, "RTM_NEWRULE");
        let route = Rtnl::NewRoute(route_message(&PR, false));
        let bytes = crate::netlink::encode(route.clone(), NLM_F_ACK, 2);
        assert_eq!(NetlinkMessage::<Rtnl>::deserialize(&bytes).unwrap().payload, NetlinkPayload::InnerMessage(route));
        // Only rules and routes are read: a link message (lo set up, RTM_SETLINK) is not.
        let mut lo = LinkHeader::default();
        lo.index = LOOPBACK_IFINDEX;
        let bytes = crate::netlink::encode(Rtnl::SetLink(lo), 0, 3);
        assert_eq!(bytes.len(), 16 + 16, "a netlink header and a bare ifinfomsg");
        assert!(NetlinkMessage::<Rtnl>::deserialize(&bytes).is_err());
    }

    #[test]
    fn ipv6_messages_are_the_same_rule_and_route_in_family_inet6() {
        let rule = rule_message(&PR6);
        assert_eq!(rule.header.family, AddressFamily::Inet6);
        assert_eq!(rule.attributes, rule_message(&PR).attributes, "same mark, table, priority");
        assert!(PR6.is_our_rule(&RuleView::of(&rule)));
        let route = route_message(&PR6, false);
        assert_eq!(route.header.address_family, AddressFamily::Inet6);
        assert_eq!(route.header.kind, RouteType::Local);
        assert_eq!(route.attributes, route_message(&PR, false).attributes);
        assert!(is_our_route(&route));
        assert_eq!(route_dump_message(Family::Ipv6).header.address_family, AddressFamily::Inet6);
        assert_eq!(rule_dump_message(Family::Ipv6).header.family, AddressFamily::Inet6);
        assert_eq!(PR6.describe_route(), "local ::/0 dev lo table 44657");
        assert_eq!(describe_route(&route), "local ::/0 dev ifindex 1");
    }

    fn ip(args: &[&str]) -> String {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Deletes the test netns however the test ends.
    struct NetnsGuard(String);
    impl Drop for NetnsGuard {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    /// Runs `f` on a fresh thread that has entered the named netns (setns is per-thread).
    fn in_netns<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{name}");
        let handle = std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let ns = std::fs::File::open(&path).expect("open netns");
            // SAFETY: plain syscall on a valid fd; only this thread moves.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", io::Error::last_os_error());
            f()
        });
        handle.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    #[test]
    fn programs_reads_back_and_removes_policy_routing_as_root() {
        if unsafe { libc::geteuid() } != 0 {
            if std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref() == Ok("1") {
                panic!("AETHER_REQUIRE_ROOT_TESTS=1 but not running as root");
            }
            {
                // Straight to stderr: libtest captures eprintln!, and a skip must be seen.
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED (needs root): programs_reads_back_and_removes_policy_routing_as_root"
                );
            }
            return;
        }
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!("aether-rt-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
        ip(&["netns", "add", &name]);
        let _guard = NetnsGuard(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"]);

        let state = in_netns(&name, || {
            assert!(PR.add_rule().unwrap(), "rule created");
            assert!(PR.add_route().unwrap(), "route created");
            assert!(!PR.add_rule().unwrap(), "rule already there");
            assert!(!PR.add_route().unwrap(), "route already there");
            PR.read_state().unwrap()
        });
        assert!(state.rule_present && state.route_present, "{state:?}");
        assert!(state.notes.is_empty(), "{state:?}");

        let rules = ip(&["netns", "exec", &name, "ip", "rule"]);
        assert!(rules.contains("32000:") && rules.contains("fwmark 0xae71 lookup 44657"), "{rules}");
        let routes = ip(&["netns", "exec", &name, "ip", "-4", "route", "show", "table", "44657"]);
        assert!(routes.contains("local default dev lo"), "{routes}");

        let (state, near) = in_netns(&name, || {
            assert!(PR.del_rule().unwrap(), "rule deleted");
            assert!(PR.del_route().unwrap(), "route deleted");
            assert!(!PR.del_rule().unwrap(), "rule already gone");
            assert!(!PR.del_route().unwrap(), "route already gone");
            let state = PR.read_state().unwrap();
            // A near-miss is reported: our mark at another priority.
            let other = PolicyRoute { priority: 100, ..PR };
            other.add_rule().unwrap();
            let near = PR.read_state().unwrap();
            other.del_rule().unwrap();
            (state, near)
        });
        assert_eq!(state, PolicyRouteState::default());
        assert!(!near.rule_present, "{near:?}");
        assert!(
            near.notes.iter().any(|n| n.contains("fwmark 0xae71 exists at priority 100 instead of 32000")),
            "{near:?}"
        );

        // IPv6: the same rule and route in family inet6, independent of the IPv4 pair.
        let (v4, v6) = in_netns(&name, || {
            assert!(PR.add_rule().unwrap() && PR.add_route().unwrap());
            assert!(PR6.add_rule().unwrap(), "IPv6 rule created next to the IPv4 one");
            assert!(PR6.add_route().unwrap(), "IPv6 route created");
            assert!(!PR6.add_rule().unwrap() && !PR6.add_route().unwrap(), "IPv6 pair already there");
            (PR.read_state().unwrap(), PR6.read_state().unwrap())
        });
        assert!(v4.rule_present && v4.route_present && v4.notes.is_empty(), "{v4:?}");
        assert!(v6.rule_present && v6.route_present && v6.notes.is_empty(), "{v6:?}");
        let rules6 = ip(&["netns", "exec", &name, "ip", "-6", "rule"]);
        assert!(rules6.contains("32000:") && rules6.contains("fwmark 0xae71 lookup 44657"), "{rules6}");
        let routes6 = ip(&["netns", "exec", &name, "ip", "-6", "route", "show", "table", "44657"]);
        assert!(routes6.contains("local default dev lo"), "{routes6}");
        let (v4, v6) = in_netns(&name, || {
            assert!(PR.del_rule().unwrap() && PR.del_route().unwrap());
            (PR.read_state().unwrap(), PR6.read_state().unwrap())
        });
        assert!(!v4.rule_present && !v4.route_present, "IPv4 pair gone: {v4:?}");
        assert!(v6.rule_present && v6.route_present, "deleting the IPv4 pair leaves the IPv6 one: {v6:?}");
        let never = PolicyRoute { table: 4242, ..PR6 };
        let (rule, route) = in_netns(&name, move || (never.del_rule().unwrap(), never.del_route().unwrap()));
        assert!(!rule && !route, "an IPv6 table that never existed has nothing to delete");
        let v6 = in_netns(&name, || {
            assert!(PR6.del_rule().unwrap() && PR6.del_route().unwrap());
            assert!(!PR6.del_rule().unwrap() && !PR6.del_route().unwrap(), "IPv6 pair already gone");
            PR6.read_state().unwrap()
        });
        assert_eq!(v6, PolicyRouteState::default());

        // Someone else's default route in our table: EEXIST must not pass for "ours exists".
        ip(&["netns", "exec", &name, "ip", "route", "add", "unreachable", "default", "table", "44657"]);
        let (added, state) = in_netns(&name, || (PR.add_route(), PR.read_state().unwrap()));
        assert!(
            matches!(&added, Err(Error::Route { op: "add route", source }) if source.raw_os_error() == Some(libc::EEXIST)),
            "{added:?}"
        );
        assert!(!state.route_present, "{state:?}");
        assert!(
            state.notes.iter().any(|n| n.contains("table 44657 holds route") && n.contains("instead of")),
            "{state:?}"
        );
    }

    /// With `lo` down (a netns nobody prepared), IPv6 refuses the divert route and the error
    /// says why; `loopback_up` is what makes it work (IPv4 does not mind).
    #[test]
    fn an_ipv6_route_through_a_down_lo_is_refused_by_name_and_loopback_up_mends_it() {
        if unsafe { libc::geteuid() } != 0 {
            assert_ne!(std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref(), Ok("1"), "not root");
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "SKIPPED (needs root): an_ipv6_route_through_a_down_lo_...");
            return;
        }
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!("aether-lo-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
        ip(&["netns", "add", &name]);
        let _guard = NetnsGuard(name.clone());
        let (refused, v4, added) = in_netns(&name, || {
            let refused = PR6.add_route().unwrap_err().to_string();
            let v4 = PR.add_route().unwrap();
            loopback_up().unwrap();
            (refused, v4, PR6.add_route().unwrap())
        });
        assert!(refused.contains("lo is down in this netns") && refused.contains("Network is down"), "{refused}");
        assert!(v4, "IPv4 takes the route through a down lo");
        assert!(added, "with lo up, the IPv6 route is created");
    }
}
