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
/// The layer's shape: raised whenever the same snapshot comes to be built differently in the
/// kernel. A node's record of what a pod holds names the shape (`layer_file`'s digest mixes it
/// in), so after an upgrade every pod holding an older shape is rebuilt once, counters
/// carried over. 2: Services as one verdict map element each, to a profile chain. 3: Services
/// as one data map element each, to their profile's number, and a small verdict map from
/// number to chain (adding a `goto` element makes the kernel validate every verdict map of
/// the table: the large one now holds numbers).
pub const SHAPE: u64 = 3;

mod change;
mod identity;
mod profile;
mod write;
pub use change::LayerChange;
pub use identity::{held, held_on, identity_counter, HeldLayer, LayerId, Named};
pub use profile::{
    chained_profiles, profile_chain, profile_number, rechained_vips, service_profiles, Profile, ProfileCounts,
};
pub use write::{apply, read, rebuild, remove, Applied, Held, Prepared, Reading};
pub const CHAIN_EGRESS: &str = "egress_classify";
pub const CHAIN_CLASSIFY: &str = "classify";
pub const CHAIN_REFUSE: &str = "refuse";
/// Where a Service without a profile chain of its own goes: its ports looked up by
/// `VIP . proto . port` in `service_ports` and `empty_services`.
pub const CHAIN_BY_KEY: &str = "by_key";
/// A profile chain is `ports_<its ports>` (`profile_chain`): a rule per declared port, then
/// "not declared".
pub const PROFILE_CHAIN_PREFIX: &str = "ports_";
/// A profile of more ports than this gets no chain (a packet meets at most this many rules
/// in a profile chain, plus one).
pub const MAX_PROFILE_PORTS: usize = 8;
/// At most this many profile chains per table (the most shared profiles).
pub const MAX_PROFILE_CHAINS: usize = 128;
/// A profile gets a chain when at least this many Services share it: a chain costs the
/// kernel about what this many Services' port elements do.
pub const MIN_SERVICES_PER_PROFILE: usize = 8;
/// After capture's `egress_divert` (route, -150), before its DNS DNAT (nat, -100).
pub const EGRESS_PRIORITY: i32 = -140;

pub const SET_RANGES: &str = "service_ranges";
pub const SET_MESH_VIPS: &str = "mesh_vips";
pub const SET_SERVICE_PORTS: &str = "service_ports";
pub const SET_EMPTY: &str = "empty_services";
/// A data map: each Service VIP to its port profile's number (0: `by_key`, i + 1: the i-th
/// chained profile, in profile order).
pub const SET_VIPS: &str = "service_vips";
/// A verdict map: each profile number to `goto` its chain (at most `MAX_PROFILE_CHAINS` + 1
/// elements).
pub const SET_PROFILE_CHAINS: &str = "profile_chains";
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
    /// The profiles that get chains, when decided over a larger layer than this one: a layer
    /// cut down to the Services a change touches (the node's `narrowed`) keeps the whole
    /// layer's decision, so its change is the whole layers' change. `None`: decided over
    /// this layer's own Services.
    pub chained: Option<ProfileChains>,
    /// The node's name for this content (`LayerId`), written into each of the layer's tables
    /// as the name of a counter object (`Named::counter_name`): the table says itself which
    /// layer it holds. `None`: a layer built without one (the rules' own tests and benches).
    pub identity: Option<LayerId>,
}

/// The profiles that get a chain of their own, per family (`chained_profiles`).
pub type ProfileChains = BTreeMap<Family, Vec<Profile>>;

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

/// What one pod's layer holds in the kernel, over its tables: what its memory is made of.
/// Elements dominate (about 70 bytes each, one per Service when profiles are shared); a
/// chain with its rules costs about what 15 elements do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerSize {
    /// Set and map elements as sent (an interval set's range counts its start and end keys;
    /// the `dialled` set's, filled by the datapath, are not counted).
    pub elements: usize,
    pub chains: usize,
    pub rules: usize,
}

impl ServiceLayer {
    /// The kernel objects one pod's layer for `self` holds (none in mode `off`): for
    /// estimating what building it in many pods will charge.
    pub fn size(&self) -> Result<LayerSize> {
        let mut size = LayerSize::default();
        for t in services_tables(self)? {
            size.elements += t.sets.iter().map(|s| nft::set_keys(s, &s.elements).len()).sum::<usize>();
            size.chains += t.chains.len();
            size.rules += t.chains.iter().map(|c| c.rules.len()).sum::<usize>();
        }
        Ok(size)
    }

    /// The set and map elements one pod's layer holds (`size().elements`), counted from the
    /// lists without building the tables: for a node that estimates an apply's charge.
    pub fn element_count(&self) -> Result<usize> {
        Ok(self.elements_with(|family| {
            let services = service_profiles(self, family);
            let chained = self.chained_in(family, &services);
            // One map element per VIP, and the ports of those without a profile chain; a
            // number per chain in the verdict map (`by_key`'s and each profile's).
            let keyed: usize =
                services.iter().filter(|(_, p)| chained.binary_search(p).is_err()).map(|(_, p)| p.len()).sum();
            services.len() + keyed + chained.len() + 1
        }))
    }

    /// At least `element_count()`, counted in one pass over the ports without grouping them
    /// into profiles (which allocates a profile per Service): every VIP's element, every port
    /// keyed, every profile chain there may be. For a quick bound on work that is checked
    /// again exactly only when the bound does not fit.
    pub fn element_bound(&self) -> Result<usize> {
        Ok(self.elements_with(|family| {
            // VIPs counted where the address changes (more than there are when unsorted).
            let (mut vips, mut ports, mut last) = (0, 0, None);
            for p in self.ports.iter().filter(|p| Family::of(p.vip) == family) {
                ports += 1;
                if last != Some(p.vip) {
                    (vips, last) = (vips + 1, Some(p.vip));
                }
            }
            let chains = match &self.chained {
                Some(c) => c.get(&family).map_or(0, Vec::len),
                None => MAX_PROFILE_CHAINS,
            };
            vips + ports + chains + 1
        }))
    }

    /// The elements of each family's table (none in mode `off`): its ranges, mesh VIPs, the
    /// addresses never refused and the refusal's own, plus what `from_ports` counts of the
    /// Services' ports in that family.
    fn elements_with(&self, from_ports: impl Fn(Family) -> usize) -> usize {
        if self.mode == LayerMode::Off {
            return 0;
        }
        let mut n = 0;
        for family in self.families() {
            let ours = |a: &IpAddr| Family::of(*a) == family;
            let ranges = range_elements(&self.ranges, family)
                .iter()
                .map(|e| nft::key::interval_keys(KeyType::addr(family), e).len())
                .sum::<usize>();
            let mesh = self.mesh_vips.iter().filter(|a| ours(a)).collect::<BTreeSet<_>>().len();
            let never_refused = self.never_refused().into_iter().filter(ours).count();
            let refusing = if self.mode == LayerMode::Refuse { 2 } else { 0 };
            n += ranges + mesh + never_refused + refusing + from_ports(family);
        }
        n
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
/// that family's ranges, VIPs and ports (the profile chains are those of the family's own
/// Services).
fn family_table(layer: &ServiceLayer, family: Family) -> Table {
    let set = |name: &str, key: KeyType, interval: bool, elements: Vec<Element>, comment: &str| Set {
        name: name.into(),
        key,
        interval,
        elements,
        comment: comment.into(),
        timeout_secs: None,
        data: SetData::None,
    };
    let ours = |a: &IpAddr| Family::of(*a) == family;
    let addrs = |set: BTreeSet<IpAddr>| set.into_iter().filter(ours).map(addr_element).collect::<Vec<_>>();
    let services = service_profiles(layer, family);
    let chained = layer.chained_in(family, &services);
    // The profile numbers' chains: the lookup by key (0) first, then each chained profile's.
    let mut goto_chains = vec![CHAIN_BY_KEY.to_string()];
    goto_chains.extend(chained.iter().map(profile_chain));
    let (mut vips, mut with_endpoints, mut without) = (Vec::new(), Vec::new(), Vec::new());
    for (vip, profile) in &services {
        let number = profile::number_in(&chained, profile);
        vips.push(Element::Numbered(*vip, number));
        if number == 0 {
            for &(proto, port, ok) in profile {
                let e = service_element((*vip, proto, port));
                if ok {
                    with_endpoints.push(e)
                } else {
                    without.push(e)
                }
            }
        }
    }
    let (addr_key, service_key) = (KeyType::addr(family), KeyType::service(family));
    let mut dialled =
        set(SET_DIALLED, service_key, false, Vec::new(), "VIP . proto . port dialled in the Service ranges (demand)");
    dialled.timeout_secs = Some(layer.dialled_timeout_secs);
    let mut service_vips = set(SET_VIPS, addr_key, false, vips, "every Service VIP: its port profile's number");
    service_vips.data = SetData::Number;
    let numbers = (0..goto_chains.len()).map(|i| Element::Goto(i as u32, i as u16)).collect();
    let mut profile_chains =
        set(SET_PROFILE_CHAINS, KeyType::Mark, false, numbers, "every port profile's number: goto its chain");
    profile_chains.data = SetData::Goto(goto_chains);
    let sets = vec![
        set(SET_RANGES, addr_key, true, range_elements(&layer.ranges, family), "ServiceCIDRs and ClusterSetIPs"),
        set(SET_MESH_VIPS, addr_key, false, addrs(layer.mesh_vips.iter().copied().collect()), "VIPs of mesh Services"),
        set(
            SET_SERVICE_PORTS,
            service_key,
            false,
            with_endpoints,
            "ports with endpoints of Services without a profile chain",
        ),
        set(
            SET_EMPTY,
            service_key,
            false,
            without,
            "ports without a usable endpoint of Services without a profile chain",
        ),
        service_vips,
        profile_chains,
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
    // The profile's number reaches `profile_chains` through the mark (`Action::DaddrMapVmap`):
    // each chain it goes to sets capture's divert mark back first.
    let restore = Action::SetMark(layer.divert_mark);
    const RESTORED: &str = "the divert mark back (classify carried the profile's number in it)";
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
            vec![Match::DaddrInSet(SET_NEVER_REFUSED.into())],
            Action::CountAccept("service".into()),
            "the API server Service is never refused, whatever the snapshot says",
        ),
        rule(
            vec![],
            Action::DaddrMapVmap { map: SET_VIPS.into(), vmap: SET_PROFILE_CHAINS.into() },
            "a Service VIP: its port profile decides",
        ),
        rule(vec![], restore.clone(), "the divert mark back, if a number with no chain was left in it"),
        rule(vec![], refusal("refused_no_service"), "in a Service range, and no Service owns the address"),
    ];
    let by_key = vec![
        rule(vec![], restore.clone(), RESTORED),
        rule(
            vec![Match::ServiceKeyInSet(SET_SERVICE_PORTS.into())],
            Action::CountAccept("service".into()),
            "a known Service port with endpoints",
        ),
        rule(
            vec![Match::ServiceKeyInSet(SET_EMPTY.into())],
            refusal("refused_no_endpoints"),
            "a Service port without a usable endpoint",
        ),
        rule(vec![], refusal("refused_port_not_declared"), "a Service VIP, on a port the Service does not declare"),
    ];
    let mut chains = vec![
        Chain {
            name: CHAIN_EGRESS.into(),
            hook: Some(BaseHook { kind: ChainKind::Filter, hook: Hook::Output, priority: EGRESS_PRIORITY }),
            rules: egress,
        },
        Chain { name: CHAIN_CLASSIFY.into(), hook: None, rules: classify },
        Chain { name: CHAIN_BY_KEY.into(), hook: None, rules: by_key },
    ];
    for profile in &chained {
        let mut rules = vec![rule(vec![], restore.clone(), RESTORED)];
        rules.extend(profile.iter().map(|&(proto, port, ok)| match ok {
            true => {
                rule(vec![Match::Dport(proto, port)], Action::CountAccept("service".into()), "declared, with endpoints")
            }
            false => {
                rule(vec![Match::Dport(proto, port)], refusal("refused_no_endpoints"), "declared, no usable endpoint")
            }
        }));
        rules.push(rule(vec![], refusal("refused_port_not_declared"), "a port the Service does not declare"));
        chains.push(Chain { name: profile_chain(profile), hook: None, rules });
    }
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
    let mut counters: Vec<String> = COUNTERS.iter().map(|c| c.to_string()).collect();
    counters.extend(identity_counter(layer));
    Table { family, name: TABLE.into(), sets, counters, chains }
}

/// The shape of the layer the current netns holds: `None` without one, 1 for the first shape
/// (`service_vips` a plain set of VIPs), 2 for the second (a verdict map), `SHAPE` for this
/// one (a data map to numbers). Reads the tables' sets only.
pub fn held_shape() -> Result<Option<u64>> {
    for family in Family::ALL {
        if let Some(vips) = nft::set_kind(family, TABLE, SET_VIPS)? {
            return Ok(Some(match vips.data_type {
                _ if vips.flags & nft::key::set_flags::MAP == 0 => 1,
                nft::key::DATA_VERDICT => 2,
                _ => SHAPE,
            }));
        }
    }
    Ok(None)
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
    for c in nft::counters_each(&Family::ALL, TABLE)? {
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
        for e in nft::set_elements(family, TABLE, SET_DIALLED)? {
            let Some((addr, proto, port)) = nft::key::parse_service_key(&e.key) else { continue };
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
mod tests;
