//! Whether anything in a directory changed since the last look: an inotify watch on it. For a
//! long-lived process that keeps beliefs about the files of a directory others write too (the
//! installer's applier and the pods' files under `services/pods/`): looking costs one read
//! that finds nothing, where checking each file would cost a system call per file.

use std::path::Path;

use inotify::{Inotify, WatchMask};

/// A watch on one directory: its files created, written, removed or renamed, and the
/// directory itself removed or moved.
#[derive(Debug)]
pub struct DirWatch(Inotify);

/// What is watched: anything that can change what a file of the directory says.
const EVENTS: WatchMask = WatchMask::CREATE
    .union(WatchMask::DELETE)
    .union(WatchMask::MODIFY)
    .union(WatchMask::CLOSE_WRITE)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::ATTRIB)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF)
    .union(WatchMask::ONLYDIR);

impl DirWatch {
    /// A watch on `dir` from now on; `None` when it cannot be had (the directory is absent,
    /// or inotify is out of instances or watches): the caller then trusts nothing it kept.
    pub fn new(dir: &Path) -> Option<DirWatch> {
        // Non-blocking: a look finds nothing rather than waits.
        let inotify = Inotify::init().ok()?;
        inotify.watches().add(dir, EVENTS).ok()?;
        Some(DirWatch(inotify))
    }

    /// Whether anything happened since the watch was made or last looked at (what happened
    /// is not read, only that something did). A watch that fails, or whose event queue
    /// overflowed, says that something did.
    pub fn changed(&mut self) -> bool {
        let mut buf = [0u8; 4096];
        let mut changed = false;
        loop {
            match self.0.read_events(&mut buf) {
                Ok(_) => changed = true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return changed,
                Err(_) => return true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_sees_each_kind_of_write_and_only_once() {
        let scratch = aether_testkit::ScratchDir::new("dirwatch");
        let dir = &scratch.0;
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
        std::fs::remove_dir_all(dir).unwrap();
        assert!(w.changed(), "the directory's removal not seen");
        assert!(DirWatch::new(dir).is_none(), "a watch on a directory that is not there");
    }
}
