//! The Service-range and refusal-counter layer (docs/design.md "The Service-range and
//! refusal-counter layer"): its own table in each managed pod netns, built from a
//! `ServiceLayer` (the node snapshot, validated by the caller).
//!
//! Shape, after kube-proxy's nftables mode: a fixed, small number of rules, each one set
//! lookup (hash or interval), so the first-packet cost does not grow with the Service count;
//! a Service change is a change of set elements only.
//!
//! Which traffic is classified: exactly what the capture table diverts. The base chain sits
//! on the output hook right after capture's `egress_divert` route chain (priority -150) and
//! matches capture's divert mark, so the layer never has to repeat (and drift from) the
//! capture exclusions: excluded networks and ports, port 53, the proxy's passthrough
//! traffic, UDP other than the L4 mesh port, all left unmarked by capture, are neither
//! counted nor refused. A refusal in this chain drops the packet in OUTPUT, so it never
//! reaches `lo` and the capture listener.
//!
//! Families: one table per family the snapshot has Service ranges in (`table ip` and/or
//! `table ip6`, same name, same chains and rules, as kube-proxy's nftables mode runs one
//! proxier per family), each holding that family's ranges, VIPs and ports; capture's
//! tables divert each family's traffic with the same mark. All of a layer's tables are
//! created, replaced or changed in one transaction; counters are read as the sum of both.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::error::{Error, Result};
use crate::family::Family;
use crate::model::*;
use crate::nft;

pub const TABLE: &str = "aether_services";

mod change;
pub use change::LayerChange;
pub const CHAIN_EGRESS: &str = "egress_classify";
pub const CHAIN_CLASSIFY: &str = "classify";
pub const CHAIN_REFUSE: &str = "refuse";
/// After capture's `egress_divert` (route, -150), before its DNS DNAT (nat, -100).
pub const EGRESS_PRIORITY: i32 = -140;

pub const SET_RANGES: &str = "service_ranges";
pub const SET_MESH_VIPS: &str = "mesh_vips";
pub const SET_SERVICE_PORTS: &str = "service_ports";
pub const SET_EMPTY: &str = "empty_services";
pub const SET_VIPS: &str = "service_vips";
pub const SET_NEVER_REFUSED: &str = "never_refused";
pub const SET_DIALLED: &str = "dialled";
/// The protocols refused: TCP and UDP in `refuse` mode, none in `count` mode. The mode is
/// data, not structure, so switching it is an element update that keeps every counter.
pub const SET_REFUSING: &str = "refusing";
/// Demand entries expire after this long without a new connection.
pub const DEFAULT_DIALLED_TIMEOUT_SECS: u32 = 3600;

/// The counters, in the order they are printed.
pub const COUNTERS: [&str; 6] =
    ["mesh", "service", "external", "refused_no_endpoints", "refused_port_not_declared", "refused_no_service"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerMode {
    /// No layer: the table is absent.
    #[default]
    Off,
    /// Classify and count; nothing changes on the path.
    Count,
    /// Count, and refuse what no Service can serve.
    Refuse,
}

/// The snapshot's own spelling (`off`, `count`, `refuse`), for people and logs.
impl std::fmt::Display for LayerMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LayerMode::Off => "off",
            LayerMode::Count => "count",
            LayerMode::Refuse => "refuse",
        })
    }
}

/// One port of one Service, as the layer needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    /// The ClusterIP, of either family.
    pub vip: IpAddr,
    pub proto: Proto,
    pub port: u16,
    /// Has at least one usable endpoint.
    pub has_endpoints: bool,
}

/// Where `vip`'s ports are in `ports`, sorted (a port sorts by its VIP first, so one VIP's
/// ports are together): found by two binary searches; empty where it has none.
pub fn ports_of(ports: &[ServicePort], vip: IpAddr) -> std::ops::Range<usize> {
    let start = ports.partition_point(|p| p.vip < vip);
    start..start + ports[start..].partition_point(|p| p.vip == vip)
}

/// The node snapshot as the layer needs it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceLayer {
    pub mode: LayerMode,
    /// ServiceCIDRs and ClusterSetIP /32s (/128s), of either family.
    pub ranges: Vec<IpNet>,
    pub mesh_vips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    pub dialled_timeout_secs: u32,
    /// Capture's divert mark: what the layer classifies.
    pub divert_mark: u32,
}

impl ServiceLayer {
    pub fn new(mode: LayerMode) -> Self {
        ServiceLayer {
            mode,
            dialled_timeout_secs: DEFAULT_DIALLED_TIMEOUT_SECS,
            divert_mark: crate::capture::DIVERT_MARK,
            ..Default::default()
        }
    }

    /// The families the layer has Service ranges in, IPv4 first: a table each.
    pub fn families(&self) -> Vec<Family> {
        Family::ALL.into_iter().filter(|f| self.ranges.iter().any(|r| Family::of(r.addr()) == *f)).collect()
    }

    /// The first address of each range: the API server Service of a ServiceCIDR, never
    /// refused (clients reach it before any agent exists). A /32 (/128) ClusterSetIP, or a
    /// /31 (/127), is its own first address.
    pub fn never_refused(&self) -> BTreeSet<IpAddr> {
        self.ranges
            .iter()
            .map(|n| match n.trunc() {
                IpNet::V4(n) if n.prefix_len() >= 31 => n.network().into(),
                IpNet::V4(n) => IpAddr::from(std::net::Ipv4Addr::from(u32::from(n.network()) + 1)),
                IpNet::V6(n) if n.prefix_len() >= 127 => n.network().into(),
                IpNet::V6(n) => IpAddr::from(std::net::Ipv6Addr::from(u128::from(n.network()) + 1)),
            })
            .collect()
    }
}

/// One address as a set element of its family.
fn addr_element(a: IpAddr) -> Element {
    match a {
        IpAddr::V4(a) => Element::Addr(a),
        IpAddr::V6(a) => Element::Addr6(a),
    }
}

/// One Service port (`VIP . proto . port`) as a set element of its VIP's family.
fn service_element((vip, proto, port): (IpAddr, Proto, u16)) -> Element {
    match vip {
        IpAddr::V4(a) => Element::Service(a, proto, port),
        IpAddr::V6(a) => Element::Service6(a, proto, port),
    }
}

/// The ranges of `family`, merged where they touch, as interval set elements.
fn range_elements(ranges: &[IpNet], family: Family) -> Vec<Element> {
    let nets = ranges.iter().map(IpNet::trunc);
    let mut elements: Vec<Element> = match family {
        Family::Ipv4 => {
            let v4: Vec<Ipv4Net> = nets.filter_map(|n| if let IpNet::V4(n) = n { Some(n) } else { None }).collect();
            Ipv4Net::aggregate(&v4).into_iter().map(Element::Net).collect()
        }
        Family::Ipv6 => {
            let v6: Vec<Ipv6Net> = nets.filter_map(|n| if let IpNet::V6(n) = n { Some(n) } else { None }).collect();
            Ipv6Net::aggregate(&v6).into_iter().map(Element::Net6).collect()
        }
    };
    elements.sort();
    elements
}

/// The layer's tables, one per family it has Service ranges in (IPv4 first); none in mode
/// `off`.
pub fn services_tables(layer: &ServiceLayer) -> Result<Vec<Table>> {
    if layer.mode == LayerMode::Off {
        return Ok(Vec::new());
    }
    if layer.divert_mark == 0 {
        return Err(Error::InvalidConfig("the Service layer needs capture's (non-zero) divert mark".into()));
    }
    if layer.dialled_timeout_secs == 0 {
        return Err(Error::InvalidConfig("the dialled set's timeout must be at least 1 second".into()));
    }
    Ok(layer.families().into_iter().map(|f| family_table(layer, f)).collect())
}

/// The layer's table of `family`: the same sets, chains and rules in each family, holding
/// that family's ranges, VIPs and ports.
fn family_table(layer: &ServiceLayer, family: Family) -> Table {
    let set = |name: &str, key: KeyType, interval: bool, elements: Vec<Element>, comment: &str| Set {
        name: name.into(),
        key,
        interval,
        elements,
        comment: comment.into(),
        timeout_secs: None,
    };
    let ours = |a: &IpAddr| Family::of(*a) == family;
    let addrs = |set: BTreeSet<IpAddr>| set.into_iter().filter(ours).map(addr_element).collect::<Vec<_>>();
    let ports = |with_endpoints: bool| {
        let keys: BTreeSet<(IpAddr, Proto, u16)> = layer
            .ports
            .iter()
            .filter(|p| p.has_endpoints == with_endpoints && ours(&p.vip))
            .map(|p| (p.vip, p.proto, p.port))
            .collect();
        keys.into_iter().map(service_element).collect::<Vec<_>>()
    };
    let (addr_key, service_key) = (KeyType::addr(family), KeyType::service(family));
    let mut dialled =
        set(SET_DIALLED, service_key, false, Vec::new(), "VIP . proto . port dialled in the Service ranges (demand)");
    dialled.timeout_secs = Some(layer.dialled_timeout_secs);
    let sets = vec![
        set(SET_RANGES, addr_key, true, range_elements(&layer.ranges, family), "ServiceCIDRs and ClusterSetIPs"),
        set(SET_MESH_VIPS, addr_key, false, addrs(layer.mesh_vips.iter().copied().collect()), "VIPs of mesh Services"),
        set(SET_SERVICE_PORTS, service_key, false, ports(true), "the Service index: ports of Services with endpoints"),
        set(SET_EMPTY, service_key, false, ports(false), "ports of Services without a usable endpoint"),
        set(SET_VIPS, addr_key, false, addrs(layer.ports.iter().map(|p| p.vip).collect()), "every Service VIP"),
        set(
            SET_NEVER_REFUSED,
            addr_key,
            false,
            addrs(layer.never_refused()),
            "first address of each range: the API server Service",
        ),
        dialled,
        set(
            SET_REFUSING,
            KeyType::InetProto,
            false,
            match layer.mode {
                LayerMode::Refuse => vec![Element::Proto(Proto::Tcp), Element::Proto(Proto::Udp)],
                _ => Vec::new(),
            },
            "protocols refused: tcp and udp in refuse mode, none in count mode",
        ),
    ];

    let rule = |matches: Vec<Match>, action: Action, comment: &str| Rule { matches, action, comment: comment.into() };
    let refusal = |counter: &str| Action::CountJump(counter.into(), CHAIN_REFUSE.into());
    let egress = vec![rule(
        vec![Match::Mark(layer.divert_mark), Match::CtStateNew, Match::CtUnconfirmed],
        Action::Jump(CHAIN_CLASSIFY.into()),
        "classify the first packet of each connection capture diverts (nothing it excludes), once",
    )];
    let classify = vec![
        rule(vec![Match::Dport(Proto::Udp, 53)], Action::Accept, "DNS goes to the node DNS proxy: never classified"),
        rule(vec![Match::Dport(Proto::Tcp, 53)], Action::Accept, "DNS goes to the node DNS proxy: never classified"),
        rule(
            vec![Match::DaddrInSet(SET_MESH_VIPS.into())],
            Action::CountAccept("mesh".into()),
            "mesh: the proxy owns it",
        ),
        rule(
            vec![Match::DaddrNotInSet(SET_RANGES.into())],
            Action::CountAccept("external".into()),
            "external: outside every Service range",
        ),
        rule(
            vec![],
            Action::UpdateServiceKeySet(SET_DIALLED.into()),
            "demand: remember what was dialled in the Service ranges",
        ),
        rule(
            vec![Match::ServiceKeyInSet(SET_SERVICE_PORTS.into())],
            Action::CountAccept("service".into()),
            "a known Service port with endpoints",
        ),
        rule(
            vec![Match::DaddrInSet(SET_NEVER_REFUSED.into())],
            Action::CountAccept("service".into()),
            "the API server Service is never refused, whatever the snapshot says",
        ),
        rule(
            vec![Match::ServiceKeyInSet(SET_EMPTY.into())],
            refusal("refused_no_endpoints"),
            "a Service port without a usable endpoint",
        ),
        rule(
            vec![Match::DaddrInSet(SET_VIPS.into())],
            refusal("refused_port_not_declared"),
            "a Service VIP, on a port the Service does not declare",
        ),
        rule(vec![], refusal("refused_no_service"), "in a Service range, and no Service owns the address"),
    ];
    let chains = vec![
        Chain {
            name: CHAIN_EGRESS.into(),
            hook: Some(BaseHook { kind: ChainKind::Filter, hook: Hook::Output, priority: EGRESS_PRIORITY }),
            rules: egress,
        },
        Chain { name: CHAIN_CLASSIFY.into(), hook: None, rules: classify },
        Chain {
            name: CHAIN_REFUSE.into(),
            hook: None,
            rules: vec![
                rule(
                    vec![Match::L4ProtoNotInSet(SET_REFUSING.into())],
                    Action::Accept,
                    "count mode: counted as it would be refused, and passes",
                ),
                rule(
                    vec![Match::L4Proto(Proto::Tcp)],
                    Action::RejectTcpReset,
                    "refused: the client sees a connection reset",
                ),
                rule(vec![], Action::RejectIcmpPortUnreachable, "refused: the client sees port unreachable"),
            ],
        },
    ];
    Table { family, name: TABLE.into(), sets, counters: COUNTERS.iter().map(|c| c.to_string()).collect(), chains }
}

/// What `apply` did in the current netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The tables were created (or rebuilt because their structure changed), counters kept.
    Rebuilt,
    /// Only set elements changed: how many were added and removed.
    Elements { added: usize, removed: usize },
    /// Nothing differed.
    Unchanged,
    /// Mode `off`: the tables were removed (`true`) or already absent.
    Removed(bool),
}

/// Makes the current netns hold the layer for `layer`. When the kernel's tables have the
/// same structure (sets, chains, rules, counters) and only set elements differ, only the
/// changed elements are sent, in one transaction. Otherwise the tables are replaced in one
/// transaction, their counters starting from the values read just before (a connection
/// counted between that read and the replace is lost; structure changes are mode changes).
pub fn apply(layer: &ServiceLayer) -> Result<Applied> {
    let tables = services_tables(layer)?;
    if tables.is_empty() {
        return remove().map(Applied::Removed);
    }
    let mut changes = Vec::new();
    for family in Family::ALL {
        let expected = tables.iter().find(|t| t.family == family);
        match (expected, nft::kernel_view(family, TABLE)?) {
            (None, None) => {}
            (Some(t), Some(actual)) => match element_diff(&nft::expected_view(t), &actual) {
                Some(c) if c.is_empty() => {}
                Some(c) => changes.push((family, c)),
                None => return rebuild_tables(&tables, None),
            },
            // A family's table missing, or one the layer no longer has.
            _ => return rebuild_tables(&tables, None),
        }
    }
    if changes.is_empty() {
        return Ok(Applied::Unchanged);
    }
    let added = changes.iter().flat_map(|(_, c)| c).map(|c| c.add.len()).sum();
    let removed = changes.iter().flat_map(|(_, c)| c).map(|c| c.delete.len()).sum();
    nft::change_elements(TABLE, &changes)?;
    Ok(Applied::Elements { added, removed })
}

/// Makes the current netns hold the layer for `layer` without reading its sets back: the
/// tables are created, or replaced with their counters carried over (one read of the counter
/// objects only). What ADD does, and what an apply does to a pod whose generation it cannot
/// vouch for.
pub fn rebuild(layer: &ServiceLayer) -> Result<Applied> {
    match Prepared::new(layer)? {
        Some(p) => p.rebuild(),
        None => remove().map(Applied::Removed),
    }
}

/// Replaces whatever layer the current netns holds with `tables` (not empty), in one
/// transaction, counters carried over: each family's from its own table, and a table of a
/// family the layer no longer has deleted with its counts added to the first new table's,
/// so the pod's totals never go backwards. With no layer there yet, `create` (the tables'
/// creation, encoded once) is sent if given.
fn rebuild_tables(tables: &[Table], create: Option<&nft::Encoded>) -> Result<Applied> {
    // A layer table always has counters: none means no table (one small dump per family).
    let mut held = BTreeMap::new();
    for family in Family::ALL {
        let counts = nft::counters(family, TABLE)?;
        if !counts.is_empty() {
            held.insert(family, counts);
        }
    }
    if held.is_empty() {
        if let Some(create) = create {
            match create.send() {
                Ok(()) => return Ok(Applied::Rebuilt),
                // Created since the look (the create is exclusive): replaced below.
                Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let mut start: BTreeMap<Family, nft::Counts> = BTreeMap::new();
    let mut retired = Vec::new();
    for (family, counts) in held {
        let into = if tables.iter().any(|t| t.family == family) {
            family
        } else {
            retired.push((family, TABLE));
            tables[0].family
        };
        let sum = start.entry(into).or_default();
        for (name, (packets, bytes)) in counts {
            let c = sum.entry(name).or_default();
            *c = (c.0 + packets, c.1 + bytes);
        }
    }
    let refs: Vec<&Table> = tables.iter().collect();
    nft::program_tables_keeping(&refs, &start, &retired)?;
    Ok(Applied::Rebuilt)
}

/// A layer made ready for many pod netns: the transaction that creates its tables encoded
/// once, so an apply that rebuilds many pods pays the encoding once, and each pod without the
/// layer costs what the kernel takes to create it.
pub struct Prepared {
    tables: Vec<Table>,
    create: nft::Encoded,
}

impl Prepared {
    /// `None` in mode `off` (no layer).
    pub fn new(layer: &ServiceLayer) -> Result<Option<Prepared>> {
        let tables = services_tables(layer)?;
        if tables.is_empty() {
            return Ok(None);
        }
        let create = nft::encode_tables(&tables.iter().collect::<Vec<_>>());
        Ok(Some(Prepared { tables, create }))
    }

    /// `rebuild` in the current netns: the encoded transaction where there is no layer yet,
    /// otherwise the tables replaced with their counters carried over.
    pub fn rebuild(&self) -> Result<Applied> {
        rebuild_tables(&self.tables, Some(&self.create))
    }
}

/// The element changes that turn `actual` into `expected`, or `None` when more than
/// elements differ (or an interval set changed: its elements are ranges, rebuilt whole).
fn element_diff(expected: &nft::read::TableView, actual: &nft::read::TableView) -> Option<Vec<nft::ElementChange>> {
    let strip = |v: &nft::read::TableView| {
        let mut v = v.clone();
        for s in &mut v.sets {
            s.elements.clear();
        }
        v.counters.values_mut().for_each(|c| *c = (0, 0));
        v
    };
    let structural = nft::read::diff(&strip(expected), &strip(actual));
    if !structural.is_empty() {
        return None;
    }
    let mut changes = Vec::new();
    for e in &expected.sets {
        if e.is_dynamic() {
            continue;
        }
        let a = actual.sets.iter().find(|a| a.name == e.name)?;
        if e.elements == a.elements {
            continue;
        }
        if e.is_interval() {
            return None;
        }
        changes.push(nft::ElementChange {
            set: e.name.clone(),
            delete: a.elements.difference(&e.elements).cloned().collect(),
            add: e.elements.difference(&a.elements).cloned().collect(),
        });
    }
    Some(changes)
}

/// Removes the layer (the tables of both families) from the current netns; `Ok(false)` when
/// it was absent.
pub fn remove() -> Result<bool> {
    let mut removed = false;
    for family in Family::ALL {
        removed |= nft::remove(family, TABLE)?;
    }
    Ok(removed)
}

/// Compares the kernel's layer with `layer`; an empty list means intact. Differences in the
/// IPv6 table are prefixed with its name.
pub fn verify(layer: &ServiceLayer) -> Result<Vec<String>> {
    let tables = services_tables(layer)?;
    let mut out = Vec::new();
    for family in Family::ALL {
        let name = format!("table {} {TABLE}", family.nft_name());
        match (tables.iter().find(|t| t.family == family), nft::kernel_view(family, TABLE)?) {
            (None, None) => {}
            (None, Some(_)) if tables.is_empty() => out.push(format!("{name} is present, but the mode is off")),
            (None, Some(_)) => out.push(format!("{name} is present, but the snapshot has no {family} Service range")),
            (Some(_), None) => out.push(format!("{name} is missing")),
            (Some(t), Some(actual)) => {
                let diffs = nft::read::diff(&nft::expected_view(t), &actual);
                out.extend(diffs.into_iter().map(|d| if family == Family::Ipv4 { d } else { format!("{name}: {d}") }));
            }
        }
    }
    Ok(out)
}

/// The per-class counters of the layer in the current netns, summed over its tables: name ->
/// connections. `None` when the netns has no layer.
pub fn counters() -> Result<Option<BTreeMap<String, u64>>> {
    let mut sum: Option<BTreeMap<String, u64>> = None;
    for family in Family::ALL {
        let c = nft::counters(family, TABLE)?;
        if c.is_empty() {
            continue;
        }
        let sum = sum.get_or_insert_with(|| COUNTERS.iter().map(|n| (n.to_string(), 0)).collect());
        // A connection is counted once, on its first packet: packets are connections.
        for n in COUNTERS {
            *sum.get_mut(n).expect("every counter") += c.get(n).map_or(0, |v| v.0);
        }
    }
    Ok(sum)
}

/// What the pod in the current netns dialled in the Service ranges (of both families) and
/// has not let expire.
pub fn demand() -> Result<Vec<(IpAddr, Proto, u16)>> {
    let mut out = Vec::new();
    for family in Family::ALL {
        for (key, _) in nft::set_elements(family, TABLE, SET_DIALLED)? {
            let Some((addr, proto, port)) = nft::key::parse_service_key(&key) else { continue };
            let proto = match proto {
                6 => Proto::Tcp,
                17 => Proto::Udp,
                _ => continue,
            };
            out.push((addr, proto, port));
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Table;

    fn layer() -> ServiceLayer {
        let mut l = ServiceLayer::new(LayerMode::Refuse);
        l.ranges = vec!["10.96.0.0/16".parse().unwrap(), "10.200.0.7/32".parse().unwrap()];
        l.mesh_vips = vec!["10.96.5.5".parse().unwrap()];
        l.ports = vec![
            ServicePort { vip: "10.96.1.1".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: true },
            ServicePort { vip: "10.96.1.2".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: false },
        ];
        l
    }

    /// The one table of a layer of one family.
    fn one_table(l: &ServiceLayer) -> Table {
        let mut t = services_tables(l).unwrap();
        assert_eq!(t.len(), 1);
        t.remove(0)
    }

    /// `layer()` plus IPv6 ranges, a mesh VIP and Service ports.
    fn dual() -> ServiceLayer {
        let mut l = layer();
        l.ranges.extend(["fd00:10:96::/108".parse::<IpNet>().unwrap(), "fd00:200::7/128".parse().unwrap()]);
        l.mesh_vips.push("fd00:10:96::5:5".parse().unwrap());
        l.ports.extend([
            ServicePort { vip: "fd00:10:96::1:1".parse().unwrap(), proto: Proto::Tcp, port: 80, has_endpoints: true },
            ServicePort { vip: "fd00:10:96::1:2".parse().unwrap(), proto: Proto::Udp, port: 53, has_endpoints: false },
        ]);
        l
    }

    #[test]
    fn off_has_no_table() {
        assert!(services_tables(&ServiceLayer::new(LayerMode::Off)).unwrap().is_empty());
    }

    #[test]
    fn first_addresses_are_never_refused() {
        let got: Vec<String> = layer().never_refused().iter().map(|a| a.to_string()).collect();
        assert_eq!(got, ["10.96.0.1", "10.200.0.7"]);
    }

    #[test]
    fn rule_count_does_not_grow_with_services() {
        let small = one_table(&layer());
        let mut big = layer();
        for i in 0..5000u32 {
            big.ports.push(ServicePort {
                vip: std::net::Ipv4Addr::from(0x0a60_0000 + i).into(),
                proto: Proto::Tcp,
                port: 443,
                has_endpoints: i % 7 != 0,
            });
        }
        let big = one_table(&big);
        let rules = |t: &Table| t.chains.iter().map(|c| c.rules.len()).sum::<usize>();
        assert_eq!(rules(&small), rules(&big));
        assert!(big.chains.iter().flat_map(|c| &c.rules).all(|r| !r.comment.is_empty()));
    }

    #[test]
    fn count_and_refuse_differ_only_in_the_refusing_set() {
        let mut l = layer();
        l.mode = LayerMode::Count;
        let count = one_table(&l);
        l.mode = LayerMode::Refuse;
        let refuse = one_table(&l);
        assert_eq!(count.chains, refuse.chains, "a mode change must not change rules (it would rebuild the table)");
        let refusing = |t: &Table| t.sets.iter().find(|s| s.name == SET_REFUSING).unwrap().elements.clone();
        assert_eq!(refusing(&count), vec![]);
        assert_eq!(refusing(&refuse), vec![Element::Proto(Proto::Tcp), Element::Proto(Proto::Udp)]);
        // In count mode the refuse chain lets everything pass first.
        let chain = count.chains.iter().find(|c| c.name == CHAIN_REFUSE).unwrap();
        assert_eq!(chain.rules[0].matches, vec![Match::L4ProtoNotInSet(SET_REFUSING.into())]);
        assert_eq!(chain.rules[0].action, Action::Accept);
    }

    /// An IPv4 snapshot gives one `ip` table; IPv6 ranges add an `ip6` table with the same
    /// chains and rules, holding only the IPv6 elements (and the IPv4 table only the IPv4 ones).
    #[test]
    fn each_family_with_ranges_gets_its_table_with_its_own_elements() {
        assert_eq!(layer().families(), [Family::Ipv4]);
        let v4_only = one_table(&layer());
        let tables = services_tables(&dual()).unwrap();
        assert_eq!(tables.iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ipv4, Family::Ipv6]);
        assert_eq!(tables[0], v4_only, "IPv6 ranges leave the IPv4 table as it was");
        let (v4, v6) = (&tables[0], &tables[1]);
        assert_eq!(v4.chains, v6.chains, "the same rules in both families");
        assert_eq!(v4.counters, v6.counters);
        let elements = |t: &Table, set: &str| {
            t.sets.iter().find(|s| s.name == set).unwrap().elements.iter().map(|e| e.to_string()).collect::<Vec<_>>()
        };
        assert_eq!(elements(v6, SET_RANGES), ["fd00:10:96::/108", "fd00:200::7/128"]);
        assert_eq!(elements(v6, SET_MESH_VIPS), ["fd00:10:96::5:5"]);
        assert_eq!(elements(v6, SET_SERVICE_PORTS), ["fd00:10:96::1:1 . tcp . 80"]);
        assert_eq!(elements(v6, SET_EMPTY), ["fd00:10:96::1:2 . udp . 53"]);
        assert_eq!(elements(v6, SET_VIPS), ["fd00:10:96::1:1", "fd00:10:96::1:2"]);
        assert_eq!(elements(v6, SET_NEVER_REFUSED), ["fd00:10:96::1", "fd00:200::7"]);
        assert_eq!(elements(v6, SET_REFUSING), ["tcp", "udp"]);
        let key = |t: &Table, set: &str| t.sets.iter().find(|s| s.name == set).unwrap().key;
        assert_eq!(key(v6, SET_SERVICE_PORTS), KeyType::ServiceKey6);
        assert_eq!(key(v6, SET_DIALLED), KeyType::ServiceKey6);
        assert_eq!(key(v6, SET_RANGES), KeyType::Ipv6Addr);
        // An IPv6-only snapshot: the ip6 table alone.
        let mut v6_only = dual();
        v6_only.ranges.retain(|r| matches!(r, IpNet::V6(_)));
        assert_eq!(services_tables(&v6_only).unwrap().iter().map(|t| t.family).collect::<Vec<_>>(), [Family::Ipv6]);
    }

    /// The never-refused first address, per family, in each family's own arithmetic.
    #[test]
    fn first_addresses_are_never_refused_in_both_families() {
        let got: Vec<String> = dual().never_refused().iter().map(|a| a.to_string()).collect();
        assert_eq!(got, ["10.96.0.1", "10.200.0.7", "fd00:10:96::1", "fd00:200::7"]);
    }

    /// A change of IPv6 ports is an element change of the ip6 table alone; a new family is a
    /// rebuild.
    #[test]
    fn a_change_stays_in_its_family() {
        let mut more = dual();
        more.ports.push(ServicePort {
            vip: "fd00:10:96::1:3".parse().unwrap(),
            proto: Proto::Tcp,
            port: 443,
            has_endpoints: true,
        });
        let change = LayerChange::between(&dual(), &more).unwrap().expect("an element change");
        assert_eq!((change.added(), change.removed()), (2, 0), "service_ports and service_vips");
        assert_eq!(change.changes.iter().map(|(f, _)| *f).collect::<Vec<_>>(), [Family::Ipv6]);
        assert!(LayerChange::between(&layer(), &dual()).unwrap().is_none(), "a new family rebuilds");
    }
}
