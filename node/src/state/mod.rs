//! The node state directory: one record per attachment, the node-readiness marker, and the
//! lock that keeps GC apart from ADD and DEL.
//!
//! Every file is created and opened relative to its directory's file descriptor, never
//! following a symlink at the last component (`O_NOFOLLOW`), and new files are created
//! exclusively (`O_EXCL`): a symlink planted at a temp-file, lock or probe name makes the
//! operation fail instead of writing through it. Directories are 0700 and files 0600
//! (records name pods and namespaces). Writes are atomic (an exclusive temp file, fsync,
//! rename), so a reader sees the old record or the new one, never a torn one; a crash leaves
//! at worst a temp file, which readers ignore and GC removes once its writer is dead. Every
//! read is capped in size ([`MAX_RECORD_BYTES`], [`MAX_STATE_FILE_BYTES`]).

mod build_slot;
mod dir;
mod record;
mod uninstall;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use build_slot::{BuildSlot, BUILD_SLOTS_FILE};
use dir::is_stale_temp;
pub use dir::{overwrite_file, read_capped, Dir, Lock};
pub use record::{config_digest, parse_record, NetnsIdentity, PodIdentity, PodNetns, Record, RecordError, Recorded};
pub use uninstall::{
    finish_uninstall, keep_binary_for_attachment, UninstallError, Uninstalled, RELOAD_GRACE, UNINSTALLED_FILE,
};

use crate::text::clip;

/// Why the state directory cannot do what was asked. The I/O error, where there is one, is
/// the source (the CNI error's details).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Something is at the state directory's path that cannot serve as one.
    #[error("state directory {} {why}", root.display())]
    Unusable { root: PathBuf, why: String },
    #[error("cannot open state directory {}", path.display())]
    OpenRoot { path: PathBuf, source: std::io::Error },
    #[error("cannot open {}", path.display())]
    Open { path: PathBuf, source: std::io::Error },
    #[error("cannot lock {}", path.display())]
    Lock { path: PathBuf, source: std::io::Error },
    /// GC waited its bound for the exclusive lock (the CNI's "try again").
    #[error("the state directory {} is busy: ADDs and DELs held its lock for {waited:?}; try again later", root.display())]
    Busy { root: PathBuf, waited: Duration },
    #[error("cannot write attachment record {}", path.display())]
    WriteRecord { path: PathBuf, source: std::io::Error },
    #[error("cannot remove {}", path.display())]
    Remove { path: PathBuf, source: std::io::Error },
    #[error("state directory {} is not writable", path.display())]
    NotWritable { path: PathBuf, source: std::io::Error },
}

impl StateError {
    /// The operating system's error under this one, if any.
    pub fn io_source(&self) -> Option<&std::io::Error> {
        match self {
            StateError::Unusable { .. } | StateError::Busy { .. } => None,
            StateError::OpenRoot { source, .. }
            | StateError::Open { source, .. }
            | StateError::Lock { source, .. }
            | StateError::WriteRecord { source, .. }
            | StateError::Remove { source, .. }
            | StateError::NotWritable { source, .. } => Some(source),
        }
    }
}

/// The shapes of the capture ruleset a record names (the current one: `CURRENT`).
pub use aether_rules::RulesetVersion;

/// Present while the installer has marked the node not ready; its content is the reason.
pub const NOT_READY_MARKER: &str = "node-not-ready";
/// The installer's reconciler's last pass, written by it and read by `aether-cni inspect`.
pub const LAST_PASS_FILE: &str = "reconciler-last-pass.json";
/// The version of the attachment record this plugin writes. Version 0 is the record before
/// versioning (no `version` field); every version is read, missing fields taking defaults.
pub const RECORD_VERSION: u32 = 1;
/// An attachment record is about a kilobyte; anything past this is not one.
pub const MAX_RECORD_BYTES: u64 = 64 * 1024;
/// The cap on any other state file read (the Service snapshot, the accumulator).
pub const MAX_STATE_FILE_BYTES: u64 = 64 * 1024 * 1024;
/// A temp file older than this whose writer is gone is left over from a crash.
pub const STALE_TEMP_AGE: Duration = Duration::from_secs(60);
/// How long GC waits for the exclusive lock before giving up with code 11 (try again).
pub const GC_LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// A file in the attachments directory that is not a readable record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub file: String,
    pub why: String,
}

/// What the attachments directory holds.
#[derive(Debug, Default)]
pub struct Scan {
    pub records: Vec<Record>,
    /// Record files that cannot be read (too big, not JSON, not a record): reported, never
    /// silently skipped.
    pub unreadable: Vec<Unreadable>,
    /// Temp files of dead writers (see [`is_stale_temp`]).
    pub stale_temps: Vec<String>,
}

pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: &Path) -> Self {
        StateDir { root: root.to_path_buf() }
    }

    fn open_root(&self, create: bool) -> Result<Option<Dir>, StateError> {
        Dir::open(&self.root, create).map_err(|source| match unusable_reason(&self.root) {
            Some(why) => StateError::Unusable { root: self.root.clone(), why },
            None => StateError::OpenRoot { path: self.root.clone(), source },
        })
    }

    /// The directory's path.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The attachments directory: created if `create`, else `None` when absent.
    fn attachments(&self, create: bool) -> Result<Option<Dir>, StateError> {
        let Some(root) = self.open_root(create)? else { return Ok(None) };
        root.subdir("attachments", create).map_err(|source| StateError::Open { path: root.join("attachments"), source })
    }

    /// Creates the directories if needed (0700).
    pub fn ensure(&self) -> Result<(), StateError> {
        self.attachments(true).map(|_| ())
    }

    /// Shared for ADD and DEL (which run in parallel for different pods), exclusive for GC.
    ///
    /// Fair to GC: everyone passes a turnstile (`lock.turnstile`) to take the lock, and GC
    /// holds the turnstile while it waits for the lock, so ADDs and DELs that keep coming
    /// cannot starve it; GC still waits at most [`GC_LOCK_TIMEOUT`], then fails with code 11.
    pub fn lock(&self, exclusive: bool) -> Result<Lock, StateError> {
        self.lock_within(exclusive, if exclusive { gc_lock_timeout() } else { None })
    }

    fn lock_within(&self, exclusive: bool, timeout: Option<Duration>) -> Result<Lock, StateError> {
        let root = self.open_root(true)?.expect("created");
        self.ensure()?;
        let busy = |source: std::io::Error| {
            if source.kind() == std::io::ErrorKind::TimedOut {
                StateError::Busy { root: self.root.clone(), waited: timeout.unwrap_or_default() }
            } else {
                StateError::Lock { path: root.join("lock"), source }
            }
        };
        let started = Instant::now();
        let turnstile = root.lock("lock.turnstile", true, timeout).map_err(busy)?;
        let rest = timeout.map(|t| t.saturating_sub(started.elapsed()));
        let lock = root.lock("lock", exclusive, rest).map_err(busy)?;
        drop(turnstile);
        Ok(lock)
    }

    /// File names are built from validated parts (network names and container IDs are
    /// restricted by the spec; ifnames by the kernel), joined by a separator none contains.
    pub(crate) fn record_name(network: &str, container_id: &str, ifname: &str) -> String {
        let safe = |s: &str| s.replace(|c: char| !(c.is_ascii_alphanumeric() || "_.-".contains(c)), "_");
        format!("{}+{}+{}.json", safe(network), safe(container_id), safe(ifname))
    }

    pub fn write(&self, rec: &Record) -> Result<(), StateError> {
        let dir = self.attachments(true)?.expect("created");
        let name = Self::record_name(&rec.network, &rec.container_id, &rec.ifname);
        let body = serde_json::to_vec_pretty(rec).expect("records serialize");
        dir.write_atomic(&name, &body).map_err(|source| StateError::WriteRecord { path: dir.join(&name), source })
    }

    /// The record of an attachment: `Ok(None)` when there is none, an error naming the file
    /// when it exists but cannot be read.
    pub fn read(&self, network: &str, container_id: &str, ifname: &str) -> Result<Option<Record>, Unreadable> {
        let name = Self::record_name(network, container_id, ifname);
        let unreadable = |why: String| Unreadable { file: name.clone(), why };
        let dir = self.attachments(false).map_err(|e| unreadable(e.to_string()))?;
        let Some(dir) = dir else { return Ok(None) };
        match dir.read(&name, MAX_RECORD_BYTES) {
            Ok(None) => Ok(None),
            Ok(Some(d)) => parse_record(&d).map(Some).map_err(|e| unreadable(e.to_string())),
            Err(e) => Err(unreadable(e.to_string())),
        }
    }

    /// When the record of an attachment was last written (its inode's change time), without
    /// reading it: `Ok(None)` when there is none. One `stat`, for checks repeated per pod
    /// (an apply's visit) that only need to know whether it is still the record they read.
    pub fn record_changed_at(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
    ) -> std::io::Result<Option<std::time::SystemTime>> {
        use std::os::unix::fs::MetadataExt;
        let path = self.root.join("attachments").join(Self::record_name(network, container_id, ifname));
        match std::fs::symlink_metadata(path) {
            Ok(m) => {
                let since_epoch = Duration::new(m.ctime().max(0) as u64, m.ctime_nsec().clamp(0, 999_999_999) as u32);
                Ok(Some(std::time::UNIX_EPOCH + since_epoch))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes a record; absence is fine.
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> Result<(), StateError> {
        self.remove_file(&Self::record_name(network, container_id, ifname))
    }

    /// Removes a file of the attachments directory by name; absence is fine.
    pub fn remove_file(&self, name: &str) -> Result<(), StateError> {
        let Some(dir) = self.attachments(false)? else { return Ok(()) };
        dir.remove(name).map(|_| ()).map_err(|source| StateError::Remove { path: dir.join(name), source })
    }

    /// Every record (of all networks), every file that is not a readable record, and the
    /// temp files of dead writers. Reading never creates the directory.
    pub fn scan(&self) -> Scan {
        let mut scan = Scan::default();
        let dir = match self.attachments(false) {
            Ok(Some(d)) => d,
            Ok(None) => return scan,
            Err(e) => {
                scan.unreadable.push(Unreadable { file: "attachments".into(), why: e.to_string() });
                return scan;
            }
        };
        let names = match dir.names() {
            Ok(n) => n,
            Err(e) => {
                scan.unreadable.push(Unreadable { file: dir.path().display().to_string(), why: e.to_string() });
                return scan;
            }
        };
        for name in names {
            if name.starts_with('.') {
                if dir.metadata(&name).is_ok_and(|m| is_stale_temp(&name, &m)) {
                    scan.stale_temps.push(name);
                }
                continue;
            }
            let parsed = match dir.read(&name, MAX_RECORD_BYTES) {
                Ok(Some(d)) => parse_record(&d).map_err(|e| e.to_string()),
                Ok(None) => continue, // removed meanwhile
                Err(e) => Err(e.to_string()),
            };
            match parsed {
                Ok(r) => scan.records.push(r),
                Err(why) => scan.unreadable.push(Unreadable { file: name, why: clip(&why, 200) }),
            }
        }
        scan.records
            .sort_by(|a, b| (&a.network, &a.container_id, &a.ifname).cmp(&(&b.network, &b.container_id, &b.ifname)));
        scan
    }

    /// Every readable record; for callers that also report the unreadable, see [`scan`].
    pub fn records(&self) -> Vec<Record> {
        self.scan().records
    }

    /// The reason the node is marked not ready, if it is.
    pub fn not_ready_reason(&self) -> Option<String> {
        let root = self.open_root(false).ok().flatten()?;
        match root.read(NOT_READY_MARKER, 4096) {
            Ok(Some(d)) => Some(String::from_utf8_lossy(&d).trim().to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("{NOT_READY_MARKER} cannot be read: {e}")),
        }
    }

    /// Proves the directory is usable: create (exclusively, never through a symlink), write
    /// and remove a file in it.
    pub fn probe_writable(&self) -> Result<(), StateError> {
        let root = self.open_root(true)?.expect("created");
        self.ensure()?;
        let name = format!(".probe.{}", std::process::id());
        let fail = |source| StateError::NotWritable { path: self.root.clone(), source };
        let _ = root.remove(&name); // our own PID's leftover, if any
        let mut f = root.openat(&name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600).map_err(fail)?;
        let written = f.write_all(b"ok").and_then(|()| f.sync_all());
        let _ = root.remove(&name);
        written.map_err(fail)
    }
}

/// Why `root` cannot serve as a state directory although something is there: a file, a
/// dangling symlink, a symlink to a file. `None` when it is a directory (or a symlink to
/// one) or does not exist yet (it is created when first needed).
pub fn unusable_reason(root: &Path) -> Option<String> {
    use std::io::ErrorKind;
    let kind = |m: &std::fs::Metadata| {
        if m.is_file() {
            "a regular file"
        } else if m.is_dir() {
            "a directory"
        } else {
            "neither a file nor a directory"
        }
    };
    let link = match std::fs::symlink_metadata(root) {
        Err(e) if e.kind() == ErrorKind::NotFound => return None,
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Some("cannot exist: a parent directory on its path is a file".into())
        }
        Err(e) => return Some(format!("cannot be read: {e}")),
        Ok(m) => m,
    };
    if !link.file_type().is_symlink() {
        return (!link.is_dir()).then(|| format!("is {}, not a directory", kind(&link)));
    }
    let target = std::fs::read_link(root).map(|t| t.display().to_string()).unwrap_or_else(|_| "?".into());
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => None,
        Ok(m) => Some(format!("is a symlink to {target}, which is {}, not a directory", kind(&m))),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            Some(format!("is a dangling symlink: its target {target} does not exist"))
        }
        Err(e) => Some(format!("is a symlink to {target}, which cannot be read: {e}")),
    }
}

/// A point where a test may have the process SIGKILLed (`AETHER_CNI_CRASH_AT=<name>`), to
/// prove what a crash exactly there leaves. Compiled in only with `fault-injection`.
pub fn crash_point(name: &str) {
    #[cfg(feature = "fault-injection")]
    if std::env::var("AETHER_CNI_CRASH_AT").as_deref() == Ok(name) {
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let _ = name;
}

/// A point where a test may hold the process (`AETHER_CNI_PAUSE_AT=<name>`), to put its own
/// step exactly there: the point creates the file `AETHER_CNI_PAUSE_FILE` and waits until the
/// test removes it (30 s at most), the first time it is reached in the process. Compiled in
/// only with `fault-injection`.
pub fn pause_point(name: &str) {
    #[cfg(feature = "fault-injection")]
    {
        static PAUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let here = std::env::var("AETHER_CNI_PAUSE_AT").is_ok_and(|at| at == name);
        if let (true, Some(file)) = (here, std::env::var_os("AETHER_CNI_PAUSE_FILE")) {
            if !PAUSED.swap(true, std::sync::atomic::Ordering::SeqCst) {
                let file = std::path::Path::new(&file);
                // A pause the test cannot see would pass as no pause: fail loudly instead.
                if let Err(e) = std::fs::write(file, b"") {
                    panic!("the pause point {name} cannot make {}: {e}", file.display());
                }
                let until = Instant::now() + Duration::from_secs(30);
                while file.exists() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }
    let _ = name;
}

/// Whether a test asked the step `name` of DEL to fail (`AETHER_CNI_INJECT_FAILURE=<name>`):
/// the step returns an error instead of going on, as a DEL failing there would. Compiled in
/// only with `fault-injection`.
pub fn fails_here(name: &str) -> bool {
    #[cfg(feature = "fault-injection")]
    if std::env::var("AETHER_CNI_INJECT_FAILURE").as_deref() == Ok(name) {
        return true;
    }
    let _ = name;
    false
}

/// GC's bound on its lock wait; tests may shorten it (fault-injection builds only).
fn gc_lock_timeout() -> Option<Duration> {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("AETHER_CNI_GC_LOCK_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()) {
        return Some(Duration::from_millis(ms));
    }
    Some(GC_LOCK_TIMEOUT)
}

#[cfg(test)]
mod tests;
