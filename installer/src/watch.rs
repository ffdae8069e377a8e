//! The conf and bin directories watched with inotify: each event becomes a call of the
//! watcher's `on_event` with the file's name (if the kernel said) and when it was seen.

use std::ffi::OsString;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::Error;

/// inotify on the conf and bin directories; each event is handed to `on_event`.
pub struct Watcher {
    watches: inotify::Watches,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const WATCH_MASK: inotify::WatchMask = inotify::WatchMask::CREATE
    .union(inotify::WatchMask::CLOSE_WRITE)
    .union(inotify::WatchMask::MODIFY)
    .union(inotify::WatchMask::MOVED_TO)
    .union(inotify::WatchMask::MOVED_FROM)
    .union(inotify::WatchMask::DELETE)
    .union(inotify::WatchMask::ATTRIB)
    .union(inotify::WatchMask::DELETE_SELF)
    .union(inotify::WatchMask::MOVE_SELF);

impl Watcher {
    /// Watches `dirs`, calling `on_event` on a thread of its own for each event until it
    /// returns false or the watcher is dropped.
    pub fn start(
        mut on_event: impl FnMut(Option<OsString>, Instant) -> bool + Send + 'static,
        dirs: &[&Path],
    ) -> Result<Watcher, Error> {
        let mut inotify = inotify::Inotify::init().map_err(Error::Watch)?;
        let watches = inotify.watches();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("installer-inotify".into())
            .spawn(move || {
                // poll with a timeout rather than a blocking read, so that stopping needs no
                // event to wake the thread (a read-only root has nowhere to make one).
                let fd = std::os::fd::AsRawFd::as_raw_fd(&inotify);
                let mut buf = [0u8; 8192];
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
                    let ready = unsafe { libc::poll(&mut pfd, 1, 200) };
                    if ready < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                        break;
                    }
                    if ready <= 0 {
                        continue;
                    }
                    let events = match inotify.read_events(&mut buf) {
                        Ok(events) => events,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(_) => break,
                    };
                    let at = Instant::now();
                    for e in events {
                        if !on_event(e.name.map(|n| n.to_os_string()), at) {
                            return;
                        }
                    }
                }
            })
            .map_err(Error::Watch)?;
        let w = Watcher { watches, stop, thread: Some(thread) };
        w.rewatch(dirs);
        Ok(w)
    }

    /// (Re)adds the watches: a directory created or replaced after start is picked up.
    pub fn rewatch(&self, dirs: &[&Path]) {
        let mut watches = self.watches.clone();
        for d in dirs {
            let _ = watches.add(d, WATCH_MASK);
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
