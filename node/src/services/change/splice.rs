//! A change applied to the stored state without reading it as a whole snapshot: the
//! canonical `snapshot.json` (written by the last change) is edited where the change touches
//! it, each Service found by its canonical bytes, and the new layer is the stored one
//! (`layer.bin`) with the touched Services' ports taken out and put in. The checks a whole
//! snapshot gets are made for what the change touches only, against the stored layer's
//! sorted VIPs; everything else was checked when it was stored and is unchanged.
//!
//! This path only ever accepts: whenever the change would be refused, or is of a kind it
//! does not do (new Service ranges, a result near a limit), it answers `None` and the full
//! reading (`change::apply`, `snapshot::parse`) decides, with its messages. What it accepts
//! is byte for byte what the full reading stores (checked by tests).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::ops::Range;

use aether_rules::services::{LayerMode, ServiceLayer, ServicePort};
use memchr::memmem;

use super::{render_head, render_service, Change, SERVICES_END};
use crate::services::snapshot::{self, Service, MAX_MESH_VIPS, MAX_SERVICES, MAX_SERVICE_PORTS};

/// What the change makes: the new canonical document and its layer (ports sorted, the
/// other lists not yet), and the layer's change: every port of the VIPs `gone` taken out,
/// then `came` put in (both sorted).
pub struct Spliced {
    pub text: Vec<u8>,
    pub layer: ServiceLayer,
    pub gone: Vec<IpAddr>,
    pub came: Vec<ServicePort>,
}

/// Where the stored document's Services are: the `[`...`]` of `"services"`.
const SERVICES_START: &[u8] = b"\"services\":[";

/// A Service of the stored document the change touches: where it is, what it was, what it
/// becomes (`None`: removed).
struct Touched {
    span: Range<usize>,
    old: Service,
    new: Option<Service>,
}

#[derive(Clone, Copy)]
enum Slot {
    Stored(usize),
    Added(usize),
}

/// `c` applied to `text`, the canonical document `stored` (its layer, lists sorted) was made
/// from; `None` when the full reading must decide.
pub fn splice(
    stored_text: Cow<'_, [u8]>,
    stored: &ServiceLayer,
    stored_generation: u64,
    c: &Change,
) -> Option<Spliced> {
    let text: &[u8] = &stored_text;
    if c.service_ranges.is_some() {
        // Every VIP is to be checked against new ranges, and the pods rebuilt: the full path.
        return None;
    }
    let body_start = memmem::find(text, SERVICES_START)? + SERVICES_START.len();
    let body_end = text.len().checked_sub(SERVICES_END.len()).filter(|&e| e >= body_start)?;
    if &text[body_end..] != SERVICES_END {
        return None;
    }
    // The members before the Services: small, read as a snapshot without Services.
    let mut head_doc = text[..body_start].to_vec();
    head_doc.extend_from_slice(SERVICES_END);
    let mut head = snapshot::parse(&head_doc).ok()?;
    if head.generation != stored_generation || render_head(&head) != text[..body_start] {
        return None;
    }
    let body = &text[body_start..body_end];

    head.generation = c.generation;
    if let Some(m) = c.mode {
        head.mode = m;
    }
    if let Some(t) = c.dialled_timeout_secs {
        head.dialled_timeout_secs = t;
    }
    if head.mode != LayerMode::Off && head.service_ranges.is_empty() {
        return None;
    }
    // Mesh VIPs, in the order `change::apply` leaves them.
    for a in &c.mesh_vips_removed {
        let at = head.mesh_vips.iter().position(|v| v == a)?;
        head.mesh_vips.remove(at);
    }
    for a in &c.mesh_vips_added {
        if head.mesh_vips.contains(a) {
            return None;
        }
        head.mesh_vips.push(*a);
    }
    if head.mesh_vips.len() > MAX_MESH_VIPS {
        return None;
    }

    // The Services, by name, as `change::apply` treats them: removals first, then puts
    // (replacing in place, or appended), then endpoint flips on the result.
    let mut touched: Vec<Touched> = Vec::new();
    let mut added: Vec<Service> = Vec::new();
    // `None`: removed by this change.
    let mut at: HashMap<(String, String), Option<Slot>> = HashMap::new();
    let mut lookup = |at: &mut HashMap<(String, String), Option<Slot>>, ns: &str, name: &str| -> Option<Option<Slot>> {
        let key = (ns.to_string(), name.to_string());
        if let Some(s) = at.get(&key) {
            return Some(*s);
        }
        let (span, old) = find(body, ns, name)?;
        let span = body_start + span.start..body_start + span.end;
        touched.push(Touched { span, new: Some(old.clone()), old });
        let slot = Some(Slot::Stored(touched.len() - 1));
        at.insert(key, slot);
        Some(slot)
    };
    // Edits to make once the lookups (which add to `touched`) are done.
    let mut removed = Vec::new();
    for (ns, name) in &c.services_removed {
        match lookup(&mut at, ns, name)? {
            Some(Slot::Stored(i)) => removed.push(i),
            _ => return None,
        }
        at.insert((ns.clone(), name.clone()), None);
    }
    let mut puts = Vec::new();
    for s in &c.services_put {
        match lookup(&mut at, &s.namespace, &s.name) {
            Some(Some(slot)) => puts.push((slot, s.clone())),
            // Not stored, or removed by this change: appended (as `change::apply` does).
            Some(None) | None => {
                let slot = Slot::Added(added.len());
                added.push(s.clone());
                at.insert((s.namespace.clone(), s.name.clone()), Some(slot));
            }
        }
    }
    let mut flips = Vec::new();
    for (ns, name, usable) in &c.endpoints {
        match lookup(&mut at, ns, name)? {
            Some(slot) => flips.push((slot, *usable)),
            None => return None,
        }
    }
    for i in removed {
        touched[i].new = None;
    }
    for (slot, s) in puts {
        match slot {
            Slot::Stored(i) => touched[i].new = Some(s),
            Slot::Added(j) => added[j] = s,
        }
    }
    for (slot, usable) in flips {
        match slot {
            Slot::Stored(i) => touched[i].new.as_mut()?.usable_endpoints = usable,
            Slot::Added(j) => added[j].usable_endpoints = usable,
        }
    }

    // In the document's order from here on (the slots are done with).
    touched.sort_by_key(|t| t.span.start);

    // The checks of a whole snapshot, for what changed. A Service VIP of the stored layer is
    // free only if its Service is one of the touched ones (VIPs were unique).
    let stored_vip = |a: &IpAddr| {
        let i = stored.ports.partition_point(|p| p.vip < *a);
        stored.ports.get(i).is_some_and(|p| p.vip == *a)
    };
    let freed: HashSet<IpAddr> = touched.iter().map(|t| t.old.vip).collect();
    let taken = |a: &IpAddr| stored_vip(a) && !freed.contains(a);
    let in_ranges = |a: &IpAddr| head.service_ranges.iter().any(|n| n.contains(a));
    let mesh: HashSet<IpAddr> = head.mesh_vips.iter().copied().collect();
    let finals: Vec<&Service> = touched.iter().filter_map(|t| t.new.as_ref()).chain(&added).collect();
    let mut vips = HashSet::new();
    for s in &finals {
        let twice = s.ports.iter().enumerate().any(|(j, p)| s.ports[..j].contains(p));
        if twice || !vips.insert(s.vip) || taken(&s.vip) || mesh.contains(&s.vip) || !in_ranges(&s.vip) {
            return None;
        }
    }
    for a in &c.mesh_vips_added {
        if taken(a) || vips.contains(a) || !in_ranges(a) {
            return None;
        }
    }
    let ports_out: usize = touched.iter().map(|t| t.old.ports.len()).sum();
    let ports_in: usize = finals.iter().map(|s| s.ports.len()).sum();
    let ports = stored.ports.len().saturating_sub(ports_out) + ports_in;
    // Each Service has a port: the stored ports bound the stored Services.
    if ports > MAX_SERVICE_PORTS || stored.ports.len() + added.len() > MAX_SERVICES {
        return None;
    }

    // The document, edited in place from its end (an edit moves only what follows it; the
    // stored bytes between touched Services stay as they are). A removed Service takes a
    // comma beside it with it: the one after it, or else the one before.
    let mut out = stored_text.into_owned();
    let mut body_end = body_end;
    let mut one = Vec::with_capacity(256);
    for t in touched.iter().rev() {
        let old_len = out.len();
        match &t.new {
            Some(s) => {
                one.clear();
                render_service(s, &mut one);
                out.splice(t.span.clone(), one.iter().copied());
            }
            None if out.get(t.span.end) == Some(&b',') => drop(out.drain(t.span.start..t.span.end + 1)),
            None if t.span.start > body_start && out[t.span.start - 1] == b',' => {
                drop(out.drain(t.span.start - 1..t.span.end))
            }
            None => drop(out.drain(t.span.clone())),
        }
        body_end = body_end + out.len() - old_len;
    }
    if !added.is_empty() {
        let mut tail = Vec::with_capacity(added.len() * 160);
        for s in &added {
            if body_end > body_start || !tail.is_empty() {
                tail.push(b',');
            }
            render_service(s, &mut tail);
        }
        out.splice(body_end..body_end, tail);
    }
    out.splice(..body_start, render_head(&head));

    // The layer: the touched Services' stored ports out, their new ones in.
    let mut gone: Vec<IpAddr> = touched.iter().map(|t| t.old.vip).collect();
    gone.sort_unstable();
    gone.dedup();
    let mut came: Vec<ServicePort> = finals.iter().flat_map(|s| s.layer_ports()).collect();
    came.sort_unstable();
    let layer = ServiceLayer {
        mode: head.mode,
        ranges: stored.ranges.clone(),
        mesh_vips: head.mesh_vips.clone(),
        ports: spliced_ports(&stored.ports, &gone, &came),
        dialled_timeout_secs: head.dialled_timeout_secs,
        divert_mark: stored.divert_mark,
        chained: None,
    };
    Some(Spliced { text: out, layer, gone, came })
}

/// The sorted `ports` without every port of the VIPs in `gone`, with `came` merged in (both
/// sorted; none of `came` among the ports kept): sorted, in one pass of copies rather than a
/// copy, a filter and a sort of 20,000 ports.
pub(in crate::services) fn spliced_ports(
    ports: &[ServicePort],
    gone: &[IpAddr],
    came: &[ServicePort],
) -> Vec<ServicePort> {
    let mut out = Vec::with_capacity(ports.len() + came.len());
    let mut came = came.iter().copied().peekable();
    let mut from = 0;
    // The runs kept between the gone VIPs' runs (each VIP's ports are together: VIP first).
    let mut kept = Vec::with_capacity(gone.len() + 1);
    for &v in gone {
        let run = aether_rules::services::ports_of(&ports[from..], v);
        kept.push(&ports[from..from + run.start]);
        from += run.end;
    }
    kept.push(&ports[from..]);
    for mut run in kept {
        while let Some(&next) = came.peek() {
            let at = run.partition_point(|p| *p < next);
            if at == run.len() {
                break;
            }
            out.extend_from_slice(&run[..at]);
            out.push(next);
            came.next();
            run = &run[at..];
        }
        out.extend_from_slice(run);
    }
    out.extend(came);
    out
}

/// The Service `ns`/`name` in the Services of a canonical document: where its object is,
/// and what it says. The canonical bytes of a Service's start can only be found at its
/// start: a `"` inside a JSON string is always escaped.
fn find(body: &[u8], ns: &str, name: &str) -> Option<(Range<usize>, Service)> {
    let text = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let key = format!("{{\"namespace\":{},\"name\":{},\"vip\":", text(ns), text(name));
    let start = memmem::find(body, key.as_bytes())?;
    // A Service object ends at the `}` after its usableEndpoints (nothing else is quoted
    // there but inside strings, where a `"` is escaped).
    const END: &[u8] = b",\"usableEndpoints\":";
    let tail = start + memmem::find(&body[start..], END)? + END.len();
    let end = tail + body[tail..].iter().position(|&b| b == b'}')? + 1;
    let s = service(&body[start..end])?;
    (s.namespace == ns && s.name == name).then_some((start..end, s))
}

/// One Service object, read by the snapshot's own reading (in a document of one Service,
/// without ranges' checks: it was checked when stored).
fn service(object: &[u8]) -> Option<Service> {
    let mut doc = br#"{"generation":1,"mode":"off","serviceRanges":[],"services":["#.to_vec();
    doc.extend_from_slice(object);
    doc.extend_from_slice(b"]}");
    let v: serde_json::Value = serde_json::from_slice(&doc).ok()?;
    snapshot::parse_items(&v).ok()?.services.pop()
}
