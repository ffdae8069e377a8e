//! An uninstall while pods are still attached. A runtime tears a pod down with the chain it was
//! ADDed with (containerd: the configuration it still holds, reloaded 1-11 ms after the
//! conflist goes; some runtimes: the one cached at ADD), and a plugin missing from the CNI bin
//! directory fails the whole DEL ("failed to find plugin"), so the sandbox's addresses, netns
//! and veth leak. So the installer removes the conflist, and the plugin binary only once no
//! attachment record is left; while records remain it leaves the binary and says so in
//! `<stateDir>/uninstalled`, and the DEL (or GC) that removes the last record removes the
//! binary and that file. An ADD that raced the uninstall and wrote its record after the
//! binary went puts the binary back (it runs from it: `/proc/self/exe`), so its own DEL finds
//! it.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{StateDir, StateError};

/// The installer's word that it uninstalled and left the plugin binary for the attached pods.
pub const UNINSTALLED_FILE: &str = "uninstalled";

/// How long after the conflist went the binary stays at least: an ADD a runtime started with
/// the chain it still held (and the DEL that undoes a failed one) needs it. Runtimes reload on
/// inotify within milliseconds; this is two hundred times containerd's slowest reload seen.
pub const RELOAD_GRACE: Duration = Duration::from_secs(2);

/// `<stateDir>/uninstalled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Uninstalled {
    /// The binary left, by device and inode: the installer (in its container) and the plugin
    /// (on the host) see it at different paths.
    pub dev: u64,
    pub ino: u64,
    /// When the conflist was removed, in milliseconds since the epoch.
    pub conflist_removed_ms: u64,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why the binary could not be removed or put back.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{what} {}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> UninstallError {
    let path = path.to_path_buf();
    move |source| UninstallError::Io { what, path, source }
}

/// The binary this process runs from, and whether it is still there (`/proc/self/exe` names
/// a removed file with ` (deleted)` after its path).
fn own_binary() -> Result<(PathBuf, bool), UninstallError> {
    let link = Path::new("/proc/self/exe");
    let target = std::fs::read_link(link).map_err(io("cannot read", link))?;
    let text = target.to_string_lossy();
    Ok(match text.strip_suffix(" (deleted)") {
        Some(path) => (PathBuf::from(path), false),
        None => (target, true),
    })
}

impl StateDir {
    /// Says that the installer uninstalled (the conflist removed now) and left `binary`.
    pub fn mark_uninstalled(&self, binary: &Path) -> Result<(), UninstallError> {
        let m = std::fs::metadata(binary).map_err(io("cannot stat", binary))?;
        self.write_uninstalled(&Uninstalled { dev: m.dev(), ino: m.ino(), conflist_removed_ms: now_ms() })
    }

    fn write_uninstalled(&self, u: &Uninstalled) -> Result<(), UninstallError> {
        let root = self.open_root(true)?.expect("created");
        let body = serde_json::to_vec(u).expect("serializes");
        root.write_atomic(UNINSTALLED_FILE, &body).map_err(io("cannot write", &root.join(UNINSTALLED_FILE)))
    }

    /// The installer's word, if it left the binary; an unreadable file is taken for none.
    pub fn uninstalled(&self) -> Option<Uninstalled> {
        let root = self.open_root(false).ok().flatten()?;
        serde_json::from_slice(&root.read(UNINSTALLED_FILE, 4096).ok().flatten()?).ok()
    }

    /// Forgets it (a new install, or the binary removed).
    pub fn clear_uninstalled(&self) -> Result<(), UninstallError> {
        let Some(root) = self.open_root(false)? else { return Ok(()) };
        root.remove(UNINSTALLED_FILE).map(|_| ()).map_err(io("cannot remove", &root.join(UNINSTALLED_FILE)))
    }

    /// How many attachment records (readable or not) the directory holds; a directory that
    /// cannot be listed counts as one unreadable (the binary stays on doubt).
    pub fn attachment_count(&self) -> usize {
        let scan = self.scan();
        scan.records.len() + scan.unreadable.len()
    }
}

/// After a DEL or GC: if the installer left the binary for the attached pods and the last of
/// them is gone, removes this process's binary (when it is the one left, by device and inode)
/// and the installer's word, after [`RELOAD_GRACE`] since the conflist went. Under the
/// exclusive state lock: no ADD or DEL runs meanwhile. The binary removed, if any.
pub fn finish_uninstall(state: &StateDir) -> Result<Option<PathBuf>, UninstallError> {
    if state.uninstalled().is_none() {
        return Ok(None);
    }
    let _lock = state.lock(true)?;
    let Some(u) = state.uninstalled() else { return Ok(None) };
    if state.attachment_count() > 0 {
        return Ok(None);
    }
    let waited = Duration::from_millis(now_ms().saturating_sub(u.conflist_removed_ms));
    std::thread::sleep(RELOAD_GRACE.saturating_sub(waited));
    let (path, present) = own_binary()?;
    let removed = match std::fs::metadata(&path) {
        Ok(m) if present && (m.dev(), m.ino()) == (u.dev, u.ino) => {
            std::fs::remove_file(&path).map_err(io("cannot remove", &path))?;
            Some(path)
        }
        _ => None,
    };
    state.clear_uninstalled()?;
    Ok(removed)
}

/// After an ADD wrote its record (under the state lock): if the binary this process runs from
/// was removed by an uninstall meanwhile and nothing took its place, puts it back and says so
/// in `uninstalled`, so that the pod's DEL finds it (and removes it again once the last pod is
/// gone). The binary put back, if any.
pub fn keep_binary_for_attachment(state: &StateDir) -> Result<Option<PathBuf>, UninstallError> {
    let (path, present) = own_binary()?;
    if present || path.symlink_metadata().is_ok() {
        return Ok(None);
    }
    let dir = path.parent().ok_or_else(|| UninstallError::Io {
        what: "no directory for",
        path: path.clone(),
        source: std::io::ErrorKind::NotFound.into(),
    })?;
    let tmp = dir.join(format!(
        ".{}.aether-tmp.{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::copy("/proc/self/exe", &tmp).map_err(io("cannot copy the running binary to", &tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(io("cannot chmod", &tmp))?;
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("cannot put back", &path)(e));
    }
    let m = std::fs::metadata(&path).map_err(io("cannot stat", &path))?;
    // The grace is long over: the conflist went before the binary did.
    state.write_uninstalled(&Uninstalled { dev: m.dev(), ino: m.ino(), conflist_removed_ms: 0 })?;
    Ok(Some(path))
}
