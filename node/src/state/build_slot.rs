//! The node's slots for building whole Service layers: at most one build per CPU but one at
//! a time, so that a CPU stays free for pod starts.
//!
//! Why: the kernel runs a layer's creation (one transaction of 20,000-odd elements, about
//! 15 ms at 10,000 Services) in one system call, and a kernel without preemption (the
//! server default) gives the CPU to nobody else until it returns, whatever the builder's
//! nice level. 110 layers built at once after their ADDs' answers (a node's reboot) then
//! hold every CPU in turn, and every other pod's start waits for a CPU each time it needs
//! one: measured, the 110 ADDs' answers took the whole build's time (4.5x Debian `tuning`'s
//! storm), and 0.99x with builds one at a time on 2 CPUs.
//!
//! A slot is a write lock on one byte of `<stateDir>/layer-builds` (an open-file-description
//! lock: the process or thread that took it holds it until it lets go or ends, never a
//! process it forks). It orders work, it guards nothing: a slot that cannot be taken (the
//! file cannot be opened) is logged and the layer built all the same, as a pod left without
//! its layer is the larger harm. Taken after the pod's own lock, and nothing is taken while
//! it is held, so a builder waiting for one holds no slot another waits for. For the same
//! reason a wait is bounded (`SLOT_WAIT`): a build stuck in the kernel keeps its slot, and the
//! builders behind it would otherwise keep their pods' locks (and those pods' DELs) waiting.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::dir::Dir;

/// The slots' file, in the state directory (not under `services/`: it holds no state).
pub const BUILD_SLOTS_FILE: &str = "layer-builds";

/// The longest a builder waits for a slot before it builds without one. A layer takes tens
/// of milliseconds; a whole node's worth (110 pods) a few seconds on 2 CPUs. Past this the
/// holder is taken for stuck.
const SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// One slot, held until dropped (the file's close lets go of its lock).
#[derive(Debug)]
pub struct BuildSlot {
    _held: Option<File>,
}

impl BuildSlot {
    /// Waits for a free slot of the node's (`slots()`); a slot that cannot be had is logged,
    /// and the caller goes on without one.
    pub fn take(state_dir: &Path) -> BuildSlot {
        match take(state_dir, slots(), slot_wait()) {
            Ok(Some(file)) => BuildSlot { _held: Some(file) },
            Ok(None) => {
                tracing::warn!(
                    file = %state_dir.join(BUILD_SLOTS_FILE).display(),
                    waited_secs = slot_wait().as_secs_f64(),
                    "no build slot came free (a build holding one may be stuck): built without one"
                );
                BuildSlot { _held: None }
            }
            Err(e) => {
                tracing::warn!(
                    file = %state_dir.join(BUILD_SLOTS_FILE).display(),
                    "no slot for building the Service layer ({e}): built without waiting for one"
                );
                BuildSlot { _held: None }
            }
        }
    }
}

/// How many layers may be built at once: one per CPU this process may use, but one, and at
/// least one (`AETHER_CNI_LAYER_BUILD_SLOTS` in a test's fault-injection build).
fn slots() -> usize {
    #[cfg(feature = "fault-injection")]
    if let Some(n) = std::env::var("AETHER_CNI_LAYER_BUILD_SLOTS").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// `SLOT_WAIT`, or `AETHER_CNI_LAYER_BUILD_SLOT_WAIT_MS` in a test's fault-injection build.
fn slot_wait() -> std::time::Duration {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("AETHER_CNI_LAYER_BUILD_SLOT_WAIT_MS").ok().and_then(|v| v.parse().ok()) {
        return std::time::Duration::from_millis(ms);
    }
    SLOT_WAIT
}

/// The slots' file with a slot held, or `None` when none came free within `bound`.
fn take(state_dir: &Path, slots: usize, bound: std::time::Duration) -> std::io::Result<Option<File>> {
    let dir = Dir::open(state_dir, true)?.expect("created");
    let file = dir.openat(BUILD_SLOTS_FILE, libc::O_RDWR | libc::O_CREAT, 0o600)?;
    // A free slot if there is one; else wait for the one of this process's number (waiters
    // spread over the slots; with one slot, the common case on a small node, exactly FIFO
    // enough: every waiter waits for the one holder).
    for slot in 0..slots {
        if lock_byte(&file, slot, false)? {
            return Ok(Some(file));
        }
    }
    let at = std::process::id() as usize % slots.max(1);
    // The blocking request is made by a thread through a copy of the descriptor (the same
    // open file description, whose lock it is); this thread waits for it at most `bound`.
    // Given up, its copy is dropped here, and the waiting thread's, once the lock comes, is
    // the last: closing it lets go of the lock at once.
    let waiter = file.try_clone()?;
    let (sent, taken) = std::sync::mpsc::channel();
    std::thread::Builder::new().name("build-slot".into()).spawn(move || {
        // Unsent only when the builder gave up and went on without a slot: the lock or the
        // error is nobody's then, and `waiter`'s close here lets go of a lock taken late.
        let _ = sent.send(lock_byte(&waiter, at, true));
    })?;
    match taken.recv_timeout(bound) {
        Ok(locked) => locked.map(|_| Some(file)),
        Err(_) => Ok(None),
    }
}

/// A write lock on byte `at` of `file` (an open file description's), waiting for it when
/// `wait`; `false` when it is held elsewhere and `wait` is not set.
fn lock_byte(file: &File, at: usize, wait: bool) -> std::io::Result<bool> {
    // SAFETY: a plain struct for fcntl, every field set below or zero.
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = libc::F_WRLCK as libc::c_short;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = at as libc::off_t;
    range.l_len = 1;
    let cmd = if wait { libc::F_OFD_SETLKW } else { libc::F_OFD_SETLK };
    loop {
        // SAFETY: fcntl on a descriptor this function borrows, with a valid struct.
        if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &range) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN | libc::EACCES) if !wait => return Ok(false),
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh state directory of this test process's.
    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The slots' file of `dir`, opened anew (its own open file description: its own locks).
    fn probe(dir: &Path) -> File {
        Dir::open(dir, false).unwrap().unwrap().openat(BUILD_SLOTS_FILE, libc::O_RDWR, 0).unwrap()
    }

    /// Two slots hold two builders, each on its own byte; with one slot, a second builder
    /// waits until the first lets go, then takes it.
    #[test]
    fn a_builder_waits_for_a_free_slot_and_takes_it_when_one_is_let_go() {
        let dir = scratch("aether-build-slot");
        let forever = std::time::Duration::from_secs(3600);
        let take = move |dir: &Path, slots| take(dir, slots, forever).unwrap().expect("a slot");
        let (first, second) = (take(&dir, 2), take(&dir, 2));
        assert!(
            !lock_byte(&probe(&dir), 0, false).unwrap() && !lock_byte(&probe(&dir), 1, false).unwrap(),
            "both held"
        );
        drop(second);

        let waiter = {
            let dir = dir.clone();
            std::thread::spawn(move || take(&dir, 1))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!waiter.is_finished(), "a second builder waits while the one slot is held");
        drop(first);
        let _now = waiter.join().unwrap();
        assert!(!lock_byte(&probe(&dir), 0, false).unwrap(), "the waiter holds the slot it waited for");
        drop(_now);
        assert!(lock_byte(&probe(&dir), 0, false).unwrap(), "and lets go of it when dropped");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A builder waits for a held slot at most its bound, then goes on without one; the slot
    /// its waiting thread gets later is let go of at once.
    #[test]
    fn a_builder_stops_waiting_for_a_slot_after_its_bound() {
        let dir = scratch("aether-build-slot-bound");
        let stuck = take(&dir, 1, std::time::Duration::ZERO).unwrap().expect("the free slot");
        let bound = std::time::Duration::from_millis(200);
        let waiter = {
            let dir = dir.clone();
            std::thread::spawn(move || take(&dir, 1, bound).unwrap().is_some())
        };
        std::thread::sleep(bound * 5);
        assert!(waiter.is_finished(), "the builder still waits for the slot after its bound");
        assert!(!waiter.join().unwrap(), "the builder says it has a slot it never got");
        drop(stuck);
        // The given-up request's thread takes the slot when it comes free, and lets go of it.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !lock_byte(&probe(&dir), 0, false).unwrap() {
            assert!(std::time::Instant::now() < until, "a given-up wait kept the slot");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // (Free once may be before the waiting thread got it: free again, well after.)
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(lock_byte(&probe(&dir), 0, false).unwrap(), "a given-up wait kept the slot");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
