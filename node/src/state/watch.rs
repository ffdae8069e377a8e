//! Whether anything in a directory changed since the last look: an inotify watch on it. For a
//! long-lived process that keeps beliefs about the files of a directory others write too (the
//! installer's applier and the pods' files under `services/pods/`): looking costs one read
//! that finds nothing, where checking each file would cost a system call per file.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

/// A watch on one directory: its files created, written, removed or renamed, and the
/// directory itself removed or moved.
#[derive(Debug)]
pub struct DirWatch(OwnedFd);

/// What is watched: anything that can change what a file of the directory says.
const EVENTS: u32 = libc::IN_CREATE
    | libc::IN_DELETE
    | libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

impl DirWatch {
    /// A watch on `dir` from now on; `None` when it cannot be had (the directory is absent,
    /// or inotify is out of instances or watches): the caller then trusts nothing it kept.
    pub fn new(dir: &Path) -> Option<DirWatch> {
        // SAFETY: inotify_init1 takes flags only; a descriptor it returns is ours alone.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: a valid inotify descriptor and a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), EVENTS | libc::IN_ONLYDIR) };
        (wd >= 0).then_some(DirWatch(fd))
    }

    /// Whether anything happened since the watch was made or last looked at (what happened
    /// is not read, only that something did). A watch that fails, or whose event queue
    /// overflowed, says that something did.
    pub fn changed(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        let mut changed = false;
        loop {
            // SAFETY: reads into a buffer of the length given.
            let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            match n {
                n if n > 0 => changed = true,
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => return changed,
                _ => return true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_sees_each_kind_of_write_and_only_once() {
        let dir = std::env::temp_dir().join(format!("aether-dirwatch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a"), "1\n").unwrap();
        let mut w = DirWatch::new(&dir).unwrap();
        assert!(!w.changed(), "nothing happened yet");
        let steps: [(&str, &dyn Fn()); 4] = [
            ("written in place", &|| {
                use std::io::Write;
                std::fs::OpenOptions::new().write(true).open(dir.join("a")).unwrap().write_all(b"2\n").unwrap()
            }),
            ("replaced by a rename", &|| {
                std::fs::write(dir.join(".a.tmp"), "3\n").unwrap();
                std::fs::rename(dir.join(".a.tmp"), dir.join("a")).unwrap()
            }),
            ("removed", &|| std::fs::remove_file(dir.join("a")).unwrap()),
            ("created", &|| std::fs::write(dir.join("b"), "1\n").unwrap()),
        ];
        for (what, step) in steps {
            step();
            assert!(w.changed(), "{what}: not seen");
            assert!(!w.changed(), "{what}: seen twice");
        }
        // Reading a file changes nothing.
        let _ = std::fs::read(dir.join("b")).unwrap();
        assert!(!w.changed(), "a read was taken for a change");
        // The directory itself gone.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(w.changed(), "the directory's removal not seen");
        assert!(DirWatch::new(&dir).is_none(), "a watch on a directory that is not there");
    }
}
