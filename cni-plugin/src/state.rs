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

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use aether_netns::Netns;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{clip, code, CniError};

/// Present while the installer has marked the node not ready; its content is the reason.
pub const NOT_READY_MARKER: &str = "node-not-ready";
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

/// The identity of the network namespace ADD programmed: its nsfs device and inode, and its
/// cookie (the inode alone is handed to the next namespace once this one is freed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetnsIdentity {
    pub dev: u64,
    pub ino: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cookie: Option<u64>,
}

impl NetnsIdentity {
    pub fn of(ns: &Netns) -> Self {
        let id = ns.id();
        NetnsIdentity { dev: id.dev, ino: id.ino, cookie: ns.cookie().ok() }
    }

    /// Whether `ns` is this namespace (the cookie compared when both sides have one).
    pub fn matches(&self, ns: &Netns) -> bool {
        let id = ns.id();
        if (id.dev, id.ino) != (self.dev, self.ino) {
            return false;
        }
        match (self.cookie, ns.cookie().ok()) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// [`RECORD_VERSION`] when written; 0 for records written before versioning.
    #[serde(default)]
    pub version: u32,
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    /// The namespace ADD programmed (absent in version 0 records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_id: Option<NetnsIdentity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// [`config_digest`] of `capture`: for people and logs; CHECK compares `capture` itself.
    #[serde(default)]
    pub config_digest: String,
    /// The capture configuration ADD programmed, so DEL, GC, CHECK and `inspect` know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<aether_rules::CaptureConfig>,
    /// Capture fields the stored record lacked (an older plugin's), read as their defaults.
    #[serde(skip)]
    pub defaulted: Vec<String>,
}

/// Where a record's pod netns stands now.
#[derive(Debug)]
pub enum PodNetns {
    /// The namespace ADD programmed, still at the recorded path.
    Live(Netns),
    /// Gone: the path names nothing, something that is not a namespace, or another namespace
    /// than the one ADD programmed (a path reused, a PID reused). Nothing may act on it.
    Gone(String),
}

impl Record {
    /// A record for what ADD just programmed in `ns`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        network: &str,
        container_id: &str,
        ifname: &str,
        ns: &Netns,
        netns_path: &str,
        pod: &crate::env::CniArgs,
        capture: aether_rules::CaptureConfig,
    ) -> Record {
        Record {
            version: RECORD_VERSION,
            network: network.into(),
            container_id: container_id.into(),
            ifname: ifname.into(),
            netns: netns_path.into(),
            netns_id: Some(NetnsIdentity::of(ns)),
            pod_namespace: pod.pod_namespace.clone(),
            pod_name: pod.pod_name.clone(),
            pod_uid: pod.pod_uid.clone(),
            config_digest: config_digest(&capture),
            capture: Some(capture),
            defaulted: Vec::new(),
        }
    }

    /// Whether `ns` is the namespace this record's ADD programmed. A version 0 record has no
    /// identity: then any namespace at its path is taken for the pod's.
    pub fn owns(&self, ns: &Netns) -> bool {
        self.netns_id.is_none_or(|id| id.matches(ns))
    }

    /// Opens the recorded netns if it is still the pod's (see [`PodNetns`]). Errors other
    /// than "not there" (e.g. permission) are returned: the record must then be kept.
    pub fn open_netns(&self) -> Result<PodNetns, aether_netns::Error> {
        self.open_netns_at(&self.netns)
    }

    /// Like [`Record::open_netns`], at `path` (a DEL's `CNI_NETNS`).
    pub fn open_netns_at(&self, path: &str) -> Result<PodNetns, aether_netns::Error> {
        use aether_netns::Error as E;
        match Netns::open_foreign(path) {
            Ok(ns) if self.owns(&ns) => Ok(PodNetns::Live(ns)),
            Ok(ns) => Ok(PodNetns::Gone(format!(
                "{path} is now another network namespace ({}) than the one ADD programmed",
                ns.id()
            ))),
            Err(e @ (E::NotFound { .. } | E::NotANamespace { .. } | E::HostNamespace { .. })) => {
                Ok(PodNetns::Gone(e.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    /// The key of this attachment, as people read it.
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.network, self.container_id, self.ifname)
    }
}

/// Parses a stored record of any version: unknown fields are ignored, missing capture
/// fields take the defaults the capture configuration has always had (named in
/// `defaulted`), and what cannot be read is an error saying why.
pub fn parse_record(bytes: &[u8]) -> Result<Record, String> {
    let mut v: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object_mut().ok_or("not a JSON object")?;
    let version = obj.get("version").map_or(Some(0), Value::as_u64).ok_or("\"version\" is not a number")?;
    let mut defaulted = Vec::new();
    if let Some(Value::Object(capture)) = obj.get_mut("capture") {
        let mode = capture.get("mode").cloned().map(serde_json::from_value).transpose();
        let mode = mode.map_err(|e| format!("capture.mode: {e}"))?.unwrap_or(aether_rules::CaptureMode::RedirectAll);
        let Value::Object(defaults) =
            serde_json::to_value(aether_rules::CaptureConfig::new(mode)).expect("capture config serializes")
        else {
            unreachable!("a struct serializes to an object")
        };
        for (k, d) in defaults {
            if !capture.contains_key(&k) {
                defaulted.push(k.clone());
                capture.insert(k, d);
            }
        }
    }
    let mut rec: Record = serde_json::from_value(v).map_err(|e| format!("version {version} record: {e}"))?;
    rec.defaulted = defaulted;
    Ok(rec)
}

/// A stable digest of a capture configuration: FNV-1a of its JSON with keys sorted, so it
/// depends on the values alone (not on field order, nor on `Debug` formatting).
pub fn config_digest(cfg: &aether_rules::CaptureConfig) -> String {
    fn canonical(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    canonical(&m[k], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    canonical(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut text = String::new();
    canonical(&serde_json::to_value(cfg).expect("capture config serializes"), &mut text);
    fnv1a(&text)
}

fn fnv1a(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn io_error(what: String, e: std::io::Error) -> CniError {
    CniError::new(code::IO_FAILURE, what).with_details(e.to_string())
}

fn cstr(name: &OsStr) -> std::io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

fn check(rc: libc::c_int) -> std::io::Result<libc::c_int> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A directory opened once; every file operation is relative to it and never follows a
/// symlink at the file's own name.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Opens `path` (symlinks in the path itself are the operator's choice and followed),
    /// creating it and its parents (0700) if `create`. `None` when it does not exist.
    pub fn open(path: &Path, create: bool) -> std::io::Result<Option<Dir>> {
        let c = cstr(path.as_os_str())?;
        let open = || check(unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) });
        // Opened first, created only when missing: it exists for every command but the
        // node's first, and a mkdir that fails with EEXIST costs a fresh ADD more than the open.
        let opened = match open() {
            Err(e) if create && e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path)?;
                open()
            }
            opened => opened,
        };
        match opened {
            Ok(fd) => {
                let dir = Dir { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: path.to_path_buf() };
                if create {
                    dir.restrict()?;
                }
                Ok(Some(dir))
            }
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The subdirectory `name` (never through a symlink), created 0700 if `create`.
    pub fn subdir(&self, name: &str, create: bool) -> std::io::Result<Option<Dir>> {
        let c = cstr(OsStr::new(name))?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        let open = || check(unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags) });
        // As in `open`: created only when the open finds nothing there.
        let opened = match open() {
            Err(e) if create && e.kind() == std::io::ErrorKind::NotFound => {
                match check(unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), 0o700) }) {
                    Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
                    _ => {}
                }
                open()
            }
            opened => opened,
        };
        match opened {
            Ok(fd) => {
                let dir = Dir { fd: unsafe { OwnedFd::from_raw_fd(fd) }, path: self.path.join(name) };
                if create {
                    dir.restrict()?;
                }
                Ok(Some(dir))
            }
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Directories made by older releases were 0755: make them 0700.
    fn restrict(&self) -> std::io::Result<()> {
        let meta = self.file_metadata()?;
        if meta.permissions().mode() & 0o077 != 0 {
            check(unsafe { libc::fchmod(self.fd.as_raw_fd(), 0o700) })?;
        }
        Ok(())
    }

    fn file_metadata(&self) -> std::io::Result<std::fs::Metadata> {
        // The directory's own fd, borrowed (never closed here): no dup just to stat it.
        std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(self.fd.as_raw_fd()) }).metadata()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn openat(&self, name: &str, flags: libc::c_int, mode: libc::mode_t) -> std::io::Result<File> {
        let c = cstr(OsStr::new(name))?;
        let fd = check(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        })?;
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// The content of regular file `name`, `None` if it does not exist; an error if it is
    /// not a regular file or is larger than `cap` bytes (naming the limit).
    pub fn read(&self, name: &str, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
        let f = match self.openat(name, libc::O_RDONLY | libc::O_NONBLOCK, 0) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let meta = f.metadata()?;
        if !meta.file_type().is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        if meta.len() > cap {
            return Err(std::io::Error::other(format!("{} bytes, over the limit of {cap} bytes", meta.len())));
        }
        let mut out = Vec::with_capacity(meta.len() as usize);
        f.take(cap + 1).read_to_end(&mut out)?;
        if out.len() as u64 > cap {
            return Err(std::io::Error::other(format!("over the limit of {cap} bytes")));
        }
        Ok(Some(out))
    }

    /// Writes `name` atomically: an exclusive temp file (0600) beside it, fsync, rename.
    pub fn write_atomic(&self, name: &str, body: &[u8]) -> std::io::Result<()> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let (tmp, mut f) = loop {
            // Unpredictable enough, and exclusive: a file planted at the name only costs a retry.
            let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
            let tmp =
                format!(".{name}.tmp.{}.{:x}{:x}", std::process::id(), nanos, SEQ.fetch_add(1, Ordering::Relaxed));
            match self.openat(&tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600) {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        };
        let mut write = || -> std::io::Result<()> {
            f.write_all(body)?;
            f.sync_all()?;
            let (old, new) = (cstr(OsStr::new(&tmp))?, cstr(OsStr::new(name))?);
            check(unsafe { libc::renameat(self.fd.as_raw_fd(), old.as_ptr(), self.fd.as_raw_fd(), new.as_ptr()) })?;
            Ok(())
        };
        write().inspect_err(|_| {
            let _ = self.remove(&tmp);
        })
    }

    /// Removes `name`; `false` if it was not there.
    pub fn remove(&self, name: &str) -> std::io::Result<bool> {
        let c = cstr(OsStr::new(name))?;
        match check(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) }) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The names in the directory (no `.`/`..`).
    pub fn names(&self) -> std::io::Result<Vec<String>> {
        // read_dir needs a path: the fd's own, so a directory swapped since opening is not read.
        let mut out: Vec<String> = std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        out.sort();
        Ok(out)
    }

    /// `lstat` of `name`.
    pub fn metadata(&self, name: &str) -> std::io::Result<std::fs::Metadata> {
        let f = self.openat(name, libc::O_PATH, 0)?;
        f.metadata()
    }

    /// A shared or exclusive `flock` on `name` (created 0600 if missing, never through a
    /// symlink), waiting at most `timeout` (forever if `None`).
    pub fn lock(&self, name: &str, exclusive: bool, timeout: Option<Duration>) -> std::io::Result<Lock> {
        let f = self.openat(name, libc::O_RDWR | libc::O_CREAT, 0o600)?;
        flock(f, exclusive, timeout)
    }

    /// Like [`Dir::lock`] on an existing lock file, shared, for readers: `None` when the
    /// lock file does not exist (nothing was ever written, so nothing to keep apart from).
    pub fn lock_existing_shared(&self, name: &str) -> std::io::Result<Option<Lock>> {
        match self.openat(name, libc::O_RDONLY, 0) {
            Ok(f) => flock(f, false, None).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// A lock on a state file, released on drop.
#[derive(Debug)]
pub struct Lock(File);

impl Drop for Lock {
    fn drop(&mut self) {
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn flock(f: File, exclusive: bool, timeout: Option<Duration>) -> std::io::Result<Lock> {
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
    let Some(timeout) = timeout else {
        check(unsafe { libc::flock(f.as_raw_fd(), op) })?;
        return Ok(Lock(f));
    };
    let deadline = Instant::now() + timeout;
    loop {
        match check(unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) }) {
            Ok(_) => return Ok(Lock(f)),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("still busy after {timeout:?}")))
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads `path`, at most `cap` bytes (see [`Dir::read`]); `None` if it does not exist.
pub fn read_capped(path: &Path, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
    let (dir, name) = parent_and_name(path)?;
    match Dir::open(&dir, false)? {
        Some(d) => d.read(&name, cap),
        None => Ok(None),
    }
}

fn parent_and_name(path: &Path) -> std::io::Result<(PathBuf, String)> {
    match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) => Ok((p.to_path_buf(), n.to_string_lossy().into_owned())),
        _ => Err(std::io::Error::from(std::io::ErrorKind::InvalidInput)),
    }
}

/// A temp file a writer left (`.<name>.tmp.<pid>[.<nonce>]`) whose writer is gone and which
/// is older than [`STALE_TEMP_AGE`]: left over from a crash.
fn is_stale_temp(name: &str, meta: &std::fs::Metadata) -> bool {
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.split_once(".tmp.")).map(|(_, r)| r) else {
        return false;
    };
    let Some(pid) = rest.split('.').next().and_then(|p| p.parse::<i32>().ok()) else { return false };
    let old = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|now| now.as_secs().saturating_sub(meta.mtime() as u64) > STALE_TEMP_AGE.as_secs())
        .unwrap_or(false);
    let writer_alive = pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM));
    old && !writer_alive
}

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

    fn open_root(&self, create: bool) -> Result<Option<Dir>, CniError> {
        Dir::open(&self.root, create).map_err(|e| match unusable_reason(&self.root) {
            Some(why) => CniError::new(code::IO_FAILURE, format!("state directory {} {why}", self.root.display())),
            None => io_error(format!("cannot open state directory {}", self.root.display()), e),
        })
    }

    /// The attachments directory: created if `create`, else `None` when absent.
    fn attachments(&self, create: bool) -> Result<Option<Dir>, CniError> {
        let Some(root) = self.open_root(create)? else { return Ok(None) };
        root.subdir("attachments", create)
            .map_err(|e| io_error(format!("cannot open {}", root.join("attachments").display()), e))
    }

    /// Creates the directories if needed (0700).
    pub fn ensure(&self) -> Result<(), CniError> {
        self.attachments(true).map(|_| ())
    }

    /// Shared for ADD and DEL (which run in parallel for different pods), exclusive for GC.
    ///
    /// Fair to GC: everyone passes a turnstile (`lock.turnstile`) to take the lock, and GC
    /// holds the turnstile while it waits for the lock, so ADDs and DELs that keep coming
    /// cannot starve it; GC still waits at most [`GC_LOCK_TIMEOUT`], then fails with code 11.
    pub fn lock(&self, exclusive: bool) -> Result<Lock, CniError> {
        self.lock_within(exclusive, if exclusive { gc_lock_timeout() } else { None })
    }

    fn lock_within(&self, exclusive: bool, timeout: Option<Duration>) -> Result<Lock, CniError> {
        let root = self.open_root(true)?.expect("created");
        self.ensure()?;
        let busy = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                CniError::new(
                    code::TRY_AGAIN,
                    format!(
                        "the state directory {} is busy: ADDs and DELs held its lock for {:?}; try again later",
                        self.root.display(),
                        timeout.unwrap_or_default()
                    ),
                )
            } else {
                io_error(format!("cannot lock {}", root.join("lock").display()), e)
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
    fn record_name(network: &str, container_id: &str, ifname: &str) -> String {
        let safe = |s: &str| s.replace(|c: char| !(c.is_ascii_alphanumeric() || "_.-".contains(c)), "_");
        format!("{}+{}+{}.json", safe(network), safe(container_id), safe(ifname))
    }

    pub fn write(&self, rec: &Record) -> Result<(), CniError> {
        let dir = self.attachments(true)?.expect("created");
        let name = Self::record_name(&rec.network, &rec.container_id, &rec.ifname);
        let body = serde_json::to_vec_pretty(rec).expect("records serialize");
        dir.write_atomic(&name, &body)
            .map_err(|e| io_error(format!("cannot write attachment record {}", dir.join(&name).display()), e))
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
            Ok(Some(d)) => parse_record(&d).map(Some).map_err(unreadable),
            Err(e) => Err(unreadable(e.to_string())),
        }
    }

    /// Removes a record; absence is fine.
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> Result<(), CniError> {
        self.remove_file(&Self::record_name(network, container_id, ifname))
    }

    /// Removes a file of the attachments directory by name; absence is fine.
    pub fn remove_file(&self, name: &str) -> Result<(), CniError> {
        let Some(dir) = self.attachments(false)? else { return Ok(()) };
        dir.remove(name).map(|_| ()).map_err(|e| io_error(format!("cannot remove {}", dir.join(name).display()), e))
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
                Ok(Some(d)) => parse_record(&d),
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
    pub fn probe_writable(&self) -> Result<(), CniError> {
        let root = self.open_root(true)?.expect("created");
        self.ensure()?;
        let name = format!(".probe.{}", std::process::id());
        let fail = |e| io_error(format!("state directory {} is not writable", self.root.display()), e);
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

/// GC's bound on its lock wait; tests may shorten it (fault-injection builds only).
fn gc_lock_timeout() -> Option<Duration> {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("AETHER_CNI_GC_LOCK_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()) {
        return Some(Duration::from_millis(ms));
    }
    Some(GC_LOCK_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    fn rec(id: &str) -> Record {
        let mut capture = aether_rules::CaptureConfig::new(aether_rules::CaptureMode::Scoped);
        capture.rule_priority = 31000;
        Record {
            version: RECORD_VERSION,
            network: "k8s-pod-network".into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: "/run/netns/x".into(),
            netns_id: Some(NetnsIdentity { dev: 4, ino: 4026532177, cookie: Some(4103) }),
            pod_namespace: Some("shop".into()),
            pod_name: Some("cart-0".into()),
            pod_uid: None,
            config_digest: config_digest(&capture),
            capture: Some(capture),
            defaulted: Vec::new(),
        }
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("aether-state-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn records_round_trip_and_removal_is_idempotent() {
        let d = tmpdir("rt");
        let s = StateDir::new(&d);
        s.write(&rec("a")).unwrap();
        s.write(&rec("b")).unwrap();
        assert_eq!(s.read("k8s-pod-network", "a", "eth0"), Ok(Some(rec("a"))));
        assert_eq!(s.records().len(), 2);
        s.remove("k8s-pod-network", "a", "eth0").unwrap();
        s.remove("k8s-pod-network", "a", "eth0").unwrap();
        assert_eq!(s.records(), vec![rec("b")]);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unreadable_records_are_reported_by_name_and_temp_files_ignored() {
        let d = tmpdir("torn");
        let s = StateDir::new(&d);
        s.write(&rec("a")).unwrap();
        fs::write(d.join("attachments/k8s+torn+eth0.json"), b"{\"network\": \"k8s\", \"contai").unwrap();
        fs::write(d.join("attachments/.k8s+b+eth0.json.tmp.123"), b"partial").unwrap();
        let scan = s.scan();
        assert_eq!(scan.records, vec![rec("a")]);
        assert_eq!(scan.unreadable.len(), 1, "{:?}", scan.unreadable);
        assert_eq!(scan.unreadable[0].file, "k8s+torn+eth0.json");
        assert!(scan.unreadable[0].why.contains("not JSON"), "{:?}", scan.unreadable);
        assert!(s.read("k8s", "torn", "eth0").is_err());
        fs::remove_dir_all(&d).unwrap();
    }

    /// Issue 9 item 2: a record an older plugin wrote (no version, no netns identity, a
    /// capture field missing, an unknown field) is still read, the missing field defaulted
    /// and named.
    #[test]
    fn an_older_record_is_read_with_defaults_and_a_newer_ones_extra_fields_ignored() {
        let mut v = serde_json::to_value(rec("a")).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("version");
        o.remove("netnsId");
        o["capture"].as_object_mut().unwrap().remove("rulePriority");
        o.insert("addedByANewerRelease".into(), serde_json::json!({"x": 1}));
        let r = parse_record(v.to_string().as_bytes()).unwrap();
        assert_eq!(r.version, 0);
        assert_eq!(r.defaulted, ["rulePriority"]);
        assert_eq!(r.capture.as_ref().unwrap().rule_priority, aether_rules::capture::RULE_PRIORITY);
        assert_eq!(r.capture.as_ref().unwrap().mode, aether_rules::CaptureMode::Scoped);
        assert_eq!(r.container_id, "a");
        // What cannot be a record says why.
        for (bad, why) in [(&b"[1]"[..], "not a JSON object"), (b"{\"network\": 1}", "version 0 record")] {
            assert!(parse_record(bad).unwrap_err().contains(why), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_config_digest_is_stable_and_independent_of_debug_output() {
        let c = aether_rules::CaptureConfig::new(aether_rules::CaptureMode::RedirectAll);
        // Pinned: a release that changes it makes every pod's digest change.
        assert_eq!(config_digest(&c), config_digest(&c.clone()));
        // Before versioned records the digest was FNV-1a of the `Debug` text.
        assert_ne!(config_digest(&c), fnv1a(&format!("{c:?}")));
        let mut other = c.clone();
        other.rule_priority += 1;
        assert_ne!(config_digest(&c), config_digest(&other));
    }

    #[test]
    fn parallel_writers_never_tear_a_record() {
        let d = tmpdir("par");
        let s = std::sync::Arc::new(StateDir::new(&d));
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..20 {
                        s.write(&rec(&format!("c{i}"))).unwrap();
                        assert!(s.read("k8s-pod-network", &format!("c{i}"), "eth0").unwrap().is_some());
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(s.records().len(), 16);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_state_directory_that_is_not_one_is_named_for_what_it_is() {
        let d = tmpdir("unusable");
        fs::create_dir_all(&d).unwrap();
        assert_eq!(unusable_reason(&d.join("missing")), None);
        assert_eq!(unusable_reason(&d), None);
        fs::write(d.join("file"), b"x").unwrap();
        assert_eq!(unusable_reason(&d.join("file")).unwrap(), "is a regular file, not a directory");
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling")).unwrap();
        let why = unusable_reason(&d.join("dangling")).unwrap();
        assert!(why.starts_with("is a dangling symlink") && why.contains("nowhere"), "{why}");
        std::os::unix::fs::symlink(d.join("file"), d.join("to-file")).unwrap();
        assert!(unusable_reason(&d.join("to-file")).unwrap().contains("which is a regular file"));
        std::os::unix::fs::symlink(&d, d.join("to-dir")).unwrap();
        assert_eq!(unusable_reason(&d.join("to-dir")), None);
        assert!(unusable_reason(&d.join("file/below")).unwrap().contains("parent directory on its path is a file"));
        // ADD's error names it too, not "File exists".
        let e = StateDir::new(&d.join("dangling")).ensure().unwrap_err();
        assert!(e.msg.contains("dangling symlink") && e.msg.contains("dangling"), "{}", e.msg);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_not_ready_marker_carries_its_reason() {
        let d = tmpdir("nr");
        let s = StateDir::new(&d);
        s.ensure().unwrap();
        assert_eq!(s.not_ready_reason(), None);
        fs::write(d.join(NOT_READY_MARKER), "installer: CNI config not chained yet\n").unwrap();
        assert_eq!(s.not_ready_reason().as_deref(), Some("installer: CNI config not chained yet"));
        fs::remove_dir_all(&d).unwrap();
    }

    /// Issue 12 item 3: symlinks planted at every name the plugin creates are never written
    /// through, and what it creates is 0700/0600.
    #[test]
    fn planted_symlinks_are_never_followed_and_modes_are_private() {
        let d = tmpdir("sym");
        let s = StateDir::new(&d);
        s.ensure().unwrap();
        let target = d.with_extension("target");
        let _ = fs::remove_file(&target);
        let pid = std::process::id();
        // The names the plugin used to write to, predictable from the PID.
        for name in [
            format!("attachments/.k8s-pod-network+a+eth0.json.tmp.{pid}"),
            format!(".probe.{pid}"),
            "lock".into(),
            "lock.turnstile".into(),
        ] {
            symlink(&target, d.join(&name)).unwrap();
        }
        s.write(&rec("a")).unwrap();
        assert!(s.probe_writable().is_ok());
        assert!(s.lock(false).is_err(), "a symlink at the lock's name is refused, not followed");
        assert!(!target.exists(), "something was written through a planted symlink");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&d), 0o700);
        assert_eq!(mode(&d.join("attachments")), 0o700);
        assert_eq!(mode(&d.join("attachments/k8s-pod-network+a+eth0.json")), 0o600);
        // An older release's 0755 directory is tightened.
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        s.ensure().unwrap();
        assert_eq!(mode(&d), 0o700);
        // A record that is a symlink (to a record elsewhere) is unreadable, not followed.
        let elsewhere = d.with_extension("rec");
        fs::write(&elsewhere, serde_json::to_vec(&rec("b")).unwrap()).unwrap();
        symlink(&elsewhere, d.join("attachments/k8s-pod-network+b+eth0.json")).unwrap();
        let scan = s.scan();
        assert_eq!(scan.records, vec![rec("a")]);
        assert_eq!(scan.unreadable.len(), 1);
        let _ = fs::remove_file(&elsewhere);
        fs::remove_dir_all(&d).unwrap();
    }

    /// Issue 12 item 6: records are read up to a documented size, and the error names it.
    #[test]
    fn an_oversized_record_is_unreadable_naming_the_limit() {
        let d = tmpdir("big");
        let s = StateDir::new(&d);
        s.ensure().unwrap();
        let big = vec![b' '; MAX_RECORD_BYTES as usize + 1];
        fs::write(d.join("attachments/k8s-pod-network+big+eth0.json"), &big).unwrap();
        let scan = s.scan();
        assert!(
            scan.unreadable[0].why.contains(&format!("limit of {MAX_RECORD_BYTES} bytes")),
            "{:?}",
            scan.unreadable
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn temp_files_of_dead_writers_are_stale_once_old() {
        let d = tmpdir("stale");
        let s = StateDir::new(&d);
        s.ensure().unwrap();
        let dead = format!(".k8s+x+eth0.json.tmp.{}.1", i32::MAX - 1); // no such PID
        let alive = format!(".k8s+y+eth0.json.tmp.{}.1", std::process::id());
        let young = format!(".k8s+z+eth0.json.tmp.{}", i32::MAX - 1);
        for n in [&dead, &alive, &young] {
            fs::write(d.join("attachments").join(n), b"partial").unwrap();
        }
        let old = SystemTime::now() - STALE_TEMP_AGE - Duration::from_secs(5);
        for n in [&dead, &alive] {
            File::options().write(true).open(d.join("attachments").join(n)).unwrap().set_modified(old).unwrap();
        }
        assert_eq!(s.scan().stale_temps, vec![dead]);
        fs::remove_dir_all(&d).unwrap();
    }

    /// Issue 12 item 9: GC gets its exclusive lock although ADDs and DELs keep overlapping
    /// (some shared holder at every instant), and gives up with code 11 when one never ends.
    #[test]
    fn gc_is_not_starved_by_overlapping_shared_holders_and_its_wait_is_bounded() {
        let d = tmpdir("fair");
        let s = std::sync::Arc::new(StateDir::new(&d));
        s.ensure().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let holders: Vec<_> = (0..4)
            .map(|i| {
                let (s, stop) = (s.clone(), stop.clone());
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(5 * i));
                    while !stop.load(Ordering::SeqCst) {
                        let _l = s.lock(false).unwrap();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        let got = s.lock_within(true, Some(Duration::from_secs(5)));
        assert!(got.is_ok(), "GC starved: {got:?}");
        drop(got);
        stop.store(true, Ordering::SeqCst);
        for h in holders {
            h.join().unwrap();
        }
        let stuck = s.lock(false).unwrap();
        let e = s.lock_within(true, Some(Duration::from_millis(100))).unwrap_err();
        assert_eq!(e.code, code::TRY_AGAIN);
        assert!(e.msg.contains("busy"), "{}", e.msg);
        drop(stuck);
        fs::remove_dir_all(&d).unwrap();
    }
}
