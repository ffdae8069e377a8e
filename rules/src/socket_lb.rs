//! Is a connect-time socket load balancer on this node? Cilium's kube-proxy replacement
//! (socket LB) and Calico's eBPF dataplane attach BPF programs to the root cgroup at the
//! connect/sendmsg hooks and rewrite a ClusterIP to a backend inside `connect()`, before any
//! netfilter hook sees the packet: the capture then hands the proxy a pod address instead of
//! the Service's, and the Service layer classifies every Service connection as external.
//!
//! Asked of the kernel with `BPF_PROG_QUERY` on the cgroup v2 root (read only: nothing is
//! loaded or attached).

use std::io;
use std::os::fd::AsRawFd;

/// The cgroup hooks a connect-time load balancer uses (`enum bpf_attach_type`).
pub const HOOKS: [(u32, &str); 6] =
    [(10, "connect4"), (11, "connect6"), (14, "sendmsg4"), (15, "sendmsg6"), (19, "recvmsg4"), (20, "recvmsg6")];

const BPF_PROG_QUERY: libc::c_long = 16;

/// The query's part of `union bpf_attr` (the kernel accepts a shorter attr than its own,
/// the rest taken as zero).
#[repr(C)]
#[derive(Default)]
struct ProgQuery {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
}

/// Where the cgroup v2 hierarchy's root is mounted (`/sys/fs/cgroup` on a unified host;
/// Cilium mounts its own at `/run/cilium/cgroupv2` on hybrid ones): from mountinfo, the
/// first cgroup2 mount whose root is the hierarchy's root.
pub fn cgroup2_root() -> Option<std::path::PathBuf> {
    let mounts = aether_netns::mountinfo::read().ok()?;
    mounts.into_iter().find(|m| m.fstype == "cgroup2" && m.root == std::path::Path::new("/")).map(|m| m.mount_point)
}

/// The hooks of the root cgroup at `root` with programs attached, and how many each.
pub fn attached_at(root: &std::path::Path) -> io::Result<Vec<(&'static str, u32)>> {
    let dir = std::fs::File::open(root)?;
    let mut found = Vec::new();
    for (attach_type, name) in HOOKS {
        let mut q = ProgQuery { target_fd: dir.as_raw_fd() as u32, attach_type, ..Default::default() };
        // SAFETY: `q` is a valid, initialized attr of the size passed; the kernel writes
        // only within it (prog_ids is null, so no ids are copied out).
        let rc = unsafe {
            libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, &mut q as *mut ProgQuery, std::mem::size_of::<ProgQuery>())
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // A kernel without this hook (older than the hook) has nothing attached there.
            if e.raw_os_error() == Some(libc::EINVAL) {
                continue;
            }
            return Err(e);
        }
        if q.prog_cnt > 0 {
            found.push((name, q.prog_cnt));
        }
    }
    Ok(found)
}

/// What doctor and the installer say about it.
#[derive(Debug, PartialEq, Eq)]
pub enum Finding {
    /// No program at any of the hooks.
    None,
    /// Programs at these hooks of the root cgroup (hook, count).
    Attached(Vec<(&'static str, u32)>),
    /// No cgroup v2 hierarchy is mounted: nothing can be attached there.
    NoCgroup2,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Finding::None => f.write_str(
                "no connect-time socket load balancer (no BPF program at the root cgroup's connect/sendmsg hooks)",
            ),
            Finding::NoCgroup2 => f.write_str("no connect-time socket load balancer (no cgroup v2 hierarchy mounted)"),
            Finding::Attached(hooks) => {
                let list: Vec<String> = hooks.iter().map(|(h, n)| format!("{h} ({n})")).collect();
                write!(
                    f,
                    "a connect-time socket load balancer: BPF programs at the root cgroup's {} hooks. It rewrites a \
                     ClusterIP to a backend inside connect(), before the capture sees it: the proxy is handed a pod \
                     address, and the Service layer counts Service connections as external. For Cilium, limit socket \
                     LB to the host namespace (socketLB.hostNamespaceOnly=true); for Calico's eBPF dataplane, \
                     FelixConfiguration bpfConnectTimeLoadBalancing: Disabled (bpfConnectTimeLoadBalancingEnabled: \
                     false in older releases)",
                    list.join(", ")
                )
            }
        }
    }
}

/// Looks at this node's root cgroup.
pub fn detect() -> io::Result<Finding> {
    let Some(root) = cgroup2_root() else {
        return Ok(Finding::NoCgroup2);
    };
    let hooks = attached_at(&root)?;
    Ok(if hooks.is_empty() { Finding::None } else { Finding::Attached(hooks) })
}
