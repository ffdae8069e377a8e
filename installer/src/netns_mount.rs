//! Whether the runtime's netns directory, as mounted in the installer's container, shows the
//! pods' network namespaces made after the installer started.
//!
//! A pod's netns is a bind mount the runtime makes on the host (`/var/run/netns/cni-...`).
//! The installer runs in a mount namespace of its own, and sees a bind mount made there later
//! only if the mount its `--netns-dir` is on receives the host's mounts: a slave (`master:N`
//! in mountinfo, what the chart's `mountPropagation: HostToContainer` makes of a shared host
//! path) or a shared one (`shared:N`). On a private one every pod started after the installer
//! would look gone: its record a leftover to collect, and the pod then a missed one to
//! restart. So the installer checks it at start (fail closed: see `Installation` and
//! docs/operating.md): a netns directory that does not receive them makes the node not ready,
//! and the reconciler takes no record whose netns is under it for gone.

use std::path::{Path, PathBuf};

use aether_netns::mountinfo::{self, Mount, Propagation};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetnsMountError {
    #[error(
        "the netns directory {} (--netns-dir) cannot be resolved in this container: {why} (the chart mounts \
         hostPaths.netnsDir there)",
        dir.display()
    )]
    Resolve { dir: PathBuf, why: String },
    #[error("cannot read this process's mount table (/proc/self/mountinfo): {0}")]
    Mountinfo(String),
    #[error("the netns directory {} (--netns-dir) is on no mount of /proc/self/mountinfo", dir.display())]
    NoMount { dir: PathBuf },
    #[error(
        "the netns directory {} (--netns-dir) is on the mount {}, which is {propagation} in this container: network \
         namespaces the runtime makes on the host after the installer started do not show up in it, so the \
         reconciler cannot see new pods' netns (it takes none of them for gone and repairs none it cannot see) and \
         the node stays not ready. The chart mounts hostPaths.netnsDir with mountPropagation: HostToContainer, which \
         needs the host path to be a shared or slave mount (on the host: findmnt -o TARGET,PROPAGATION --target {}; \
         make it shared with mount --make-rshared /, or bind the directory onto itself and mount --make-shared it), \
         then restart this pod",
        dir.display(),
        mount_point.display(),
        dir.display()
    )]
    NoPropagation { dir: PathBuf, mount_point: PathBuf, propagation: Propagation },
}

/// The check on a mount table: `dir` is the directory as given, `real` with its symlinks
/// resolved (`/var/run` is often a link to `/run`).
pub fn check_in(dir: &Path, real: &Path, mounts: &[Mount]) -> Result<(), NetnsMountError> {
    let m = mountinfo::containing(mounts, real).ok_or_else(|| NetnsMountError::NoMount { dir: dir.into() })?;
    if m.propagation.receives() {
        return Ok(());
    }
    Err(NetnsMountError::NoPropagation {
        dir: dir.into(),
        mount_point: m.mount_point.clone(),
        propagation: m.propagation,
    })
}

/// The check on this process's mount table.
pub fn check(dir: &Path) -> Result<(), NetnsMountError> {
    let real =
        std::fs::canonicalize(dir).map_err(|e| NetnsMountError::Resolve { dir: dir.into(), why: e.to_string() })?;
    let mounts = mountinfo::read().map_err(|e| NetnsMountError::Mountinfo(e.to_string()))?;
    check_in(dir, &real, &mounts)
}

/// A netns directory the installer cannot trust to show new pods' netns: a record's netns
/// under it that is not found says nothing of the pod.
#[derive(Debug, Clone)]
pub struct Blind {
    /// The directory as given and as resolved.
    pub dirs: Vec<PathBuf>,
    pub why: String,
}

impl Blind {
    pub fn new(dir: &Path, why: &NetnsMountError) -> Blind {
        let mut dirs = vec![dir.to_path_buf()];
        dirs.extend(std::fs::canonicalize(dir).ok().filter(|r| r != dir));
        Blind { dirs, why: why.to_string() }
    }

    /// Whether `netns` (a record's path) is under it.
    pub fn covers(&self, netns: &str) -> bool {
        self.dirs.iter().any(|d| Path::new(netns).starts_with(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container's table: its root private, the netns directory a slave of the host's
    /// (HostToContainer), another private bind, and a path with a space (escaped).
    const TABLE: &str = "\
590 500 0:80 / / ro,relatime - overlay overlay rw
612 590 0:26 /netns /var/run/netns ro,nosuid,nodev master:3 - tmpfs tmpfs rw,mode=755
613 590 0:26 /netns /run/private\\040netns ro - tmpfs tmpfs rw
614 590 0:26 /netns /run/shared rw shared:7 - tmpfs tmpfs rw
";

    #[test]
    fn a_slave_or_shared_mount_passes_and_a_private_one_is_named() {
        let m = mountinfo::parse(TABLE);
        assert_eq!(check_in(Path::new("/var/run/netns"), Path::new("/var/run/netns"), &m), Ok(()));
        assert_eq!(check_in(Path::new("/run/shared"), Path::new("/run/shared"), &m), Ok(()));
        let dir = Path::new("/run/private netns");
        let e = check_in(dir, dir, &m).unwrap_err();
        let NetnsMountError::NoPropagation { mount_point, .. } = &e else { panic!("{e:?}") };
        assert_eq!(mount_point, dir, "the escaped mount point, unescaped");
        let text = e.to_string();
        for needle in
            ["/run/private netns", "private", "mountPropagation: HostToContainer", "shared or slave mount", "not ready"]
        {
            assert!(text.contains(needle), "{needle:?} not in: {text}");
        }
        // A directory that is no mount point is judged by the mount it is on (here `/`).
        let e = check_in(Path::new("/var/lib/x"), Path::new("/var/lib/x"), &m).unwrap_err();
        assert!(e.to_string().contains("on the mount /, which is private"), "{e}");
        assert_eq!(check_in(Path::new("/x"), Path::new("/x"), &[]), Err(NetnsMountError::NoMount { dir: "/x".into() }));
    }

    #[test]
    fn blind_covers_the_paths_under_it() {
        let b = Blind { dirs: vec!["/var/run/netns".into(), "/run/netns".into()], why: String::new() };
        assert!(b.covers("/var/run/netns/cni-1"));
        assert!(b.covers("/run/netns/cni-1"));
        assert!(!b.covers("/run/netns-other/cni-1"));
        assert!(!b.covers("/proc/1/ns/net"));
    }
}
