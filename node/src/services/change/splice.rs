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
use std::hash::{BuildHasher, RandomState};
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
/// from; `None` when the full reading must decide. With `index` (the long-lived applier's,
/// kept with `text`), touched Services are found through it, and it is carried to the new
/// text; without, each is searched for.
pub fn splice(
    stored_text: Cow<'_, [u8]>,
    stored: &ServiceLayer,
    stored_generation: u64,
    c: &Change,
    mut index: Option<&mut ServiceIndex>,
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
        let (span, old) = locate(body, ns, name, index.as_deref_mut())?;
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
    // Each edit's place in the body and how much it moved what follows, in the order made
    // (for the index).
    let mut moved = Vec::with_capacity(touched.len());
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
        moved.push((t.span.start - body_start, out.len() as isize - old_len as isize));
    }
    let mut appended = Vec::with_capacity(added.len());
    if !added.is_empty() {
        let mut tail = Vec::with_capacity(added.len() * 160);
        for s in &added {
            if body_end > body_start || !tail.is_empty() {
                tail.push(b',');
            }
            appended.push((s, body_end - body_start + tail.len()));
            render_service(s, &mut tail);
        }
        out.splice(body_end..body_end, tail);
    }
    let new_head = render_head(&head);
    let new_body = new_head.len()..out.len() - body_start + new_head.len() - SERVICES_END.len();
    out.splice(..body_start, new_head);
    if let Some(index) = index {
        let removed = touched.iter().filter(|t| t.new.is_none()).map(|t| (&t.old, t.span.start - body_start));
        index.carry(&out[new_body], removed, &moved, appended);
    }

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
        identity: None,
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

/// Where each Service of a kept canonical document starts, so that the long-lived applier
/// finds a Service a change touches without searching the whole document (1.7 MB at 10,000
/// Services) for it. Only ever a hint: an offset is used once the Service's canonical bytes
/// are found there and its object reads as that Service, and a missing or wrong one falls
/// back to the search, so no result rests on the index. Built by one scan at its first use,
/// then carried across splices by the edits each makes: logged, not applied to every start
/// (a change would cost a pass over 10,000 of them), and a start is moved by those made
/// since it was noted when it is looked up. Past `MAX_MOVES` edits it is scanned again.
#[derive(Default)]
pub struct ServiceIndex {
    /// Each Service's offset in the Services' body (after the `[`: the head's edits move
    /// nothing here) when it was noted, and how many `moves` there were then, by a hash of
    /// its canonical key bytes (`key`); `None`: not built yet.
    starts: Option<HashMap<u64, (usize, usize)>>,
    /// The edits made since the index was built, in the order made: where (an offset in the
    /// body as it was then) and by how much it moved every start after it.
    moves: Vec<(usize, isize)>,
    /// `starts` holds every Service of the body: its last scan read the body to its end with
    /// no two keys hashed alike, and every Service appended since was noted under a hash of
    /// its own. A key it lacks is then no Service's (a change's new Service is not searched
    /// for through the whole document). It may hold a key no Service has any more (a removal
    /// it did not follow: a hint that fails), never lack one a Service has.
    complete: bool,
    hasher: RandomState,
    /// Services found by their offset here, searched for, and known absent.
    pub found: u64,
    pub searched: u64,
    pub absent: u64,
}

/// The edits an index follows before it is scanned anew: a lookup walks at most these.
const MAX_MOVES: usize = 1024;

impl ServiceIndex {
    pub(super) fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Where the Service whose key hashes to `h` starts now, as far as the index knows.
    pub(super) fn start(&self, h: u64) -> Option<usize> {
        let &(at, seen) = self.starts.as_ref()?.get(&h)?;
        let moves = self.moves.get(seen..)?;
        // Wrapping: a wrong start is only a wrong hint.
        Some(moves.iter().fold(at, |at, &(place, by)| if place < at { at.wrapping_add_signed(by) } else { at }))
    }

    /// Notes that the Service whose key hashes to `h` starts at `at` now (when built).
    pub(super) fn note(&mut self, h: u64, at: usize) {
        if let Some(starts) = &mut self.starts {
            starts.insert(h, (at, self.moves.len()));
        }
    }

    /// How many Services the index holds (`None`: not built yet).
    #[cfg(test)]
    pub(super) fn len(&self) -> Option<usize> {
        self.starts.as_ref().map(HashMap::len)
    }

    /// The edits logged since the index was last scanned.
    #[cfg(test)]
    pub(super) fn moves(&self) -> usize {
        self.moves.len()
    }

    /// Forgets every start (built, but empty).
    #[cfg(test)]
    pub(super) fn clear(&mut self) {
        (self.starts, self.moves, self.complete) = (Some(HashMap::new()), Vec::new(), false);
    }

    /// Built from `body` now.
    #[cfg(test)]
    pub(super) fn build(&mut self, body: &[u8]) {
        self.rescan(body);
    }

    /// Where `key` starts in `body`, as far as the index knows (built now if not yet).
    fn hint(&mut self, body: &[u8], key: &[u8]) -> Option<usize> {
        if self.starts.is_none() {
            self.rescan(body);
        }
        self.start(self.hash(key))
    }

    /// Whether the Service whose key is `key` is in no document the index is complete for.
    fn lacks(&self, key: &[u8]) -> bool {
        self.complete && self.starts.as_ref().is_some_and(|starts| !starts.contains_key(&self.hash(key)))
    }

    fn rescan(&mut self, body: &[u8]) {
        let (starts, complete) = self.scan(body);
        (self.starts, self.complete) = (Some(starts), complete);
        self.moves.clear();
    }

    /// Every Service's start in `body`, in one pass over it; where it stops making sense,
    /// what follows is left out (searched for when touched). Whether it holds them all (the
    /// pass reached the end, and no two keys hashed alike).
    fn scan(&self, body: &[u8]) -> (HashMap<u64, (usize, usize)>, bool) {
        let vip = memmem::Finder::new(b",\"vip\":");
        let end = memmem::Finder::new(OBJECT_END);
        let mut starts = HashMap::new();
        let (mut at, mut alike) = (0, false);
        while body.get(at) == Some(&b'{') {
            // The key ends at the first `,"vip":` (inside a string a `"` is escaped).
            let Some(key) = vip.find(&body[at..]).map(|k| at + k + vip.needle().len()) else { break };
            let Some(tail) = end.find(&body[key..]).map(|t| key + t + OBJECT_END.len()) else { break };
            let Some(close) = body[tail..].iter().position(|&b| b == b'}') else { break };
            alike |= starts.insert(self.hash(&body[at..key]), (at, 0)).is_some();
            at = tail + close + 1;
            at += usize::from(body.get(at) == Some(&b','));
        }
        let complete = at == body.len() && !alike;
        (starts, complete)
    }

    /// Follows a splice's edits: the `removed` Services (with their starts) leave, the edits
    /// `moved` (in the order made) are logged, the `appended` Services (with their starts in
    /// the new `body`) enter; or, past `MAX_MOVES`, the new `body` is scanned.
    fn carry<'s>(
        &mut self,
        body: &[u8],
        removed: impl Iterator<Item = (&'s Service, usize)>,
        moved: &[(usize, isize)],
        appended: Vec<(&Service, usize)>,
    ) {
        if self.starts.is_none() {
            return;
        }
        for (s, at) in removed {
            let h = self.hash(key(&s.namespace, &s.name).as_bytes());
            if self.start(h) == Some(at) {
                self.starts.as_mut().map(|starts| starts.remove(&h));
            }
        }
        if self.moves.len() + moved.len() > MAX_MOVES {
            self.rescan(body);
            return;
        }
        self.moves.extend(moved.iter().filter(|(_, by)| *by != 0));
        for (s, at) in appended {
            let h = self.hash(key(&s.namespace, &s.name).as_bytes());
            // Another key of the same hash: which keys are held is no longer exact.
            self.complete &= self.starts.as_ref().is_some_and(|starts| !starts.contains_key(&h));
            self.note(h, at);
        }
    }
}

/// The canonical bytes a Service's object starts with. They can only be found at its start:
/// a `"` inside a JSON string is always escaped.
pub(super) fn key(ns: &str, name: &str) -> String {
    let text = |s: &str| serde_json::to_string(s).expect("a string serializes");
    format!("{{\"namespace\":{},\"name\":{},\"vip\":", text(ns), text(name))
}

/// The Service `ns`/`name` in the Services of a canonical document, through `index` when
/// there is one and it knows where: where its object is, and what it says.
fn locate(body: &[u8], ns: &str, name: &str, index: Option<&mut ServiceIndex>) -> Option<(Range<usize>, Service)> {
    let key = key(ns, name);
    let Some(index) = index else { return find(body, &key, ns, name) };
    let hinted = index.hint(body, key.as_bytes()).and_then(|at| object(body, at, &key, ns, name));
    if hinted.is_some() {
        index.found += 1;
        return hinted;
    }
    if index.lacks(key.as_bytes()) {
        index.absent += 1;
        return None;
    }
    index.searched += 1;
    let found = find(body, &key, ns, name)?;
    // Known from now on (a hint that was wrong is put right).
    index.note(index.hash(key.as_bytes()), found.0.start);
    Some(found)
}

/// The Service `ns`/`name`, whose canonical `key` is given, searched for in `body`.
fn find(body: &[u8], key: &str, ns: &str, name: &str) -> Option<(Range<usize>, Service)> {
    object(body, memmem::find(body, key.as_bytes())?, key, ns, name)
}

/// The Service `ns`/`name` when its object starts at `start` in `body`.
fn object(body: &[u8], start: usize, key: &str, ns: &str, name: &str) -> Option<(Range<usize>, Service)> {
    if !body.get(start..)?.starts_with(key.as_bytes()) {
        return None;
    }
    let end = object_end(body, start)?;
    let s = service(&body[start..end])?;
    (s.namespace == ns && s.name == name).then_some((start..end, s))
}

/// What a Service object's last member starts with: the object ends at the `}` after it
/// (nothing else is quoted there but inside strings, where a `"` is escaped).
const OBJECT_END: &[u8] = b",\"usableEndpoints\":";

/// The end of the Service object starting at `start`.
fn object_end(body: &[u8], start: usize) -> Option<usize> {
    let tail = start + memmem::find(&body[start..], OBJECT_END)? + OBJECT_END.len();
    Some(tail + body[tail..].iter().position(|&b| b == b'}')? + 1)
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
