//! The Service-range and refusal-counter layer's node side: what `aether-cni services` does
//! for the agent, and the hooks a pod's attachment calls. Split by job: `snapshot` (the
//! agent's document and its checks), `layer_file` (`layer.bin`), `apply` (a document checked
//! and stored, and the stored layer to a new pod), `engine` (the one apply engine: what each
//! pod gets, done and recorded the same way whether it is reached by entering its netns or on
//! a kept socket), `applier` (the long-lived applier: a cache in front of the engine), `fold` (counts of removed layers), `report`
//! (counters, demand, verify, `inspect`'s view), `budget` (what the work will charge to this
//! process's memory cgroup, refused before it starts when that crosses the limit).
//!
//! State, under `<stateDir>/services/`:
//! - `snapshot.json`: the last accepted snapshot, exactly as the agent sent it (atomic write);
//! - `layer.bin`: the same snapshot as the layer needs it, compact and checksummed
//!   (`layer_file`), written after `snapshot.json`: what ADD loads (never the JSON), and the
//!   generation the next apply computes its element change from;
//! - `layer.journal`: the changes the installer's applier stored since the two files above
//!   were written whole, which every reader folds in (`journal`);
//! - `accumulator.json`: the final counts of pods DEL has folded in (node totals never go
//!   backwards when pods go), changed only under `counts.lock`, around its read and write;
//! - `encoded-<mark>`: the transaction the first ADD of the stored layer sent for that divert
//!   mark, which the next ADDs send as it is (`encoded`: valid only for the very `layer.bin`
//!   and binary that wrote it);
//! - `lock`: appliers (`services apply`, the installer's applier, `services verify`) hold it
//!   exclusively while they store a layer and bring the recorded pods to it; readers
//!   (`counters`, `demand`, `snapshot`) shared. ADD and DEL never take it.
//!
//! What each pod holds is in no file: its tables name it (`layer::Named`), and every change
//! swaps that name in the same transaction as its elements (`engine`). What keeps work on one
//! pod apart is the pod's own netns lock (`Netns::lock`, no file): ADD holds it while it
//! writes the record and builds the layer, DEL while it folds the counts, removes the layer
//! and forgets the record, an apply or repair while it visits the pod, rebuilding or
//! removing only while the record is there (`engine::recorded`; an element change needs no
//! look, as the kernel refuses it once the DEL removed the name it compares). An apply
//! lists the records after it stored its layer, and ADD reads the stored layer after it
//! wrote its record, so no pod misses a generation; and no pod start waits for another
//! pod's work or for an apply.

pub mod applier;
pub mod apply;
pub mod budget;
pub mod change;
mod encoded;
mod engine;
pub mod fold;
mod journal;
pub mod layer_file;
mod outcome;
mod plan;
pub mod report;
pub mod snapshot;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::state;
use crate::PodError;
pub use applier::Applier;
pub use apply::{
    apply_change, apply_current_snapshot_in_netns, apply_document, built_after_answer, ApplyReport, PodOutcome,
};
use apply::{generation_value, leading_generation};
pub use engine::{applied_run, AppliedRun};
pub use fold::{end_stale_fold, retire_layer, Retired};
pub use layer_file::{LayerFileError, StoredLayer};
pub use report::{
    describe_pod_layer, node_counters, node_demand, repair_pod_layer, stored_header, verify_pod_layer, verify_pods,
    LayerHeader, LayerVerdict, NodeCounters, PodVerified, VerifyReport,
};

/// A file's identity: a rewritten file (a new inode by rename, or new times) differs. What
/// vouches for a kept copy of a stored file (the applier's, ADD's kept transaction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileId {
    /// The identity of `path` itself (a symlink's own).
    fn of(path: &Path) -> Option<FileId> {
        fs::symlink_metadata(path).ok().map(|m| FileId::from(&m))
    }

    /// The identity of the file `path` names, through symlinks (`/proc/self/exe`).
    fn of_target(path: &Path) -> Option<FileId> {
        fs::metadata(path).ok().map(|m| FileId::from(&m))
    }

    fn from(m: &fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        }
    }

    /// Its fields as bytes (little-endian), for a file that records it.
    fn bytes(&self) -> [u8; 56] {
        let mut b = [0u8; 56];
        for (at, v) in [(0, self.dev), (8, self.ino), (16, self.size)] {
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        b[24..40].copy_from_slice(&self.mtime_ns.to_le_bytes());
        b[40..56].copy_from_slice(&self.ctime_ns.to_le_bytes());
        b
    }
}

/// Why the Service layer's node state cannot do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    #[error("cannot open state directory {}: {source}", path.display())]
    OpenState { path: PathBuf, source: std::io::Error },
    #[error("cannot open {}: {source}", path.display())]
    Open { path: PathBuf, source: std::io::Error },
    #[error("cannot create {}: {source}", path.display())]
    Create { path: PathBuf, source: std::io::Error },
    #[error("cannot lock {}: {source}", path.display())]
    Lock { path: PathBuf, source: std::io::Error },
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write {}: {source}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    /// `accumulator.json` exists but cannot be read: never taken for zero.
    #[error("{} is unreadable: {source}", path.display())]
    Accumulator { path: PathBuf, source: serde_json::Error },
    /// The stored `snapshot.json` (state from before `layer.bin`) no longer passes the checks.
    #[error("stored snapshot {} is invalid: {}", path.display(), reasons.join("; "))]
    StoredInvalid { path: PathBuf, reasons: Vec<String> },
    #[error(transparent)]
    LayerFile(#[from] LayerFileError),
    /// The agent's document is refused, with every reason (nothing changed).
    #[error("the snapshot is refused: {}", reasons.join("; "))]
    Refused { reasons: Vec<String> },
    #[error("generation: {new} is older than the stored generation {stored}; nothing changed")]
    OlderGeneration { new: u64, stored: u64 },
    /// A change document whose base is not the stored generation: the agent sends a whole
    /// snapshot instead.
    #[error("baseGeneration: {base} is not the stored generation {stored}; send a whole snapshot; nothing changed")]
    StaleBase { base: u64, stored: u64 },
    #[error("baseGeneration: {base}, but no snapshot is stored; send a whole snapshot; nothing changed")]
    NoBase { base: u64 },
    #[error("no Service snapshot is stored")]
    NoSnapshot,
    #[error("generation: {0} is already stored with different content; a new snapshot needs a new generation")]
    GenerationReused(u64),
    /// The pods' network namespaces cannot be toured (a thread, or the way home).
    #[error("cannot visit the pods' network namespaces: {0}")]
    Tour(aether_netns::Error),
    /// Work in one pod's netns failed.
    #[error(transparent)]
    Pod(#[from] PodError),
    /// Not started: what it would charge to this process's memory cgroup does not fit under
    /// its limit (nothing was changed).
    #[error("the Service layer: {0}")]
    OverBudget(crate::memcg::OverBudget),
}

impl ServicesError {
    /// What the agent is told, one line each: a refused document's every reason, or this.
    pub fn reasons(&self) -> Vec<String> {
        match self {
            ServicesError::Refused { reasons } => reasons.clone(),
            other => vec![other.to_string()],
        }
    }
}

/// The services part of the state directory.
pub struct ServicesDir {
    state: PathBuf,
    root: PathBuf,
    /// Whether the files releases before kept per pod were swept (`sweep_legacy_files`).
    legacy_swept: std::sync::OnceLock<()>,
    /// The directory the lock held now was taken in (`lock`): the holder's reads and writes
    /// of its files go through it, without opening the directory by path for each (an apply
    /// reads and writes a dozen small files).
    held: std::sync::Mutex<Option<std::sync::Arc<state::Dir>>>,
}

/// The services lock, held (`ServicesDir::lock`); released on drop.
pub(crate) struct ServicesLock<'a> {
    dir: &'a ServicesDir,
    _lock: state::Lock,
}

impl Drop for ServicesLock<'_> {
    fn drop(&mut self) {
        // Before the lock itself is released (the fields drop after this).
        *self.dir.held.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl ServicesDir {
    pub fn new(state_dir: &Path) -> Self {
        ServicesDir {
            state: state_dir.to_path_buf(),
            root: state_dir.join("services"),
            legacy_swept: Default::default(),
            held: Default::default(),
        }
    }

    /// The directory, created (0700) if `create`; `None` when absent and not created. While
    /// the lock is held, the one it was taken in.
    fn open(&self, create: bool) -> Result<Option<std::sync::Arc<state::Dir>>, ServicesError> {
        if let Some(dir) = self.held_dir() {
            return Ok(Some(dir));
        }
        let Some(root) = state::Dir::open(&self.state, create)
            .map_err(|source| ServicesError::OpenState { path: self.state.clone(), source })?
        else {
            return Ok(None);
        };
        let dir = root
            .subdir("services", create)
            .map_err(|source| ServicesError::Open { path: self.root.clone(), source })?;
        Ok(dir.map(std::sync::Arc::new))
    }

    fn held_dir(&self) -> Option<std::sync::Arc<state::Dir>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The lock, taken in the directory as it is at its path now (never in one kept from
    /// before: a directory replaced since would hold another lock file).
    fn lock(&self, exclusive: bool) -> Result<ServicesLock<'_>, ServicesError> {
        let root = state::Dir::open(&self.state, true)
            .map_err(|source| ServicesError::OpenState { path: self.state.clone(), source })?
            .expect("created");
        let dir = root
            .subdir("services", true)
            .map_err(|source| ServicesError::Open { path: self.root.clone(), source })?
            .expect("created");
        let lock = dir
            .lock("lock", exclusive, None)
            .map_err(|source| ServicesError::Lock { path: self.root.join("lock"), source })?;
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::sync::Arc::new(dir));
        Ok(ServicesLock { dir: self, _lock: lock })
    }

    /// For readers (`counters`, `demand`): the shared lock if the directory exists, and
    /// nothing created when it does not (no snapshot was ever applied).
    fn read_lock(&self) -> Result<Option<state::Lock>, ServicesError> {
        match self.open(false)? {
            None => Ok(None),
            Some(dir) => dir
                .lock_existing_shared("lock")
                .map_err(|source| ServicesError::Lock { path: self.root.join("lock"), source }),
        }
    }

    fn write_atomic(&self, name: &str, body: &[u8]) -> Result<(), ServicesError> {
        let dir = self.open(true)?.expect("created");
        dir.write_atomic(name, body).map_err(|source| ServicesError::Write { path: self.root.join(name), source })
    }

    /// Removes a file of the directory, if there.
    fn remove(&self, name: &str) -> Result<(), ServicesError> {
        let dir = self.open(true)?.expect("created");
        dir.remove(name).map(drop).map_err(|source| ServicesError::Write { path: self.root.join(name), source })
    }

    /// A file of the directory, capped in size; `None` if absent.
    fn read(&self, name: &str) -> Result<Option<Vec<u8>>, ServicesError> {
        let read = match self.held_dir() {
            Some(dir) => dir.read(name, state::MAX_STATE_FILE_BYTES),
            None => state::read_capped(&self.root.join(name), state::MAX_STATE_FILE_BYTES),
        };
        read.map_err(|source| ServicesError::Read { path: self.root.join(name), source })
    }

    fn layer_path(&self) -> PathBuf {
        self.root.join("layer.bin")
    }

    /// The accepted snapshot's layer, from `layer.bin`. A damaged file is reported, never
    /// silently ignored. State from before `layer.bin` existed (an upgrade) has only
    /// `snapshot.json`: it is parsed instead, within the snapshot limits, until the next
    /// apply writes `layer.bin`.
    pub fn stored_layer(&self) -> Result<Option<StoredLayer>, ServicesError> {
        if let Some((l, base)) = layer_file::read_with_base(&self.layer_path())? {
            return Ok(Some(journal::fold(l, &self.journal(&base)?)));
        }
        let path = self.root.join("snapshot.json");
        let mut text = Vec::new();
        match fs::File::open(&path) {
            Ok(f) => f
                .take(snapshot::MAX_SNAPSHOT_BYTES as u64 + 1)
                .read_to_end(&mut text)
                .map_err(|source| ServicesError::Read { path: path.clone(), source })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ServicesError::Read { path, source }),
        };
        snapshot::parse(&text)
            // No source digest: the next apply, whatever it sends, writes `layer.bin`.
            .map(|s| Some(StoredLayer::new(s.generation, &s.layer(0), 0)))
            .map_err(|r| ServicesError::StoredInvalid { path, reasons: r.reasons })
    }

    fn journal_path(&self) -> PathBuf {
        self.root.join(journal::JOURNAL)
    }

    /// The journal's entries over `layer.bin` (`base`).
    fn journal(&self, base: &layer_file::Base) -> Result<Vec<journal::Entry<'static>>, ServicesError> {
        let path = self.journal_path();
        journal::read(&path, base).map_err(|source| ServicesError::Read { path, source })
    }

    /// The stored generation and source digest, from `layer.bin`'s header and the journal
    /// (a source digest of 0 while the journal extends it: no document is known whole by its
    /// digest).
    pub(super) fn stored_header(&self) -> Result<Option<(u64, u64)>, ServicesError> {
        let Some(base) = layer_file::read_base(&self.layer_path())? else { return Ok(None) };
        Ok(Some(match self.journal(&base)?.last() {
            Some(e) => (e.generation, 0),
            None => (base.generation, base.source),
        }))
    }

    /// The generation of `text` when `text` is the stored `snapshot.json` byte for byte but
    /// for the value of its top-level `generation`, and that file is the one `layer.bin`
    /// (`stored`: its generation and source digest, from its header) was made from: the same
    /// content, already checked and in force, under a new generation. With the source digest,
    /// for the caller to check under the lock. `None` whenever that is not certain: the
    /// document is then read and checked in full. Costs a skim of the document (the
    /// generation found, the rest skipped) and a comparison, about a fifth of a full reading.
    fn stored_with_new_generation(&self, text: &[u8], stored: (u64, u64)) -> Option<(u64, u64)> {
        let (stored_generation, stored_source) = stored;
        // A generation is at most 20 digits: documents further apart in size differ in more.
        let path = self.root.join("snapshot.json");
        if fs::metadata(&path).ok()?.len().abs_diff(text.len() as u64) > 20 {
            return None;
        }
        let stored = self.read("snapshot.json").ok()??;
        // `snapshot.source` vouches for the document without hashing it again.
        if self.source_marker().is_none_or(|(named, _)| named != stored_source)
            && layer_file::source_digest(&stored) != stored_source
        {
            return None;
        }
        let (span, generation) = leading_generation(text).or_else(|| generation_value(text))?;
        // The same bytes up to the generation put the stored document's parser at its own
        // top-level generation value there too; the stored value is canonical digits (a
        // stored document was read as a u64), and everything after it must be the same.
        let stored_value = stored_generation.to_string();
        let stored_end = span.start + stored_value.len();
        let same = text[..span.start] == stored[..span.start.min(stored.len())]
            && stored.get(span.start..stored_end) == Some(stored_value.as_bytes())
            && text[span.end..] == stored[stored_end..];
        same.then_some((generation, stored_source))
    }

    /// Removes what releases before this one kept of what each pod holds (`pods/`,
    /// `pods.moves`, the `applying` mark and its spare: the pods' tables say it now), the
    /// spares of the stored files (the journal made whole writes rare) and `divert-mark`
    /// (each record names its mark). Once per
    /// `ServicesDir`, under the exclusive lock. Left behind, a release rolled back to would
    /// trust files that no longer say what the pods hold.
    fn sweep_legacy_files(&self) {
        if self.legacy_swept.set(()).is_err() {
            return;
        }
        for name in
            ["pods.moves", "applying", ".applying.spare", ".snapshot.json.spare", ".layer.bin.spare", "divert-mark"]
        {
            let _ = fs::remove_file(self.root.join(name));
        }
        let _ = fs::remove_dir_all(self.root.join("pods"));
    }

    /// The divert mark of a pod whose record names no capture (records of the first
    /// releases): the default. (Releases before this one also kept ADD's last mark in
    /// `divert-mark`; every record names its own now, and the file is swept.)
    fn divert_mark(&self) -> u32 {
        aether_rules::capture::DIVERT_MARK
    }
}

/// The outcome of work done inside a netns.
fn flat<T>(r: Result<aether_rules::Result<T>, aether_netns::Error>) -> Result<T, PodError> {
    r.map_err(PodError::Netns).and_then(|r| r.map_err(PodError::Kernel))
}

#[cfg(test)]
mod tests;
