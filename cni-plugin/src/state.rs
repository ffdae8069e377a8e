//! The node state directory: one record per attachment, the node-readiness marker, and the
//! lock that keeps GC apart from ADD and DEL.
//!
//! Writes are atomic (temp file, fsync, rename), so a reader sees the old record or the new
//! one, never a torn one; a crash leaves at worst a stray temp file, which readers ignore.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{code, CniError};

/// Present while the installer has marked the node not ready; its content is the reason.
pub const NOT_READY_MARKER: &str = "node-not-ready";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub network: String,
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// Digest of the capture configuration ADD programmed.
    pub config_digest: String,
    /// The capture configuration itself, so `inspect` can rebuild what ADD programmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<aether_rules::CaptureConfig>,
}

pub struct StateDir {
    root: PathBuf,
}

fn io_error(what: String, e: std::io::Error) -> CniError {
    CniError::new(code::IO_FAILURE, what).with_details(e.to_string())
}

/// A lock on the state directory, released on drop.
pub struct Lock(File);

impl Drop for Lock {
    fn drop(&mut self) {
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Takes a shared or exclusive `flock` on `path` (created if missing), held until dropped.
pub fn lock_file(path: &Path, exclusive: bool) -> std::io::Result<Lock> {
    let f = OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
    let op = if exclusive { libc::LOCK_EX } else { libc::LOCK_SH };
    if unsafe { libc::flock(f.as_raw_fd(), op) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Lock(f))
}

/// Writes `body` to `path` so readers see the old content or the new, never a torn file:
/// a temp file beside it, fsync, rename.
pub fn write_atomic(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

impl StateDir {
    pub fn new(root: &Path) -> Self {
        StateDir { root: root.to_path_buf() }
    }

    fn attachments(&self) -> PathBuf {
        self.root.join("attachments")
    }

    /// Creates the directories if needed.
    pub fn ensure(&self) -> Result<(), CniError> {
        fs::create_dir_all(self.attachments()).map_err(|e| match unusable_reason(&self.root) {
            Some(why) => CniError::new(code::IO_FAILURE, format!("state directory {} {why}", self.root.display())),
            None => io_error(format!("cannot create state directory {}", self.attachments().display()), e),
        })
    }

    /// Shared for ADD and DEL (which run in parallel for different pods), exclusive for GC.
    pub fn lock(&self, exclusive: bool) -> Result<Lock, CniError> {
        self.ensure()?;
        let path = self.root.join("lock");
        lock_file(&path, exclusive).map_err(|e| io_error(format!("cannot lock {}", path.display()), e))
    }

    /// File names are built from validated parts (network names and container IDs are
    /// restricted by the spec; ifnames by the kernel), joined by a separator none contains.
    fn record_path(&self, network: &str, container_id: &str, ifname: &str) -> PathBuf {
        let safe = |s: &str| s.replace(|c: char| !(c.is_ascii_alphanumeric() || "_.-".contains(c)), "_");
        self.attachments().join(format!("{}+{}+{}.json", safe(network), safe(container_id), safe(ifname)))
    }

    pub fn write(&self, rec: &Record) -> Result<(), CniError> {
        self.ensure()?;
        let path = self.record_path(&rec.network, &rec.container_id, &rec.ifname);
        let body = serde_json::to_vec_pretty(rec).expect("records serialize");
        write_atomic(&path, &body)
            .map_err(|e| io_error(format!("cannot write attachment record {}", path.display()), e))
    }

    pub fn read(&self, network: &str, container_id: &str, ifname: &str) -> Option<Record> {
        let data = fs::read(self.record_path(network, container_id, ifname)).ok()?;
        serde_json::from_slice(&data).ok()
    }

    /// Removes a record; absence is fine.
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> Result<(), CniError> {
        let path = self.record_path(network, container_id, ifname);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error(format!("cannot remove attachment record {}", path.display()), e)),
        }
    }

    /// Every readable record (of all networks); torn or foreign files are skipped.
    pub fn records(&self) -> Vec<Record> {
        let Ok(dir) = fs::read_dir(self.attachments()) else { return Vec::new() };
        let mut out: Vec<Record> = dir
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| fs::read(e.path()).ok())
            .filter_map(|d| serde_json::from_slice(&d).ok())
            .collect();
        out.sort_by(|a, b| (&a.network, &a.container_id, &a.ifname).cmp(&(&b.network, &b.container_id, &b.ifname)));
        out
    }

    /// The reason the node is marked not ready, if it is.
    pub fn not_ready_reason(&self) -> Option<String> {
        fs::read_to_string(self.root.join(NOT_READY_MARKER)).ok().map(|s| s.trim().to_string())
    }

    /// Proves the directory is usable: create, write and remove a file in it.
    pub fn probe_writable(&self) -> Result<(), CniError> {
        self.ensure()?;
        let probe = self.root.join(format!(".probe.{}", std::process::id()));
        fs::write(&probe, b"ok")
            .map_err(|e| io_error(format!("state directory {} is not writable", self.root.display()), e))?;
        let _ = fs::remove_file(&probe);
        Ok(())
    }
}

/// Why `root` cannot serve as a state directory although something is there: a file, a
/// dangling symlink, a symlink to a file. `None` when it is a directory (or a symlink to
/// one) or does not exist yet (it is created when first needed).
pub fn unusable_reason(root: &Path) -> Option<String> {
    use std::io::ErrorKind;
    let kind = |m: &fs::Metadata| {
        if m.is_file() {
            "a regular file"
        } else if m.is_dir() {
            "a directory"
        } else {
            "neither a file nor a directory"
        }
    };
    let link = match fs::symlink_metadata(root) {
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
    let target = fs::read_link(root).map(|t| t.display().to_string()).unwrap_or_else(|_| "?".into());
    match fs::metadata(root) {
        Ok(m) if m.is_dir() => None,
        Ok(m) => Some(format!("is a symlink to {target}, which is {}, not a directory", kind(&m))),
        Err(e) if e.kind() == ErrorKind::NotFound => {
            Some(format!("is a dangling symlink: its target {target} does not exist"))
        }
        Err(e) => Some(format!("is a symlink to {target}, which cannot be read: {e}")),
    }
}

/// FNV-1a: a stable digest of the configuration a pod was programmed with.
pub fn digest(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> Record {
        Record {
            network: "k8s-pod-network".into(),
            container_id: id.into(),
            ifname: "eth0".into(),
            netns: "/run/netns/x".into(),
            pod_namespace: Some("shop".into()),
            pod_name: Some("cart-0".into()),
            pod_uid: None,
            config_digest: digest("x"),
            capture: Some(aether_rules::CaptureConfig::new(aether_rules::CaptureMode::Scoped)),
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
        assert_eq!(s.read("k8s-pod-network", "a", "eth0"), Some(rec("a")));
        assert_eq!(s.records().len(), 2);
        s.remove("k8s-pod-network", "a", "eth0").unwrap();
        s.remove("k8s-pod-network", "a", "eth0").unwrap();
        assert_eq!(s.records(), vec![rec("b")]);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn torn_and_stray_files_are_ignored() {
        let d = tmpdir("torn");
        let s = StateDir::new(&d);
        s.write(&rec("a")).unwrap();
        fs::write(d.join("attachments/k8s+torn+eth0.json"), b"{\"network\": \"k8s\", \"contai").unwrap();
        fs::write(d.join("attachments/k8s+b+eth0.tmp.123"), b"partial").unwrap();
        assert_eq!(s.records(), vec![rec("a")]);
        fs::remove_dir_all(&d).unwrap();
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
                        assert!(s.read("k8s-pod-network", &format!("c{i}"), "eth0").is_some());
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
}
