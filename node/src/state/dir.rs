//! The state directory's file operations: relative to a directory descriptor, never following
//! a symlink at the last component, atomic writes, capped reads, `flock` with a deadline.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::STALE_TEMP_AGE;

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

    pub(super) fn openat(&self, name: &str, flags: libc::c_int, mode: libc::mode_t) -> std::io::Result<File> {
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
            self.rename(&tmp, name)
        };
        write().inspect_err(|_| {
            let _ = self.remove(&tmp);
        })
    }

    /// Writes `body` over `name` in place (created if absent): no temporary file, rename or
    /// flush. Only for files whose loss, or a torn or empty copy left by a crash, costs
    /// nothing but work (a pod's `services/pods/` file: a rebuild); a few system calls
    /// fewer than `write_atomic` for each of an apply's 100 pods.
    ///
    /// Not truncated on opening: on ext4, a file truncated and written again is flushed to
    /// disk when closed (its guard for files replaced by truncation), which cost an apply more
    /// than its 100 pods' transactions. Cut to length only when its length changed.
    pub fn overwrite(&self, name: &str, body: &[u8]) -> std::io::Result<()> {
        let f = self.openat(name, libc::O_WRONLY | libc::O_CREAT, 0o600)?;
        overwrite_file(&f, body, f.metadata()?.len())
    }

    /// `name` opened for `overwrite_file`, kept by a caller that writes it again and again.
    pub fn open_for_overwrite(&self, name: &str) -> std::io::Result<File> {
        self.openat(name, libc::O_WRONLY, 0)
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

    /// Renames `from` to `to`, replacing it.
    pub fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        let (from, to) = (cstr(OsStr::new(from))?, cstr(OsStr::new(to))?);
        let dirfd = self.fd.as_raw_fd();
        check(unsafe { libc::renameat(dirfd, from.as_ptr(), dirfd, to.as_ptr()) }).map(drop)
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

/// `body` written over the open file `f` (now `len` bytes long) in place, as `Dir::overwrite`.
pub fn overwrite_file(f: &File, body: &[u8], len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.write_all_at(body, 0)?;
    if len != body.len() as u64 {
        f.set_len(body.len() as u64)?;
    }
    Ok(())
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
pub(super) fn is_stale_temp(name: &str, meta: &std::fs::Metadata) -> bool {
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
