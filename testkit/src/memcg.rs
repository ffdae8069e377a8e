//! A memory cgroup made for one test, with a limit, that commands are started in: cgroup v1
//! (`/sys/fs/cgroup/memory/<this process's>/aeth-...`) or v2 (`/sys/fs/cgroup/aeth-...`,
//! the memory controller enabled for the root's children as hosts do). Removed on drop, once
//! the processes started in it are gone. Root only.
//!
//! Also what a piece of work charges the kernel, measured there: the kernel charges what it
//! allocates for a process (nftables objects included) to the process's memory cgroup. The
//! work runs in a child process (the test binary again, running one test, or a bench's own
//! binary) started in a fresh cgroup, so nothing else is charged there (`charged_by_child`,
//! `child_work`). cgroup v1: `memory.kmem.usage_in_bytes`, exact to a page; v2:
//! `memory.stat`'s `kernel`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Set in a measuring child: the cgroup directory it was started in.
const MEASURE: &str = "AETHER_MEMCG_MEASURE";
/// What the measuring child prints: `<marker><bytes>`.
const MARKER: &str = "aether-memcg-charged=";

pub struct ScratchMemcg {
    pub dir: PathBuf,
    pub v2: bool,
    /// Made by the test (removed on drop), or another's looked at (a container's).
    owned: bool,
}

impl ScratchMemcg {
    /// A new memory cgroup with `limit` bytes.
    pub fn new(tag: &str, limit: u64) -> ScratchMemcg {
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
        let v1_path = own.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            controllers.split(',').any(|c| c == "memory").then(|| path.trim_start_matches('/').to_string())
        });
        let name = format!("aeth-{tag}-{}-{}", std::process::id(), super::next());
        let (dir, v2) = match v1_path {
            Some(p) => (PathBuf::from("/sys/fs/cgroup/memory").join(p).join(name), false),
            None => (PathBuf::from("/sys/fs/cgroup").join(name), true),
        };
        if v2 {
            // A v2 child has memory.max only where its parent hands down the memory controller:
            // systemd does at the root, a bare cgroup2 mount (the kernel matrix's VMs) does not.
            let control = dir.parent().expect("under the root").join("cgroup.subtree_control");
            let handed_down = std::fs::read_to_string(&control).unwrap_or_default();
            if !handed_down.split_whitespace().any(|c| c == "memory") {
                std::fs::write(&control, "+memory").unwrap_or_else(|e| panic!("{}: +memory: {e}", control.display()));
            }
        }
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot make the memory cgroup {}: {e}", dir.display()));
        let cg = ScratchMemcg { dir, v2, owned: true };
        cg.set_limit(limit);
        if !v2 {
            // No swap to spill into, as on a node: the limit is the limit.
            let _ = std::fs::write(cg.dir.join("memory.swappiness"), "0");
        }
        cg
    }

    /// The memory cgroup process `pid` is in (e.g. a container's), to read and limit; left
    /// in place on drop.
    pub fn of_process(pid: u32) -> ScratchMemcg {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("the process's cgroups");
        let line = |want: &dyn Fn(&str, &str) -> bool| {
            text.lines().find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
                want(id, controllers).then(|| path.trim_start_matches('/').to_string())
            })
        };
        match line(&|_, c| c.split(',').any(|c| c == "memory")) {
            Some(p) => ScratchMemcg { dir: PathBuf::from("/sys/fs/cgroup/memory").join(p), v2: false, owned: false },
            None => {
                let p = line(&|id, c| id == "0" && c.is_empty()).expect("a cgroup v2 line");
                ScratchMemcg { dir: PathBuf::from("/sys/fs/cgroup").join(p), v2: true, owned: false }
            }
        }
    }

    pub fn limit(&self) -> u64 {
        let path = self.file("memory.limit_in_bytes", "memory.max");
        std::fs::read_to_string(&path).unwrap().trim().parse().unwrap_or(u64::MAX)
    }

    fn file(&self, v1: &str, v2: &str) -> PathBuf {
        self.dir.join(if self.v2 { v2 } else { v1 })
    }

    pub fn set_limit(&self, bytes: u64) {
        let path = self.file("memory.limit_in_bytes", "memory.max");
        std::fs::write(&path, bytes.to_string()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }

    /// Charged now.
    pub fn usage(&self) -> u64 {
        let path = self.file("memory.usage_in_bytes", "memory.current");
        std::fs::read_to_string(&path).unwrap().trim().parse().unwrap()
    }

    /// The most ever charged since the cgroup was made (v1 `memory.max_usage_in_bytes`, v2
    /// `memory.peak`, Linux 5.19 and later).
    pub fn peak(&self) -> u64 {
        let path = self.file("memory.max_usage_in_bytes", "memory.peak");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        text.trim().parse().unwrap_or_else(|e| panic!("{}: {text:?}: {e}", path.display()))
    }

    /// The usage once it has settled (two reads half a second apart within 256 KiB, up to
    /// 15 s): what a namespace torn down frees, the kernel frees a little later.
    pub fn settled_usage(&self) -> u64 {
        let mut last = self.usage();
        for _ in 0..30 {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let now = self.usage();
            if now.abs_diff(last) < 256 << 10 {
                return now;
            }
            last = now;
        }
        last
    }

    /// What the kernel cannot reclaim without killing (there is no swap): the usage less the
    /// page cache (`total_cache` on v1, `file` on v2) but for tmpfs files (`total_shmem`,
    /// `shmem`). A limit set just above it forces the cache out first, so the room above it
    /// is the room the work has.
    pub fn unreclaimable(&self) -> u64 {
        let stat = self.stat();
        let value = |key: &str| stat_value(&stat, key);
        let (cache, shmem) =
            if self.v2 { (value("file"), value("shmem")) } else { (value("total_cache"), value("total_shmem")) };
        self.usage().saturating_sub(cache.saturating_sub(shmem))
    }

    /// What the kubelet (and the node's own budget, `aether_node::memcg`) counts as in use:
    /// the usage less inactive file pages (`total_inactive_file` on v1, `inactive_file` on
    /// v2). Above `unreclaimable` by the active file pages.
    pub fn working_set(&self) -> u64 {
        let key = if self.v2 { "inactive_file" } else { "total_inactive_file" };
        self.usage().saturating_sub(stat_value(&self.stat(), key))
    }

    fn stat(&self) -> String {
        std::fs::read_to_string(self.dir.join("memory.stat")).unwrap()
    }

    /// Processes the kernel's OOM killer ended in it.
    pub fn oom_kills(&self) -> u64 {
        let path = self.file("memory.oom_control", "memory.events");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    }

    /// Makes `cmd` start inside this cgroup (the child moves itself in before it execs).
    pub fn enter_on_spawn(&self, cmd: &mut Command) {
        let procs = std::ffi::CString::new(self.dir.join("cgroup.procs").into_os_string().into_encoded_bytes())
            .expect("a path without NUL");
        // SAFETY: only open, write and close between fork and exec (async-signal-safe).
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writer itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(e);
                }
                Ok(())
            });
        }
    }
}

impl ScratchMemcg {
    /// The kernel memory charged to the cgroup now, in bytes.
    pub fn kernel_bytes(&self) -> u64 {
        kernel_bytes(&self.dir)
    }

    /// Runs the test `test` of the current test binary again, alone, in a child process
    /// started in this cgroup; in the child, [`child_work`] does the work and reports what it
    /// charged. Returns that, in bytes.
    pub fn charged_by_child(&self, test: &str) -> u64 {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]);
        self.charged_by(cmd, test)
    }

    /// Runs `cmd` (a program that calls [`child_work`] first thing) in this cgroup, and returns
    /// what it reported, in bytes. `test` names it in a failure.
    pub fn charged_by(&self, mut cmd: Command, test: &str) -> u64 {
        self.enter_on_spawn(&mut cmd);
        let out = cmd.env(MEASURE, &self.dir).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the measuring child of {test} failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.split_once(MARKER))
            .and_then(|(_, v)| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("the measuring child of {test} reported no charge:\n{stdout}"))
    }
}

/// `memory.kmem.usage_in_bytes` (v1) or `memory.stat`'s `kernel` (v2) of the cgroup `dir`.
fn kernel_bytes(dir: &Path) -> u64 {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{}/{f}: {e}", dir.display()));
    if dir.join("memory.kmem.usage_in_bytes").exists() {
        return read("memory.kmem.usage_in_bytes").trim().parse().expect("a number");
    }
    read("memory.stat")
        .lines()
        .find_map(|l| l.strip_prefix("kernel "))
        .and_then(|v| v.trim().parse().ok())
        .expect("memory.stat has a kernel line")
}

/// In the child [`ScratchMemcg::charged_by`] starts: moves the calling thread into a fresh
/// network namespace (gone with the process), runs `prepare` (work not measured, e.g.
/// building the model), then `work` with what `prepare` made, and prints the kernel memory
/// `work` charged, once the kernel's deferred frees have settled. Returns `false` when not in
/// such a child (the caller then measures through `charged_by`).
pub fn child_work<P>(prepare: impl FnOnce() -> P, work: impl FnOnce(&P)) -> bool {
    let Some(dir) = std::env::var_os(MEASURE) else { return false };
    let dir = PathBuf::from(dir);
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare: {}", std::io::Error::last_os_error());
    let made = prepare();
    let before = settled_kernel_bytes(&dir);
    work(&made);
    let after = settled_kernel_bytes(&dir);
    println!("\n{MARKER}{}", after.saturating_sub(before));
    true
}

/// The cgroup's kernel memory once it has not moved for 200 ms (transactions free their
/// objects from a work queue after the commit), at most 5 s.
fn settled_kernel_bytes(dir: &Path) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = kernel_bytes(dir);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = kernel_bytes(dir);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

impl Drop for ScratchMemcg {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // Empty once the test's processes are reaped; a few tries for the kernel to see it.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        eprintln!("the memory cgroup {} could not be removed", self.dir.display());
    }
}

/// One value of a `memory.stat` text (0 when it is not there).
fn stat_value(stat: &str, key: &str) -> u64 {
    stat.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0)
}
