//! Network namespaces, and nothing else (with [`mountinfo`]: the mount table through which a
//! process sees their bind mounts).
//!
//! A netns is identified by the (device, inode) of its nsfs file, never by its path: two
//! paths (`/proc/1/ns/net`, a bind mount under `/run/netns`) may name the same namespace.
//! Work inside a namespace runs on a thread spawned for it, so the switch (`setns`) is
//! never visible to any other thread of the process, and the thread ends with the work.
//! Visiting many namespaces in turn ([`tour`]) uses one such thread for all of them: it
//! enters each namespace and returns to its own before anything else runs on it.

pub mod mountinfo;

use std::cell::Cell;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::sched::{setns, CloneFlags};

/// `SO_NETNS_COOKIE` (asm-generic/socket.h; the same on every architecture Kubernetes runs on).
const SO_NETNS_COOKIE: nix::libc::c_int = 71;

/// nsfs magic number (`NSFS_MAGIC` in linux/magic.h).
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// `NS_GET_NSTYPE` (linux/nsfs.h: `_IO(0xb7, 0x3)`): a namespace file's `CLONE_NEW*` type.
const NS_GET_NSTYPE: nix::libc::Ioctl = 0xb703;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("network namespace {path} does not exist")]
    NotFound { path: PathBuf },
    #[error("cannot open network namespace {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a network namespace file (not on nsfs, or another kind of namespace)")]
    NotANamespace { path: PathBuf },
    #[error("{path} is the plugin's own (host) network namespace; refusing to program it")]
    HostNamespace { path: PathBuf },
    #[error("cannot enter network namespace {path}: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("cannot create a private network namespace: {0}")]
    Unshare(nix::Error),
    #[error("the thread working inside network namespace {path} panicked")]
    WorkerPanicked { path: PathBuf },
    #[error("cannot read the cookie of network namespace {path}: {source}")]
    Cookie { path: PathBuf, source: std::io::Error },
    #[error("cannot lock network namespace {path}: {source}")]
    Lock { path: PathBuf, source: nix::Error },
}

/// A namespace's identity: the device and inode of its nsfs file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "net:[{}] (dev {})", self.ino, self.dev)
    }
}

/// An open network namespace. Holding the file keeps the namespace alive.
#[derive(Debug)]
pub struct Netns {
    /// Shared with the locks taken on it (`NetnsLock`): a lock costs no `dup` and no `close`.
    file: std::sync::Arc<File>,
    path: PathBuf,
    id: NetnsId,
}

impl Netns {
    /// Opens the namespace at `path`, checking that it really is one: a network namespace on
    /// nsfs. The path is first opened `O_PATH` (no open of what it names: a FIFO does not
    /// block, a device is not opened), checked to be on nsfs, and only then opened for use
    /// (through `/proc/self/fd`, the very file checked), and asked its type (`NS_GET_NSTYPE`):
    /// a mount or PID namespace's file is no network namespace.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = path.as_ref().to_path_buf();
        let open_err = |source: std::io::Error| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound { path: path.clone() }
            } else {
                Error::Open { path: path.clone(), source }
            }
        };
        let handle = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH | nix::libc::O_CLOEXEC)
            .open(&path)
            .map_err(open_err)?;
        let fs = nix::sys::statfs::fstatfs(handle.as_fd())
            .map_err(|e| Error::Open { path: path.clone(), source: e.into() })?;
        if fs.filesystem_type().0 as i64 != NSFS_MAGIC {
            return Err(Error::NotANamespace { path });
        }
        let fd_path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&handle));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK)
            .open(fd_path)
            .map_err(open_err)?;
        drop(handle);
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the namespace's type.
        let kind = unsafe { nix::libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&file), NS_GET_NSTYPE) };
        if kind != nix::libc::CLONE_NEWNET {
            return Err(Error::NotANamespace { path });
        }
        let meta = file.metadata().map_err(|source| Error::Open { path: path.clone(), source })?;
        let id = NetnsId { dev: meta.dev(), ino: meta.ino() };
        Ok(Netns { file: std::sync::Arc::new(file), path, id })
    }

    /// The namespace the calling thread is in.
    pub fn current() -> Result<Self, Error> {
        Self::open("/proc/thread-self/ns/net")
    }

    pub fn id(&self) -> NetnsId {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The namespace's cookie (`SO_NETNS_COOKIE`, Linux 5.14): a number the kernel gives each
    /// namespace and never gives another while it runs. The nsfs inode is not enough to
    /// tell a namespace from its successor: a namespace created after another was freed gets
    /// the same inode number back, so a path reused for a new namespace (or
    /// `/proc/<pid>/ns/net` after PID reuse) shows the old (device, inode).
    pub fn cookie(&self) -> Result<u64, Error> {
        self.run(current_cookie)?.map_err(|source| Error::Cookie { path: self.path.clone(), source })
    }

    /// Whether this is the namespace the calling thread runs in (for the plugin: the host's).
    pub fn is_current(&self) -> Result<bool, Error> {
        // A tour's thread at home knows its namespace without reading /proc again.
        if let Some(home) = TOUR_HOME.with(|h| h.take()) {
            let home = opened_home(home)?;
            let same = home.id == self.id;
            TOUR_HOME.with(|h| h.set(Some(Some(home))));
            return Ok(same);
        }
        Ok(Self::current()?.id == self.id)
    }

    /// Opens `path` and refuses it if it is the caller's own namespace, whatever the path.
    pub fn open_foreign(path: impl AsRef<Path>) -> Result<Self, Error> {
        let ns = Self::open(path)?;
        if ns.is_current()? {
            return Err(Error::HostNamespace { path: ns.path });
        }
        Ok(ns)
    }

    /// Runs `work` inside this namespace on a new thread and returns its result.
    ///
    /// The calling thread never changes namespace. Sockets the closure opens belong to this
    /// namespace for their whole life, so netlink work is done entirely inside the closure.
    /// Called on a [`tour`]'s thread, the work runs on that thread instead (entering the
    /// namespace and returning home around it), which costs two `setns` instead of a thread.
    pub fn run<T, F>(&self, work: F) -> Result<T, Error>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        if let Some(home) = TOUR_HOME.with(|h| h.take()) {
            let home = opened_home(home)?;
            // Back in place when done, so that a `run` inside `work` spawns its own thread
            // (the tour's thread is then not at home) and the next `run` is in place again.
            let result = self.run_in_place(&home, work);
            TOUR_HOME.with(|h| h.set(Some(Some(home))));
            return result;
        }
        std::thread::scope(|scope| {
            let handle = scope.spawn(|| -> Result<T, Error> {
                setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET)
                    .map_err(|source| Error::Enter { path: self.path.clone(), source })?;
                Ok(work())
            });
            handle.join().map_err(|_| Error::WorkerPanicked { path: self.path.clone() })?
        })
    }
}

/// A namespace locked by this process (`Netns::lock`); released on drop. It shares the
/// namespace's open file (the lock is its open file description's), so the `Netns` stays
/// free to use while locked and the file stays open until the lock is released. An apply
/// locks every pod on every change: a `dup` and a `close` each were two system calls per
/// pod more than the lock's own two.
#[derive(Debug)]
pub struct NetnsLock(std::sync::Arc<File>);

impl Drop for NetnsLock {
    fn drop(&mut self) {
        // SAFETY: unlocking a file descriptor this guard holds open.
        unsafe { nix::libc::flock(std::os::fd::AsRawFd::as_raw_fd(&self.0), nix::libc::LOCK_UN) };
    }
}

impl Netns {
    /// Waits for, then holds, the namespace's own lock: an exclusive `flock` on its nsfs
    /// inode, which every open of the namespace (any path, any process) shares. What works
    /// on one pod's namespace is kept apart from all other work on that pod, and from nothing
    /// else: no file is made for it, and the lock goes with the namespace. Not reentrant
    /// across opens: a holder that opens the namespace again must not lock it again.
    pub fn lock(&self) -> Result<NetnsLock, Error> {
        let lock_err = |source| Error::Lock { path: self.path.clone(), source };
        let file = std::sync::Arc::clone(&self.file);
        loop {
            // SAFETY: flock on a file descriptor held open above.
            let r = unsafe { nix::libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), nix::libc::LOCK_EX) };
            if r == 0 {
                return Ok(NetnsLock(file));
            }
            match nix::Error::last() {
                nix::Error::EINTR => continue,
                source => return Err(lock_err(source)),
            }
        }
    }

    /// Waits until no one holds the namespace's lock, and holds nothing after: a reader that
    /// must not see a pod halfway through work under way (a layer ADD is still building)
    /// without keeping the next holder waiting while it reads.
    pub fn wait_unlocked(&self) -> Result<(), Error> {
        self.lock().map(drop)
    }
}

impl Netns {
    /// `run` on a tour's thread, whose own namespace is `home`: enter, work, return home. A
    /// panic in `work` is caught (as a worker thread's would be) after the thread is home.
    fn run_in_place<T, F: FnOnce() -> T>(&self, home: &Netns, work: F) -> Result<T, Error> {
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET)
            .map_err(|source| Error::Enter { path: self.path.clone(), source })?;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        if setns(home.file.as_fd(), CloneFlags::CLONE_NEWNET).is_err() {
            // Never possible with a namespace file we hold open; were it to happen, anything
            // the process did next could land in the pod's namespace, or take the pod's for
            // its own (the host check compares with the thread's namespace): stop here.
            eprintln!("aether-cni: cannot return to the own network namespace after {}", self.path.display());
            std::process::abort();
        }
        result.map_err(|_| Error::WorkerPanicked { path: self.path.clone() })
    }
}

/// The cookie ([`Netns::cookie`]) of the namespace the calling thread is in: for work already
/// inside a namespace (`Netns::run`), which would otherwise enter it again to ask.
pub fn current_cookie() -> std::io::Result<u64> {
    // Any socket belongs to the namespace of the thread that created it.
    let fd = unsafe { nix::libc::socket(nix::libc::AF_UNIX, nix::libc::SOCK_DGRAM | nix::libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
    let rc = unsafe {
        nix::libc::getsockopt(fd, nix::libc::SOL_SOCKET, SO_NETNS_COOKIE, (&mut cookie as *mut u64).cast(), &mut len)
    };
    let result = if rc == 0 { Ok(cookie) } else { Err(std::io::Error::last_os_error()) };
    unsafe { nix::libc::close(fd) };
    result
}

thread_local! {
    /// On a tour's thread, while it is at home: `Some`, with its own namespace once a `run`
    /// or a host check needed it (a tour that enters no namespace, such as an apply whose
    /// pods are all reached on kept sockets, never opens it).
    static TOUR_HOME: Cell<Option<Option<Netns>>> = const { Cell::new(None) };
}

/// A tour's home, opened now if it was not yet (the thread is at home: its namespace is the
/// current one). On failure the tour stays as it was.
fn opened_home(home: Option<Netns>) -> Result<Netns, Error> {
    match home {
        Some(home) => Ok(home),
        None => Netns::current().inspect_err(|_| TOUR_HOME.with(|h| h.set(Some(None)))),
    }
}

/// Runs `work` on a new thread on which every [`Netns::run`] enters its namespace in place
/// and comes back, instead of spawning a thread per namespace: for visiting many namespaces
/// in turn (a Service apply reaching every pod). Between runs the thread is in the
/// namespace it started in (the caller's), so all else `work` does (files, the host
/// check of `Netns::open_foreign`) is as on any other thread.
pub fn tour<T, F>(work: F) -> Result<T, Error>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    std::thread::scope(|scope| {
        let handle = scope.spawn(|| tour_here(work));
        handle.join().map_err(|_| Error::WorkerPanicked { path: "(tour)".into() })?
    })
}

/// [`tour`] on the calling thread itself: every [`Netns::run`] inside `work` enters its
/// namespace in place and comes back, and no thread is spawned at all. For a process that
/// runs one command and ends (a CNI plugin): starting a worker thread and waking the caller
/// again is a good share of a fresh ADD, more so on a busy node. Between runs the thread is
/// in its own namespace, as a tour's thread is; `setns` only ever moves the calling thread.
pub fn tour_here<T>(work: impl FnOnce() -> T) -> Result<T, Error> {
    /// Ends the tour also when `work` unwinds, restoring an enclosing tour's home.
    struct Restore(Option<Option<Netns>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            TOUR_HOME.with(|h| h.set(self.0.take()));
        }
    }
    // Its home opened on first need.
    let _restore = Restore(TOUR_HOME.with(|h| h.replace(Some(None))));
    Ok(work())
}

/// Runs `work` on a new thread inside a fresh, empty network namespace that disappears
/// with the thread: a place to try kernel features without touching any real namespace.
pub fn run_in_private<T, F>(work: F) -> Result<T, Error>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    std::thread::scope(|scope| {
        let handle = scope.spawn(|| -> Result<T, Error> {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(Error::Unshare)?;
            Ok(work())
        });
        handle.join().map_err(|_| Error::WorkerPanicked { path: "(private)".into() })?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_namespace_is_identified_by_inode_not_path() {
        let a = Netns::open("/proc/self/ns/net").unwrap();
        let b = Netns::open("/proc/thread-self/ns/net").unwrap();
        assert_eq!(a.id(), b.id());
        assert!(a.is_current().unwrap());
    }

    #[test]
    fn a_namespace_locked_by_one_open_is_locked_for_every_open_and_only_it() {
        let held = Netns::open("/proc/self/ns/net").unwrap();
        let other_open = Netns::open("/proc/thread-self/ns/net").unwrap();
        let try_lock = |ns: &Netns| {
            // SAFETY: a non-blocking flock on a descriptor the `Netns` holds open.
            let r = unsafe {
                nix::libc::flock(std::os::fd::AsRawFd::as_raw_fd(&ns.file), nix::libc::LOCK_EX | nix::libc::LOCK_NB)
            };
            let taken = r == 0;
            if taken {
                // SAFETY: as above.
                unsafe { nix::libc::flock(std::os::fd::AsRawFd::as_raw_fd(&ns.file), nix::libc::LOCK_UN) };
            }
            taken
        };
        // Control: free before, so a refusal below is the lock's.
        assert!(try_lock(&other_open), "the namespace's lock is free before");
        let guard = held.lock().unwrap();
        assert!(!try_lock(&other_open), "another open of the same namespace must wait");
        if root("a_namespace_locked_by_one_open_is_locked_for_every_open_and_only_it") {
            let private_free = run_in_private(|| try_lock(&Netns::current().unwrap())).unwrap();
            assert!(private_free, "another namespace's lock is its own");
        }
        drop(guard);
        assert!(try_lock(&other_open), "released on drop");
    }

    #[test]
    fn own_namespace_is_refused_by_any_path() {
        for path in ["/proc/self/ns/net", "/proc/thread-self/ns/net", "/proc/1/../self/ns/net"] {
            match Netns::open_foreign(path) {
                Err(Error::HostNamespace { .. }) => {}
                other => panic!("{path}: expected HostNamespace, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_private_namespace_is_not_the_callers() {
        if unsafe { libc_geteuid() } != 0 {
            {
                // Straight to stderr: libtest captures eprintln!, and a skip must be seen.
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "SKIPPED (needs root): a_private_namespace_is_not_the_callers");
            }
            assert_ne!(std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref(), Ok("1"), "root required");
            return;
        }
        let outside = Netns::current().unwrap().id();
        let inside = run_in_private(|| Netns::current().unwrap().id()).unwrap();
        assert_ne!(inside, outside);
        assert_eq!(Netns::current().unwrap().id(), outside);
    }

    extern "C" {
        #[link_name = "geteuid"]
        fn libc_geteuid() -> u32;
    }

    #[test]
    fn a_namespace_reusing_a_freed_inode_has_another_cookie() {
        if unsafe { libc_geteuid() } != 0 {
            {
                use std::io::Write as _;
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED (needs root): a_namespace_reusing_a_freed_inode_has_another_cookie"
                );
            }
            assert_ne!(std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref(), Ok("1"), "root required");
            return;
        }
        let own = Netns::current().unwrap();
        assert_eq!(own.cookie().unwrap(), own.cookie().unwrap(), "a cookie is stable");
        assert_eq!(current_cookie().unwrap(), own.cookie().unwrap(), "read in place, the thread's namespace's");
        // Namespaces made and freed one after another: the kernel hands the freed inode
        // number to the next one (seen on 6.18), never the cookie.
        let mut seen = Vec::new();
        for _ in 0..5 {
            let id_and_cookie = run_in_private(|| {
                let ns = Netns::current().unwrap();
                assert_eq!(current_cookie().unwrap(), ns.cookie().unwrap(), "read in place, not the caller's");
                (ns.id(), ns.cookie().unwrap())
            })
            .unwrap();
            seen.push(id_and_cookie);
        }
        let cookies: std::collections::BTreeSet<u64> = seen.iter().map(|(_, c)| *c).collect();
        assert_eq!(cookies.len(), seen.len(), "cookies repeat: {seen:?}");
        assert!(!cookies.contains(&own.cookie().unwrap()));
    }

    /// Root tests skip loudly without root, and fail when root is required.
    fn root(name: &str) -> bool {
        if unsafe { libc_geteuid() } == 0 {
            return true;
        }
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED (needs root): {name}");
        assert_ne!(std::env::var("AETHER_REQUIRE_ROOT_TESTS").as_deref(), Ok("1"), "root required");
        false
    }

    /// A namespace of its own, kept alive by its open file.
    fn private() -> Netns {
        run_in_private(|| Netns::current().unwrap()).unwrap()
    }

    #[test]
    fn a_tour_enters_each_namespace_and_is_home_between_visits() {
        if !root("a_tour_enters_each_namespace_and_is_home_between_visits") {
            return;
        }
        let (a, b) = (private(), private());
        let caller = Netns::current().unwrap().id();
        let seen = tour(|| {
            let tour_thread = std::thread::current().id();
            let mut seen = Vec::new();
            for ns in [&a, &b, &a] {
                // In place: the tour's own thread, inside the namespace.
                let (id, thread) = ns.run(|| (Netns::current().unwrap().id(), std::thread::current().id())).unwrap();
                assert_eq!(thread, tour_thread, "a run on a tour's thread runs in place");
                seen.push(id);
                assert_eq!(Netns::current().unwrap().id(), caller, "home between visits");
                // The host check still knows the caller's namespace for its own.
                assert!(matches!(Netns::open_foreign("/proc/self/ns/net"), Err(Error::HostNamespace { .. })));
            }
            seen
        })
        .unwrap();
        assert_eq!(seen, vec![a.id(), b.id(), a.id()]);
        assert_eq!(Netns::current().unwrap().id(), caller);
    }

    #[test]
    fn a_run_inside_a_tours_visit_and_a_panic_in_one_leave_the_tour_home() {
        if !root("a_run_inside_a_tours_visit_and_a_panic_in_one_leave_the_tour_home") {
            return;
        }
        let (a, b) = (private(), private());
        let caller = Netns::current().unwrap().id();
        tour(|| {
            // Nested: the inner run gets a thread of its own; the visit stays in `a`.
            let (inner, after) =
                a.run(|| (b.run(|| Netns::current().unwrap().id()).unwrap(), Netns::current().unwrap().id())).unwrap();
            assert_eq!((inner, after), (b.id(), a.id()));
            assert_eq!(Netns::current().unwrap().id(), caller);
            // A panic in a visit is that visit's error, as on a worker thread; the tour goes on at home.
            assert!(matches!(a.run(|| panic!("planned panic")), Err(Error::WorkerPanicked { .. })));
            assert_eq!(Netns::current().unwrap().id(), caller);
            assert_eq!(b.run(|| Netns::current().unwrap().id()).unwrap(), b.id(), "in place again");
        })
        .unwrap();
        // Control: outside a tour a run never moves the caller either.
        assert_eq!(a.run(|| Netns::current().unwrap().id()).unwrap(), a.id());
        assert_eq!(Netns::current().unwrap().id(), caller);
    }

    #[test]
    fn a_tour_here_runs_in_place_on_the_callers_thread_and_ends_with_its_work() {
        if !root("a_tour_here_runs_in_place_on_the_callers_thread_and_ends_with_its_work") {
            return;
        }
        let a = private();
        let caller = Netns::current().unwrap().id();
        let me = std::thread::current().id();
        let seen = tour_here(|| {
            let (thread, inside) = a.run(|| (std::thread::current().id(), Netns::current().unwrap().id())).unwrap();
            assert_eq!(Netns::current().unwrap().id(), caller, "home between visits");
            (thread, inside)
        })
        .unwrap();
        assert_eq!(seen, (me, a.id()), "in place: the caller's own thread, inside the namespace");
        // A panic inside the work still ends the tour: runs after it spawn a thread again.
        let unwound = std::panic::catch_unwind(|| tour_here(|| panic!("planned panic")));
        assert!(unwound.is_err());
        let (thread, inside) = a.run(|| (std::thread::current().id(), Netns::current().unwrap().id())).unwrap();
        assert_ne!(thread, me, "after the tour, a run has a thread of its own");
        assert_eq!((inside, Netns::current().unwrap().id()), (a.id(), caller));
    }

    #[test]
    fn a_plain_file_is_not_a_namespace() {
        match Netns::open("/proc/self/status") {
            Err(Error::NotANamespace { .. }) => {}
            other => panic!("expected NotANamespace, got {other:?}"),
        }
    }

    /// Another kind of namespace is on nsfs too: its type tells it apart.
    #[test]
    fn a_mount_or_pid_namespace_is_not_a_network_namespace() {
        for path in ["/proc/self/ns/mnt", "/proc/self/ns/pid", "/proc/self/ns/uts"] {
            match Netns::open(path) {
                Err(Error::NotANamespace { .. }) => {}
                other => panic!("{path}: expected NotANamespace, got {other:?}"),
            }
        }
    }

    /// A FIFO named as a netns (a runtime that lies): refused at once, not a reader blocked
    /// until a writer comes. A blocked open is released by the test itself (it opens the write
    /// end) after a generous wait, and fails.
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("aether-netns-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("net");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let opening = fifo.clone();
        let t = std::thread::spawn(move || tx.send(Netns::open(&opening).map(|n| n.id())).unwrap());
        let outcome = match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(o) => o,
            Err(_) => {
                use std::os::unix::fs::OpenOptionsExt;
                let _writer = std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&fifo);
                t.join().unwrap();
                std::fs::remove_dir_all(&dir).unwrap();
                panic!("opening a FIFO as a netns blocked until a writer came");
            }
        };
        t.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(outcome, Err(Error::NotANamespace { .. })), "{outcome:?}");
    }

    #[test]
    fn a_missing_path_is_not_found() {
        match Netns::open("/nonexistent/netns/x") {
            Err(Error::NotFound { .. }) => {}
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    #[test]
    fn run_returns_the_closure_value_and_leaves_the_caller_where_it_was() {
        let before = Netns::current().unwrap().id();
        let ns = Netns::open("/proc/self/ns/net").unwrap();
        let inside = ns.run(|| Netns::current().unwrap().id()).unwrap();
        assert_eq!(inside, before);
        assert_eq!(Netns::current().unwrap().id(), before);
    }
}
