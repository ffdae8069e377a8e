//! Writes a runtime may read at any moment: a temp file beside the target, fsync, rename,
//! fsync of the directory. A reader (a runtime executing the binary, libcni loading the
//! conflist) sees the old file or the new one, never a partial one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The temp file `write_atomic` uses for `path`: hidden, and ending in neither `.conf`,
/// `.conflist` nor `.json`, so libcni never loads it.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.aether-tmp.{}", std::process::id()))
}

/// Replaces `path` with `body`, mode `mode` (umask not applied), atomically.
pub fn write_atomic(path: &Path, body: &[u8], mode: u32) -> io::Result<()> {
    let tmp = temp_path(path);
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(body)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(path)
    };
    write().inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// Makes a rename or unlink in `path`'s directory durable.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// Removes `path`; absence is fine. Returns whether it was there.
pub fn remove(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => sync_dir(path).map(|()| true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes temp files a killed installer (any PID) left for `path`.
pub fn remove_stale_temps(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return };
    let prefix = format!(".{}.aether-tmp.", name.to_string_lossy());
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Whether `path` holds exactly `body` with permission bits `mode`.
pub fn holds(path: &Path, body: &[u8], mode: u32) -> bool {
    let Ok(meta) = fs::symlink_metadata(path) else { return false };
    meta.is_file()
        && meta.permissions().mode() & 0o7777 == mode
        && meta.len() == body.len() as u64
        && fs::read(path).is_ok_and(|b| b == body)
}
