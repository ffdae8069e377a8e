//! A Service document to every recorded pod (`services apply`), and the stored layer to a
//! new pod (ADD). Which layer each pod netns holds is kept in `pods/`, so a pod one
//! generation behind gets only the element change, sent without reading its sets back.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use aether_netns::Netns;
use aether_rules::services::{self as layer, Applied, LayerChange};
use serde_json::Value;

use super::{budget, change, flat, layer_file, snapshot, ServicesDir, ServicesError, StoredLayer};
use crate::state::{PodNetns, Record, StateDir};
use crate::PodError;

fn refused(r: snapshot::Refused) -> ServicesError {
    ServicesError::Refused { reasons: r.reasons }
}

/// The layer a pod netns holds: `generation digest netns-id divert-mark`, one line, and
/// `first last` when the long-lived applier sent it (see `applied_run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PodHolds {
    pub(super) generation: u64,
    pub(super) digest: u64,
    /// `Netns::id()` of the netns it was written for.
    pub(super) netns: String,
    pub(super) divert_mark: u32,
    /// The netns's nftables generations from `first` to `last` were all made by the applier's
    /// element changes of the Service layer, one after another (each transaction's fence read
    /// the generation one past the last), and `last` is where this layer was sent. The
    /// reconciler carries a pod's intact state over them instead of comparing it again.
    pub(super) applied_run: Option<(u32, u32)>,
}

impl PodHolds {
    pub(super) fn new(stored: &StoredLayer, ns: &Netns, divert_mark: u32) -> Self {
        PodHolds::for_key(stored, netns_key(ns), divert_mark)
    }

    /// `new` for the netns whose `netns_key` is `netns`.
    pub(super) fn for_key(stored: &StoredLayer, netns: String, divert_mark: u32) -> Self {
        PodHolds { generation: stored.generation, digest: stored.digest, netns, divert_mark, applied_run: None }
    }

    pub(super) fn parse(text: &str) -> Option<Self> {
        // Written in place: a copy torn by a crash lacks the final newline, and is no file.
        let mut f = text.strip_suffix('\n')?.split_whitespace();
        let mut held = PodHolds {
            generation: f.next()?.parse().ok()?,
            digest: u64::from_str_radix(f.next()?, 16).ok()?,
            netns: f.next()?.to_string(),
            divert_mark: u32::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?,
            applied_run: None,
        };
        if let Some(first) = f.next() {
            held.applied_run = Some((first.parse().ok()?, f.next()?.parse().ok()?));
        }
        f.next().is_none().then_some(held)
    }

    /// Whether the pod holds `stored`'s layer for `divert_mark` (whatever the generation).
    pub(super) fn is(&self, stored: &StoredLayer, divert_mark: u32) -> bool {
        self.digest == stored.digest && self.divert_mark == divert_mark
    }
}

/// A netns's identity as one word: `device:inode`.
pub(super) fn netns_key(ns: &Netns) -> String {
    format!("{}:{}", ns.id().dev, ns.id().ino)
}

impl std::fmt::Display for PodHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:016x} {} {:#x}", self.generation, self.digest, self.netns, self.divert_mark)?;
        if let Some((first, last)) = self.applied_run {
            write!(f, " {first} {last}")?;
        }
        writeln!(f)
    }
}

/// One pod's outcome in an apply.
#[derive(Debug)]
pub struct PodOutcome {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    /// `Err(PodError::Gone)`: the netns is gone, the pod was skipped, which is not a failure.
    pub result: Result<Applied, PodError>,
}

impl PodOutcome {
    /// The pod's netns is gone: skipped, not failed.
    pub fn vanished(&self) -> bool {
        matches!(self.result, Err(PodError::Gone(_)))
    }
}

#[derive(Debug)]
pub struct ApplyReport {
    pub generation: u64,
    pub pods: Vec<PodOutcome>,
    /// What was wrong but did not stop the apply (e.g. a stored snapshot that no longer
    /// parses, replaced by this one).
    pub warnings: Vec<String>,
}

impl ApplyReport {
    pub fn failed(&self) -> bool {
        self.pods.iter().any(|p| p.result.is_err() && !p.vanished())
    }

    pub fn to_json(&self) -> Value {
        serde_json::to_value(self.view()).expect("a report serializes")
    }

    /// `to_json` as pretty text (what `services apply` prints), written without building
    /// the JSON value first (the installer answers one for every change).
    pub fn to_pretty_text(&self) -> String {
        serde_json::to_string_pretty(&self.view()).expect("a report serializes")
    }

    /// The pods by the first word of their result, `elements=98 rebuilt=2`; `none`.
    pub fn pods_by_result(&self) -> String {
        let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
        for p in &self.pods {
            let word = match &p.result {
                Ok(a) => describe_word(a),
                Err(_) if p.vanished() => "skipped",
                Err(_) => "failed",
            };
            *by.entry(word).or_default() += 1;
        }
        if by.is_empty() {
            return "none".into();
        }
        by.iter().map(|(k, n)| format!("{k}={n}")).collect::<Vec<_>>().join(" ")
    }

    fn view(&self) -> ReportView<'_> {
        let pods = self
            .pods
            .iter()
            .map(|p| {
                let (result, reason, error) = match &p.result {
                    Ok(a) => (describe(a), None, None),
                    Err(e) if p.vanished() => ("skipped".into(), Some(e.to_string()), None),
                    Err(e) => ("failed".into(), None, Some(e.to_string())),
                };
                PodView { container_id: &p.container_id, error, ifname: &p.ifname, netns: &p.netns, reason, result }
            })
            .collect();
        ReportView { generation: self.generation, pods, warnings: &self.warnings }
    }
}

/// The report as JSON. Members in the order a JSON object value keeps them (by name), so
/// the text is the same whether written from this or from `to_json`'s value.
#[derive(serde::Serialize)]
struct ReportView<'a> {
    generation: u64,
    pods: Vec<PodView<'a>>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

#[derive(serde::Serialize)]
struct PodView<'a> {
    #[serde(rename = "containerID")]
    container_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    ifname: &'a str,
    netns: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    result: String,
}

/// The first word of `describe` (all of it but for an element change), without making text.
fn describe_word(a: &Applied) -> &'static str {
    match a {
        Applied::Rebuilt => "rebuilt",
        Applied::Elements { .. } => "elements",
        Applied::Unchanged => "unchanged",
        Applied::Removed(true) => "removed",
        Applied::Removed(false) => "off",
    }
}

pub(super) fn describe(a: &Applied) -> String {
    match a {
        Applied::Elements { added, removed } => format!("elements +{added} -{removed}"),
        a => describe_word(a).into(),
    }
}

/// `services apply`: validate the whole document, refuse an older generation, store it
/// (`snapshot.json`, then `layer.bin`), apply it to every recorded pod. Validation errors
/// change nothing.
///
/// The element change from the previous stored generation is computed once; a pod whose
/// file says it holds that generation gets only the change, sent without reading its sets
/// back; a pod that already holds this content is not touched; any other pod (new, behind by
/// more than one generation, or whose change the kernel refused) is rebuilt.
pub fn apply_document(dir: &ServicesDir, text: &[u8]) -> Result<ApplyReport, ServicesError> {
    apply_document_with(dir, text, &mut Tour)
}

/// `apply_document`, reaching the pods through `reach`.
pub(super) fn apply_document_with(
    dir: &ServicesDir,
    text: &[u8],
    reach: &mut dyn PodReach,
) -> Result<ApplyReport, ServicesError> {
    // The very document already stored (the agent sending it again) is not parsed again:
    // `layer.bin` records which document it was made from. Nor is the stored document with
    // only its generation changed (an agent resyncing without news).
    let source = layer_file::source_digest(text);
    let made_from_it = |stored: Option<StoredLayer>| stored.filter(|s| s.source == source);
    let stored_header = layer_file::read_header(&dir.layer_path()).ok().flatten();
    let stored_source = stored_header.map(|(_, source)| source);
    // A look without the lock, to spare the reading; made again under it, where the stored
    // files are what the last finished apply left (one killed midway leaves no
    // `snapshot.source`), before it is trusted.
    let regenerated = match stored_header {
        Some(header @ (_, stored_source)) if stored_source != source => {
            dir.stored_with_new_generation(text, header).is_some()
        }
        _ => false,
    };
    let mut parsed = if stored_source == Some(source) || regenerated {
        None
    } else {
        Some(snapshot::parse_layer(text).map_err(refused)?)
    };
    let _lock = dir.lock(true)?;
    reach.locked(dir);
    let mut warnings = Vec::new();
    // A stored layer that no longer reads (a damaged file, another format) must not lock the
    // agent out: the new, valid one replaces it.
    let previous = dir.stored_layer().unwrap_or_else(|e| {
        warnings.push(format!("{e}; replaced by this snapshot"));
        None
    });
    // The stored content under a new generation, looked at again under the lock (an apply
    // may have stored another document since the look above, or been killed midway).
    let renamed = previous.as_ref().filter(|_| regenerated).and_then(|prev| {
        let (generation, from) = dir.stored_with_new_generation(text, (prev.generation, prev.source))?;
        (from == prev.source).then(|| StoredLayer { generation, source, ..prev.clone() })
    });
    let new = match made_from_it(previous.clone()).or(renamed) {
        Some(same) => (same, None),
        None => {
            let (generation, layer) = match parsed.take() {
                Some(read) => read,
                // Stored by a racing apply and replaced since the look above.
                None => snapshot::parse_layer(text).map_err(refused)?,
            };
            let (new, file) = StoredLayer::with_file(generation, layer, source);
            (new, Some(file))
        }
    };
    store_and_apply(dir, Cow::Borrowed(text), new, previous, warnings, false, reach)
}

/// The end of an apply, under the exclusive lock, once the document `text` is checked and
/// `new` is its layer (with `layer.bin`'s bytes when already encoded): refuses an older or
/// reused generation, stores the document and its layer, and brings every pod to it.
fn store_and_apply(
    dir: &ServicesDir,
    text: Cow<'_, [u8]>,
    (new, file): (StoredLayer, Option<Vec<u8>>),
    previous: Option<StoredLayer>,
    mut warnings: Vec<String>,
    canonical: bool,
    reach: &mut dyn PodReach,
) -> Result<ApplyReport, ServicesError> {
    let source = new.source;
    if let Some(old) = &previous {
        if new.generation < old.generation {
            return Err(ServicesError::OlderGeneration { new: new.generation, stored: old.generation });
        }
        if new.generation == old.generation && old.digest != new.digest {
            return Err(ServicesError::GenerationReused(new.generation));
        }
    }
    // Before anything is stored: work that would cross this process's memory limit is
    // refused whole (the OOM killer would stop it midway).
    super::budget::apply_fits(dir, &new, previous.as_ref())?;
    // Whether `snapshot.source` names `text` as the canonical document `new` was made from.
    let canonical_vouched = if previous.as_ref().is_none_or(|old| old.source != source) {
        // The marker goes before the document changes, and comes back only once the layer
        // matches it: killed in between, the next apply reads the stored document in full.
        dir.remove(SOURCE)?;
        reach.write_stored(dir, "snapshot.json", &text)?;
        reach.write_stored(dir, "layer.bin", &file.unwrap_or_else(|| new.encode()))?;
        let form = if canonical { "canonical" } else { "as-sent" };
        match dir.write_atomic(SOURCE, format!("{source:016x} {form}\n").as_bytes()) {
            Ok(()) => canonical,
            Err(e) => {
                warnings.push(format!("{e}; the next apply reads the stored snapshot in full"));
                false
            }
        }
    } else {
        canonical && dir.source_marker() == Some((source, true))
    };
    let report = reach.apply_to_pods(dir, &new, previous.as_ref(), warnings);
    reach.stored(dir, text, new, canonical_vouched);
    report
}

/// A stored document's text (kept, or read for the occasion) and its layer.
pub(super) type StoredText<'a> = (Cow<'a, [u8]>, StoredLayer);

/// How an apply reaches the pods once the new layer is stored, and what it may keep of the
/// stored document between applies.
pub(super) trait PodReach {
    /// Brings every recorded pod to `new` (`previous`: what was stored before).
    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError>;

    /// Writes one of the stored files, as `write_atomic` does (a long-lived applier reuses
    /// a spare file's pages).
    fn write_stored(&mut self, dir: &ServicesDir, name: &str, body: &[u8]) -> Result<(), ServicesError> {
        dir.write_atomic(name, body)
    }

    /// Told that the exclusive lock is taken: what was kept may be checked now.
    fn locked(&mut self, _dir: &ServicesDir) {}

    /// The stored document, when canonical, and its layer (`ServicesDir::canonical_stored`);
    /// called under the exclusive lock.
    fn canonical_stored(&mut self, dir: &ServicesDir) -> Result<Option<StoredText<'_>>, ServicesError> {
        Ok(dir.canonical_stored()?.map(|(text, layer)| (Cow::Owned(text), layer)))
    }

    /// Told, under the lock, what was just stored (the files are written, the pods visited);
    /// `canonical`: the stored marker vouches for `text` as the canonical document of
    /// `layer`. (Both handed over: a kept copy costs no copy of a 1.5 MB document.)
    fn stored(&mut self, _dir: &ServicesDir, _text: Cow<'_, [u8]>, _layer: StoredLayer, _canonical: bool) {}
}

/// A one-shot process's reach: one thread enters each pod's netns in turn, opening a socket
/// there for each transaction.
pub(super) struct Tour;

impl PodReach for Tour {
    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError> {
        aether_netns::tour(|| {
            // One grace period for all the pods' sockets, not one per pod (a change that
            // deletes elements makes the kernel wait one at each close).
            let _later = aether_rules::nft::CloseLater::new();
            apply_to_pods(dir, new, previous, warnings)
        })
        .map_err(ServicesError::Tour)?
    }
}

/// `services apply` with a change document: refused unless its base is the stored
/// generation; applied to the stored snapshot; the result, in canonical form
/// (`change::render`), checked and stored as a whole snapshot would be, so what is stored
/// after a change is what the whole snapshot of the same content stores. Nothing changes on
/// refusal.
///
/// When the stored document is canonical (the last apply was a change: `snapshot.source`
/// says so), the change is made to it and to `layer.bin` where it touches them
/// (`change::splice`), without reading either as a whole snapshot; otherwise, or when that
/// path cannot vouch for the result, the stored snapshot is read in full.
pub fn apply_change(dir: &ServicesDir, text: &[u8]) -> Result<ApplyReport, ServicesError> {
    apply_change_with(dir, text, &mut Tour)
}

/// `apply_change`, reaching the pods through `reach`.
pub(super) fn apply_change_with(
    dir: &ServicesDir,
    text: &[u8],
    reach: &mut dyn PodReach,
) -> Result<ApplyReport, ServicesError> {
    let c = change::parse(text).map_err(|reasons| ServicesError::Refused { reasons })?;
    let _lock = dir.lock(true)?;
    reach.locked(dir);
    if let Some((stored_text, prev)) = reach.canonical_stored(dir)? {
        if prev.generation != c.base_generation {
            return Err(ServicesError::StaleBase { base: c.base_generation, stored: prev.generation });
        }
        if let Some(s) = change::splice::splice(stored_text, &prev.layer, prev.generation, &c) {
            let source = layer_file::source_digest(&s.text);
            let (new, file) = StoredLayer::with_file(c.generation, s.layer, source);
            return store_and_apply(dir, Cow::Owned(s.text), (new, Some(file)), Some(prev), Vec::new(), true, reach);
        }
    }
    let path = dir.root.join("snapshot.json");
    let Some(stored) = dir.read("snapshot.json")? else {
        return Err(ServicesError::NoBase { base: c.base_generation });
    };
    // Each form let go of as soon as the next is made: at 100,000 Services a snapshot's
    // typed form is tens of megabytes, and the installer's memory is bounded.
    let base = snapshot::parse(&stored).map_err(|r| ServicesError::StoredInvalid { path, reasons: r.reasons })?;
    drop(stored);
    if base.generation != c.base_generation {
        return Err(ServicesError::StaleBase { base: c.base_generation, stored: base.generation });
    }
    let next = change::apply(base, &c).map_err(|reasons| ServicesError::Refused { reasons })?;
    let whole = change::render(&next);
    drop(next);
    // The result checked as a whole snapshot is, read straight into its layer.
    let (generation, layer) = snapshot::parse_layer(&whole).map_err(|r| ServicesError::Refused {
        reasons: r.reasons.into_iter().map(|r| format!("the snapshot the change makes: {r}")).collect(),
    })?;
    let mut warnings = Vec::new();
    let previous = dir.stored_layer().unwrap_or_else(|e| {
        warnings.push(format!("{e}; replaced by this snapshot"));
        None
    });
    let (new, file) = StoredLayer::with_file(generation, layer, layer_file::source_digest(&whole));
    store_and_apply(dir, Cow::Owned(whole), (new, Some(file)), previous, warnings, true, reach)
}

/// Present while an apply changes pods: written before the first pod is visited and removed
/// after the last. Found by the next apply, it says one was stopped midway, when a pod may
/// hold a layer its `pods/` file does not name (sent, then killed before the file was
/// written); trusting that file could leave the pod wrong for good (a later document with
/// the file's content would find nothing to do), so that apply trusts no file and rebuilds
/// every pod. One file per apply instead of a second write per pod.
pub(super) const APPLYING: &str = "applying";

impl ServicesDir {
    /// Marks an apply's visit of the pods as begun; whether the last one was stopped midway.
    pub(super) fn begin_pods(&self, new: &StoredLayer, warnings: &mut Vec<String>) -> Result<bool, ServicesError> {
        let interrupted = !matches!(self.read(APPLYING), Ok(None));
        if interrupted {
            warnings.push(
                "the last apply was stopped before it reached every pod: every pod's layer is rebuilt".to_string(),
            );
        }
        let dir = self.open(true)?.expect("created");
        dir.overwrite(APPLYING, format!("{}\n", new.generation).as_bytes())
            .map_err(|source| ServicesError::Write { path: self.root.join(APPLYING), source })?;
        Ok(interrupted)
    }

    /// Marks an apply's visit of the pods as finished.
    pub(super) fn end_pods(&self) -> Result<(), ServicesError> {
        self.remove(APPLYING)
    }
}

/// Names the stored `snapshot.json` by the source digest `layer.bin` carries, and says
/// whether it is in the canonical form a change writes: `<digest> canonical` or `<digest>
/// as-sent`. Removed before the document is written and written after `layer.bin`, so while
/// it names `layer.bin`'s source, the document is the one the layer was made from (without
/// hashing it again).
pub(super) const SOURCE: &str = "snapshot.source";

impl ServicesDir {
    /// What `snapshot.source` says: the source digest, and whether the form is canonical.
    pub(super) fn source_marker(&self) -> Option<(u64, bool)> {
        let marker = self.read(SOURCE).ok()??;
        let (digest, form) = std::str::from_utf8(&marker).ok()?.trim().split_once(' ')?;
        Some((u64::from_str_radix(digest, 16).ok()?, form == "canonical"))
    }

    /// The stored document and its layer when the document is canonical and the one the
    /// layer was made from; `None` otherwise.
    pub(super) fn canonical_stored(&self) -> Result<Option<(Vec<u8>, StoredLayer)>, ServicesError> {
        let Some((named, true)) = self.source_marker() else { return Ok(None) };
        let Ok(Some(layer)) = layer_file::read(&self.layer_path()) else { return Ok(None) };
        if layer.source != named {
            return Ok(None);
        }
        Ok(self.read("snapshot.json")?.map(|text| (text, layer)))
    }
}

/// `apply_document` once `new` is stored: the layer to every recorded pod, each given the
/// change from `previous` if its file says it holds that, nothing if it holds `new`, a
/// rebuild otherwise. Runs on a tour (`aether_netns::tour`: one thread entering each pod's
/// netns in turn), as a thread per pod cost more than the change it sends.
pub(super) fn apply_to_pods(
    dir: &ServicesDir,
    new: &StoredLayer,
    previous: Option<&StoredLayer>,
    mut warnings: Vec<String>,
) -> Result<ApplyReport, ServicesError> {
    let node_mark = dir.divert_mark();
    let scan = StateDir::new(&dir.state).scan();
    for u in &scan.unreadable {
        warnings.push(format!("attachment record {} cannot be read, its pod is not reached: {}", u.file, u.why));
    }
    let records = scan.records;
    // A pod still marked as folding whose layer is gone (a DEL or apply killed after removing
    // it): the mark ends before a new layer starts counting from zero.
    let folding = match dir.accumulator() {
        Ok(acc) => acc.folding,
        Err(e) => {
            warnings
                .push(format!("the node's Service totals cannot be read, stale fold marks are left as they are: {e}"));
            Default::default()
        }
    };
    let ended: Vec<String> = records
        .iter()
        .filter(|r| folding.contains_key(&r.key()))
        .filter(|r| open_pod(r).is_ok_and(|ns| matches!(ns.run(layer::counters), Ok(Ok(None)))))
        .map(Record::key)
        .collect();
    if !ended.is_empty() {
        dir.end_folding(&ended)?;
    }
    // Mode `off` removes each pod's table: its counts join the node totals first (as at
    // DEL), idempotently, so they never go backwards, also when this apply is killed.
    let off = new.layer.mode == layer::LayerMode::Off;
    let mut folded_keys = Vec::new();
    if off {
        let counts: Vec<(String, BTreeMap<String, u64>)> = records
            .iter()
            .filter_map(|r| Some((r.key(), flat(open_pod(r).ok()?.run(layer::counters)).ok()??)))
            .collect();
        dir.fold_pods(&counts)?;
        folded_keys = counts.into_iter().map(|(k, _)| k).collect();
    }
    // Each pod's layer matches the divert mark its own capture sets.
    let mark_of = |r: &Record| r.capture.as_ref().map_or(node_mark, |c| c.divert_mark);
    let mut marks: BTreeMap<u32, ForMark> = BTreeMap::new();
    for r in &records {
        marks.entry(mark_of(r)).or_insert_with(|| ForMark::new(new, mark_of(r)));
    }
    let interrupted = dir.begin_pods(new, &mut warnings)?;
    let pass = Pass { dir, new, previous, marks: &marks, narrowed: Default::default(), distrust: interrupted };
    let mut out = Visited::default();
    let pods = records.iter().map(|r| pass.visit(r, mark_of(r), &mut out)).collect();
    let Visited { warnings: more, mut removed_keys } = out;
    warnings.extend(more);
    dir.prune_pods(&records);
    dir.end_pods()?;
    if off {
        removed_keys.retain(|k| folded_keys.contains(k));
        dir.end_folding(&removed_keys)?;
    }
    Ok(ApplyReport { generation: new.generation, pods, warnings })
}

/// Two stored layers (lists sorted) cut down to the Service VIPs and mesh VIPs whose
/// elements differ, everything else kept: the change between the cut layers is the whole
/// ones' and costs what changed. A VIP's elements depend on its ports and on which profiles
/// have chains, decided over the whole layer: each cut keeps its whole layer's decision, and
/// the VIPs of a profile that gained or lost its chain.
pub(super) fn narrowed(
    old: &layer::ServiceLayer,
    new: &layer::ServiceLayer,
) -> (layer::ServiceLayer, layer::ServiceLayer) {
    let (gone, came) = sorted_difference(&old.ports, &new.ports);
    let mut vips: Vec<std::net::IpAddr> = gone.iter().chain(&came).map(|p| p.vip).collect();
    let (old_chains, new_chains) = (old.profile_chains(), new.profile_chains());
    vips.extend(layer::rechained_vips([old, new], &old_chains, &new_chains));
    vips.sort_unstable();
    vips.dedup();
    let (mesh_gone, mesh_came) = sorted_difference(&old.mesh_vips, &new.mesh_vips);
    let mut mesh: Vec<std::net::IpAddr> = mesh_gone.into_iter().chain(mesh_came).collect();
    mesh.sort_unstable();
    let cut = |l: &layer::ServiceLayer, chained: layer::ProfileChains| layer::ServiceLayer {
        mode: l.mode,
        ranges: l.ranges.clone(),
        mesh_vips: l.mesh_vips.iter().filter(|a| mesh.binary_search(a).is_ok()).copied().collect(),
        ports: vips.iter().flat_map(|&v| l.ports[layer::ports_of(&l.ports, v)].iter().copied()).collect(),
        dialled_timeout_secs: l.dialled_timeout_secs,
        divert_mark: l.divert_mark,
        chained: Some(chained),
    };
    (cut(old, old_chains), cut(new, new_chains))
}

/// (in `a` only, in `b` only) of two sorted lists.
fn sorted_difference<T: Ord + Copy>(a: &[T], b: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Equal => (i, j) = (i + 1, j + 1),
            std::cmp::Ordering::Less => {
                only_a.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                only_b.push(b[j]);
                j += 1;
            }
        }
    }
    only_a.extend_from_slice(&a[i..]);
    only_b.extend_from_slice(&b[j..]);
    (only_a, only_b)
}

/// A record's netns, if it is still the pod's (a path reused by another namespace, a file
/// or a directory is not: the pod is skipped as gone).
pub(super) fn open_pod(r: &Record) -> Result<Netns, PodError> {
    match r.open_netns() {
        Ok(PodNetns::Live(ns)) => Ok(ns),
        Ok(PodNetns::Gone(why)) => Err(PodError::Gone(why)),
        Err(e) => Err(PodError::Netns(e)),
    }
}

/// What an apply makes once per divert mark in use (in practice one): the layer, and, on
/// first need, the change from the previous generation and the encoded layer.
struct ForMark {
    layer: layer::ServiceLayer,
    /// The layer's elements (`budget::layer_elements`): what a rebuild adds.
    elements: u64,
    change: std::sync::OnceLock<Option<LayerChange>>,
    prepared: std::sync::OnceLock<Option<layer::Prepared>>,
}

impl ForMark {
    fn new(stored: &StoredLayer, mark: u32) -> Self {
        let layer = stored.for_pod(mark);
        let elements = budget::layer_elements(&layer);
        ForMark { layer, elements, change: Default::default(), prepared: Default::default() }
    }
}

/// One apply's walk over the pods.
struct Pass<'a> {
    dir: &'a ServicesDir,
    new: &'a StoredLayer,
    previous: Option<&'a StoredLayer>,
    marks: &'a BTreeMap<u32, ForMark>,
    /// The previous and the new layer cut down to where they differ (`narrowed`).
    narrowed: std::sync::OnceLock<(layer::ServiceLayer, layer::ServiceLayer)>,
    /// The last apply was stopped midway: no pod's file is trusted, every pod is rebuilt.
    distrust: bool,
}

/// What the pods' visits gathered besides their outcomes: warnings, and the attachments
/// whose layer mode `off` removed.
#[derive(Default)]
struct Visited {
    warnings: Vec<String>,
    removed_keys: Vec<String>,
}

impl Pass<'_> {
    /// Brings one pod to the new layer: nothing if its file says it holds it, the change if
    /// it holds the previous one, a rebuild otherwise.
    fn visit(&self, r: &Record, mark: u32, out: &mut Visited) -> PodOutcome {
        let (dir, new) = (self.dir, self.new);
        let m = &self.marks[&mark];
        let l = &m.layer;
        let result = match open_pod(r) {
            Err(e) => Err(e),
            Ok(ns) if l.mode == layer::LayerMode::Off => {
                dir.forget_pod(ns.path());
                let outcome = flat(ns.run(|| layer::apply(l)));
                if matches!(outcome, Ok(Applied::Removed(_))) {
                    out.removed_keys.push(r.key());
                }
                outcome
            }
            Ok(ns) => {
                let held = if self.distrust { None } else { dir.pod_holds(&ns) };
                let change = match (&held, self.previous) {
                    (Some(h), _) if h.is(new, mark) => None,
                    (Some(h), Some(prev)) if h.is(prev, mark) => Some(
                        m.change
                            .get_or_init(|| {
                                let (from, to) = self.narrowed.get_or_init(|| narrowed(&prev.layer, &new.layer));
                                let at =
                                    |l: &layer::ServiceLayer| layer::ServiceLayer { divert_mark: mark, ..l.clone() };
                                LayerChange::between(&at(from), &at(to)).ok().flatten()
                            })
                            .as_ref(),
                    ),
                    _ => Some(None),
                };
                // What it adds must fit what this process may still charge (else the pod
                // keeps the whole layer it has).
                let adds = change.map_or(0, |c| c.map_or(m.elements, |c| c.added() as u64));
                let outcome = match (change, budget::pod_fits(adds)) {
                    (_, Err(over)) => Err(PodError::OverBudget(over)),
                    (None, _) => Ok(Applied::Unchanged),
                    // Refused (the pod's layer is not what its file says): rebuilt.
                    (Some(Some(c)), _) => flat(ns.run(|| c.send().or_else(|_| layer::rebuild(l)))),
                    (Some(None), _) => match m.prepared.get_or_init(|| layer::Prepared::new(l).ok().flatten()) {
                        Some(p) => flat(ns.run(|| p.rebuild())),
                        None => flat(ns.run(|| layer::rebuild(l))),
                    },
                };
                crate::state::crash_point("services-pod-sent");
                if outcome.is_ok() && held.is_none_or(|h| !h.is(new, mark)) {
                    if let Err(e) = dir.set_pod_holds(&ns, &PodHolds::new(new, &ns, mark)) {
                        out.warnings.push(e.to_string());
                    }
                }
                if outcome.is_err() {
                    dir.forget_pod(ns.path());
                }
                outcome
            }
        };
        PodOutcome { container_id: r.container_id.clone(), ifname: r.ifname.clone(), netns: r.netns.clone(), result }
    }
}

/// For ADD, in the host netns, after the attachment record is written: applies the stored
/// layer (if any) to the pod netns `netns`, under the shared services lock, and records
/// capture's divert mark for later applies. Loads `layer.bin`, never the JSON snapshot, and
/// reads nothing back from the kernel. Returns the generation applied, `None` when the agent
/// has sent no snapshot yet (the pod then has no layer until the first apply).
pub fn apply_current_snapshot_in_netns(
    state_dir: &Path,
    netns: &Netns,
    divert_mark: u32,
) -> Result<Option<u64>, ServicesError> {
    let dir = ServicesDir::new(state_dir);
    let _lock = dir.lock(false)?;
    if dir.divert_mark() != divert_mark {
        dir.write_atomic("divert-mark", format!("{divert_mark:#x}\n").as_bytes())?;
    }
    // A stored layer that cannot be read must not keep pods from starting: the pod starts
    // without the layer (fail open, as before any snapshot), and the agent's next apply, which
    // replaces the damaged file, reaches it through its record.
    let mut stored = match dir.stored_layer() {
        Ok(Some(stored)) => stored,
        Ok(None) => return Ok(None),
        Err(e) => {
            tracing::warn!("the pod starts without the Service layer: {e}");
            return Ok(None);
        }
    };
    // Taken, not copied (20,000 ports at 10,000 Services: ADD's memory); what stays of
    // `stored` names the layer in the pod's file.
    let l = layer::ServiceLayer { divert_mark, ..std::mem::take(&mut stored.layer) };
    // The file goes first: killed after the rebuild, a file naming an older layer would be
    // trusted by the next apply (one sending that older content again would leave the pod).
    dir.forget_pod(netns.path());
    flat(netns.run(|| layer::rebuild(&l)))?;
    if let Err(e) = dir.set_pod_holds(netns, &PodHolds::new(&stored, netns, divert_mark)) {
        // Costs the pod a rebuild at the next apply instead of a change; nothing more.
        tracing::warn!("{e}");
    }
    Ok(Some(stored.generation))
}

/// Where the value of a document's top-level `generation` is, and that value, when it is
/// the document's first member (`{"generation": 7, ...`, as agents and the canonical form
/// write it): found without reading the rest. Digits only, no leading zero, at least 1.
/// Whether the rest is JSON is not looked at: the caller compares it with a stored document.
pub(super) fn leading_generation(text: &[u8]) -> Option<(std::ops::Range<usize>, u64)> {
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while text.get(*i).is_some_and(|b| b" \t\r\n".contains(b)) {
            *i += 1;
        }
    };
    for token in [&b"{"[..], b"\"generation\"", b":"] {
        skip_ws(&mut i);
        i += text.get(i..)?.starts_with(token).then_some(token.len())?;
    }
    skip_ws(&mut i);
    let start = i;
    while text.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let digits = std::str::from_utf8(&text[start..i]).ok().filter(|d| !d.starts_with('0'))?;
    let value = digits.parse::<u64>().ok().filter(|&v| v >= 1)?;
    Some((start..i, value))
}

/// Where the value of a JSON document's top-level `generation` is, and that value, when the
/// document is well-formed JSON with exactly one such member holding a whole number of at
/// least 1 (as the snapshot requires); the rest of the document is skipped, not read.
pub(super) fn generation_value(text: &[u8]) -> Option<(std::ops::Range<usize>, u64)> {
    #[derive(serde::Deserialize)]
    struct Generation<'a> {
        #[serde(borrow)]
        generation: &'a serde_json::value::RawValue,
    }
    let g: Generation = serde_json::from_slice(text).ok()?;
    let raw = g.generation.get();
    let start = (raw.as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let value = raw.parse::<u64>().ok().filter(|&v| v >= 1 && raw.bytes().all(|b| b.is_ascii_digit()))?;
    (start + raw.len() <= text.len()).then_some((start..start + raw.len(), value))
}
