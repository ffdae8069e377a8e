//! The node's Service snapshot: the JSON document `aether-cni services apply` reads, its
//! whole-document validation (every message names the place), and its conversion into the
//! layer's model. Schema: testdata/services/snapshot.schema.json.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::IpAddr;

use aether_rules::model::Proto;
use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use ipnet::IpNet;
use serde_json::Value;

mod fast;

/// The longest demand timeout accepted: a week.
pub const MAX_DIALLED_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

// The limits on one snapshot (README "The snapshot"). They bound what `apply` reads and
// parses, what `layer.bin` holds and what a pod's layer costs the kernel (about 100 bytes of
// kernel memory per Service port, so the largest layer is tens of MB per pod).
/// The largest document `apply` reads.
pub const MAX_SNAPSHOT_BYTES: usize = 64 << 20;
pub const MAX_SERVICES: usize = 100_000;
pub const MAX_PORTS_PER_SERVICE: usize = 100;
/// Service ports of all Services together.
pub const MAX_SERVICE_PORTS: usize = 200_000;
pub const MAX_SERVICE_RANGES: usize = 256;
pub const MAX_MESH_VIPS: usize = 100_000;
/// Longer strings are not echoed in messages, only their length.
const MAX_SHOWN: usize = 64;

/// A JSON value as messages show it: whole when short, otherwise its start and its size.
pub(super) fn brief(v: &Value) -> String {
    shortened(&v.to_string())
}

pub(super) fn shortened(text: &str) -> String {
    if text.len() <= MAX_SHOWN {
        return text.to_string();
    }
    let cut = (0..=MAX_SHOWN).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    format!("{}... ({} bytes)", &text[..cut], text.len())
}

/// A field name as messages show it.
fn brief_key(k: &str) -> String {
    shortened(k)
}

/// The limit an array is over, as a message; `None` within it.
fn over_limit(key: &str, what: &str, len: usize, max: usize) -> Option<String> {
    (len > max).then(|| format!("{key}: {len} {what}, more than the limit of {max}"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub generation: u64,
    pub mode: LayerMode,
    /// IPv4 and IPv6 ranges (a dual-stack cluster has a ServiceCIDR of each family).
    pub service_ranges: Vec<IpNet>,
    pub mesh_vips: Vec<IpAddr>,
    pub services: Vec<Service>,
    pub dialled_timeout_secs: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    pub vip: IpAddr,
    pub ports: Vec<(Proto, u16)>,
    pub usable_endpoints: bool,
}

impl Service {
    /// The Service's ports as the layer holds them.
    pub fn layer_ports(&self) -> impl Iterator<Item = ServicePort> + '_ {
        self.ports.iter().map(|&(proto, port)| ServicePort {
            vip: self.vip,
            proto,
            port,
            has_endpoints: self.usable_endpoints,
        })
    }
}

impl Snapshot {
    /// The layer for one pod, given capture's divert mark.
    pub fn layer(&self, divert_mark: u32) -> ServiceLayer {
        let mut l = ServiceLayer::new(self.mode);
        l.divert_mark = divert_mark;
        l.ranges = self.service_ranges.clone();
        l.mesh_vips = self.mesh_vips.clone();
        l.dialled_timeout_secs = self.dialled_timeout_secs;
        l.ports = self.services.iter().flat_map(Service::layer_ports).collect();
        l
    }
}

/// A document refused: every problem, each naming its place (`services[2].ports[0].port`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", reasons.join("; "))]
pub struct Refused {
    pub reasons: Vec<String>,
}

/// Parses and validates a whole document. All problems are collected, each naming its place
/// (`services[2].ports[0].port`), so the agent sees everything wrong at once.
pub fn parse(text: &[u8]) -> Result<Snapshot, Refused> {
    read(text).map_err(|reasons| Refused { reasons })
}

/// `parse`, and the snapshot's layer (divert mark 0): what `apply` stores. The plain form
/// agents write goes from the text to the layer without the Services' own strings and lists
/// (`fast::read_layer`); anything else, and every refusal, is `parse`'s.
pub fn parse_layer(text: &[u8]) -> Result<(u64, ServiceLayer), Refused> {
    if let Some(read) = (text.len() <= MAX_SNAPSHOT_BYTES).then(|| fast::read_layer(text)).flatten() {
        return Ok(read);
    }
    parse(text).map(|s| (s.generation, s.layer(0)))
}

fn read(text: &[u8]) -> Result<Snapshot, Vec<String>> {
    if text.len() > MAX_SNAPSHOT_BYTES {
        return Err(vec![too_large()]);
    }
    match well_formed(text) {
        Some(snap) => {
            let errs = relations(&snap);
            if errs.is_empty() {
                Ok(snap)
            } else {
                Err(errs)
            }
        }
        // The thorough reading reports what is wrong. It reads a JSON tree, which keeps the
        // last of two members of the same name; should it find nothing wrong where the typed
        // reading refused, the typed reading's reason stands (a duplicate member, say):
        // never accept what one reading refuses.
        None => match parse_reporting(text) {
            Ok(_) => Err(vec![match serde_json::from_slice::<TypedDocument>(text) {
                Err(e) => format!("the snapshot is not well formed: {e}"),
                Ok(_) => "the snapshot is not well formed (refused by the typed reading)".into(),
            }]),
            refused => refused,
        },
    }
}

/// The document's shape as the schema says it is, in typed fields borrowing the text (a
/// member twice, or one unknown, is refused by serde).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TypedDocument<'a> {
    generation: u64,
    #[serde(borrow)]
    mode: Cow<'a, str>,
    #[serde(borrow)]
    service_ranges: Vec<Cow<'a, str>>,
    #[serde(default, rename = "meshVIPs", borrow)]
    mesh_vips: Vec<Cow<'a, str>>,
    #[serde(borrow)]
    services: Vec<Svc<'a>>,
    #[serde(default = "default_timeout")]
    dialled_timeout_seconds: u64,
}
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Svc<'a> {
    #[serde(borrow)]
    namespace: Cow<'a, str>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow)]
    vip: Cow<'a, str>,
    #[serde(borrow)]
    ports: Vec<Port<'a>>,
    usable_endpoints: bool,
}
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Port<'a> {
    #[serde(borrow)]
    protocol: Cow<'a, str>,
    port: u64,
}
fn default_timeout() -> u64 {
    aether_rules::services::DEFAULT_DIALLED_TIMEOUT_SECS.into()
}

/// The document read into typed fields (no JSON tree: about a tenth of the memory and time
/// at 10,000 Services); `None` at the first thing out of place, for `parse_reporting` to say
/// what and where. The plain form agents write is read by `fast`'s scanner; anything else
/// (escapes, non-ASCII text, numbers written otherwise...) by serde.
fn well_formed(text: &[u8]) -> Option<Snapshot> {
    fast::read(text).or_else(|| typed(text))
}

/// `well_formed` by serde, into `TypedDocument`.
fn typed(text: &[u8]) -> Option<Snapshot> {
    let doc: TypedDocument = serde_json::from_slice(text).ok()?;
    if doc.services.len() > MAX_SERVICES {
        return None;
    }
    let mut services = Vec::with_capacity(doc.services.len());
    for s in doc.services {
        let ports = s.ports.iter().map(|p| Some((proto(&p.protocol)?, port(p.port)?))).collect::<Option<Vec<_>>>()?;
        services.push(typed_service(s.namespace, s.name, &s.vip, ports, s.usable_endpoints)?);
    }
    checked(doc.generation, &doc.mode, &doc.service_ranges, &doc.mesh_vips, services, doc.dialled_timeout_seconds)
}

/// A port's protocol, as the typed readings take it.
fn proto(s: &str) -> Option<Proto> {
    match s {
        "TCP" => Some(Proto::Tcp),
        "UDP" => Some(Proto::Udp),
        _ => None,
    }
}

/// A port number, as the typed readings take it.
fn port(n: u64) -> Option<u16> {
    u16::try_from(n).ok().filter(|&p| p != 0)
}

/// One Service of the typed readings, checked alone.
fn typed_service(
    namespace: Cow<'_, str>,
    name: Cow<'_, str>,
    vip: &str,
    ports: Vec<(Proto, u16)>,
    usable_endpoints: bool,
) -> Option<Service> {
    let vip = item(&namespace, &name, vip, &ports)?.vip;
    Some(Service { namespace: namespace.into_owned(), name: name.into_owned(), vip, ports, usable_endpoints })
}

/// A Service as `relations` looks at it, borrowed from a `Service` or from the text.
pub(super) struct Item<'a> {
    namespace: &'a str,
    name: &'a str,
    vip: IpAddr,
    ports: &'a [(Proto, u16)],
}

/// A Service of the typed readings checked alone, borrowed.
fn item<'a>(namespace: &'a str, name: &'a str, vip: &str, ports: &'a [(Proto, u16)]) -> Option<Item<'a>> {
    if namespace.is_empty() || name.is_empty() || ports.is_empty() || ports.len() > MAX_PORTS_PER_SERVICE {
        return None;
    }
    Some(Item { namespace, name, vip: parse_addr(vip)?, ports })
}

/// The typed readings' document from its members, checked (its Services each checked by
/// `typed_service`).
fn checked(
    generation: u64,
    mode: &str,
    service_ranges: &[impl AsRef<str>],
    mesh_vips: &[impl AsRef<str>],
    services: Vec<Service>,
    dialled_timeout_seconds: u64,
) -> Option<Snapshot> {
    let mode = match mode {
        "off" => LayerMode::Off,
        "count" => LayerMode::Count,
        "refuse" => LayerMode::Refuse,
        _ => return None,
    };
    let fits = generation >= 1
        && (1..=MAX_DIALLED_TIMEOUT_SECS).contains(&dialled_timeout_seconds)
        && (mode == LayerMode::Off || !service_ranges.is_empty())
        && service_ranges.len() <= MAX_SERVICE_RANGES
        && mesh_vips.len() <= MAX_MESH_VIPS
        && services.len() <= MAX_SERVICES;
    if !fits {
        return None;
    }
    Some(Snapshot {
        generation,
        mode,
        service_ranges: service_ranges.iter().map(|r| range(r.as_ref()).ok()).collect::<Option<Vec<_>>>()?,
        mesh_vips: mesh_vips.iter().map(|a| parse_addr(a.as_ref())).collect::<Option<Vec<_>>>()?,
        services,
        dialled_timeout_secs: dialled_timeout_seconds as u32,
    })
}

/// The slow, thorough reading of a document `well_formed` turned down: every problem, with
/// its place.
fn parse_reporting(text: &[u8]) -> Result<Snapshot, Vec<String>> {
    let doc: Value = serde_json::from_slice(text).map_err(|e| vec![format!("the snapshot is not JSON: {e}")])?;
    let snap = parse_items(&doc)?;
    let errs = relations(&snap);
    if errs.is_empty() {
        Ok(snap)
    } else {
        Err(errs)
    }
}

/// A document's items, each checked alone, with their places (a change document's items are
/// read by it too); what is wrong between them is `relations`'s.
pub(super) fn parse_items(doc: &Value) -> Result<Snapshot, Vec<String>> {
    let mut errs = Vec::new();
    let Some(obj) = doc.as_object() else {
        return Err(vec!["the snapshot must be a JSON object".into()]);
    };
    const TOP: [&str; 6] = ["generation", "mode", "serviceRanges", "meshVIPs", "services", "dialledTimeoutSeconds"];
    for k in obj.keys() {
        if !TOP.contains(&k.as_str()) {
            errs.push(format!("{}: unknown field (expected one of {})", brief_key(k), TOP.join(", ")));
        }
    }
    let generation = match obj.get("generation") {
        None => {
            errs.push("generation: missing (a positive integer that grows with each snapshot)".into());
            0
        }
        Some(v) => match v.as_u64() {
            Some(g) if g >= 1 => g,
            _ => {
                errs.push(format!("generation: {} is not a positive integer", brief(v)));
                0
            }
        },
    };
    let mode = match obj.get("mode").map(|v| (v, v.as_str())) {
        None => {
            errs.push("mode: missing (off, count or refuse)".into());
            LayerMode::Off
        }
        Some((_, Some("off"))) => LayerMode::Off,
        Some((_, Some("count"))) => LayerMode::Count,
        Some((_, Some("refuse"))) => LayerMode::Refuse,
        Some((v, _)) => {
            errs.push(format!("mode: {} is not one of off, count, refuse", brief(v)));
            LayerMode::Off
        }
    };
    let dialled_timeout_secs = match obj.get("dialledTimeoutSeconds") {
        None => aether_rules::services::DEFAULT_DIALLED_TIMEOUT_SECS,
        Some(v) => match v.as_u64() {
            Some(t) if (1..=MAX_DIALLED_TIMEOUT_SECS).contains(&t) => t as u32,
            _ => {
                errs.push(format!(
                    "dialledTimeoutSeconds: {} is not a number of seconds between 1 and {MAX_DIALLED_TIMEOUT_SECS}",
                    brief(v)
                ));
                1
            }
        },
    };

    let mut service_ranges: Vec<IpNet> = Vec::new();
    match array(obj, "serviceRanges", true, &mut errs) {
        Some(items) if items.is_empty() && mode != LayerMode::Off => {
            errs.push("serviceRanges: empty, but mode is not off (the layer needs at least one range)".into())
        }
        Some(items) if items.len() > MAX_SERVICE_RANGES => {
            errs.extend(over_limit("serviceRanges", "ranges", items.len(), MAX_SERVICE_RANGES))
        }
        Some(items) => {
            for (i, v) in items.iter().enumerate() {
                let place = format!("serviceRanges[{i}]");
                let Some(s) = v.as_str() else {
                    errs.push(format!("{place}: {} is not a string", brief(v)));
                    continue;
                };
                match range(s) {
                    Ok(net) => service_ranges.push(net),
                    Err(e) => errs.push(format!("{place}: {e}")),
                }
            }
        }
        None => {}
    }
    let mut mesh_vips = Vec::new();
    let items = array(obj, "meshVIPs", false, &mut errs);
    let too_many = items.and_then(|i| over_limit("meshVIPs", "mesh VIPs", i.len(), MAX_MESH_VIPS));
    if let Some(e) = too_many {
        errs.push(e);
    } else if let Some(items) = items {
        for (i, v) in items.iter().enumerate() {
            if let Some(a) = addr(v, &format!("meshVIPs[{i}]"), &mut errs) {
                mesh_vips.push(a);
            }
        }
    }

    let mut services = Vec::new();
    let items = array(obj, "services", true, &mut errs);
    let too_many = items.and_then(|i| over_limit("services", "Services", i.len(), MAX_SERVICES));
    if let Some(e) = too_many {
        errs.push(e);
    } else if let Some(items) = items {
        for (i, v) in items.iter().enumerate() {
            if let Some(s) = service(v, &format!("services[{i}]"), &mut errs) {
                services.push(s);
            }
        }
    }
    if !errs.is_empty() {
        // Items were left out: what is between them waits for a document of the right shape.
        return Err(errs);
    }
    Ok(Snapshot { generation, mode, service_ranges, mesh_vips, services, dialled_timeout_secs })
}

/// Networks that are never Service ranges, of either family: a range may neither overlap
/// them nor contain them.
const NEVER_RANGES: [&str; 9] = [
    "127.0.0.0/8",
    "169.254.0.0/16",
    "224.0.0.0/4",
    "0.0.0.0/8",
    "::/128",
    "::1/128",
    "::ffff:0:0/96",
    "fe80::/10",
    "ff00::/8",
];

/// An address as the snapshot writes it: IPv4 in dotted decimal without leading zeros, IPv6
/// in hexadecimal groups (RFC 4291 text without an embedded dotted IPv4 part).
fn parse_addr(s: &str) -> Option<IpAddr> {
    if s.contains(':') && s.contains('.') {
        return None;
    }
    s.parse().ok()
}

/// The family a text was meant to be in, for messages: IPv6 if it has a colon.
fn meant_family(s: &str) -> &'static str {
    if s.contains(':') {
        "IPv6"
    } else {
        "IPv4"
    }
}

/// One Service range, checked alone; the message says what is wrong with it.
fn range(s: &str) -> Result<IpNet, String> {
    if s.len() > MAX_SHOWN {
        return Err(format!("{} is not an {} CIDR", brief(&Value::String(s.into())), meant_family(s)));
    }
    let net = match crate::config::parse_ip_net(s, false).filter(|_| !(s.contains(':') && s.contains('.'))) {
        Some(n) => n,
        None => {
            return Err(match parse_addr(s) {
                Some(IpAddr::V4(_)) => format!("{s:?} has no prefix length (write {s}/32 for a ClusterSetIP)"),
                Some(IpAddr::V6(_)) => format!("{s:?} has no prefix length (write {s}/128 for a ClusterSetIP)"),
                None if s.contains(':') => format!("{s:?} is not an IPv6 CIDR (e.g. fd00:10:96::/108)"),
                None => format!("{s:?} is not an IPv4 CIDR (e.g. 10.96.0.0/12)"),
            })
        }
    };
    if net.trunc() != net {
        return Err(format!("{s:?} has host bits set (the network is {})", net.trunc()));
    }
    let never = NEVER_RANGES.iter().map(|x| x.parse::<IpNet>().expect("a CIDR"));
    if let Some(x) = never.into_iter().find(|x| x.contains(&net.network()) || net.contains(&x.network())) {
        return Err(match x {
            IpNet::V4(_) => {
                format!("{s:?} overlaps loopback, link-local, multicast or 0.0.0.0/8, which are never Service ranges")
            }
            IpNet::V6(_) => format!("{s:?} overlaps {x}, which is never a Service range"),
        });
    }
    Ok(net)
}

/// The hasher of `relations`' maps: FxHash's mixing (a rotate, a xor and a multiply per
/// 8 bytes) and MurmurHash3's final mix, several times faster than the default SipHash on
/// 10,000 names and VIPs. Not hardened against chosen collisions, which only the node agent
/// (root) could choose.
#[derive(Clone, Copy, Default)]
struct Quick;

impl std::hash::BuildHasher for Quick {
    type Hasher = QuickHasher;
    fn build_hasher(&self) -> QuickHasher {
        QuickHasher(0)
    }
}

struct QuickHasher(u64);

impl QuickHasher {
    fn mix(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl std::hash::Hasher for QuickHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.mix(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.mix(u64::from_le_bytes(last) ^ ((rest.len() as u64) << 56));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.mix(i.into());
    }
    fn write_u32(&mut self, i: u32) {
        self.mix(i.into());
    }
    fn write_u64(&mut self, i: u64) {
        self.mix(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.mix(i as u64);
    }
    fn finish(&self) -> u64 {
        // The multiply's low bits depend only on its inputs' low bits, which are the same for
        // every VIP of a range (10.96 is the low half of `10.96.x.y`'s word), and the map
        // indexes by the low bits: without a final mix every VIP fell in one chain (quadratic:
        // 60 million instructions for 10,000 Services). MurmurHash3's finalizer spreads every
        // bit over all of them.
        let mut h = self.0;
        h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        h = (h ^ (h >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// What is wrong between the items of a snapshot whose items are each well formed:
/// overlapping ranges, duplicates, VIPs outside the ranges or both mesh and Service, ports
/// declared twice, too many ports in all.
fn relations(snap: &Snapshot) -> Vec<String> {
    let items: Vec<Item> = snap
        .services
        .iter()
        .map(|s| Item { namespace: &s.namespace, name: &s.name, vip: s.vip, ports: &s.ports })
        .collect();
    relations_of(&snap.service_ranges, &snap.mesh_vips, &items)
}

/// `relations` of the parts of a snapshot.
fn relations_of(ranges: &[IpNet], mesh_vips: &[IpAddr], services: &[Item]) -> Vec<String> {
    let mut errs = Vec::new();
    for (i, net) in ranges.iter().enumerate() {
        if let Some(j) = ranges[..i].iter().position(|o| o.contains(&net.network()) || net.contains(&o.network())) {
            errs.push(format!("serviceRanges[{i}]: {:?} overlaps serviceRanges[{j}] ({})", net.to_string(), ranges[j]));
        }
    }
    let in_ranges = |a: &IpAddr| ranges.iter().any(|n| n.contains(a));
    let mut mesh: HashMap<IpAddr, usize, Quick> = HashMap::with_capacity_and_hasher(mesh_vips.len(), Quick);
    for (i, &a) in mesh_vips.iter().enumerate() {
        if let Some(&j) = mesh.get(&a) {
            // IPv6 addresses are compared as addresses: fd00::1 and fd00:0::1 are one.
            errs.push(format!("meshVIPs[{i}]: {a} duplicates meshVIPs[{j}]"));
            continue;
        }
        mesh.insert(a, i);
        if !in_ranges(&a) {
            errs.push(format!("meshVIPs[{i}]: {a} is outside every Service range"));
        }
    }
    let mut names: HashMap<(&str, &str), usize, Quick> = HashMap::with_capacity_and_hasher(services.len(), Quick);
    let mut vips: HashMap<IpAddr, usize, Quick> = HashMap::with_capacity_and_hasher(services.len(), Quick);
    for (i, s) in services.iter().enumerate() {
        if let Some(j) = names.insert((s.namespace, s.name), i) {
            errs.push(format!("services[{i}]: Service {}/{} duplicates services[{j}]", s.namespace, s.name));
        }
        if let Some(j) = vips.insert(s.vip, i) {
            errs.push(format!("services[{i}].vip: {} is also the VIP of services[{j}]", s.vip));
        }
        if !in_ranges(&s.vip) {
            errs.push(format!("services[{i}].vip: {} is outside every Service range", s.vip));
        }
        if mesh.contains_key(&s.vip) {
            errs.push(format!(
                "services[{i}].vip: {} is also a mesh VIP (mesh Services are listed in meshVIPs only)",
                s.vip
            ));
        }
        for (j, &(proto, port)) in s.ports.iter().enumerate() {
            if s.ports[..j].contains(&(proto, port)) {
                errs.push(format!("services[{i}].ports[{j}]: {}/{port} is declared twice", proto.name()));
            }
        }
    }
    let ports: usize = services.iter().map(|s| s.ports.len()).sum();
    errs.extend(over_limit("services", "Service ports in all", ports, MAX_SERVICE_PORTS));
    errs
}

/// The message for a document over `MAX_SNAPSHOT_BYTES`.
pub fn too_large() -> String {
    format!("the snapshot is larger than the limit of {MAX_SNAPSHOT_BYTES} bytes (64 MiB); nothing changed")
}

fn array<'a>(
    obj: &'a serde_json::Map<String, Value>,
    key: &str,
    required: bool,
    errs: &mut Vec<String>,
) -> Option<&'a Vec<Value>> {
    match obj.get(key) {
        None if required => {
            errs.push(format!("{key}: missing (an array, possibly empty)"));
            None
        }
        None => None,
        Some(Value::Array(a)) => Some(a),
        Some(v) => {
            errs.push(format!("{key}: {} is not an array", brief(v)));
            None
        }
    }
}

fn addr(v: &Value, place: &str, errs: &mut Vec<String>) -> Option<IpAddr> {
    match v.as_str().map(|s| (s, parse_addr(s))) {
        Some((_, Some(a))) => Some(a),
        Some((s, None)) => {
            errs.push(format!("{place}: {} is not an {} address", brief(v), meant_family(s)));
            None
        }
        None => {
            errs.push(format!("{place}: {} is not a string", brief(v)));
            None
        }
    }
}

fn service(v: &Value, place: &str, errs: &mut Vec<String>) -> Option<Service> {
    let Some(obj) = v.as_object() else {
        errs.push(format!("{place}: {} is not an object", brief(v)));
        return None;
    };
    const KEYS: [&str; 5] = ["namespace", "name", "vip", "ports", "usableEndpoints"];
    let before = errs.len();
    for k in obj.keys() {
        if !KEYS.contains(&k.as_str()) {
            errs.push(format!("{place}.{}: unknown field (expected one of {})", brief_key(k), KEYS.join(", ")));
        }
    }
    let text = |k: &str, errs: &mut Vec<String>| match obj.get(k).and_then(Value::as_str) {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => {
            errs.push(format!("{place}.{k}: missing or not a non-empty string"));
            String::new()
        }
    };
    let namespace = text("namespace", errs);
    let name = text("name", errs);
    let vip = match obj.get("vip") {
        Some(v) => addr(v, &format!("{place}.vip"), errs),
        None => {
            errs.push(format!("{place}.vip: missing (the Service's ClusterIP)"));
            None
        }
    };
    let usable_endpoints = match obj.get("usableEndpoints") {
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            errs.push(format!("{place}.usableEndpoints: {} is not true or false", brief(v)));
            false
        }
        None => {
            errs.push(format!(
                "{place}.usableEndpoints: missing (true when the Service has a ready, serving or terminating endpoint)"
            ));
            false
        }
    };
    let mut ports = Vec::new();
    match obj.get("ports") {
        Some(Value::Array(items)) if items.len() > MAX_PORTS_PER_SERVICE => {
            errs.extend(over_limit(&format!("{place}.ports"), "ports", items.len(), MAX_PORTS_PER_SERVICE))
        }
        Some(Value::Array(items)) if !items.is_empty() => {
            for (j, p) in items.iter().enumerate() {
                let pp = format!("{place}.ports[{j}]");
                let Some(po) = p.as_object() else {
                    errs.push(format!("{pp}: {} is not an object", brief(p)));
                    continue;
                };
                for k in po.keys() {
                    if k != "protocol" && k != "port" {
                        errs.push(format!("{pp}.{}: unknown field (expected protocol, port)", brief_key(k)));
                    }
                }
                let proto = match po.get("protocol").and_then(Value::as_str) {
                    Some("TCP") => Some(Proto::Tcp),
                    Some("UDP") => Some(Proto::Udp),
                    Some("SCTP") => {
                        errs.push(format!("{pp}.protocol: SCTP is not supported (TCP or UDP)"));
                        None
                    }
                    _ => {
                        errs.push(format!(
                            "{pp}.protocol: {} is not TCP or UDP",
                            brief(po.get("protocol").unwrap_or(&Value::Null))
                        ));
                        None
                    }
                };
                let port = match po.get("port").and_then(Value::as_u64) {
                    Some(n @ 1..=65535) => Some(n as u16),
                    _ => {
                        errs.push(format!(
                            "{pp}.port: {} is not a port (1-65535)",
                            brief(po.get("port").unwrap_or(&Value::Null))
                        ));
                        None
                    }
                };
                if let (Some(proto), Some(port)) = (proto, port) {
                    ports.push((proto, port));
                }
            }
        }
        Some(Value::Array(_)) => errs.push(format!("{place}.ports: empty (a Service has at least one port)")),
        Some(v) => errs.push(format!("{place}.ports: {} is not an array", brief(v))),
        None => errs.push(format!("{place}.ports: missing")),
    }
    if errs.len() > before {
        return None;
    }
    Some(Service { namespace, name, vip: vip?, ports, usable_endpoints })
}

#[cfg(test)]
mod tests;
