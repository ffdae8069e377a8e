//! The Service layer's applier for a long-lived process (the installer, which serves it to the
//! agent over a unix socket): `services apply` without a process per document.
//!
//! What a one-shot `services apply` pays for every document, this keeps between documents,
//! each piece checked under the services lock before it is trusted: the stored canonical
//! document and its layer (by the identity of the files), the attachment records (by the
//! directory's), and for each pod its netns and a netfilter socket opened there (a socket
//! stays in its netns, so a change is sent without entering it) with the layer the pod holds.
//! The stored files stay the truth and are written as by `services apply`: whatever another
//! writer (`services apply`, ADD, DEL, the reconciler, `verify`) changes is seen by the next
//! document, and anything in doubt is read again or handed to the one-shot path.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use aether_netns::Netns;
use aether_rules::nft::{Encoded, KeptSocket};
use aether_rules::services::{self as layer, Applied, LayerChange};

use super::apply::{
    apply_change_with, apply_document_with, apply_to_pods, narrowed, open_pod, ApplyReport, PodHolds, PodOutcome,
    PodReach, StoredText,
};
use super::{budget, change, flat, ServicesDir, ServicesError, StoredLayer};
use crate::state::{self, Record, StateDir};
use crate::PodError;

/// A whole snapshot or a change document (a top-level `baseGeneration`), told apart as
/// `services apply` tells them. Meant for one thread: it enters pod netns in place on the
/// thread that calls it (`aether_netns::tour_here`).
pub struct Applier {
    dir: ServicesDir,
    kept: Kept,
}

impl Applier {
    pub fn new(state_dir: &Path) -> Self {
        Applier { dir: ServicesDir::new(state_dir), kept: Kept::default() }
    }

    /// `services apply` of `text`: the same checks, refusals, stored files and pod outcomes.
    pub fn apply(&mut self, text: &[u8]) -> Result<ApplyReport, ServicesError> {
        if change::is_change(text) {
            apply_change_with(&self.dir, text, &mut self.kept)
        } else {
            apply_document_with(&self.dir, text, &mut self.kept)
        }
    }

    /// Lets go of what is kept for pods that are gone: records removed (DEL, GC, the
    /// reconciler), or a netns path that no longer names the pod's netns. A kept socket keeps
    /// its netns alive, so this is called when idle, about once a second.
    pub fn tidy(&mut self) {
        let Ok(_lock) = self.dir.lock(false) else { return };
        self.kept.records(&self.dir);
        let live: BTreeSet<String> = self.kept.records.as_ref().map_or_else(BTreeSet::new, |r| r.keys());
        self.kept.links.retain(|key, link| live.contains(key) && link.still_there());
    }

    /// How many pods' sockets are kept (for metrics and tests).
    pub fn kept_pods(&self) -> usize {
        self.kept.links.len()
    }
}

/// A file's identity: a rewritten file (a new inode by rename, or new times) differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileId {
    fn of(path: &Path) -> Option<FileId> {
        let m = std::fs::symlink_metadata(path).ok()?;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Some(FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The three stored files whose identities vouch for a kept copy.
const STORED_FILES: [&str; 3] = ["snapshot.json", "layer.bin", super::apply::SOURCE];

fn stored_ids(dir: &ServicesDir) -> [Option<FileId>; 3] {
    STORED_FILES.map(|name| FileId::of(&dir.root.join(name)))
}

/// The canonical stored document and its layer as this applier stored them.
struct KeptStored {
    text: Vec<u8>,
    layer: StoredLayer,
    files: [Option<FileId>; 3],
}

/// The attachment records as last read, with the directory's identity then.
struct KeptRecords {
    dir: Option<FileId>,
    records: std::sync::Arc<Vec<Record>>,
    unreadable: Vec<String>,
}

impl KeptRecords {
    fn keys(&self) -> BTreeSet<String> {
        self.records.iter().map(Record::key).collect()
    }
}

/// A pod reached without entering it.
struct Link {
    /// The netns path and identity of the record it was opened for.
    path: String,
    recorded: Option<crate::state::NetnsIdentity>,
    ns: Netns,
    sock: KeptSocket,
    /// The layer the pod holds, as this applier last sent it or read it from the pod's file;
    /// `None`: unknown (rebuilt at the next document).
    holds: Option<PodHolds>,
    /// `holds` is to be read again from the pod's file before it is used.
    reread: bool,
    /// The pod's file under `pods/`, kept open: written in place with one system call while
    /// it is still the file at its name (anyone who replaces it unlinks this one first).
    file: Option<std::fs::File>,
    /// `netns_key` of `ns`, made once.
    key: String,
}

impl Link {
    /// Writes what the pod holds into its file: in place while the kept one is still linked,
    /// else as `set_pod_holds` does, and the new file kept.
    fn write_holds(&mut self, dir: &ServicesDir, held: &PodHolds, body: &mut String) -> Result<(), ServicesError> {
        use std::fmt::Write;
        body.clear();
        write!(body, "{held}").expect("a String takes any text");
        if let Some(f) = &self.file {
            if let Some(m) = f.metadata().ok().filter(|m| m.nlink() > 0) {
                if state::overwrite_file(f, body.as_bytes(), m.len()).is_ok() {
                    return Ok(());
                }
            }
        }
        dir.set_pod_holds(&self.ns, held)?;
        self.file = dir.open_pod_holds(&self.ns);
        Ok(())
    }
}

impl Link {
    fn open(r: &Record) -> Result<Link, PodError> {
        let ns = open_pod(r)?;
        let sock = flat(ns.run(KeptSocket::open))?;
        let key = super::apply::netns_key(&ns);
        Ok(Link { path: r.netns.clone(), recorded: r.netns_id, ns, sock, holds: None, reread: true, file: None, key })
    }

    /// Whether the record's path still names the netns this link is in. A stat, not an open
    /// (this runs for every pod once a second): the kept socket pins the netns, so no other
    /// netns can show its (device, inode) while the link lives.
    fn still_there(&self) -> bool {
        let id = self.ns.id();
        std::fs::metadata(&self.path).is_ok_and(|m| m.dev() == id.dev && m.ino() == id.ino)
    }
}

#[derive(Default)]
struct Kept {
    stored: Option<KeptStored>,
    records: Option<KeptRecords>,
    links: BTreeMap<String, Link>,
    /// `layer.bin`'s identity after this applier last wrote or checked it: the links'
    /// beliefs hold only while no one else has stored a layer since.
    layer_bin: Option<FileId>,
    /// The spare files `snapshot.json` and `layer.bin` are written through.
    spares: BTreeMap<String, state::Spare>,
}

impl Kept {
    /// The records, read again only when the attachments directory changed (records are
    /// written by rename and removed by unlink, each of which changes it).
    fn records(&mut self, dir: &ServicesDir) -> &KeptRecords {
        let now = FileId::of(&dir.state.join("attachments"));
        if self.records.as_ref().is_none_or(|k| now.is_none() || k.dir != now) {
            let scan = StateDir::new(&dir.state).scan();
            let unreadable = scan
                .unreadable
                .iter()
                .map(|u| format!("attachment record {} cannot be read, its pod is not reached: {}", u.file, u.why))
                .collect();
            self.records = Some(KeptRecords { dir: now, records: scan.records.into(), unreadable });
        }
        self.records.as_ref().expect("just read")
    }

    /// Forgets what each pod holds (kept sockets stay): read again from the pods' files.
    fn forget_beliefs(&mut self) {
        self.links.values_mut().for_each(|l| l.reread = true);
    }

    /// The fast visit: every recorded pod sent the element change on its kept socket, or
    /// rebuilt in place. The caller has checked the cases it does not handle.
    fn visit_pods(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: &StoredLayer,
        mut warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError> {
        let node_mark = dir.divert_mark();
        let rescanned = self.records.as_ref().map(|k| k.dir) != Some(FileId::of(&dir.state.join("attachments")));
        let records = self.records(dir);
        warnings.extend(records.unreadable.iter().cloned());
        let records = records.records.clone();
        if rescanned {
            let live: BTreeSet<String> = records.iter().map(Record::key).collect();
            self.links.retain(|k, _| live.contains(k));
            dir.prune_pods(&records);
        }
        // An apply stopped midway: no pod's file, nor what was believed, is trusted.
        let interrupted = dir.begin_pods(new, &mut warnings)?;
        let mut marks: BTreeMap<u32, Mark> = BTreeMap::new();
        let mut cut: Option<(layer::ServiceLayer, layer::ServiceLayer)> = None;
        let mut pods = Vec::with_capacity(records.len());
        // A pod's file's text, made in one buffer for all.
        let mut body = String::with_capacity(96);
        for r in records.iter() {
            let mark = r.capture.as_ref().map_or(node_mark, |c| c.divert_mark);
            let m = marks.entry(mark).or_insert_with(|| Mark::new(new, mark));
            let key = r.key();
            // Opened for this very record (`Link::open` checked the netns was its); a socket
            // pins its netns, so what was checked then still holds.
            if self.links.get(&key).is_some_and(|l| l.path != r.netns || l.recorded != r.netns_id) {
                self.links.remove(&key);
            }
            let mut link = match self.links.entry(key) {
                std::collections::btree_map::Entry::Occupied(o) => Ok(o.into_mut()),
                std::collections::btree_map::Entry::Vacant(v) => Link::open(r).map(|l| v.insert(l)),
            };
            if let Ok(link) = &mut link {
                if interrupted {
                    (link.holds, link.reread) = (None, false);
                } else if link.reread {
                    (link.holds, link.reread) = (dir.pod_holds(&link.ns), false);
                }
            }
            let result = match link {
                Err(e) => Err(e),
                Ok(link) => {
                    // What this visit committed in the pod's netns: nothing, an element change
                    // (with the generation its fence read), or a rebuild.
                    let mut sent = Sent::Rebuild;
                    let outcome = match &link.holds {
                        Some(h) if h.is(new, mark) => Ok(Applied::Unchanged),
                        Some(h) if h.is(previous, mark) => {
                            let (from, to) = cut.get_or_insert_with(|| narrowed(&previous.layer, &new.layer));
                            // Without a run to extend, the generation just before the change, so
                            // that one can start at it (one more request, only then).
                            let at = match link.holds.as_ref().and_then(|h| h.applied_run) {
                                Some(_) => None,
                                None => link.sock.generation().ok(),
                            };
                            // What it adds must fit what this process may still charge.
                            let adds = match m.change(from, to).map(|(c, _)| c.added() as u64) {
                                Some(added) => added,
                                None => m.elements(),
                            };
                            if let Err(over) = budget::pod_fits(adds) {
                                Err(PodError::OverBudget(over))
                            } else {
                                // Refused (the pod's layer is not what it was believed to hold): rebuilt.
                                match m.change(from, to).map(|(c, encoded)| c.send_encoded_on(encoded, &mut link.sock))
                                {
                                    Some(Ok((Applied::Unchanged, _))) => {
                                        sent = Sent::Nothing;
                                        Ok(Applied::Unchanged)
                                    }
                                    Some(Ok((applied, generation))) => {
                                        sent = Sent::Change { before: at, after: generation };
                                        Ok(applied)
                                    }
                                    _ => m.rebuild(&link.ns),
                                }
                            }
                        }
                        _ => m.rebuild(&link.ns),
                    };
                    state::crash_point("services-pod-sent");
                    match &outcome {
                        Ok(_) if link.holds.as_ref().is_some_and(|h| h.is(new, mark)) => {}
                        Ok(_) => {
                            let before = link.holds.as_ref().and_then(|h| h.applied_run);
                            let held = PodHolds {
                                applied_run: sent.run(before),
                                ..PodHolds::for_key(new, link.key.clone(), mark)
                            };
                            match link.write_holds(dir, &held, &mut body) {
                                Ok(()) => link.holds = Some(held),
                                Err(e) => {
                                    warnings.push(e.to_string());
                                    link.holds = None;
                                }
                            }
                        }
                        Err(_) => {
                            dir.forget_pod(link.ns.path());
                            (link.holds, link.file) = (None, None);
                        }
                    }
                    outcome
                }
            };
            pods.push(PodOutcome {
                container_id: r.container_id.clone(),
                ifname: r.ifname.clone(),
                netns: r.netns.clone(),
                result,
            });
        }
        dir.end_pods()?;
        Ok(ApplyReport { generation: new.generation, pods, warnings })
    }
}

/// What a visit committed in a pod's netns.
enum Sent {
    /// Nothing (the change had no element for it): its generation did not move.
    Nothing,
    /// The element change: the generation read just before it (when read), and the one its
    /// transaction's fence read.
    Change { before: Option<u32>, after: Option<u32> },
    /// A rebuild (its generation is not followed).
    Rebuild,
}

impl Sent {
    /// The pod's run of generations made by this applier's element changes alone, after this
    /// visit, from the one before it (`PodHolds::applied_run`). A change whose fence read one
    /// past the run's last extends it, and one past the generation read just before it
    /// starts one there: nothing else was committed in between (any commit moves the
    /// generation by one). Any other change starts a run at its own generation: what came
    /// before it (another commit, even one between the transaction and its fence) is not
    /// claimed.
    fn run(&self, run: Option<(u32, u32)>) -> Option<(u32, u32)> {
        match (self, run) {
            (Sent::Nothing, run) => run,
            (Sent::Change { after: Some(after), .. }, Some((first, last))) if last.wrapping_add(1) == *after => {
                Some((first, *after))
            }
            (Sent::Change { before: Some(before), after: Some(after) }, _) if before.wrapping_add(1) == *after => {
                Some((*before, *after))
            }
            (Sent::Change { after: Some(after), .. }, _) => Some((*after, *after)),
            (Sent::Change { after: None, .. }, _) | (Sent::Rebuild, _) => None,
        }
    }
}

/// What a visit makes once per divert mark in use (in practice one), on first need.
struct Mark<'a> {
    stored: &'a StoredLayer,
    mark: u32,
    /// The whole layer for this mark, made on first need (a rebuild): a copy of 20,000 ports.
    layer: Option<layer::ServiceLayer>,
    change: Option<Option<(LayerChange, Encoded)>>,
    prepared: Option<Option<layer::Prepared>>,
}

impl<'a> Mark<'a> {
    fn new(stored: &'a StoredLayer, mark: u32) -> Self {
        Mark { stored, mark, layer: None, change: None, prepared: None }
    }

    /// The element change between the cut layers for this mark, encoded once.
    fn change(&mut self, from: &layer::ServiceLayer, to: &layer::ServiceLayer) -> Option<&(LayerChange, Encoded)> {
        let mark = self.mark;
        self.change
            .get_or_insert_with(|| {
                let at = |l: &layer::ServiceLayer| layer::ServiceLayer { divert_mark: mark, ..l.clone() };
                let c = LayerChange::between(&at(from), &at(to)).ok().flatten()?;
                let encoded = c.encode();
                Some((c, encoded))
            })
            .as_ref()
    }

    /// The layer's elements: what a rebuild adds.
    fn elements(&mut self) -> u64 {
        let (stored, mark) = (self.stored, self.mark);
        budget::layer_elements(self.layer.get_or_insert_with(|| stored.for_pod(mark)))
    }

    /// The pod's layer rebuilt, in its netns (entered in place: the caller is on a tour),
    /// if it fits what this process may still charge (else the pod keeps what it has).
    fn rebuild(&mut self, ns: &Netns) -> Result<Applied, PodError> {
        budget::pod_fits(self.elements()).map_err(PodError::OverBudget)?;
        let (stored, mark) = (self.stored, self.mark);
        let l = self.layer.get_or_insert_with(|| stored.for_pod(mark));
        match self.prepared.get_or_insert_with(|| layer::Prepared::new(l).ok().flatten()) {
            Some(p) => flat(ns.run(|| p.rebuild())),
            None => flat(ns.run(|| layer::rebuild(l))),
        }
    }
}

impl PodReach for Kept {
    fn locked(&mut self, dir: &ServicesDir) {
        // Another writer stored a layer since this applier's last: nothing kept about the
        // stored document or what pods hold is trusted.
        let now = FileId::of(&dir.layer_path());
        if now.is_none() || now != self.layer_bin {
            self.stored = None;
            self.forget_beliefs();
        }
    }

    fn write_stored(&mut self, dir: &ServicesDir, name: &str, body: &[u8]) -> Result<(), ServicesError> {
        dir.replace_via_spare(name, body, self.spares.entry(name.to_string()).or_default())
    }

    fn canonical_stored(&mut self, dir: &ServicesDir) -> Result<Option<StoredText<'_>>, ServicesError> {
        if self.stored.as_ref().is_some_and(|k| k.files == stored_ids(dir)) {
            // Handed over whole: a change edits the text in place, and `stored` keeps what
            // it becomes (an apply that stops before then leaves the next to read the files).
            let k = self.stored.take().expect("checked");
            return Ok(Some((Cow::Owned(k.text), k.layer)));
        }
        self.stored = None;
        Ok(dir.canonical_stored()?.map(|(text, layer)| (Cow::Owned(text), layer)))
    }

    fn stored(&mut self, dir: &ServicesDir, text: Cow<'_, [u8]>, layer: StoredLayer, canonical: bool) {
        self.layer_bin = FileId::of(&dir.layer_path());
        // Kept only when the marker vouches for the document (it names the layer's source).
        self.stored = canonical.then(|| KeptStored { text: text.into_owned(), layer, files: stored_ids(dir) });
    }

    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError> {
        // Mode `off` (counts folded, tables removed), a first layer, or pods still marked as
        // folding: the one-shot path, which knows them; what pods hold is read again after.
        let folding = dir.accumulator().map(|a| !a.folding.is_empty()).unwrap_or(true);
        let simple = new.layer.mode != layer::LayerMode::Off && !folding;
        match previous.filter(|_| simple) {
            Some(previous) => aether_netns::tour_here(|| self.visit_pods(dir, new, previous, warnings))
                .map_err(ServicesError::Tour)?,
            None => {
                self.forget_beliefs();
                let _later = aether_rules::nft::CloseLater::new();
                aether_netns::tour_here(|| apply_to_pods(dir, new, previous, warnings)).map_err(ServicesError::Tour)?
            }
        }
    }
}

#[cfg(test)]
mod tests;
