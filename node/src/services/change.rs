//! The agent's change document: what changed since a named base generation, instead of the
//! whole snapshot (schema: testdata/services/change.schema.json). It is applied to the stored
//! snapshot, and the result, rendered as a whole snapshot in canonical form, goes through
//! exactly the checks and the storing of a whole snapshot: after a change, `snapshot.json`
//! is byte for byte `render` of the same content, and `layer.bin` and the pods follow from it.

use std::collections::HashMap;
use std::net::IpAddr;

use aether_rules::model::Proto;
use aether_rules::services::LayerMode;
use serde_json::{json, Value};

use super::snapshot::{self, Service, Snapshot};

/// The largest change document `apply` reads: a change that big is no longer cheaper than a
/// whole snapshot.
pub const MAX_CHANGE_BYTES: usize = 4 << 20;
/// Items of all the change's lists together (Services put, removed, flipped; mesh VIPs added
/// and removed).
pub const MAX_CHANGED_ITEMS: usize = 10_000;

/// Whether `text` is a change document (a top-level `baseGeneration`), not a snapshot. The
/// byte search keeps the skim off whole snapshots; the skim settles it (the bytes may be
/// inside a string).
pub fn is_change(text: &[u8]) -> bool {
    if memchr::memmem::find(text, b"\"baseGeneration\"").is_none() {
        return false;
    }
    #[derive(serde::Deserialize)]
    struct Skim {
        #[serde(rename = "baseGeneration")]
        base_generation: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_slice::<Skim>(text).is_ok_and(|s| s.base_generation.is_some())
}

/// A change document, read and checked item by item (the result is checked whole later).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Change {
    pub base_generation: u64,
    pub generation: u64,
    pub mode: Option<LayerMode>,
    pub service_ranges: Option<Vec<ipnet::IpNet>>,
    pub dialled_timeout_secs: Option<u32>,
    pub mesh_vips_added: Vec<IpAddr>,
    pub mesh_vips_removed: Vec<IpAddr>,
    /// Added, or replacing the Service of the same namespace/name.
    pub services_put: Vec<Service>,
    pub services_removed: Vec<(String, String)>,
    /// (namespace, name, usableEndpoints)
    pub endpoints: Vec<(String, String, bool)>,
}

const TOP: [&str; 10] = [
    "baseGeneration",
    "generation",
    "mode",
    "serviceRanges",
    "dialledTimeoutSeconds",
    "meshVIPsAdded",
    "meshVIPsRemoved",
    "servicesPut",
    "servicesRemoved",
    "endpoints",
];

/// Reads a change document; every problem, each naming its place.
pub fn parse(text: &[u8]) -> Result<Change, Vec<String>> {
    if text.len() > MAX_CHANGE_BYTES {
        return Err(vec![format!(
            "the change is larger than the limit of {MAX_CHANGE_BYTES} bytes (4 MiB); send a whole snapshot; nothing changed"
        )]);
    }
    let doc: Value = serde_json::from_slice(text).map_err(|e| vec![format!("the change is not JSON: {e}")])?;
    let Some(obj) = doc.as_object() else { return Err(vec!["the change must be a JSON object".into()]) };
    let mut errs = Vec::new();
    for k in obj.keys() {
        if !TOP.contains(&k.as_str()) {
            errs.push(format!("{}: unknown field (expected one of {})", snapshot::shortened(k), TOP.join(", ")));
        }
    }
    let generation_of = |key: &str, errs: &mut Vec<String>| match obj.get(key).map(|v| (v, v.as_u64())) {
        Some((_, Some(g))) if g >= 1 => g,
        Some((v, _)) => {
            errs.push(format!("{key}: {} is not a positive integer", snapshot::brief(v)));
            0
        }
        None => {
            errs.push(format!("{key}: missing"));
            0
        }
    };
    let mut c = Change {
        base_generation: generation_of("baseGeneration", &mut errs),
        generation: generation_of("generation", &mut errs),
        ..Change::default()
    };
    if c.generation != 0 && c.base_generation != 0 && c.generation <= c.base_generation {
        errs.push(format!("generation: {} is not newer than baseGeneration {}", c.generation, c.base_generation));
    }
    let lists = ["meshVIPsAdded", "meshVIPsRemoved", "servicesPut", "servicesRemoved", "endpoints"];
    let items: usize = lists.iter().filter_map(|k| obj.get(*k)?.as_array().map(Vec::len)).sum();
    if items > MAX_CHANGED_ITEMS {
        return Err(vec![format!(
            "the change lists {items} items, more than the limit of {MAX_CHANGED_ITEMS}; send a whole snapshot; nothing changed"
        )]);
    }
    // The whole-snapshot fields a change may set: read by the snapshot's own reading.
    let mut probe = serde_json::Map::new();
    probe.insert("generation".into(), json!(1));
    probe.insert("services".into(), json!([]));
    probe.insert("mode".into(), obj.get("mode").cloned().unwrap_or(json!("off")));
    // Without ranges of its own, a placeholder keeps a mode from being refused for the
    // want of them (the result is checked whole).
    probe.insert("serviceRanges".into(), obj.get("serviceRanges").cloned().unwrap_or(json!(["10.0.0.0/8"])));
    if let Some(t) = obj.get("dialledTimeoutSeconds") {
        probe.insert("dialledTimeoutSeconds".into(), t.clone());
    }
    for key in ["meshVIPsAdded", "meshVIPsRemoved"] {
        let vips = obj.get(key).cloned().unwrap_or(json!([]));
        probe.insert("meshVIPs".into(), vips);
        // Ranges and relations are the result's to check: only the items here.
        match snapshot::parse_items(&Value::Object(probe.clone())) {
            Ok(s) if key == "meshVIPsAdded" => c.mesh_vips_added = s.mesh_vips,
            Ok(s) => c.mesh_vips_removed = s.mesh_vips,
            Err(e) => errs.extend(e.into_iter().map(|e| e.replacen("meshVIPs", key, 1))),
        }
    }
    probe.insert("meshVIPs".into(), json!([]));
    probe.insert("services".into(), obj.get("servicesPut").cloned().unwrap_or(json!([])));
    match snapshot::parse_items(&Value::Object(probe)) {
        Ok(s) => {
            c.services_put = s.services;
            c.mode = obj.contains_key("mode").then_some(s.mode);
            c.service_ranges = obj.contains_key("serviceRanges").then_some(s.service_ranges);
            c.dialled_timeout_secs = obj.contains_key("dialledTimeoutSeconds").then_some(s.dialled_timeout_secs);
        }
        Err(e) => errs.extend(e.into_iter().map(|e| {
            if e.starts_with("services") {
                e.replacen("services", "servicesPut", 1)
            } else {
                e
            }
        })),
    }
    c.services_removed = names(obj, "servicesRemoved", &[], &mut errs).into_iter().map(|(ns, n, _)| (ns, n)).collect();
    c.endpoints = names(obj, "endpoints", &["usableEndpoints"], &mut errs)
        .into_iter()
        .map(|(ns, n, o)| (ns, n, o.get("usableEndpoints").and_then(Value::as_bool).unwrap_or(false)))
        .collect();
    if errs.is_empty() {
        Ok(c)
    } else {
        Err(errs)
    }
}

/// A list of `{namespace, name, ...}` objects; `more` are further required booleans.
fn names(
    obj: &serde_json::Map<String, Value>,
    key: &str,
    more: &[&str],
    errs: &mut Vec<String>,
) -> Vec<(String, String, serde_json::Map<String, Value>)> {
    let mut out = Vec::new();
    let items = match obj.get(key) {
        None => return out,
        Some(Value::Array(a)) => a,
        Some(v) => {
            errs.push(format!("{key}: {} is not an array", snapshot::brief(v)));
            return out;
        }
    };
    for (i, v) in items.iter().enumerate() {
        let place = format!("{key}[{i}]");
        let Some(o) = v.as_object() else {
            errs.push(format!("{place}: {} is not an object", snapshot::brief(v)));
            continue;
        };
        let allowed: Vec<&str> = ["namespace", "name"].into_iter().chain(more.iter().copied()).collect();
        let before = errs.len();
        for k in o.keys() {
            if !allowed.contains(&k.as_str()) {
                errs.push(format!(
                    "{place}.{}: unknown field (expected {})",
                    snapshot::shortened(k),
                    allowed.join(", ")
                ));
            }
        }
        let mut text = |k: &str| match o.get(k).and_then(Value::as_str) {
            Some(s) if !s.is_empty() => s.to_string(),
            _ => {
                errs.push(format!("{place}.{k}: missing or not a non-empty string"));
                String::new()
            }
        };
        let (ns, name) = (text("namespace"), text("name"));
        for k in more {
            if !o.get(*k).is_some_and(Value::is_boolean) {
                errs.push(format!("{place}.{k}: missing or not true or false"));
            }
        }
        if errs.len() == before {
            out.push((ns, name, o.clone()));
        }
    }
    out
}

/// What the change makes of `base` (the stored snapshot): the new snapshot, still to be
/// checked whole. Refuses what the change names but `base` does not have, and what it adds
/// twice, each naming the change's place.
pub fn apply(base: Snapshot, c: &Change) -> Result<Snapshot, Vec<String>> {
    let mut errs = Vec::new();
    let base_generation = base.generation;
    // Made from `base` itself, not a copy: at 100,000 Services a copy is tens of megabytes.
    let mut next = base;
    next.generation = c.generation;
    if let Some(m) = c.mode {
        next.mode = m;
    }
    if let Some(r) = &c.service_ranges {
        next.service_ranges = r.clone();
    }
    if let Some(t) = c.dialled_timeout_secs {
        next.dialled_timeout_secs = t;
    }
    for (i, a) in c.mesh_vips_removed.iter().enumerate() {
        match next.mesh_vips.iter().position(|v| v == a) {
            Some(at) => {
                next.mesh_vips.remove(at);
            }
            None => errs.push(format!(
                "meshVIPsRemoved[{i}]: {a} is not a mesh VIP of the stored generation {base_generation}"
            )),
        }
    }
    for (i, a) in c.mesh_vips_added.iter().enumerate() {
        if next.mesh_vips.contains(a) {
            errs.push(format!("meshVIPsAdded[{i}]: {a} is already a mesh VIP"));
        } else {
            next.mesh_vips.push(*a);
        }
    }
    let mut at: HashMap<(String, String), usize> =
        next.services.iter().enumerate().map(|(i, s)| ((s.namespace.clone(), s.name.clone()), i)).collect();
    let mut gone = vec![false; next.services.len()];
    for (i, (ns, name)) in c.services_removed.iter().enumerate() {
        match at.remove(&(ns.clone(), name.clone())) {
            Some(j) => gone[j] = true,
            None => errs.push(format!(
                "servicesRemoved[{i}]: Service {ns}/{name} is not in the stored generation {base_generation}"
            )),
        }
    }
    for s in &c.services_put {
        match at.get(&(s.namespace.clone(), s.name.clone())) {
            Some(&j) => next.services[j] = s.clone(),
            None => {
                at.insert((s.namespace.clone(), s.name.clone()), next.services.len());
                next.services.push(s.clone());
                gone.push(false);
            }
        }
    }
    for (i, (ns, name, usable)) in c.endpoints.iter().enumerate() {
        match at.get(&(ns.clone(), name.clone())) {
            Some(&j) => next.services[j].usable_endpoints = *usable,
            None => errs.push(format!("endpoints[{i}]: Service {ns}/{name} is not in the result of the change")),
        }
    }
    let mut keep = gone.iter().map(|g| !g);
    next.services.retain(|_| keep.next().unwrap_or(true));
    if errs.is_empty() {
        Ok(next)
    } else {
        Err(errs)
    }
}

/// A snapshot as a whole document in canonical form: the members in the schema's order,
/// compact, lists in the snapshot's own order. What `snapshot.json` holds after a change,
/// and what a whole snapshot of the same content in this form stores too.
pub fn render(s: &Snapshot) -> Vec<u8> {
    let mut out = render_head(s);
    for (i, v) in s.services.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        render_service(v, &mut out);
    }
    out.extend_from_slice(SERVICES_END);
    out
}

/// What ends a canonical document, after its last Service.
pub(super) const SERVICES_END: &[u8] = b"]}\n";

/// The canonical document up to and including the `[` that opens its Services.
pub(super) fn render_head(s: &Snapshot) -> Vec<u8> {
    let mode = match s.mode {
        LayerMode::Off => "off",
        LayerMode::Count => "count",
        LayerMode::Refuse => "refuse",
    };
    format!(
        "{{\"generation\":{},\"mode\":\"{mode}\",\"serviceRanges\":{},\"meshVIPs\":{},\"dialledTimeoutSeconds\":{},\"services\":[",
        s.generation,
        json!(s.service_ranges.iter().map(|r| r.to_string()).collect::<Vec<_>>()),
        json!(s.mesh_vips.iter().map(|a| a.to_string()).collect::<Vec<_>>()),
        s.dialled_timeout_secs,
    )
    .into_bytes()
}

/// One Service in canonical form (written by hand: serde_json's map keeps insertion order
/// only with `preserve_order`; a port's members are in the sorted order a JSON map has).
pub(super) fn render_service(v: &Service, out: &mut Vec<u8>) {
    use std::io::Write;
    let text = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let _ = write!(
        out,
        "{{\"namespace\":{},\"name\":{},\"vip\":\"{}\",\"ports\":[",
        text(&v.namespace),
        text(&v.name),
        v.vip
    );
    for (i, &(p, port)) in v.ports.iter().enumerate() {
        let proto = if p == Proto::Tcp { "TCP" } else { "UDP" };
        let _ = write!(out, "{}{{\"port\":{port},\"protocol\":\"{proto}\"}}", if i > 0 { "," } else { "" });
    }
    let _ = write!(out, "],\"usableEndpoints\":{}}}", v.usable_endpoints);
}

pub(crate) mod splice;

#[cfg(test)]
mod tests;
