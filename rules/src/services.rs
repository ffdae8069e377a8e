//! The Service-range and refusal-counter layer (DESIGN.md "The Service-range and
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

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::error::{Error, Result};
use crate::family::Family;
use crate::model::*;
use crate::nft;

pub const TABLE: &str = "aether_services";
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
    pub vip: Ipv4Addr,
    pub proto: Proto,
    pub port: u16,
    /// Has at least one usable endpoint.
    pub has_endpoints: bool,
}

/// The node snapshot as the layer needs it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceLayer {
    pub mode: LayerMode,
    /// ServiceCIDRs and ClusterSetIP /32s.
    pub ranges: Vec<Ipv4Net>,
    pub mesh_vips: Vec<Ipv4Addr>,
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

    /// The first address of each range: the API server Service of a ServiceCIDR, never
    /// refused (clients reach it before any agent exists). A /32 ClusterSetIP is its own
    /// first address.
    pub fn never_refused(&self) -> BTreeSet<Ipv4Addr> {
        self.ranges
            .iter()
            .map(|n| {
                let n = n.trunc();
                if n.prefix_len() >= 31 {
                    n.network()
                } else {
                    Ipv4Addr::from(u32::from(n.network()) + 1)
                }
            })
            .collect()
    }
}

/// The table for `layer`, or `None` in mode `off`.
pub fn services_table(layer: &ServiceLayer) -> Result<Option<Table>> {
    if layer.mode == LayerMode::Off {
        return Ok(None);
    }
    if layer.divert_mark == 0 {
        return Err(Error::InvalidConfig("the Service layer needs capture's (non-zero) divert mark".into()));
    }
    if layer.dialled_timeout_secs == 0 {
        return Err(Error::InvalidConfig("the dialled set's timeout must be at least 1 second".into()));
    }
    let set = |name: &str, key: KeyType, interval: bool, elements: Vec<Element>, comment: &str| Set {
        name: name.into(),
        key,
        interval,
        elements,
        comment: comment.into(),
        timeout_secs: None,
    };
    let ranges: Vec<Ipv4Net> = {
        let mut r = Ipv4Net::aggregate(&layer.ranges.iter().map(|n| n.trunc()).collect::<Vec<_>>());
        r.sort();
        r
    };
    let mesh: BTreeSet<Ipv4Addr> = layer.mesh_vips.iter().copied().collect();
    let live: BTreeSet<(Ipv4Addr, Proto, u16)> =
        layer.ports.iter().filter(|p| p.has_endpoints).map(|p| (p.vip, p.proto, p.port)).collect();
    let empty: BTreeSet<(Ipv4Addr, Proto, u16)> =
        layer.ports.iter().filter(|p| !p.has_endpoints).map(|p| (p.vip, p.proto, p.port)).collect();
    let vips: BTreeSet<Ipv4Addr> = layer.ports.iter().map(|p| p.vip).collect();
    let svc =
        |s: &BTreeSet<(Ipv4Addr, Proto, u16)>| s.iter().map(|&(a, p, port)| Element::Service(a, p, port)).collect();
    let mut dialled = set(
        SET_DIALLED,
        KeyType::ServiceKey,
        false,
        Vec::new(),
        "VIP . proto . port dialled in the Service ranges (demand)",
    );
    dialled.timeout_secs = Some(layer.dialled_timeout_secs);
    let sets = vec![
        set(
            SET_RANGES,
            KeyType::Ipv4Addr,
            true,
            ranges.into_iter().map(Element::Net).collect(),
            "ServiceCIDRs and ClusterSetIPs",
        ),
        set(
            SET_MESH_VIPS,
            KeyType::Ipv4Addr,
            false,
            mesh.into_iter().map(Element::Addr).collect(),
            "VIPs of mesh Services",
        ),
        set(
            SET_SERVICE_PORTS,
            KeyType::ServiceKey,
            false,
            svc(&live),
            "the Service index: ports of Services with endpoints",
        ),
        set(SET_EMPTY, KeyType::ServiceKey, false, svc(&empty), "ports of Services without a usable endpoint"),
        set(SET_VIPS, KeyType::Ipv4Addr, false, vips.into_iter().map(Element::Addr).collect(), "every Service VIP"),
        set(
            SET_NEVER_REFUSED,
            KeyType::Ipv4Addr,
            false,
            layer.never_refused().into_iter().map(Element::Addr).collect(),
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
    let mut chains = vec![
        Chain {
            name: CHAIN_EGRESS.into(),
            hook: Some(BaseHook { kind: ChainKind::Filter, hook: Hook::Output, priority: EGRESS_PRIORITY }),
            rules: egress,
        },
        Chain { name: CHAIN_CLASSIFY.into(), hook: None, rules: classify },
    ];
    chains.push(Chain {
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
    });
    Ok(Some(Table {
        family: Family::Ipv4,
        name: TABLE.into(),
        sets,
        counters: COUNTERS.iter().map(|c| c.to_string()).collect(),
        chains,
    }))
}

/// What `apply` did in the current netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The table was created (or rebuilt because its structure changed), counters kept.
    Rebuilt,
    /// Only set elements changed: how many were added and removed.
    Elements { added: usize, removed: usize },
    /// Nothing differed.
    Unchanged,
    /// Mode `off`: the table was removed (`true`) or already absent.
    Removed(bool),
}

/// Makes the current netns hold the layer for `layer`. When the kernel's table has the same
/// structure (sets, chains, rules, counters) and only set elements differ, only the changed
/// elements are sent, in one transaction. Otherwise the table is replaced in one
/// transaction, its counters starting from the values read just before (a connection
/// counted between that read and the replace is lost; structure changes are mode changes).
pub fn apply(layer: &ServiceLayer) -> Result<Applied> {
    let Some(table) = services_table(layer)? else {
        return nft::remove(Family::Ipv4, TABLE).map(Applied::Removed);
    };
    let Some(actual) = nft::kernel_view(Family::Ipv4, TABLE)? else {
        nft::program(&table)?;
        return Ok(Applied::Rebuilt);
    };
    let expected = nft::expected_view(&table);
    match element_diff(&expected, &actual) {
        Some(changes) if changes.is_empty() => Ok(Applied::Unchanged),
        Some(changes) => {
            let added = changes.iter().map(|c| c.add.len()).sum();
            let removed = changes.iter().map(|c| c.delete.len()).sum();
            nft::change_elements(TABLE, &changes)?;
            Ok(Applied::Elements { added, removed })
        }
        None => {
            nft::program_keeping(&table, &actual.counters)?;
            Ok(Applied::Rebuilt)
        }
    }
}

/// Makes the current netns hold the layer for `layer` without reading its sets back: the
/// table is created, or replaced with its counters carried over (one read of the counter
/// objects only). What ADD does, and what an apply does to a pod whose generation it cannot
/// vouch for.
pub fn rebuild(layer: &ServiceLayer) -> Result<Applied> {
    match Prepared::new(layer)? {
        Some(p) => p.rebuild(),
        None => nft::remove(Family::Ipv4, TABLE).map(Applied::Removed),
    }
}

/// A layer made ready for many pod netns: the transaction that creates it encoded once, so
/// an apply that rebuilds many pods pays the encoding once, and each pod without the layer
/// costs what the kernel takes to create it.
pub struct Prepared {
    table: Table,
    create: nft::Encoded,
}

impl Prepared {
    /// `None` in mode `off` (no layer).
    pub fn new(layer: &ServiceLayer) -> Result<Option<Prepared>> {
        Ok(services_table(layer)?.map(|table| Prepared { create: nft::encode(&table), table }))
    }

    /// `rebuild` in the current netns: the encoded transaction where there is no layer yet,
    /// otherwise the table replaced with its counters carried over.
    pub fn rebuild(&self) -> Result<Applied> {
        // The layer always has counters: none means no table (one small dump tells).
        let counters = nft::counters(TABLE)?;
        if counters.is_empty() {
            match self.create.send() {
                Ok(()) => return Ok(Applied::Rebuilt),
                // Created since the look (the create is exclusive): replaced below.
                Err(Error::Transaction { source, .. }) if source.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(e),
            }
        }
        nft::program_keeping(&self.table, &counters)?;
        Ok(Applied::Rebuilt)
    }
}

/// The set elements that turn the layer for `old` into the layer for `new`, computed from the
/// models alone (no kernel involved), once per apply for every pod that holds `old`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerChange {
    changes: Vec<nft::ElementChange>,
}

impl LayerChange {
    /// The change between two layers, or `None` when more than the elements of hash sets
    /// differ (a new range, timeout or mark, a mode `off`): those pods are rebuilt.
    pub fn between(old: &ServiceLayer, new: &ServiceLayer) -> Result<Option<LayerChange>> {
        let (Some(old), Some(new)) = (services_table(old)?, services_table(new)?) else {
            return Ok(None);
        };
        let bare = |t: &Table| {
            let mut t = t.clone();
            t.sets.iter_mut().for_each(|s| s.elements.clear());
            t
        };
        if bare(&old) != bare(&new) {
            return Ok(None);
        }
        let mut changes = Vec::new();
        for (o, n) in old.sets.iter().zip(&new.sets) {
            if o.timeout_secs.is_some() || o.elements == n.elements {
                continue;
            }
            if o.interval {
                return Ok(None);
            }
            // Both sorted and without duplicates (built from ordered sets).
            let (delete, add) = sorted_difference(&o.elements, &n.elements);
            changes.push(nft::ElementChange {
                set: o.name.clone(),
                delete: nft::set_keys(o, &delete),
                add: nft::set_keys(n, &add),
            });
        }
        Ok(Some(LayerChange { changes }))
    }

    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    pub fn added(&self) -> usize {
        self.changes.iter().map(|c| c.add.len()).sum()
    }

    pub fn removed(&self) -> usize {
        self.changes.iter().map(|c| c.delete.len()).sum()
    }

    /// Sends the change to the layer in the current netns, in one transaction, without
    /// reading anything back. The kernel refuses all of it if the layer does not hold what
    /// the change starts from where it matters (the table or a deleted element missing): the
    /// caller then rebuilds.
    pub fn send(&self) -> Result<Applied> {
        if self.is_empty() {
            return Ok(Applied::Unchanged);
        }
        nft::change_elements(TABLE, &self.changes)?;
        Ok(Applied::Elements { added: self.added(), removed: self.removed() })
    }
}

/// (in `a` only, in `b` only) of two sorted lists without duplicates.
fn sorted_difference<T: Ord + Clone>(a: &[T], b: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => {
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if x < y => {
                only_a.push(x.clone());
                i += 1;
            }
            (Some(_), Some(y)) => {
                only_b.push(y.clone());
                j += 1;
            }
            (Some(x), None) => {
                only_a.push(x.clone());
                i += 1;
            }
            (None, Some(y)) => {
                only_b.push(y.clone());
                j += 1;
            }
            (None, None) => unreachable!(),
        }
    }
    (only_a, only_b)
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

/// Removes the layer from the current netns; `Ok(false)` when it was absent.
pub fn remove() -> Result<bool> {
    nft::remove(Family::Ipv4, TABLE)
}

/// Compares the kernel's layer with `layer`; an empty list means intact.
pub fn verify(layer: &ServiceLayer) -> Result<Vec<String>> {
    let table = services_table(layer)?;
    Ok(match (table, nft::kernel_view(Family::Ipv4, TABLE)?) {
        (None, None) => Vec::new(),
        (None, Some(_)) => vec![format!("table ip {TABLE} is present, but the mode is off")],
        (Some(_), None) => vec![format!("table ip {TABLE} is missing")],
        (Some(t), Some(actual)) => nft::read::diff(&nft::expected_view(&t), &actual),
    })
}

/// The per-class counters of the layer in the current netns: name -> (packets, bytes).
/// `None` when the netns has no layer.
pub fn counters() -> Result<Option<BTreeMap<String, u64>>> {
    let c = nft::counters(TABLE)?;
    if c.is_empty() {
        return Ok(None);
    }
    // A connection is counted once, on its first packet: packets are connections.
    Ok(Some(COUNTERS.iter().map(|n| (n.to_string(), c.get(*n).map(|v| v.0).unwrap_or(0))).collect()))
}

/// What the pod in the current netns dialled in the Service ranges and has not let expire.
pub fn demand() -> Result<Vec<(Ipv4Addr, Proto, u16)>> {
    let mut out = Vec::new();
    for (key, _) in nft::set_elements(TABLE, SET_DIALLED)? {
        let Some((addr, proto, port)) = nft::key::parse_service_key(&key) else { continue };
        let proto = match proto {
            6 => Proto::Tcp,
            17 => Proto::Udp,
            _ => continue,
        };
        out.push((addr, proto, port));
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

    #[test]
    fn off_has_no_table() {
        assert!(services_table(&ServiceLayer::new(LayerMode::Off)).unwrap().is_none());
    }

    #[test]
    fn first_addresses_are_never_refused() {
        let got: Vec<String> = layer().never_refused().iter().map(|a| a.to_string()).collect();
        assert_eq!(got, ["10.96.0.1", "10.200.0.7"]);
    }

    #[test]
    fn rule_count_does_not_grow_with_services() {
        let small = services_table(&layer()).unwrap().unwrap();
        let mut big = layer();
        for i in 0..5000u32 {
            big.ports.push(ServicePort {
                vip: Ipv4Addr::from(0x0a60_0000 + i),
                proto: Proto::Tcp,
                port: 443,
                has_endpoints: i % 7 != 0,
            });
        }
        let big = services_table(&big).unwrap().unwrap();
        let rules = |t: &Table| t.chains.iter().map(|c| c.rules.len()).sum::<usize>();
        assert_eq!(rules(&small), rules(&big));
        assert!(big.chains.iter().flat_map(|c| &c.rules).all(|r| !r.comment.is_empty()));
    }

    #[test]
    fn count_and_refuse_differ_only_in_the_refusing_set() {
        let mut l = layer();
        l.mode = LayerMode::Count;
        let count = services_table(&l).unwrap().unwrap();
        l.mode = LayerMode::Refuse;
        let refuse = services_table(&l).unwrap().unwrap();
        assert_eq!(count.chains, refuse.chains, "a mode change must not change rules (it would rebuild the table)");
        let refusing = |t: &Table| t.sets.iter().find(|s| s.name == SET_REFUSING).unwrap().elements.clone();
        assert_eq!(refusing(&count), vec![]);
        assert_eq!(refusing(&refuse), vec![Element::Proto(Proto::Tcp), Element::Proto(Proto::Udp)]);
        // In count mode the refuse chain lets everything pass first.
        let chain = count.chains.iter().find(|c| c.name == CHAIN_REFUSE).unwrap();
        assert_eq!(chain.rules[0].matches, vec![Match::L4ProtoNotInSet(SET_REFUSING.into())]);
        assert_eq!(chain.rules[0].action, Action::Accept);
    }
}
