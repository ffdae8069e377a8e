//! `/proc/<pid>/mountinfo`, parsed in one place (proc(5)): which mount a path is on, what it
//! mounts, and how mounts propagate to it.
//!
//! Why it is here: a pod's netns is a bind mount (under `/var/run/netns`), and a process in
//! another mount namespace (the installer's container) sees the ones made after it started
//! only through a mount that receives propagation from the host's (`master:N`, a slave, or
//! `shared:N`). The cgroup code reads the same table for its mount points.
//!
//! A line: `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`:
//! mount ID, parent ID, major:minor, root, mount point, mount options, zero or more optional
//! fields (`shared:N`, `master:N`, `propagate_from:N`, `unbindable`), a `-`, then the
//! filesystem type, the source and the super options. Paths are octal-escaped (`\040` for a
//! space, `\011`, `\012`, `\134`).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// How mount events propagate to and from a mount (its optional fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Propagation {
    /// `shared:N`: in peer group N; mounts under it propagate to and from its peers.
    pub shared: Option<u32>,
    /// `master:N`: a slave of peer group N; receives the mounts made under it.
    pub master: Option<u32>,
    /// `unbindable`.
    pub unbindable: bool,
}

impl Propagation {
    /// Whether mounts made under the same place in another mount namespace (the host's) can
    /// show up here: a slave or a shared mount. A private (or unbindable) one never receives
    /// them.
    pub fn receives(&self) -> bool {
        self.shared.is_some() || self.master.is_some()
    }
}

impl std::fmt::Display for Propagation {
    /// As mount(8) names it, with mountinfo's own fields: `shared (shared:3)`, `slave
    /// (master:1)`, `shared and slave (shared:4 master:1)`, `private`, `unbindable`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.shared, self.master) {
            (Some(s), Some(m)) => write!(f, "shared and slave (shared:{s} master:{m})"),
            (Some(s), None) => write!(f, "shared (shared:{s})"),
            (None, Some(m)) => write!(f, "slave (master:{m})"),
            (None, None) if self.unbindable => write!(f, "unbindable (private, no optional field but unbindable)"),
            (None, None) => write!(f, "private (no shared:N or master:N optional field)"),
        }
    }
}

/// One mountinfo line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub id: u32,
    pub parent: u32,
    /// The path within the filesystem that is mounted (a bind mount's source; a cgroup
    /// namespace's root).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub propagation: Propagation,
    pub fstype: String,
    pub source: String,
    pub super_options: String,
}

/// One line, or `None` when it is not one (too few fields, no separator).
pub fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let mut l = left.split(' ');
    let id = l.next()?.parse().ok()?;
    let parent = l.next()?.parse().ok()?;
    let _dev = l.next()?;
    let root = PathBuf::from(unescape(l.next()?));
    let mount_point = PathBuf::from(unescape(l.next()?));
    let _options = l.next()?;
    let mut propagation = Propagation::default();
    for field in l {
        if let Some(n) = field.strip_prefix("shared:") {
            propagation.shared = n.parse().ok();
        } else if let Some(n) = field.strip_prefix("master:") {
            propagation.master = n.parse().ok();
        } else if field == "unbindable" {
            propagation.unbindable = true;
        }
    }
    let mut r = right.split(' ');
    let fstype = r.next()?.to_string();
    let source = unescape(r.next().unwrap_or("")).to_string_lossy().into_owned();
    let super_options = r.next().unwrap_or("").to_string();
    Some(Mount { id, parent, root, mount_point, propagation, fstype, source, super_options })
}

/// Every line of `text` that parses, in order (a later mount on the same point is on top).
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

/// This process's mount table.
pub fn read() -> std::io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The mount `path` (absolute, symlinks resolved) is on: the one whose mount point is the
/// longest prefix of it, the last listed of those (the one on top).
pub fn containing<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.mount_point))
        .max_by_key(|(i, m)| (m.mount_point.components().count(), *i))
        .map(|(_, m)| m)
}

/// mountinfo's octal escapes (`\040` for a space) undone; a path's bytes need not be UTF-8.
pub fn unescape(field: &str) -> OsString {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as kernels print them: the host's root (shared), a container's rslave netns
    /// directory, a private bind, an unbindable one, and one of each kind of escape.
    const SAMPLE: &str = "\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
45 27 254:0 /run/netns /run/netns rw,relatime shared:3 - ext4 /dev/vda rw
47 45 0:4 net:[4026532180] /run/netns/cni-1 rw shared:5 - nsfs nsfs rw
612 590 0:26 /netns /var/run/netns ro,nosuid,nodev master:3 - tmpfs tmpfs rw,mode=755
613 590 0:26 /netns /var/run/netns-private ro - tmpfs tmpfs rw
614 590 0:26 /x /both rw shared:9 master:3 propagate_from:3 - tmpfs tmpfs rw
615 590 0:26 /y /never rw unbindable - tmpfs tmpfs rw
616 27 0:27 /a\\040b /mnt/with\\040space\\011tab\\012nl\\134back rw - tmpfs none\\040x rw
";

    #[test]
    fn fields_and_propagation() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 8);
        assert_eq!((m[0].id, m[0].parent), (27, 1));
        assert_eq!(m[0].propagation, Propagation { shared: Some(1), ..Default::default() });
        assert_eq!(m[2].root, Path::new("net:[4026532180]"));
        assert_eq!(m[2].fstype, "nsfs");
        let slave = &m[3];
        assert_eq!(slave.mount_point, Path::new("/var/run/netns"));
        assert_eq!(slave.root, Path::new("/netns"));
        assert_eq!(slave.propagation.master, Some(3));
        assert!(slave.propagation.receives());
        assert_eq!(slave.propagation.to_string(), "slave (master:3)");
        assert_eq!(
            (slave.fstype.as_str(), slave.source.as_str(), slave.super_options.as_str()),
            ("tmpfs", "tmpfs", "rw,mode=755")
        );
        assert!(!m[4].propagation.receives());
        assert!(m[4].propagation.to_string().starts_with("private"), "{}", m[4].propagation);
        assert_eq!(m[5].propagation, Propagation { shared: Some(9), master: Some(3), unbindable: false });
        assert!(m[5].propagation.receives());
        assert!(m[6].propagation.unbindable && !m[6].propagation.receives());
    }

    #[test]
    fn octal_escapes_are_undone() {
        let m = &parse(SAMPLE)[7];
        assert_eq!(m.mount_point, Path::new("/mnt/with space\ttab\nnl\\back"));
        assert_eq!(m.root, Path::new("/a b"));
        assert_eq!(m.source, "none x");
        // Not an escape: kept as it is.
        assert_eq!(unescape("/a\\9b\\"), OsString::from("/a\\9b\\"));
        // A byte that is not UTF-8 (\377) stays a byte of the path.
        assert_eq!(unescape("/x\\377").into_vec(), b"/x\xff".to_vec());
    }

    #[test]
    fn malformed_lines_are_skipped() {
        assert_eq!(parse("garbage\n1 2 3\n\n27 1 254:0 / / rw - ext4 /dev/vda rw\n").len(), 1);
        assert!(parse_line("x 1 254:0 / / rw - ext4 /dev/vda rw").is_none(), "an ID that is no number");
    }

    #[test]
    fn the_mount_a_path_is_on() {
        let m = parse(SAMPLE);
        let on = |p: &str| containing(&m, Path::new(p)).map(|m| m.id);
        assert_eq!(on("/var/run/netns/cni-2"), Some(612));
        assert_eq!(on("/var/run/netns"), Some(612));
        assert_eq!(on("/var/run/netns-private"), Some(613), "a prefix of the name is no parent");
        assert_eq!(on("/run/netns/cni-1"), Some(47));
        assert_eq!(on("/etc"), Some(27));
        // Two mounts on one point: the later is on top.
        let stacked = parse(&format!("{SAMPLE}700 612 0:30 / /var/run/netns rw - tmpfs tmpfs rw\n"));
        assert_eq!(containing(&stacked, Path::new("/var/run/netns/a")).map(|m| m.id), Some(700));
        assert!(containing(&[], Path::new("/")).is_none());
    }
}
