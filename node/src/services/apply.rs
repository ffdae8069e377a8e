//! A Service document checked and stored (`services apply`), then brought to every recorded
//! pod by the apply engine (`engine`); and the stored layer to a new pod (ADD). Which layer
//! each pod netns holds is named in its own tables (`layer::Named`), so a pod one generation
//! behind gets only the element change, sent without reading its sets back.

use std::borrow::Cow;
use std::path::Path;

use aether_netns::Netns;
use aether_rules::services as layer;

use super::change::splice::ServiceIndex;
use super::engine;
use super::plan::Plan;
use super::{budget, change, encoded, flat, journal, layer_file, snapshot, ServicesDir, ServicesError, StoredLayer};
use aether_rules::services::HeldLayer;

fn refused(r: snapshot::Refused) -> ServicesError {
    ServicesError::Refused { reasons: r.reasons }
}

pub(super) use super::outcome::describe;
pub use super::outcome::{ApplyReport, PodOutcome};

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
    let stored_header = dir.stored_header().ok().flatten();
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
        budget::document_fits(text).map_err(ServicesError::OverBudget)?;
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
        None => {
            let (generation, layer) = match parsed.take() {
                Some(read) => read,
                // Stored by a racing apply and replaced since the look above.
                None => snapshot::parse_layer(text).map_err(refused)?,
            };
            let (new, file) = StoredLayer::with_file(generation, layer, source);
            (new, Storing::Whole(Some(file)))
        }
        Some(same) => (same, Storing::Whole(None)),
    };
    store_and_apply(dir, (Cow::Borrowed(text), None), new, previous, warnings, false, reach)
}

/// How an apply stores its document and layer.
pub(super) enum Storing<'a> {
    /// `snapshot.json` and `layer.bin` written whole (with the file's bytes when already
    /// encoded), the journal removed.
    Whole(Option<Vec<u8>>),
    /// An entry appended to the applier's journal (`PodReach::append_journal`).
    Journal(journal::Entry<'a>),
}

/// The end of an apply, under the exclusive lock, once the document `text` is checked and
/// `new` is its layer (with `layer.bin`'s bytes when already encoded): refuses an older or
/// reused generation, stores the document and its layer, and brings every pod to it.
/// `index`: where the Services of `text` are, carried from the stored document's.
fn store_and_apply(
    dir: &ServicesDir,
    (text, index): (Cow<'_, [u8]>, Option<ServiceIndex>),
    (new, storing): (StoredLayer, Storing<'_>),
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
    // Before anything is stored: what each pod gets, decided once; work that would cross this
    // process's memory limit is refused whole (the OOM killer would stop it midway).
    let plan = reach.plan(dir, &new, previous.as_ref())?;
    apply_fits(&plan, &new, previous.as_ref())?;
    // Whether `snapshot.source` names `text` as the canonical document `new` was made from
    // (with the journal: names the canonical document the journal's changes apply to).
    let file = match storing {
        Storing::Journal(entry) => {
            reach.append_journal(dir, &entry)?;
            let report = reach.apply_to_pods(dir, (&new, previous.as_ref()), &plan, warnings);
            reach.stored(dir, text, index, new, canonical);
            return report;
        }
        Storing::Whole(file) => file,
    };
    let canonical_vouched = if previous.as_ref().is_none_or(|old| old.source != source) {
        // The marker goes before the document changes, and comes back only once the layer
        // matches it: killed in between, the next apply reads the stored document in full.
        dir.remove(SOURCE)?;
        reach.write_stored(dir, "snapshot.json", &text)?;
        reach.write_stored(dir, "layer.bin", &file.unwrap_or_else(|| new.encode()))?;
        // A journal over the layer before is stale now (readers pass it by); gone with it.
        dir.remove(journal::JOURNAL)?;
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
    let report = reach.apply_to_pods(dir, (&new, previous.as_ref()), &plan, warnings);
    reach.stored(dir, text, index, new, canonical_vouched);
    report
}

/// Before an apply stores anything: whether carrying out `plan` (every recorded pod brought
/// to `new`) fits this process's memory limit, when one binds. A quick bound first (every pod
/// rebuilt at a bound of the layer's elements: the exact count groups 20,000 ports into
/// profiles at 10,000 Services, which was half of a change's CPU under a limit); only when
/// that does not fit, the plan's elements: the change's for each pod that gets it (counted,
/// not built), the whole layer's for each rebuilt.
fn apply_fits(plan: &Plan, new: &StoredLayer, previous: Option<&StoredLayer>) -> Result<(), ServicesError> {
    // A test's way to reach the checks made pod by pod: the estimate before the apply skipped.
    if new.layer.mode == layer::LayerMode::Off || crate::state::fails_here("memory-budget-estimate") {
        return Ok(());
    }
    let Some((reading, per)) = budget::budget() else { return Ok(()) };
    let tally = plan.tally();
    let pods = tally.changed + tally.rebuilt + tally.migrated;
    let bound = budget::layer_bound(&new.layer);
    if crate::memcg::fits(&reading, pods as u64 * bound, per).is_ok() {
        return Ok(());
    }
    let change = || match previous {
        // At most the new layer cut to the VIPs that differ (the change's sets are what the
        // apply will build; the estimate must not cost that).
        Some(prev) => budget::layer_elements(&engine::narrowed(prev, new).1).min(bound),
        None => budget::layer_elements(&new.layer),
    };
    let elements = tally.elements(change, || budget::layer_elements(&new.layer));
    crate::memcg::fits(&reading, elements, per).map_err(ServicesError::OverBudget)
}

/// A stored document's text (kept, or read for the occasion), its layer, and where its
/// Services are when the reach keeps that with the text (`None`: each is searched for).
pub(super) type StoredText<'a> = (Cow<'a, [u8]>, StoredLayer, Option<ServiceIndex>);

/// How an apply reaches the pods once the new layer is stored, and what it may keep of the
/// stored document between applies: a one-shot process (`Tour`), or the installer's
/// long-lived applier (`applier::Kept`, a cache in front of the same engine).
pub(super) trait PodReach {
    /// Brings every recorded pod to `new` (`previous`: what was stored before): the engine's
    /// `apply_to_pods` on a tour, through this reach's way into the pods (`engine::Pods`).
    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        layers: (&StoredLayer, Option<&StoredLayer>),
        plan: &Plan,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError>;

    /// Writes one of the stored files, as `write_atomic` does (a long-lived applier reuses
    /// a spare file's pages).
    fn write_stored(&mut self, dir: &ServicesDir, name: &str, body: &[u8]) -> Result<(), ServicesError> {
        dir.write_atomic(name, body)
    }

    /// Told that the exclusive lock is taken: what was kept may be checked now.
    fn locked(&mut self, _dir: &ServicesDir) {}

    /// The plan (`Plan::make`) for bringing every recorded pod to `new` (`previous`: what is
    /// stored now), made before `new` is stored, from what each pod's tables say they hold.
    fn plan(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
    ) -> Result<Plan, ServicesError>;

    /// Whether the next change may be stored as a journal entry (`append_journal`): only a
    /// long-lived applier's, to a journal it wrote itself, while it has room.
    fn journal_room(&mut self, _dir: &ServicesDir) -> bool {
        false
    }

    /// Appends `entry` to the journal (`journal_room` said there is room).
    fn append_journal(&mut self, dir: &ServicesDir, _entry: &journal::Entry) -> Result<(), ServicesError> {
        Err(ServicesError::Write {
            path: dir.journal_path(),
            source: std::io::Error::other("only the installer's applier keeps a journal"),
        })
    }

    /// The stored document, when canonical, and its layer (`ServicesDir::canonical_stored`);
    /// called under the exclusive lock.
    fn canonical_stored(&mut self, dir: &ServicesDir) -> Result<Option<StoredText<'_>>, ServicesError> {
        Ok(dir.canonical_stored()?.map(|(text, layer)| (Cow::Owned(text), layer, None)))
    }

    /// Told, under the lock, what was just stored (the files are written, the pods visited);
    /// `canonical`: the stored marker vouches for `text` as the canonical document of
    /// `layer`; `index`: where its Services are, when known. (All handed over: a kept copy
    /// costs no copy of a 1.5 MB document.)
    fn stored(
        &mut self,
        _dir: &ServicesDir,
        _text: Cow<'_, [u8]>,
        _index: Option<ServiceIndex>,
        _layer: StoredLayer,
        _canonical: bool,
    ) {
    }
}

/// A one-shot process's reach: one thread enters each pod's netns in turn, opening a socket
/// there for each transaction (`engine::Entering`).
pub(super) struct Tour;

impl PodReach for Tour {
    fn plan(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
    ) -> Result<Plan, ServicesError> {
        let records = crate::state::StateDir::new(&dir.state).scan().records;
        // Each pod entered in turn on one thread (`Netns::run` spawns one per call outside a
        // tour), its tables read; the visit then sends without reading them again.
        aether_netns::tour(|| {
            Plan::make(&records, dir.divert_mark(), previous, new, |_, r| {
                flat(engine::open_pod(r).ok()?.run(layer::held)).ok()
            })
        })
        .map_err(ServicesError::Tour)
    }

    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        layers: (&StoredLayer, Option<&StoredLayer>),
        plan: &Plan,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError> {
        aether_netns::tour(|| {
            // One grace period for all the pods' sockets, not one per pod (a change that
            // deletes elements makes the kernel wait one at each close).
            let _later = aether_rules::nft::CloseLater::new();
            engine::apply_to_pods(dir, layers, plan, warnings, &mut engine::Entering::default())
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
    budget::document_fits(text).map_err(ServicesError::OverBudget)?;
    let c = change::parse(text).map_err(|reasons| ServicesError::Refused { reasons })?;
    let _lock = dir.lock(true)?;
    reach.locked(dir);
    if let Some((stored_text, prev, mut index)) = reach.canonical_stored(dir)? {
        if prev.generation != c.base_generation {
            return Err(ServicesError::StaleBase { base: c.base_generation, stored: prev.generation });
        }
        if let Some(s) = change::splice::splice(stored_text, &prev.layer, prev.generation, &c, index.as_mut()) {
            let mut layer = s.layer;
            layer.mesh_vips.sort_unstable();
            // What the engine's cut compares (`narrowed`): only these VIPs' ports can differ.
            let touched: Vec<std::net::IpAddr> = s.gone.iter().copied().chain(s.came.iter().map(|p| p.vip)).collect();
            let (new, storing) = if reach.journal_room(dir) {
                // Stored as what changed: the layer's digest moved by the change alone.
                let digest = layer_file::moved_digest(prev.digest, &prev.layer, &layer, &s.gone, &s.came);
                let entry = journal::Entry {
                    from: prev.generation,
                    generation: c.generation,
                    mode: layer.mode,
                    dialled_timeout_secs: layer.dialled_timeout_secs,
                    mesh_vips: layer.mesh_vips.clone(),
                    gone: s.gone,
                    came: s.came,
                    change: Cow::Borrowed(text),
                };
                (StoredLayer { generation: c.generation, digest, source: 0, layer }, Storing::Journal(entry))
            } else {
                let (new, file) = StoredLayer::with_file(c.generation, layer, layer_file::source_digest(&s.text));
                (new, Storing::Whole(Some(file)))
            };
            engine::note_touched(&prev, &new, touched);
            let storing = (new, storing);
            return store_and_apply(dir, (Cow::Owned(s.text), index), storing, Some(prev), Vec::new(), true, reach);
        }
    }
    let path = dir.root.join("snapshot.json");
    let Some(stored) = dir.stored_text()? else {
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
    let storing = (new, Storing::Whole(Some(file)));
    store_and_apply(dir, (Cow::Owned(whole), None), storing, previous, warnings, true, reach)
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
    /// layer was made from, with the journal's changes applied to both; `None` otherwise.
    pub(super) fn canonical_stored(&self) -> Result<Option<(Vec<u8>, StoredLayer)>, ServicesError> {
        // Asked before any of it is read (here, or as it is by `stored_text` when it is not
        // canonical).
        let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        budget::stored_fits(size(&self.root.join("snapshot.json")) + size(&self.journal_path()))
            .map_err(ServicesError::OverBudget)?;
        let Some((named, true)) = self.source_marker() else { return Ok(None) };
        let Ok(Some((layer, base))) = layer_file::read_with_base(&self.layer_path()) else { return Ok(None) };
        if layer.source != named {
            return Ok(None);
        }
        let Some(text) = self.read("snapshot.json")? else { return Ok(None) };
        let entries = self.journal(&base)?;
        if entries.is_empty() {
            return Ok(Some((text, layer)));
        }
        let text = journal::fold_text(text, &layer, &entries).ok_or_else(|| ServicesError::StoredInvalid {
            path: self.journal_path(),
            reasons: vec!["its changes do not apply to snapshot.json; send a whole snapshot".into()],
        })?;
        Ok(Some((text, journal::fold(layer, &entries))))
    }

    /// `services snapshot`: the stored document as it stands, under the shared lock (never
    /// halfway through an apply).
    pub fn current_snapshot(&self) -> Result<Option<Vec<u8>>, ServicesError> {
        let Some(_lock) = self.read_lock()? else { return Ok(None) };
        self.stored_text()
    }

    /// The stored document as it stands: `snapshot.json` with the journal's changes applied
    /// (`canonical_stored`'s). A document `snapshot.source` does not vouch for as `layer.bin`'s
    /// canonical source is taken as it is: an apply stopped after writing it (the marker goes
    /// first) left it newer than the layer and its journal, which it already holds.
    pub(super) fn stored_text(&self) -> Result<Option<Vec<u8>>, ServicesError> {
        match self.canonical_stored()? {
            Some((text, _)) => Ok(Some(text)),
            None => self.read("snapshot.json"),
        }
    }
}

/// `layer.bin` at least this long (about 2,000 IPv4 Service ports, 2 ms of the kernel's
/// element work in a pod) is built after ADD's answer: below it, building costs less than
/// handing the work to a process of its own.
const AFTER_ANSWER_FROM_BYTES: u64 = 16 * 1024;

/// Whether ADD builds the stored layer after answering the runtime
/// (`attachment::LayerToBuild`): when `layer.bin` is at least [`AFTER_ANSWER_FROM_BYTES`]
/// long. One `statx`; no layer stored, or one that cannot be looked at, is built before
/// the answer as ever (where it is then skipped or refused as before).
pub fn built_after_answer(state_dir: &Path) -> bool {
    ServicesDir::new(state_dir).layer_path().metadata().is_ok_and(|m| m.len() >= AFTER_ANSWER_FROM_BYTES)
}

/// For ADD, in the host netns, after the attachment record is written and holding the pod's
/// netns lock: applies the stored layer (if any) to the pod netns `netns`. Takes no lock of
/// the node's: an apply storing a layer meanwhile lists the records after storing it, so it
/// either reaches this pod (after this, under the same netns lock, and brings it forward
/// from the name its tables carry) or stored before the reading here. Loads `layer.bin`,
/// never the JSON snapshot, and reads nothing back from the kernel. Returns the generation
/// applied, `None` when the agent has sent no snapshot yet (the pod then has no layer until
/// the first apply).
pub fn apply_current_snapshot_in_netns(
    state_dir: &Path,
    netns: &Netns,
    divert_mark: u32,
) -> Result<Option<u64>, ServicesError> {
    let dir = ServicesDir::new(state_dir);
    // The transaction the last ADD of this layer and mark sent, kept (`encoded`): sent as
    // it is, without reading `layer.bin` or building the layer.
    let key = encoded::Key::now(&dir, divert_mark);
    if let Some(c) = key.as_ref().and_then(|k| encoded::read(&dir, k)) {
        let (generation, seq_count) = (c.generation, c.seq_count);
        let bytes = c.bytes.into_owned();
        match flat(netns.run(move || aether_rules::nft::send_bytes(bytes, seq_count))) {
            Ok(()) => return Ok(Some(generation)),
            // A layer there already (made by an apply since the record was written), or
            // anything else: the layer is built, which replaces it or names what is refused.
            Err(e) => tracing::debug!("the kept transaction of the Service layer was not taken ({e}): built"),
        }
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
    // A new pod holds no layer: the engine's rebuild, on the layer taken from the stored one.
    // If the netns held one (another interface's ADD) that an apply's change moved between
    // the reading and the rebuild: brought from what it holds now to the layer stored now.
    // (`Moved`: brought after a move, to the generation stored then, or none stored any more.)
    enum Tried {
        First(engine::Brought),
        Moved(Option<u64>),
    }
    let mut taken = Some(stored.take_for_pod(divert_mark));
    let tried = engine::bring_while_moved(|tries| {
        let pod = |stored, held, layer| engine::OnePod {
            stored,
            mark: divert_mark,
            held,
            check: false,
            layer,
            charged: false,
        };
        if tries == 0 {
            let one = pod(&stored, Some(HeldLayer::Absent), taken.take());
            return Ok(engine::bring_pod(&dir, netns, one).map(Tried::First));
        }
        let Some(now) = dir.stored_layer()? else { return Ok(Ok(Tried::Moved(None))) };
        Ok(engine::bring_pod(&dir, netns, pod(&now, None, None)).map(|_| Tried::Moved(Some(now.generation))))
    })?;
    let brought = match tried {
        Tried::First(b) => b,
        Tried::Moved(generation) => return Ok(generation),
    };
    // Kept only when the stored files did not move while they were read (no lock keeps them
    // still): the bytes are then the layer of the files the key names.
    let unmoved = key.is_some() && key == encoded::Key::now(&dir, divert_mark);
    if let (Some((bytes, seq_count)), Some(key), true) = (brought.created, &key, unmoved) {
        let c =
            encoded::Cached { generation: stored.generation, digest: stored.digest, seq_count, bytes: bytes.into() };
        encoded::write(&dir, key, &c);
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
