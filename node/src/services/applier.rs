//! The Service layer's applier for a long-lived process (the installer, which serves it to the
//! agent over a unix socket): `services apply` without a process per document. A cache in
//! front of the one apply engine (`engine`), never a second one: what each pod gets is the
//! engine's decision, done and recorded by the engine, whichever way the pod is reached.
//!
//! What a one-shot `services apply` pays for every document, this keeps between documents,
//! each piece checked under the services lock before it is trusted: the stored canonical
//! document and its layer (by the identity of the files), the attachment records (by the
//! directory's), and for each pod its netns and a netfilter socket opened there (a socket
//! stays in its netns, so a change is sent without entering it) with the layer it last sent
//! the pod (a belief: a change's compare-and-swap is refused by the kernel when the pod holds
//! anything else, and the pod's own table is read then). The stored files stay the truth of
//! what the agent sent, and are written as by
//! `services apply`: whatever another writer (`services apply`, ADD, DEL, the reconciler,
//! `verify`) changes is seen by the next document, and anything in doubt is read again.

use std::borrow::Cow;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use aether_netns::Netns;
use aether_rules::nft::{Encoded, Guarded, KeptSocket};

use super::apply::{apply_change_with, apply_document_with, ApplyReport, PodReach, StoredText};
use super::change::splice::ServiceIndex;
use super::engine::{self, open_pod, PodLink, Pods};
use super::plan::Plan;
use super::{change, flat, journal, layer_file, FileId, ServicesDir, ServicesError, StoredLayer};
use crate::state::{Record, StateDir};
use crate::PodError;
use aether_rules::services::HeldLayer;

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
        // (Reading the records lets go of the pods whose records are gone.)
        self.kept.read_records(&self.dir, FileId::of(&self.dir.state.join("attachments")));
        self.kept.links.retain(|_, link| link.still_there());
    }

    /// How many pods' sockets are kept (for metrics and tests).
    pub fn kept_pods(&self) -> usize {
        self.kept.links.len()
    }
}

/// The stored files whose identities vouch for a kept copy.
const STORED_FILES: [&str; 4] = ["snapshot.json", "layer.bin", super::apply::SOURCE, journal::JOURNAL];

fn stored_ids(dir: &ServicesDir) -> [Option<FileId>; 4] {
    STORED_FILES.map(|name| FileId::of(&dir.root.join(name)))
}

/// Where `layer.bin` and the journal are in `STORED_FILES`.
const LAYER_BIN: usize = 1;
const JOURNAL: usize = 3;

/// The canonical stored document and its layer as this applier stored them, and where the
/// document's Services are (found there without a search of the whole text).
struct KeptStored {
    text: Vec<u8>,
    layer: StoredLayer,
    files: [Option<FileId>; 4],
    index: ServiceIndex,
}

/// The journal this applier writes, kept open for appending while it is the file at its
/// name as this applier left it.
struct KeptJournal {
    file: std::fs::File,
    id: Option<FileId>,
    entries: usize,
}

/// The attachment records as last read, with the directory's identity then.
struct KeptRecords {
    dir: Option<FileId>,
    records: std::sync::Arc<Vec<Record>>,
    /// Each record's `Record::key`, made once per reading (not at each visit of its pod).
    keys: Vec<String>,
    unreadable: Vec<String>,
}

/// A pod reached without entering it.
struct Link {
    /// The netns path and identity of the record it was opened for.
    path: String,
    recorded: Option<crate::state::NetnsIdentity>,
    ns: Netns,
    sock: KeptSocket,
    /// The layer the pod holds, as last sent or read; `None`: unknown (read from the kernel
    /// before it is used).
    holds: Option<HeldLayer>,
    /// The netns's ruleset generation as this link last read or made it: the guard of its
    /// next change (`Encoded::send_guarded_on`), which the kernel checks (stale when anything
    /// else committed there since: the change is then sent with a fence).
    generation: Option<u32>,
}

impl Link {
    fn open(r: &Record) -> Result<Link, PodError> {
        let ns = open_pod(r)?;
        let sock = flat(ns.run(KeptSocket::open))?;
        Ok(Link { path: r.netns.clone(), recorded: r.netns_id, ns, sock, holds: None, generation: None })
    }

    /// Whether it was opened for `r` (its netns path and identity).
    fn opened_for(&self, r: &Record) -> bool {
        self.path == r.netns && self.recorded == r.netns_id
    }

    /// Whether the record's path still names the netns this link is in. A stat, not an open
    /// (this runs for every pod once a second): the kept socket pins the netns, so no other
    /// netns can show its (device, inode) while the link lives.
    fn still_there(&self) -> bool {
        let id = self.ns.id();
        std::fs::metadata(&self.path).is_ok_and(|m| m.dev() == id.dev && m.ino() == id.ino)
    }
}

impl PodLink for Link {
    fn netns(&self) -> &Netns {
        &self.ns
    }

    fn held(&mut self, fresh: bool) -> Result<HeldLayer, PodError> {
        match self.holds {
            Some(h) if !fresh => Ok(h),
            _ => {
                let h = aether_rules::services::held_on(&mut self.sock).map_err(PodError::Kernel)?;
                self.holds = Some(h);
                Ok(h)
            }
        }
    }

    fn believe(&mut self, now: Option<HeldLayer>) {
        self.holds = now;
    }

    fn send(&mut self, change: &Encoded, read_before: bool) -> Result<(Option<u32>, Option<u32>), PodError> {
        // Guarded by the generation this link last saw, the kernel's ACK is the fence and
        // the generation after it is known: nothing else committed in between.
        if let Some(guard) = self.generation {
            match change.send_guarded_on(&mut self.sock, guard).map_err(PodError::Kernel)? {
                Guarded::Committed(after) => {
                    self.generation = Some(after);
                    return Ok((Some(guard), Some(after)));
                }
                Guarded::Stale => {}
            }
        }
        let before = if read_before { self.sock.generation().ok() } else { None };
        self.generation = None;
        let after = change.send_on(&mut self.sock).map_err(PodError::Kernel)?;
        self.generation = after;
        Ok((before, after))
    }
}

#[derive(Default)]
struct Kept {
    stored: Option<KeptStored>,
    records: Option<KeptRecords>,
    links: HashMap<String, Link>,
    /// The identities of `layer.bin` and the journal after this applier last wrote or
    /// checked them: the links' beliefs hold only while no one else has stored a layer since.
    layer_bin: (Option<FileId>, Option<FileId>),
    journal: Option<KeptJournal>,
}

impl Kept {
    /// The records, read again only when the attachments directory changed (records are
    /// written by rename and removed by unlink, each of which changes it).
    /// `now`: the attachments directory's identity, as just read.
    /// A pod whose record is gone is let go (its socket closed) when they are read again.
    fn read_records(&mut self, dir: &ServicesDir, now: Option<FileId>) -> &KeptRecords {
        if self.records.as_ref().is_none_or(|k| now.is_none() || k.dir != now) {
            let scan = StateDir::new(&dir.state).scan();
            let unreadable = scan.unreadable.iter().map(engine::unreadable).collect();
            let keys: Vec<String> = scan.records.iter().map(Record::key).collect();
            let live: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
            self.links.retain(|k, _| live.contains(k.as_str()));
            self.records = Some(KeptRecords { dir: now, records: scan.records.into(), keys, unreadable });
        }
        self.records.as_ref().expect("just read")
    }

    /// Forgets what each pod holds (kept sockets stay): read again from the pods' tables.
    fn forget_beliefs(&mut self) {
        self.links.values_mut().for_each(|l| l.holds = None);
    }
}

impl Pods for Kept {
    fn records(&mut self, dir: &ServicesDir, warnings: &mut Vec<String>) -> Arc<Vec<Record>> {
        let kept = self.read_records(dir, FileId::of(&dir.state.join("attachments")));
        warnings.extend(kept.unreadable.iter().cloned());
        kept.records.clone()
    }

    fn reach(&mut self, i: usize, r: &Record) -> Result<&mut dyn PodLink, PodError> {
        // The record's key as made when the records were read (it is the `i`th of them).
        let made = self.records.as_ref().filter(|k| k.records.get(i).is_some_and(|x| std::ptr::eq(x, r)));
        let key = made.map_or_else(|| Cow::Owned(r.key()), |k| Cow::Borrowed(k.keys[i].as_str()));
        // Opened for this very record (`Link::open` checked the netns was its); a socket
        // pins its netns, so what was checked then still holds.
        if !self.links.get(key.as_ref()).is_some_and(|l| l.opened_for(r)) {
            let link = Link::open(r);
            self.links.remove(key.as_ref());
            self.links.insert(key.to_string(), link?);
        }
        Ok(self.links.get_mut(key.as_ref()).expect("kept above"))
    }
}

impl PodReach for Kept {
    fn locked(&mut self, dir: &ServicesDir) {
        // Another writer stored a layer since this applier's last: nothing kept about the
        // stored document or what pods hold is trusted.
        let now = (FileId::of(&dir.layer_path()), FileId::of(&dir.journal_path()));
        if now.0.is_none() || now != self.layer_bin {
            self.stored = None;
            self.forget_beliefs();
        }
    }

    fn plan(
        &mut self,
        dir: &ServicesDir,
        new: &StoredLayer,
        previous: Option<&StoredLayer>,
    ) -> Result<Plan, ServicesError> {
        // The kept records while the directory is unchanged, else read again (and kept: the
        // apply that follows finds them read).
        self.read_records(dir, FileId::of(&dir.state.join("attachments")));
        let Kept { records: Some(kept), links, .. } = self else { unreachable!("just read") };
        let node_mark = dir.divert_mark();
        aether_netns::tour_here(|| {
            // (Each record's key as made when they were read, not once more per pod.)
            Plan::make(&kept.records, node_mark, previous, new, |i, r| match links.get_mut(&kept.keys[i]) {
                // A pod reached before holds what this applier believes (its table read when
                // in doubt), without opening its netns each change.
                Some(l) if l.opened_for(r) => l.held(false).ok(),
                _ => flat(engine::open_pod(r).ok()?.run(aether_rules::services::held)).ok(),
            })
        })
        .map_err(ServicesError::Tour)
    }

    fn journal_room(&mut self, dir: &ServicesDir) -> bool {
        let now = FileId::of(&dir.journal_path());
        match &self.journal {
            // Its own journal, as it left it, with room (entries and bytes: what readers fold
            // and read stays bounded).
            Some(j) => {
                j.id.is_some_and(|id| id.size < journal::APPEND_BELOW)
                    && j.id == now
                    && j.entries < journal::MAX_ENTRIES
            }
            // A new journal, over the `layer.bin` the kept copy is of (`canonical_stored`
            // checked the files); never over one another process left (its entries would go).
            None => now.is_none(),
        }
    }

    fn append_journal(&mut self, dir: &ServicesDir, entry: &journal::Entry) -> Result<(), ServicesError> {
        let path = dir.journal_path();
        let write = |source| ServicesError::Write { path: path.clone(), source };
        let bytes = entry.encode();
        match &mut self.journal {
            Some(j) => {
                // Whatever happens, the identity it had is no longer vouched for.
                j.id = None;
                std::io::Write::write_all(&mut j.file, &bytes).map_err(write)?;
                j.id = FileId::of(&path);
                j.entries += 1;
            }
            None => {
                let base = layer_file::read_base(&dir.layer_path())?
                    .ok_or_else(|| write(std::io::Error::other("layer.bin is gone")))?;
                let mut whole = journal::header(&base);
                whole.extend_from_slice(&bytes);
                dir.write_atomic(journal::JOURNAL, &whole)?;
                let file = std::fs::OpenOptions::new().append(true).open(&path).map_err(write)?;
                self.journal = Some(KeptJournal { file, id: FileId::of(&path), entries: 1 });
            }
        }
        Ok(())
    }

    fn canonical_stored(&mut self, dir: &ServicesDir) -> Result<Option<StoredText<'_>>, ServicesError> {
        if self.stored.as_ref().is_some_and(|k| k.files == stored_ids(dir)) {
            // Handed over whole: a change edits the text in place, and `stored` keeps what
            // it becomes (an apply that stops before then leaves the next to read the files).
            let k = self.stored.take().expect("checked");
            return Ok(Some((Cow::Owned(k.text), k.layer, Some(k.index))));
        }
        self.stored = None;
        // Indexed at the first Service a change looks for, and kept with the text from then.
        Ok(dir.canonical_stored()?.map(|(text, layer)| (Cow::Owned(text), layer, Some(ServiceIndex::default()))))
    }

    fn stored(
        &mut self,
        dir: &ServicesDir,
        text: Cow<'_, [u8]>,
        index: Option<ServiceIndex>,
        layer: StoredLayer,
        canonical: bool,
    ) {
        let ids = stored_ids(dir);
        self.layer_bin = (ids[LAYER_BIN], ids[JOURNAL]);
        if self.journal.as_ref().is_some_and(|j| j.id.is_none() || j.id != self.layer_bin.1) {
            // Written whole (the journal removed), or not as this applier left it.
            self.journal = None;
        }
        // Kept only when the marker vouches for the document (it names the layer's source).
        self.stored = canonical.then(|| KeptStored {
            text: text.into_owned(),
            layer,
            files: ids,
            index: index.unwrap_or_default(),
        });
    }

    fn apply_to_pods(
        &mut self,
        dir: &ServicesDir,
        layers: (&StoredLayer, Option<&StoredLayer>),
        plan: &Plan,
        warnings: Vec<String>,
    ) -> Result<ApplyReport, ServicesError> {
        // On this thread (a tour of its own: `Netns::run` enters a pod in place), through the
        // kept links. A rebuild's socket is closed at once, waiting for the kernel to destroy
        // the layer it replaced before the next pod's: in a long-lived process under a memory
        // limit, the old layers are not left pending together.
        aether_netns::tour_here(|| engine::apply_to_pods(dir, layers, plan, warnings, self))
            .map_err(ServicesError::Tour)?
    }
}

#[cfg(test)]
mod tests;
