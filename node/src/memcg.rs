//! The memory cgroup this process is charged to: its limit and what it holds now, read from
//! the cgroup filesystem (v2 and v1: nodes run both), and whether some more kernel memory
//! fits under that limit.
//!
//! Why it matters: the kernel charges every nftables object to the memory cgroup of the
//! process that sends it, not to the pod whose netns holds it. A Service layer that the
//! installer (or an agent's `services apply`) programs into a hundred pods is charged to that
//! one container, and crossing its limit gets the process SIGKILLed by the OOM killer in the
//! middle of its work. So work that would cross it is refused before it starts.
//!
//! Where the files are: `/proc/self/cgroup` names the cgroup, `0::<path>` on v2 (files
//! `memory.max`, `memory.current` under `/sys/fs/cgroup/<path>`), `N:memory:<path>` on v1
//! (`memory.limit_in_bytes`, `memory.usage_in_bytes` under `/sys/fs/cgroup/memory/<path>`);
//! a hybrid host has both lines, and the memory controller is v1's there. The directory is
//! found through `/proc/self/mountinfo`: inside a container with a cgroup namespace the path
//! is `/`; without one (containerd and podman on v1) it is the full path, and the container's
//! own cgroup is what is mounted at `/sys/fs/cgroup/memory`.

use std::path::{Path, PathBuf};

/// Which cgroup hierarchy holds the memory controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup's directory in the cgroup filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Memcg {
    pub dir: PathBuf,
    pub version: Version,
    /// The directory the hierarchy is mounted at (v2: limits are looked up to it).
    root: PathBuf,
}

/// What a memory cgroup holds and may hold, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// The lowest limit of the cgroup and its ancestors; `None`: unlimited.
    pub limit: Option<u64>,
    /// Charged now (`memory.current`, `memory.usage_in_bytes`).
    pub usage: u64,
    /// Of which file pages the kernel reclaims before it would kill (`inactive_file`): the
    /// kubelet's working set is `usage` less these.
    pub reclaimable: u64,
}

impl Reading {
    /// What cannot be reclaimed without killing: the working set.
    pub fn in_use(&self) -> u64 {
        self.usage.saturating_sub(self.reclaimable)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MemcgError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{} holds {text:?}, not a number of bytes", path.display())]
    Parse { path: PathBuf, text: String },
}

/// v1 writes "no limit" as the largest page-aligned counter value; v2 as `max`.
const UNLIMITED_FROM: u64 = 1 << 62;

impl Memcg {
    /// This process's memory cgroup; `None` when no memory controller is mounted or named.
    pub fn own() -> Result<Option<Memcg>, MemcgError> {
        let read =
            |path: &str| std::fs::read_to_string(path).map_err(|source| MemcgError::Read { path: path.into(), source });
        Ok(Memcg::find(&read("/proc/self/cgroup")?, &read("/proc/self/mountinfo")?))
    }

    /// The memory cgroup `/proc/self/cgroup`'s `cgroups` names, in the cgroup filesystem
    /// `/proc/self/mountinfo`'s `mounts` shows: v1's memory line if there is one (a hybrid
    /// host), else v2's `0::` line when the v2 hierarchy has the memory controller. The
    /// directory is the mount point joined with the path below the mount's root: a container
    /// without a cgroup namespace (containerd and podman on v1) sees its own cgroup's full path
    /// in `/proc/self/cgroup` but that cgroup itself mounted at `/sys/fs/cgroup/memory`.
    pub fn find(cgroups: &str, mounts: &str) -> Option<Memcg> {
        let mut v2 = None;
        for line in cgroups.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
            if controllers.split(',').any(|c| c == "memory") {
                let (root, mount) = mount_of(mounts, |fstype, options| {
                    fstype == "cgroup" && options.split(',').any(|o| o == "memory")
                })?;
                return Some(Memcg { dir: below(&mount, &root, path), version: Version::V1, root: mount });
            }
            if id == "0" && controllers.is_empty() {
                v2 = Some(path);
            }
        }
        let path = v2?;
        let (root, mount) = mount_of(mounts, |fstype, _| fstype == "cgroup2")?;
        let controllers = std::fs::read_to_string(mount.join("cgroup.controllers")).ok()?;
        controllers.split_whitespace().any(|c| c == "memory").then(|| Memcg {
            dir: below(&mount, &root, path),
            version: Version::V2,
            root: mount,
        })
    }

    /// Reads the cgroup's limit and usage now.
    pub fn read(&self) -> Result<Reading, MemcgError> {
        match self.version {
            Version::V2 => {
                // The root cgroup has no limit file; a limit higher up binds as much as one here.
                let mut limit = None;
                let mut dir = self.dir.as_path();
                while dir.starts_with(&self.root) {
                    match read_bytes(&dir.join("memory.max")) {
                        Ok(Some(l)) => limit = Some(limit.map_or(l, |m: u64| m.min(l))),
                        Ok(None) => {}
                        Err(MemcgError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                    let Some(up) = dir.parent() else { break };
                    dir = up;
                }
                let usage = match read_bytes(&self.dir.join("memory.current")) {
                    // The host's root cgroup (a process outside any container, e.g. an agent
                    // run on the node itself) has no usage file, and no limit binds it. A
                    // container's cgroup namespace also shows its cgroup as `/`, but that one
                    // has the file.
                    Err(MemcgError::Read { source, .. })
                        if source.kind() == std::io::ErrorKind::NotFound && self.dir == self.root =>
                    {
                        return Ok(Reading { limit, usage: 0, reclaimable: 0 });
                    }
                    other => other?.unwrap_or(0),
                };
                let reclaimable = stat_value(&self.dir.join("memory.stat"), "inactive_file")?.unwrap_or(0);
                Ok(Reading { limit, usage, reclaimable })
            }
            Version::V1 => {
                let stat = self.dir.join("memory.stat");
                let own = read_bytes(&self.dir.join("memory.limit_in_bytes"))?;
                // Read once for both values (the kernel totals every counter at each read).
                let [hierarchical, reclaimable] =
                    stat_values(&stat, ["hierarchical_memory_limit", "total_inactive_file"])?;
                // Ancestors' limits, as v1 itself sums them up.
                let hierarchical = hierarchical.filter(|&l| l < UNLIMITED_FROM);
                let limit = match (own, hierarchical) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let usage = read_bytes(&self.dir.join("memory.usage_in_bytes"))?.unwrap_or(0);
                Ok(Reading { limit, usage, reclaimable: reclaimable.unwrap_or(0) })
            }
        }
    }
}

impl Memcg {
    /// The kernel's own memory charged to the cgroup (slab and the like, not the process's
    /// heap), where the cgroup says it apart: v1's `memory.kmem.usage_in_bytes`, v2's
    /// `kernel` in `memory.stat` (5.18 on). `None` where it does not.
    pub fn kernel_usage(&self) -> Result<Option<u64>, MemcgError> {
        match self.version {
            Version::V1 => match read_bytes(&self.dir.join("memory.kmem.usage_in_bytes")) {
                Err(MemcgError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(None),
                other => other,
            },
            Version::V2 => stat_value(&self.dir.join("memory.stat"), "kernel"),
        }
    }
}

/// The first mount in mountinfo's `text` whose filesystem type and super options `is`
/// accepts: (the cgroup it mounts, where). Parsed by [`aether_netns::mountinfo`].
fn mount_of(text: &str, is: impl Fn(&str, &str) -> bool) -> Option<(String, PathBuf)> {
    aether_netns::mountinfo::parse(text)
        .into_iter()
        .find(|m| is(&m.fstype, &m.super_options))
        .map(|m| (m.root.to_string_lossy().into_owned(), m.mount_point))
}

/// The directory of cgroup `path` where the cgroup `root` is mounted at `mount`.
fn below(mount: &Path, root: &str, path: &str) -> PathBuf {
    let rel = path.strip_prefix(root).unwrap_or(path);
    mount.join(rel.trim_start_matches('/'))
}

/// A file holding bytes, or `max`/v1's unlimited value (`None`).
/// A cgroup file's text now, through a descriptor kept open per path (every change reads
/// three of them, where the opens cost as much as the reads): the kernel makes the text anew
/// at each read from offset 0. A descriptor that fails (its cgroup removed, and maybe made
/// again at the path) is opened again once.
fn read_text(path: &Path) -> Result<String, MemcgError> {
    use std::os::unix::fs::FileExt;
    static KEPT: std::sync::Mutex<Vec<(PathBuf, std::fs::File)>> = std::sync::Mutex::new(Vec::new());
    /// Files kept at most (a process reads its own cgroup's three or four).
    const MAX_KEPT: usize = 8;
    // `whole`: a cgroup file, whose text the kernel makes whole at a read from offset 0 and
    // hands over in one read when the buffer holds it; a read at a later offset would make it
    // all again (for `memory.stat`, every counter totalled once more) only to find its end.
    let read_all = |f: &std::fs::File, whole: bool| -> std::io::Result<String> {
        let mut out = Vec::with_capacity(2048);
        let mut buf = [0u8; 16 << 10];
        loop {
            let n = f.read_at(&mut buf, out.len() as u64)?;
            out.extend_from_slice(&buf[..n]);
            if n == 0 || (whole && n < buf.len()) {
                return String::from_utf8(out).map_err(std::io::Error::other);
            }
        }
    };
    let err = |source| MemcgError::Read { path: path.into(), source };
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = kept.iter().position(|(p, _)| p == path) {
        if let Ok(text) = read_all(&kept[i].1, true) {
            return Ok(text);
        }
        kept.remove(i);
    }
    let f = std::fs::File::open(path).map_err(err)?;
    // Only the cgroup filesystem's files are kept: there a file goes only with its cgroup,
    // after which its descriptor fails. Anywhere else a file may be replaced under a kept one.
    let cgroupfs = on_cgroupfs(&f);
    let text = read_all(&f, cgroupfs).map_err(err)?;
    if cgroupfs {
        if kept.len() >= MAX_KEPT {
            kept.remove(0);
        }
        kept.push((path.to_path_buf(), f));
    }
    Ok(text)
}

/// Whether `f` is a file of the cgroup filesystem (v1 or v2).
fn on_cgroupfs(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    const CGROUP_SUPER_MAGIC: i64 = 0x27e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into the buffer it is given, a valid descriptor's.
    let ok = unsafe { libc::fstatfs(f.as_raw_fd(), &mut fs) } == 0;
    ok && matches!(fs.f_type as i64, CGROUP_SUPER_MAGIC | CGROUP2_SUPER_MAGIC)
}

fn read_bytes(path: &Path) -> Result<Option<u64>, MemcgError> {
    let text = read_text(path)?;
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    let n: u64 = t.parse().map_err(|_| MemcgError::Parse { path: path.into(), text: t.chars().take(40).collect() })?;
    Ok((n < UNLIMITED_FROM).then_some(n))
}

/// One `key value` line of `memory.stat`; `None` when the key is not there.
fn stat_value(path: &Path, key: &str) -> Result<Option<u64>, MemcgError> {
    stat_values(path, [key]).map(|[v]| v)
}

/// The `key value` lines of `keys` in one reading of `memory.stat`; `None` for a key that is
/// not there.
fn stat_values<const N: usize>(path: &Path, keys: [&str; N]) -> Result<[Option<u64>; N], MemcgError> {
    let text = read_text(path)?;
    let mut out = [None; N];
    for line in text.lines() {
        let Some((k, v)) = line.split_once(' ') else { continue };
        if let Some(i) = keys.iter().position(|&key| key == k) {
            let n = v.trim().parse().map_err(|_| MemcgError::Parse { path: path.into(), text: line.into() })?;
            out[i] = Some(n);
        }
    }
    Ok(out)
}

const MIB: u64 = 1 << 20;

/// Kept free under the limit whatever the estimate says: the estimate's error, the
/// process's own heap growing while it works, a transaction's transient objects. A tenth of
/// the limit, and at least 8 MiB.
pub fn headroom(limit: u64) -> u64 {
    (limit / 10).max(8 * MIB)
}

/// What refused work would have charged to the memory cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// Kernel memory: nftables elements at the bytes one costs, as measured on this kernel.
    Elements { elements: u64, per_element: u64 },
    /// This process's own memory: the body of a document read into a buffer; `bytes` of it,
    /// `whole` when that is its declared length (else what arrived so far).
    DocumentRead { bytes: u64, whole: bool },
    /// This process's own memory: a document of `bytes` and `objects` JSON objects parsed
    /// and applied (its text already held).
    DocumentParse { bytes: u64, objects: u64 },
    /// This process's own memory: the stored document of `bytes` (and its journal) read, for
    /// a change to be made to it.
    StoredRead { bytes: u64 },
}

/// Work refused because what it would charge does not fit under the memory limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverBudget {
    /// Bytes the work would charge.
    pub needed: u64,
    pub charge: Charge,
    pub in_use: u64,
    pub limit: u64,
    /// Kept free on top of the need (none for a document: the headroom is there for it).
    pub headroom: u64,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let needed = mib(self.needed);
        let size = |bytes: u64| bytes as f64 / MIB as f64;
        // What would be charged, and for what; the rest is the same for every charge.
        match self.charge {
            Charge::Elements { elements, per_element } => write!(
                f,
                "not started: it would charge about {needed} MiB of kernel memory ({elements} nftables elements x \
                 {per_element} bytes, as measured on this kernel)"
            )?,
            Charge::DocumentRead { bytes, whole } => write!(
                f,
                "not read: a document of {:.1} MiB{} would charge about {needed} MiB of this process's own memory \
                 to be read",
                size(bytes),
                if whole { "" } else { " so far (sent without its length)" }
            )?,
            Charge::DocumentParse { bytes, objects } => write!(
                f,
                "not parsed: a document of {:.1} MiB ({objects} JSON objects) would charge about {needed} MiB more \
                 of this process's own memory to be parsed and applied",
                size(bytes)
            )?,
            Charge::StoredRead { bytes } => write!(
                f,
                "not read: the stored document of {:.1} MiB, which the change is made to, would charge about \
                 {needed} MiB of this process's own memory to be read and changed",
                size(bytes)
            )?,
        }
        write!(
            f,
            " to this process's memory cgroup, which holds {} MiB of its {} MiB limit",
            mib(self.in_use),
            mib(self.limit)
        )?;
        if self.headroom > 0 {
            write!(f, " with {} MiB kept free", mib(self.headroom))?;
        }
        write!(
            f,
            "; nothing was changed. Raise resources.limits.memory of this container to at least {} MiB \
             (docs/operating.md, \"Memory\")",
            mib(self.suggested_limit())
        )
    }
}

impl std::error::Error for OverBudget {}

impl OverBudget {
    /// A limit under which this work would have started, with a little room for the
    /// process's own memory moving meanwhile (4 MiB), rounded up to 16 MiB.
    pub fn suggested_limit(&self) -> u64 {
        let floor = self.in_use + self.needed + 4 * MIB;
        // The headroom is a tenth of the limit: the limit that leaves it.
        (floor * 10).div_ceil(9).max(floor + 8 * MIB).div_ceil(16 * MIB) * 16 * MIB
    }
}

/// MiB, rounded up (a need is never shown smaller than it is).
fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// Whether `elements` more nftables elements, at `per_element` bytes, fit under the
/// reading's limit less the headroom.
pub fn fits(reading: &Reading, elements: u64, per_element: u64) -> Result<(), OverBudget> {
    let Some(limit) = reading.limit else { return Ok(()) };
    let needed = elements.saturating_mul(per_element);
    let headroom = headroom(limit);
    if reading.in_use().saturating_add(needed).saturating_add(headroom) <= limit {
        return Ok(());
    }
    let charge = Charge::Elements { elements, per_element };
    Err(OverBudget { needed, charge, in_use: reading.in_use(), limit, headroom })
}

/// Whether `needed` bytes of this process's own memory (a document read, or parsed:
/// `charge`) fit under the reading's limit. The headroom is not kept free here: it exists for
/// this (the process's own heap growing while it works); the kernel work the document asks
/// for is checked after, with the headroom, against the usage the parse left.
pub fn own_fits(reading: &Reading, needed: u64, charge: Charge) -> Result<(), OverBudget> {
    let Some(limit) = reading.limit else { return Ok(()) };
    if reading.in_use().saturating_add(needed) <= limit {
        return Ok(());
    }
    Err(OverBudget { needed, charge, in_use: reading.in_use(), limit, headroom: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("aether-memcg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, body) in files {
            std::fs::write(dir.join(name), body).unwrap();
        }
    }

    /// mountinfo lines: a v1 memory hierarchy mounting `v1_root` at `/sys/fs/cgroup/memory`,
    /// and a v2 one mounting `/` at `v2_mount`.
    fn mounts(v1_root: &str, v2_mount: &Path) -> String {
        format!(
            "97 84 0:45 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755\n\
             98 97 0:29 {v1_root} /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu\n\
             101 97 0:32 {v1_root} /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n\
             102 97 0:33 / {} rw - cgroup2 cgroup2 rw,nsdelegate\n",
            v2_mount.display()
        )
    }

    #[test]
    fn v1_memory_line_wins_on_a_hybrid_host() {
        let text = "9:name=systemd:/\n4:memory:/kubepods/pod1/abc\n1:cpu,cpuacct:/x\n0::/\n";
        let m = Memcg::find(text, &mounts("/", Path::new("/unused"))).unwrap();
        assert_eq!(m.version, Version::V1);
        assert_eq!(m.dir, Path::new("/sys/fs/cgroup/memory/kubepods/pod1/abc"));
        // A container in its own cgroup namespace: the path is the root.
        let m = Memcg::find("4:memory:/\n", &mounts("/", Path::new("/unused"))).unwrap();
        assert_eq!(m.dir, Path::new("/sys/fs/cgroup/memory"));
        // A container without one (containerd, podman on v1): its cgroup is mounted as the
        // root of the hierarchy it sees.
        let own = "/kubepods/burstable/pod1/c0ffee";
        let m = Memcg::find(&format!("4:memory:{own}\n"), &mounts(own, Path::new("/unused"))).unwrap();
        assert_eq!(m.dir, Path::new("/sys/fs/cgroup/memory"));
        // No memory hierarchy mounted: nothing to read.
        assert_eq!(Memcg::find(text, "97 84 0:45 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"), None);
    }

    #[test]
    fn v2_line_only_when_the_hierarchy_has_the_memory_controller() {
        let root = tmp("v2find");
        let m = mounts("/", &root);
        let only_v2: String = m.lines().filter(|l| l.contains("cgroup2")).map(|l| format!("{l}\n")).collect();
        assert_eq!(Memcg::find("0::/a/b\n", &only_v2), None, "no cgroup.controllers: no memory controller");
        write(&root, &[("cgroup.controllers", "cpu io pids\n")]);
        assert_eq!(Memcg::find("0::/a/b\n", &only_v2), None);
        write(&root, &[("cgroup.controllers", "cpu memory pids\n")]);
        let found = Memcg::find("0::/a/b\n", &only_v2).unwrap();
        assert_eq!((found.version, found.dir), (Version::V2, root.join("a/b")));
        assert_eq!(Memcg::find("", &only_v2), None);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn v2_reads_the_lowest_limit_up_to_the_root() {
        let root = tmp("v2read");
        write(&root, &[("cgroup.controllers", "memory\n")]);
        write(&root.join("a"), &[("memory.max", "104857600\n")]);
        write(
            &root.join("a/b"),
            &[
                ("memory.max", "max\n"),
                ("memory.current", "52428800\n"),
                ("memory.stat", "anon 1\ninactive_file 4096\n"),
            ],
        );
        let only_v2 = format!("102 97 0:33 / {} rw - cgroup2 cgroup2 rw\n", root.display());
        let m = Memcg::find("0::/a/b\n", &only_v2).unwrap();
        let r = m.read().unwrap();
        assert_eq!(r, Reading { limit: Some(100 * MIB), usage: 50 * MIB, reclaimable: 4096 });
        assert_eq!(r.in_use(), 50 * MIB - 4096);
        write(&root.join("a"), &[("memory.max", "max\n")]);
        assert_eq!(m.read().unwrap().limit, None);
        write(&root.join("a/b"), &[("memory.current", "lots\n")]);
        assert!(matches!(m.read(), Err(MemcgError::Parse { .. })), "a value that is no number is an error");
        // The host's root cgroup: no usage file, no limit (found in the kernel matrix's VMs,
        // where every process runs there: the budget warned "cannot be read" on each apply).
        let at_root = Memcg::find("0::/\n", &only_v2).unwrap();
        assert_eq!(at_root.read().unwrap(), Reading { limit: None, usage: 0, reclaimable: 0 });
        // Below the root the file must be there.
        std::fs::remove_file(root.join("a/b/memory.current")).unwrap();
        assert!(matches!(m.read(), Err(MemcgError::Read { .. })));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A real memory cgroup read again and again through its kept files: each reading is
    /// the kernel's of that moment (a limit moved between two), and a cgroup removed and made
    /// again at the same path is read anew, not through the dead one's files.
    #[test]
    fn a_real_cgroup_read_again_says_what_it_holds_now() {
        if !aether_testkit::root_or_skip("a_real_cgroup_read_again_says_what_it_holds_now") {
            return;
        }
        let version_of = |cg: &aether_testkit::memcg::ScratchMemcg| if cg.v2 { Version::V2 } else { Version::V1 };
        let cg = aether_testkit::memcg::ScratchMemcg::new("kept-read", 300 * MIB);
        let root = if cg.v2 { PathBuf::from("/sys/fs/cgroup") } else { PathBuf::from("/sys/fs/cgroup/memory") };
        let m = Memcg { dir: cg.dir.clone(), version: version_of(&cg), root };
        assert_eq!(m.read().unwrap().limit, Some(300 * MIB));
        cg.set_limit(200 * MIB);
        assert_eq!(m.read().unwrap().limit, Some(200 * MIB), "a kept file read the old limit");
        // `memory.stat` read through its kept descriptor in one read: every counter the kernel
        // lists, to the last (v1 ends with the hierarchical totals the budget reads).
        let stat = cg.dir.join("memory.stat");
        let keys =
            |t: &str| t.lines().filter_map(|l| l.split_whitespace().next().map(str::to_string)).collect::<Vec<_>>();
        for _ in 0..2 {
            let (kept, fresh) = (read_text(&stat).unwrap(), std::fs::read_to_string(&stat).unwrap());
            assert!(kept.ends_with('\n') && keys(&kept).len() > 10, "{kept}");
            assert_eq!(keys(&kept), keys(&fresh), "memory.stat read short");
        }
        let (dir, v2) = (cg.dir.clone(), cg.v2);
        drop(cg);
        assert!(!dir.exists(), "RIG BROKEN: the cgroup was not removed");
        /// The cgroup made again here, removed also when the test fails.
        struct Again(PathBuf);
        impl Drop for Again {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        std::fs::create_dir(&dir).unwrap();
        let _again = Again(dir.clone());
        std::fs::write(dir.join(if v2 { "memory.max" } else { "memory.limit_in_bytes" }), (100 * MIB).to_string())
            .unwrap();
        assert_eq!(m.read().unwrap().limit, Some(100 * MIB), "the removed cgroup's files were read");
    }

    #[test]
    fn v1_reads_its_own_and_the_hierarchical_limit() {
        let root = tmp("v1read");
        let dir = root.join("memory/pod");
        let stat = |h: u64| format!("cache 0\ntotal_inactive_file 8192\nhierarchical_memory_limit {h}\n");
        write(
            &dir,
            &[
                ("memory.limit_in_bytes", "134217728\n"),
                ("memory.usage_in_bytes", "1048576\n"),
                ("memory.stat", &stat(9223372036854771712)),
            ],
        );
        let v1 = format!("101 97 0:32 / {} ro - cgroup cgroup rw,memory\n", root.join("memory").display());
        let m = Memcg::find("4:memory:/pod\n", &v1).unwrap();
        assert_eq!(m.read().unwrap(), Reading { limit: Some(128 * MIB), usage: MIB, reclaimable: 8192 });
        write(&dir, &[("memory.stat", &stat(64 * MIB))]);
        assert_eq!(m.read().unwrap().limit, Some(64 * MIB), "a parent's lower limit binds");
        write(&dir, &[("memory.limit_in_bytes", "9223372036854771712\n"), ("memory.stat", &stat(9223372036854771712))]);
        assert_eq!(m.read().unwrap().limit, None, "v1's unlimited");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn fits_under_the_limit_less_the_headroom() {
        let r = |in_use: u64| Reading { limit: Some(128 * MIB), usage: in_use, reclaimable: 0 };
        // 128 MiB: 12.8 MiB kept free.
        assert!(fits(&r(100 * MIB), 100_000, 100).is_ok(), "9.5 MiB more fits");
        let refused = fits(&r(100 * MIB), 200_000, 100).unwrap_err();
        assert_eq!((refused.needed, refused.limit, refused.in_use), (20_000_000, 128 * MIB, 100 * MIB));
        let text = refused.to_string();
        assert!(text.contains("about 20 MiB"), "{text}");
        assert!(text.contains("100 MiB of its 128 MiB limit"), "{text}");
        assert!(text.contains("resources.limits.memory"), "{text}");
        // The suggested limit admits the work.
        let raised = Reading { limit: Some(refused.suggested_limit()), ..r(100 * MIB) };
        assert!(fits(&raised, 200_000, 100).is_ok(), "{}", refused.suggested_limit());
        assert!(fits(&Reading { limit: None, ..r(100 * MIB) }, u64::MAX / 2, 1000).is_ok(), "no limit");
        // Reclaimable file pages are not held against the work.
        assert!(fits(&Reading { reclaimable: 30 * MIB, ..r(120 * MIB) }, 100_000, 100).is_ok());
    }

    #[test]
    fn a_document_fits_under_the_limit_itself() {
        let r = |in_use: u64| Reading { limit: Some(128 * MIB), usage: in_use, reclaimable: 0 };
        let parse = Charge::DocumentParse { bytes: 3 * MIB + MIB / 4, objects: 60_001 };
        // Into the headroom (12.8 MiB) but under the limit: the headroom is there for it.
        assert!(own_fits(&r(110 * MIB), 18 * MIB, parse).is_ok());
        let refused = own_fits(&r(120 * MIB), 20 * MIB, parse).unwrap_err();
        assert_eq!(
            (refused.needed, refused.limit, refused.in_use, refused.headroom),
            (20 * MIB, 128 * MIB, 120 * MIB, 0)
        );
        let text = refused.to_string();
        for needle in [
            "not parsed: a document of 3.2 MiB (60001 JSON objects)",
            "about 20 MiB more of this process's own memory",
            "120 MiB of its 128 MiB limit",
            "nothing was changed",
            "resources.limits.memory",
        ] {
            assert!(text.contains(needle), "{needle:?} in {text}");
        }
        let raised = Reading { limit: Some(refused.suggested_limit()), ..r(120 * MIB) };
        assert!(own_fits(&raised, 20 * MIB, parse).is_ok(), "{}", refused.suggested_limit());
        assert!(own_fits(&Reading { limit: None, ..r(120 * MIB) }, u64::MAX / 2, parse).is_ok(), "no limit");
        let read = own_fits(&r(120 * MIB), 9 * MIB, Charge::DocumentRead { bytes: 9 * MIB, whole: true });
        let read = read.unwrap_err().to_string();
        assert!(read.contains("not read: a document of 9.0 MiB would charge about 9 MiB"), "{read}");
        let part = own_fits(&r(120 * MIB), 16 * MIB, Charge::DocumentRead { bytes: 9 * MIB, whole: false });
        let part = part.unwrap_err().to_string();
        assert!(
            part.contains("a document of 9.0 MiB so far (sent without its length) would charge about 16 MiB"),
            "{part}"
        );
        let stored = own_fits(&r(120 * MIB), 45 * MIB, Charge::StoredRead { bytes: 9 * MIB }).unwrap_err().to_string();
        assert!(stored.contains("not read: the stored document of 9.0 MiB, which the change is made to"), "{stored}");
    }
}
